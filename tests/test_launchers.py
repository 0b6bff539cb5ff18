"""Cluster and local sweep launchers: conf/hydra/launcher/{slurm,local}.yaml compose into Hydra's
submitit and joblib launchers, and a sweep really runs through submitit's local executor."""

import pytest
from hydra import compose, initialize_config_dir

from conftest import TINY, run_cli
from relpos_cli.config import conf_dir


def hydra_launcher(*overrides: str):
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=True).hydra.launcher


def test_slurm_launcher_composes_with_shell_overrides():
    launcher = hydra_launcher("hydra/launcher=slurm", "hydra.launcher.partition=gpu", "hydra.launcher.timeout_min=30",
                              "hydra.launcher.gpus_per_node=2", "hydra.launcher.array_parallelism=4")
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert (launcher.partition, launcher.timeout_min, launcher.gpus_per_node, launcher.array_parallelism) == ("gpu", 30, 2, 4)
    assert launcher.tasks_per_node == 1 and launcher.signal_delay_s == 120  # the file's own settings


def test_local_launcher_is_joblib():
    launcher = hydra_launcher("hydra/launcher=local", "hydra.launcher.n_jobs=3")
    assert launcher._target_.endswith("joblib_launcher.JoblibLauncher") and launcher.n_jobs == 3


def test_sweep_through_submitit_local_executor(tmp_path):
    sweep = tmp_path / "sweep"
    run_cli("train", "-m", "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=5", "pos=alibi,t5",
            *TINY, "device=cpu", f"hydra.sweep.dir={sweep}")
    runs = sorted(p for p in sweep.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert len(runs) == 2 and "pos=alibi" in runs[0].name and "pos=t5" in runs[1].name
    for run in runs:
        assert (run / "checkpoint.pt").is_file() and (run / "metrics.jsonl").read_text().count("\n") == 2
    assert list((sweep / ".submitit").iterdir()), "the jobs ran through submitit"


@pytest.mark.parametrize("launcher", ["slurm", "local"])
def test_launcher_choice_is_listed_on_a_typo(launcher, tmp_path):
    proc = run_cli("train", "-m", f"hydra/launcher={launcher}x", *TINY, f"hydra.sweep.dir={tmp_path}", check=False)
    assert proc.returncode == 2 and launcher in proc.stderr and "Traceback" not in proc.stderr
