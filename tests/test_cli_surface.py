"""What a researcher sees around the runs, found by using them: the W&B run of a fresh training run,
the offline rebuild's rows, relpos.log's head line, and usage errors."""

import re
import time
from datetime import datetime

import pytest
import wandb

from conftest import TINY, run_in_process
from wandb_records import OfflineRun

pytestmark = pytest.mark.usefixtures("in_temp_cwd")
OFFLINE = [*TINY[:-1], "wandb.mode=offline"]


def offline_run(run_dir) -> OfflineRun:
    wandb.teardown()  # what the end of a relpos process does: the W&B service writes out the offline files
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    return OfflineRun(offline)


def test_a_fresh_training_run_is_a_train_run_and_eval_rows_get_rows_of_their_own(tmp_path):
    """A run only trained was job_type `inspect` (its metrics.jsonl did not exist yet when training
    opened the W&B run), and the offline rebuild logged the first eval length into the last training
    step's row (train/loss and eval/length=32 at _step 4)."""
    run_dir = tmp_path / "run"
    code, out, err = run_in_process("train", *OFFLINE, f"hydra.run.dir={run_dir}")
    assert code == 0, out + err
    assert offline_run(run_dir).run.job_type == "train"

    code, out, err = run_in_process("eval-length", str(run_dir), "eval.lengths=[32,64]", "eval.tokens=128")
    assert code == 0, out + err
    run = offline_run(run_dir)
    assert run.run.job_type == "train"
    trained = [row for row in run.history if "train/loss" in row]
    evaluated = [row for row in run.history if "eval/length" in row]
    assert [row["eval/length"] for row in evaluated] == [32, 64]
    assert not any("eval/length" in row for row in trained)
    assert min(row["_step"] for row in evaluated) > max(row["_step"] for row in trained)


def log_times(text: str) -> list[datetime]:
    return [datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f")
            for m in re.finditer(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) [A-Z]+ ", text, re.M)]


def test_relpos_log_heads_a_command_with_its_command_line_in_time_order(tmp_path, monkeypatch):
    """The head line said `command: relpos model=tiny ...` (sys.argv as rewritten for Hydra: no
    `train`; a sweep's `hydra.sweep.dir=... --multirun`), and was stamped after the record it heads
    (the git look-up takes milliseconds: 04:22:29,612 above 04:22:29,597)."""
    from relpos_cli import logs

    def slow_commit() -> str:
        time.sleep(0.05)
        return " at abc"
    monkeypatch.setattr(logs, "_checkout_commit", slow_commit)

    run_dir = tmp_path / "run"
    code, out, err = run_in_process("train", *TINY, f"hydra.run.dir={run_dir}")
    assert code == 0, out + err
    text = (run_dir / "relpos.log").read_text()
    assert text.splitlines()[0].split(" INFO ", 1)[1].startswith(f"command: relpos train {' '.join(TINY)} hydra.run.dir=")
    times = log_times(text)
    assert len(times) > 3 and times == sorted(times)

    code, out, err = run_in_process("train", "-m", *TINY, "pos=rope,alibi", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert code == 0, out + err
    for job in sorted((tmp_path / "sweep").glob("*_*")):
        heads = [l for l in (job / "relpos.log").read_text().splitlines() if " INFO command: " in l]
        assert len(heads) == 1 and "command: relpos train -m model=tiny" in heads[0], heads
        assert "--multirun" not in heads[0]


def test_a_sweep_job_that_trains_then_evaluates_heads_its_relpos_log_once(tmp_path):
    """One command, one head line: the job's evaluation added a second (both `relpos model=tiny ...`)."""
    code, out, err = run_in_process("sweep", *TINY, "eval.lengths=[32]", "eval.tokens=64",
                                    f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert code == 0, out + err
    (job,) = (tmp_path / "sweep").glob("0_*")
    text = (job / "relpos.log").read_text()
    heads = [l for l in text.splitlines() if " INFO command: " in l]
    assert len(heads) == 1 and "command: relpos sweep model=tiny" in heads[0], heads
    assert " INFO eval-length " in text  # the evaluation's records are there, under the same head
    assert log_times(text) == sorted(log_times(text))


@pytest.mark.parametrize("args, fragment", [
    (["bogus"], "No such command 'bogus'."),
    (["eval-lenght", "RUN"], "Did you mean 'eval-length'"),
    (["--bogus"], "No such option: --bogus"),
    (["schemes", "--bogus"], "No such option: --bogus"),
    (["sample"], "Missing argument 'RUN_DIR'."),
    (["sample", "RUN", "-n", "many"], "Invalid value for '--max-new-tokens'"),
])
def test_usage_errors_are_one_line_and_exit_2(args, fragment):
    """Click drew five lines: the usage, a hint and the error in a box. (In-process the program is
    called `root`; from the shell, `relpos`.)"""
    code, out, err = run_in_process(*args)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1 and fragment in err, err
    command = " ".join(a for a in args[:1] if not a.startswith("-") and a in ("schemes", "sample"))
    assert err.endswith(f"{' ' + command if command else ''} --help)\n"), err


def test_plain_relpos_still_shows_the_help():
    code, out, err = run_in_process()
    assert code == 2 and "Usage: root [OPTIONS] COMMAND" in out + err and "eval-length" in out + err  # in-process name


@pytest.mark.parametrize("shell, fragment", [("bash", "complete -o default -F _relpos_completion relpos"),
                                             ("zsh", "#compdef relpos"),
                                             ("fish", "complete --command relpos"),
                                             ("powershell", "Register-ArgumentCompleter")])
def test_show_completion_prints_the_named_shell_s_script(shell, fragment):
    """With shellingham (installed with typer) Typer printed the script of the shell it ran in and
    ignored the shell named: `relpos --show-completion zsh` run from bash printed bash's."""
    import os

    code, out, err = run_in_process("--show-completion", shell)
    assert code == 0 and fragment in out, out + err
    assert "_RELPOS_COMPLETE" not in os.environ  # the request is not left set for the next command


def test_show_completion_of_an_unknown_shell_is_one_line():
    code, out, err = run_in_process("--show-completion", "tcsh")
    assert code == 2 and out == "" and err.count("\n") == 1 and "choose one of bash, zsh, fish" in err


@pytest.mark.parametrize("command", ["eval-length", "eval-task", "compare", "inspect"])
def test_an_unknown_option_of_a_command_over_runs_is_named_as_an_option(command, tmp_path, monkeypatch):
    """The commands over run dirs take their extra arguments as runs and overrides: `--bogus` was
    'run dir not found: --bogus'."""
    monkeypatch.chdir(tmp_path)
    code, _, err = run_in_process(command, "--bogus", str(tmp_path))
    assert code == 2 and err.strip().splitlines() == ["error: no such option: --bogus (--help lists the command's options)"], err
