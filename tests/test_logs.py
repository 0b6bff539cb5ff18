"""relpos.log holds what a run did; stdout that is not a terminal gets one line per log step; a
terminal keeps the finished training bar; validation runs every train.eval_every steps."""

import io
import logging
import re
import warnings

import pytest
from rich.console import Console

from conftest import TINY, metrics, run_in_process
from relpos_cli.logs import run_log
from relpos_cli.terminal import TrainingDisplay

pytestmark = pytest.mark.usefixtures("in_temp_cwd")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """6 steps, logged every 4, validated every 3: steps 3 and 6 validate, 4 only logs."""
    run_dir = tmp_path_factory.mktemp("logs") / "run"
    code, out, err = run_in_process("train", *TINY, "train.steps=6", "train.log_every=4", "train.eval_every=3",
                                    "train.ckpt_every=5", f"hydra.run.dir={run_dir}")
    assert code == 0, err
    return run_dir, out


def test_validation_runs_every_eval_every_steps_not_only_on_log_steps(trained):
    run_dir, _ = trained
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [3, 4, 6]
    assert [r["step"] for r in rows if "val_loss" in r] == [3, 6]


def test_stdout_that_is_not_a_terminal_gets_one_line_per_log_step(trained):
    run_dir, out = trained
    lines = [l for l in out.splitlines() if l.startswith("step ")]
    assert [re.match(r"step +(\d+)/6 ", l)[1] for l in lines if "/6 " in l] == ["3", "4", "6"]
    assert "val_loss" in lines[0] and "val_loss" not in lines[1]
    assert lines[-1].startswith("step 6: loss")  # the final line


def test_relpos_log_holds_config_steps_validation_checkpoints_and_the_final_line(trained):
    run_dir, _ = trained
    log = (run_dir / "relpos.log").read_text()
    for fragment in ("pid ", "config:", "n_layers: 2", "relpos train pos=rope", "step 3/6", "val_loss", "step 4/6",
                     f"checkpoint {run_dir}/checkpoints/step_00000005.pt", f"checkpoint {run_dir}/checkpoint.pt (final)",
                     "step 6: loss", f"run dir: {run_dir}"):
        assert fragment in log, fragment


def test_errors_and_warnings_reach_relpos_log(tmp_path):
    run_dir = tmp_path / "run"
    code, _, _ = run_in_process("train", *TINY, "train.steps=3", "train.lr=1e30", "train.warmup_steps=0",
                                "train.grad_clip=1e30", f"hydra.run.dir={run_dir}")
    assert code == 2
    assert re.search(r"ERROR error: non-finite loss .* at step \d", (run_dir / "relpos.log").read_text())
    with run_log(tmp_path), warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("a deprecated thing")
    assert "WARNING" in (tmp_path / "relpos.log").read_text() and "a deprecated thing" in (tmp_path / "relpos.log").read_text()
    # the file is let go (pytest's own capture handlers may sit on the logger too)
    assert not [h for h in logging.getLogger("relpos").handlers if isinstance(h, logging.FileHandler)]


def test_a_terminal_keeps_the_finished_training_bar():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=80)
    with TrainingDisplay(console, total=4, start=0) as display:
        for step in range(1, 5):
            display.advance()
        display.show({"step": 4, "loss": 1.5, "lr": 1e-3, "tokens_per_s": 1000.0, "val_loss": 1.25})
    # after the last redraw the bar is printed once more and left there (a transient bar erases itself)
    last = buf.getvalue().rsplit("\r", 1)[-1]
    assert "4/4" in last and "val 1.250" in last and "\x1b[2K" not in last.split("4/4", 1)[1]


def test_each_command_s_records_start_with_what_reproduces_them(trained):
    """The command line, relpos's version and commit, Python, torch and its threads, the host: nothing
    in a run dir said which code or how many threads made its numbers."""
    import subprocess
    import sys

    import torch

    from conftest import REPO
    from relpos_cli import __version__

    run_dir, _ = trained
    code, _, err = run_in_process("eval-length", str(run_dir), "eval.lengths=[32]", "eval.tokens=64")
    assert code == 0, err
    lines = [line for line in (run_dir / "relpos.log").read_text().splitlines() if " INFO command: relpos " in line]
    assert len(lines) >= 2  # train's, then eval-length's
    last = lines[-1]
    assert f"relpos {__version__}" in last and f"python {sys.version.split()[0]}" in last
    threads = torch.get_num_threads()
    assert f"torch {torch.__version__} ({threads} {'thread' if threads == 1 else 'threads'})" in last
    if (REPO / ".git").exists():
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        assert f" at {head}" in last
