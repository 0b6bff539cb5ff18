"""Ctrl-C, kill and a full disk on the newest commands (eval-task, compare --metric accuracy,
sample, init_from, the task sweep), as a user meets them: real processes and real signals, a
one-line message, nothing half-written, and a rerun that continues or starts cleanly."""

import errno
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO
from test_errors import assert_one_clear_line, relpos
from test_eval_task import TASK_TINY
from test_failures import ENV, ctrl_c_after_the_first_checkpoint, fail_writes, start, wait_for
from test_resume import signal_after_checkpoint
from test_task_faults import SMALL, copy_of, passkey_run  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("in_temp_cwd")
HUGE = ["task.eval_lengths=[1048576]", "task.samples=1", "task.depths=[0.5]"]  # one example of 1M tokens


def relpos_process(*args, **extra):
    """`relpos ARGS` in a process of its own, with this test's token cache and offline settings."""
    keys = ("RELPOS_CACHE", "WANDB_MODE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    return start(*args, env={**{k: os.environ[k] for k in keys}, **extra})


@pytest.fixture(scope="module")
def rope_passkey_run(tmp_path_factory):
    """pos=rope attends with one fused SDPA call per layer: at 1M tokens a single call of minutes."""
    run = tmp_path_factory.mktemp("rope") / "run"
    code, _, err = relpos("train", *TASK_TINY, "task=passkey", "pos=rope", f"hydra.run.dir={run}")
    assert code == 0, err
    return run


# `relpos ARGS` with the fused attention kernel marked: a file is touched as a call over a long
# example begins, so a test can signal the process while it is inside one (a call of minutes at 1M tokens)
IN_KERNEL = """
import pathlib, sys
import torch.nn.functional as F
real, marker = F.scaled_dot_product_attention, pathlib.Path(sys.argv.pop(1))
def marked(q, *args, **kwargs):
    if q.shape[-2] > 100_000:  # the 1M-token example, not the training length scored first
        marker.touch()
    return real(q, *args, **kwargs)
F.scaled_dot_product_attention = marked
from relpos_cli.cli import main
sys.argv[0] = "relpos"
main()
"""


def start_marked(marker, *args):
    marker.unlink(missing_ok=True)
    keys = ("RELPOS_CACHE", "WANDB_MODE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    return subprocess.Popen([sys.executable, "-c", IN_KERNEL, str(marker), *args], cwd=REPO,
                            env={**ENV, **{k: os.environ[k] for k in keys}},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def only_kept(run):
    """Of the interrupted command, only the result files of the lengths it finished before the 1M-token
    one (eval-task stores each length as it is scored): no other result, temp or PID file."""
    return sorted(p.name for p in run.iterdir() if p.name.startswith(("eval_task", "compare")) or p.name.endswith(".tmp")
                  or p.name == ".relpos.pid") == ["eval_task.csv", "eval_task.json"]


def stop_while_scoring(proc, marker, sig):
    """Send `sig` once the command is inside the fused attention over the 1M-token example;
    (exit code, stderr, seconds it took to stop)."""
    wait_for(marker.is_file, proc, "the evaluation never reached the attention kernel")
    time.sleep(1)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(sig)
    began = time.monotonic()
    _, err = proc.communicate(timeout=300)
    return proc.returncode, err, time.monotonic() - began


@pytest.mark.slow
def test_eval_task_and_compare_at_a_million_tokens_stop_on_ctrl_c_and_kill(rope_passkey_run, tmp_path):
    """A 1M-token example used to compute for minutes with no progress, Ctrl-C ignored for over 5
    minutes (the signal waits until the fused attention call returns). Scored in a worker thread,
    the command stops within seconds with one line naming the lengths it kept, and leaves the dir free."""
    run = copy_of(rope_passkey_run, tmp_path)
    marker = tmp_path / "in_attention"
    kept = f"lengths 112 kept in {run / 'eval_task.json'}"
    first = start_marked(marker, "eval-task", str(run), *HUGE)
    code, err, seconds = stop_while_scoring(first, marker, signal.SIGINT)
    assert_one_clear_line(code, err, f"SIGINT: stopped; {kept}")
    assert code == 130 and seconds < 60 and only_kept(run), (seconds, sorted(p.name for p in run.iterdir()))

    second = start_marked(marker, "eval-task", str(run), *HUGE)
    wait_for(lambda: (run / ".relpos.pid").is_file(), second, "the evaluation never took the run dir")
    code, _, err = relpos("eval-task", str(run), *SMALL)  # a second process on the same run dir
    assert_one_clear_line(code, err, f"{run} is in use by another relpos process (PID {second.pid}, relpos eval-task)")
    code, err, seconds = stop_while_scoring(second, marker, signal.SIGTERM)
    assert_one_clear_line(code, err, f"SIGTERM: stopped; {kept}")
    assert code == 128 + signal.SIGTERM and seconds < 60 and only_kept(run)

    out = tmp_path / "cmp"
    compare = start_marked(marker, "compare", str(run), "--metric", "accuracy", *HUGE, "--out", str(out))
    code, err, seconds = stop_while_scoring(compare, marker, signal.SIGINT)
    assert_one_clear_line(code, err, "SIGINT: stopped")  # not "evaluation failed" for this run and on to the next
    assert code == 130 and seconds < 60 and only_kept(run) and not out.exists()

    code, _, err = relpos("eval-task", str(run), *SMALL)  # a rerun starts cleanly
    assert code == 0, err


def test_a_full_disk_under_eval_task_and_compare_is_one_line_and_keeps_the_stored_result(passkey_run, tmp_path,
                                                                                         monkeypatch):
    run = copy_of(passkey_run, tmp_path)
    assert relpos("eval-task", str(run), *SMALL)[0] == 0
    stored = {p.name: p.read_bytes() for p in run.glob("eval_task*")}
    for number, hint in ((errno.ENOSPC, "no space left on the device"), (errno.EROFS, "read-only file system")):
        with monkeypatch.context() as full:
            fail_writes(full, number)
            code, _, err = relpos("eval-task", str(run), *SMALL, "task.samples=3")
            assert_one_clear_line(code, err, str(run), hint)
            code, _, err = relpos("compare", str(run), "--metric", "accuracy", *SMALL, "--out", str(tmp_path / "cmp"))
            assert_one_clear_line(code, err, str(tmp_path / "cmp"), hint)  # the stored result compared, then written
            code, out, err = relpos("compare", str(run), "--metric", "accuracy", *SMALL, "task.samples=3", "--out",
                                    str(tmp_path / "cmp"))  # evaluated first: that evaluation cannot write
            assert_one_clear_line(code, err, "no evaluated runs to compare", str(run), hint)
            assert "Traceback" not in out + err
        assert {p.name: p.read_bytes() for p in run.glob("eval_task*")} == stored
        assert not list(run.glob(".*.tmp")) and not list((tmp_path / "cmp").glob("*"))
    code, _, err = relpos("eval-task", str(run), *SMALL, "task.samples=3")  # the rerun does it
    assert code == 0, err
    assert {c["samples"] for c in json.loads((run / "eval_task.json").read_text())["cells"]} == {3}


def test_sample_stops_on_ctrl_c_and_kill_with_one_line(tiny_run):
    for sig in (signal.SIGINT, signal.SIGTERM):
        proc = relpos_process("sample", str(tiny_run), "-n", "1000000", "-p", "x",
                              PYTHONUNBUFFERED="1")  # the first token can be read as soon as it is printed
        assert proc.stdout.read(2), proc.communicate()  # the prompt and a first token: generating
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
        assert_one_clear_line(proc.returncode, err, f"{signal.Signals(sig).name}: stopped")
        assert proc.returncode == 128 + sig


def test_a_fine_tuned_run_killed_or_out_of_disk_continues_or_starts_cleanly(tiny_run, tmp_path, monkeypatch):
    """init_from from an alibi parent: SIGTERM after a checkpoint, then resume finishes it; a full
    disk at its first write is one line, and the same command then trains it from the start."""
    child = tmp_path / "child"
    args = ["train", f"init_from={tiny_run}", "train.steps=60", "train.ckpt_every=2", "train.batch_size=4",
            "train.seq_len=32", "train.val_batches=1", "train.log_every=2", "wandb.mode=disabled"]
    code, _, err = signal_after_checkpoint(relpos_process(*args, f"hydra.run.dir={child}"), child, signal.SIGTERM)
    assert_one_clear_line(code, err, "SIGTERM at step", f"resume with: relpos train resume={child}")
    assert code == 128 + signal.SIGTERM and not (child / "checkpoint.pt").exists()
    code, _, err = relpos("train", f"resume={child}")
    assert code == 0, err
    steps = [json.loads(l)["step"] for l in (child / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(2, 61, 2)) and (child / "checkpoint.pt").is_file()

    fresh = tmp_path / "fresh"
    with monkeypatch.context() as full:
        fail_writes(full, errno.ENOSPC)
        code, _, err = relpos(*args, "train.steps=2", f"hydra.run.dir={fresh}")
    assert_one_clear_line(code, err, str(fresh), "no space left on the device")
    code, _, err = relpos(*args, "train.steps=2", f"hydra.run.dir={fresh}")
    assert code == 0, err


def test_ctrl_c_in_a_task_sweep_names_the_jobs_that_never_ran(tmp_path):
    sweep = tmp_path / "sweep"
    proc = relpos_process("sweep", *TASK_TINY, "task=passkey", "train.steps=100000", "train.ckpt_every=2",
                          "pos=rope,alibi", f"hydra.sweep.dir={sweep}")
    assert_one_clear_line(130, ctrl_c_after_the_first_checkpoint(proc, sweep), "SIGINT at step",
                          "resume with: relpos train resume=", "the sweep stopped at job #0, these 1 never ran: #1 pos=alibi")
    assert not list(sweep.glob("*/eval_task*")) and not (sweep / "compare_accuracy.csv").exists()
