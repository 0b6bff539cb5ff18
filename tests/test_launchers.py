"""Cluster and local sweep launchers: conf/hydra/launcher/{slurm,local}.yaml compose into Hydra's
submitit and joblib launchers, and a sweep really runs through submitit's local executor: each job
trains and evaluates, and submitit's time-limit signal checkpoints, requeues and resumes it."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from hydra import compose, initialize_config_dir

from conftest import REPO, TINY, metrics, run_cli
from relpos_cli.config import conf_dir
from wandb_records import OfflineRun


def hydra_launcher(*overrides: str):
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=True).hydra.launcher


def test_slurm_launcher_composes_with_shell_overrides():
    launcher = hydra_launcher("hydra/launcher=slurm", "hydra.launcher.partition=gpu", "hydra.launcher.timeout_min=30",
                              "hydra.launcher.gpus_per_node=2", "hydra.launcher.array_parallelism=4")
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert (launcher.partition, launcher.timeout_min, launcher.gpus_per_node, launcher.array_parallelism) == ("gpu", 30, 2, 4)
    assert launcher.tasks_per_node == 1 and launcher.signal_delay_s == 120  # the file's own settings
    # SLURM is asked for the signal relpos checkpoints and requeues on, and time-limit requeues are allowed
    from submitit import JobEnvironment
    from submitit.slurm.slurm import _make_sbatch_string

    sbatch = _make_sbatch_string("python -m relpos_cli", "/tmp", signal_delay_s=launcher.signal_delay_s)
    assert f"#SBATCH --signal={JobEnvironment.USR_SIG}@120" in sbatch and launcher.max_num_timeout > 0


def test_local_launcher_is_joblib():
    launcher = hydra_launcher("hydra/launcher=local", "hydra.launcher.n_jobs=3")
    assert launcher._target_.endswith("joblib_launcher.JoblibLauncher") and launcher.n_jobs == 3


def time_limit_signal() -> int:
    """The signal submitit asks SLURM for before the time limit (and its local executor sends)."""
    from submitit import JobEnvironment

    return getattr(signal, f"SIG{JobEnvironment.USR_SIG}")


def test_sweep_jobs_evaluate_where_they_train_and_requeue_on_the_time_limit_signal(tmp_path):
    sweep = tmp_path / "sweep"
    steps = 60
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200", "OMP_NUM_THREADS": "1"}  # two jobs, two cores
    proc = subprocess.Popen(
        [sys.executable, "-m", "relpos_cli", "sweep", "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=5",
         "pos=alibi,t5", *TINY[:-1], "wandb.mode=offline", f"train.steps={steps}", "train.log_every=1",
         "train.eval_every=0", "device=cpu", "eval.lengths=[32,64]", "eval.tokens=256", f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:  # the alibi job is training: send it what SLURM sends before the limit
        log = next(sweep.glob("0_*/relpos.log"), None)
        if log is not None and re.search(r"step +2/", log.read_text()):
            break
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.005)
    os.kill(int(re.search(r"pid (\d+)", log.read_text())[1]), time_limit_signal())
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, out + err

    runs = sorted(p for p in sweep.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name != "wandb")
    assert len(runs) == 2 and "pos=alibi" in runs[0].name and "pos=t5" in runs[1].name
    text = runs[0].joinpath("relpos.log").read_text()
    assert "requeued through submitit" in text and re.search(r"resumed at step \d+", text), text
    for run in runs:
        assert [m["step"] for m in metrics(run)] == list(range(1, steps + 1))  # every step once, across the requeue
        assert (run / "eval_length.json").is_file() and "eval-length default" in (run / "relpos.log").read_text()
        (offline,) = (run / "wandb").glob("offline-run-*")  # one W&B run despite the requeue, in the sweep's group
        record = OfflineRun(offline)
        assert record.run.run_group == str(sweep) and len(record.column("train/loss")) == steps
        assert record.column("eval/length") == [32, 64]
    assert list((sweep / ".submitit").iterdir()), "the jobs ran through submitit"
    assert {g["label"] for g in json.loads((sweep / "compare.json").read_text())["groups"]} == {"alibi", "t5"}


@pytest.mark.slow
def test_sigterm_stops_a_local_sweep_and_its_workers_after_their_checkpoints(tmp_path):
    """`kill` reaches the sweep's process alone, not the joblib workers training its jobs: they must
    checkpoint and end with it, not train on orphaned and start the jobs still queued."""
    sweep = tmp_path / "sweep"
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "relpos_cli", "sweep", "hydra/launcher=local", "hydra.launcher.n_jobs=2",
         "pos=rope,alibi", "seed=0,1", *TINY[:2], "train.steps=100000", *TINY[2:], "train.ckpt_every=0",
         "device=cpu", f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:  # both workers are training
        logs = [next(sweep.glob(f"{n}_*/relpos.log"), None) for n in (0, 1)]
        if all(log is not None and re.search(r"step +4/", log.read_text()) for log in logs):
            break
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    workers = [int(re.search(r"pid (\d+)", log.read_text())[1]) for log in logs]
    proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=150)  # orphaned workers would hold its pipes open
        time.sleep(1)
        orphans = [pid for pid in workers if process_exists(pid)]
    finally:
        for pid in workers:
            if process_exists(pid):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 130 and "Traceback" not in err, out + err
    assert not orphans
    for log in logs:  # each job saved where it stopped and said so
        assert list(log.parent.glob("checkpoints/step_*.pt")), err
        assert "SIGTERM at step" in err and str(log.parent) in err
    assert not list(sweep.glob("2_*")) and not list(sweep.glob("3_*")), "a queued job started after the kill"


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("launcher", ["slurm", "local"])
def test_launcher_choice_is_listed_on_a_typo(launcher, tmp_path):
    proc = run_cli("train", "-m", f"hydra/launcher={launcher}x", *TINY, f"hydra.sweep.dir={tmp_path}", check=False)
    assert proc.returncode == 2 and launcher in proc.stderr and "Traceback" not in proc.stderr
