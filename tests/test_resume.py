"""Checkpoints, exact resume after SIGKILL / SIGTERM, non-finite losses: each checked against an
uninterrupted run of the same config (bitwise on CPU)."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import REPO, TINY, final_weights, metrics, run_cli, trained_run

LONG = [*TINY, "train.steps=120", "train.log_every=1", "train.ckpt_every=10", "train.keep_checkpoints=2",
        "train.eval_every=25", "device=cpu", "pos=t5"]


def start(*args, cwd=REPO):
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    return subprocess.Popen([sys.executable, "-m", "relpos_cli", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def signal_after_checkpoint(proc, run_dir, sig, after_step=0):
    """Send `sig` once a periodic checkpoint newer than after_step exists; the run must still be going."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        steps = [int(p.stem.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*.pt")]
        if steps and max(steps) > after_step:
            break
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.005)
    assert proc.poll() is None, "the run finished before it could be interrupted"
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return trained_run(tmp_path_factory, *LONG)


def test_sigkill_then_sigterm_then_resume_is_bitwise_the_uninterrupted_run(reference, tmp_path):
    run_dir = tmp_path / "run"
    rc, _, _ = signal_after_checkpoint(start("train", *LONG, f"hydra.run.dir={run_dir}", cwd=tmp_path), run_dir,
                                       signal.SIGKILL)
    assert rc == -signal.SIGKILL
    killed_at = max(int(p.stem.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*.pt"))

    rc, _, err = signal_after_checkpoint(start("train", f"resume={run_dir}", cwd=tmp_path), run_dir, signal.SIGTERM,
                                         killed_at)
    assert rc == 128 + signal.SIGTERM
    err = " ".join(err.split())
    assert f"resume with: relpos train resume={run_dir}" in err and "Traceback" not in err

    run_cli("train", f"resume={run_dir}", cwd=tmp_path)
    got, want = metrics(run_dir), metrics(reference)
    assert [m["step"] for m in got] == list(range(1, 121))  # no duplicated or missing steps
    assert [(m["loss"], m["lr"], m.get("val_loss")) for m in got] == [(m["loss"], m["lr"], m.get("val_loss")) for m in want]
    ref_weights, weights = final_weights(reference), final_weights(run_dir)
    assert all(torch.equal(ref_weights[k], weights[k]) for k in ref_weights)
    assert len(list((run_dir / "checkpoints").glob("step_*.pt"))) == 2  # keep_checkpoints
    assert not list((run_dir / "checkpoints").glob(".*.tmp"))


def test_a_closed_terminal_stops_training_with_a_checkpoint(tmp_path):
    """SIGHUP (the terminal closed) is taken as SIGTERM is: the step finishes, a checkpoint is
    saved, one line says how to resume. Before, SIGHUP's default action ended the run unsaved."""
    run_dir = tmp_path / "run"
    rc, _, err = signal_after_checkpoint(start("train", *LONG, f"hydra.run.dir={run_dir}", cwd=tmp_path), run_dir,
                                         signal.SIGHUP)
    assert rc == 128 + signal.SIGHUP
    err = " ".join(err.split())
    assert "SIGHUP at step" in err and f"resume with: relpos train resume={run_dir}" in err and "Traceback" not in err


def test_resuming_a_finished_run_says_so_and_exits_0(reference, tmp_path):
    out = run_cli("train", f"resume={reference}", cwd=tmp_path).stdout
    assert "already finished" in out


def test_resume_refuses_other_overrides_and_non_runs(reference, tmp_path):
    proc = run_cli("train", f"resume={reference}", "train.steps=5", check=False)
    assert proc.returncode == 2 and "takes no other overrides" in proc.stderr
    proc = run_cli("train", f"resume={tmp_path}", check=False)
    assert proc.returncode == 2 and "is not a relpos run" in proc.stderr and "Traceback" not in proc.stderr


def test_a_fresh_run_into_an_existing_run_dir_is_refused(reference):
    proc = run_cli("train", *LONG, f"hydra.run.dir={reference}", check=False)
    assert proc.returncode == 2 and "already holds a run" in proc.stderr
    assert not (reference / "failed.json").exists()


def test_corrupt_checkpoint_is_one_clear_line(tmp_path):
    run_dir = tmp_path / "run"
    run_cli("train", *TINY, "train.ckpt_every=2", f"hydra.run.dir={run_dir}")
    (run_dir / "checkpoint.pt").unlink()  # as if killed after step 2
    proc = run_cli("eval-length", str(run_dir), check=False)
    assert proc.returncode == 2 and f"resume={run_dir}" in " ".join(proc.stderr.split())
    (run_dir / "checkpoints" / "step_00000002.pt").write_bytes(b"not a checkpoint")
    proc = run_cli("train", f"resume={run_dir}", check=False)
    assert proc.returncode == 2 and "corrupt checkpoint" in proc.stderr and "Traceback" not in proc.stderr


def test_non_finite_loss_stops_naming_the_step_and_last_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    args = [*TINY, "train.steps=30", "train.ckpt_every=1", "train.lr=1e30", "train.warmup_steps=0", "train.grad_clip=1e30"]
    proc = run_cli("train", *args, f"hydra.run.dir={run_dir}", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    err = " ".join(proc.stderr.split())
    assert "non-finite loss" in err and "at step" in err and "last good checkpoint" in err
    for ckpt in (run_dir / "checkpoints").glob("step_*.pt"):  # never a checkpoint with NaN weights
        state = torch.load(ckpt, weights_only=False)["model"]
        assert all(torch.isfinite(v).all() for v in state.values())

    # skip drops the non-finite steps; a model that still ends non-finite is a failed run, not a result
    skip_dir = tmp_path / "skip"
    proc = run_cli("train", *args, "train.on_nan=skip", f"hydra.run.dir={skip_dir}", check=False)
    err = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and "training ended non-finite (loss nan" in err and "no checkpoint.pt written" in err
    rows = metrics(skip_dir)
    assert rows[-1]["skipped_steps"] > 0 and not math.isfinite(rows[-1]["loss"])
    assert json.loads((skip_dir / "failed.json").read_text())["error"].startswith("training ended non-finite")
    assert not (skip_dir / "checkpoint.pt").exists()


def test_truncate_metrics_drops_later_rows_and_a_half_written_line(tmp_path):
    from relpos_cli.checkpoint import truncate_metrics

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 6)) + '{"step": 6, "lo')
    truncate_metrics(tmp_path, 3)
    assert [m["step"] for m in metrics(tmp_path)] == [1, 2, 3]
