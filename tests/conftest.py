import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One token cache for the whole session: the stdlib corpus is tokenized once."""
    return tmp_path_factory.mktemp("relpos_cache")


@pytest.fixture(autouse=True)
def offline_env(monkeypatch, cache_dir):
    monkeypatch.setenv("RELPOS_CACHE", str(cache_dir))
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


TINY = ["model=tiny", "train.steps=4", "train.batch_size=4", "train.seq_len=32", "train.log_every=2",
        "train.val_batches=1", "wandb.mode=disabled"]


def run_cli(*args: str, cwd: Path | None = None, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m relpos_cli ARGS` in a subprocess, as a user would run it."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200", **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "relpos_cli", *args], cwd=cwd or REPO, env=full_env, capture_output=True, text=True,
        timeout=600,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"relpos {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def metrics(run_dir: Path) -> list[dict]:
    """The rows of a run's metrics.jsonl."""
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=False)["model"]


def trained_run(tmp_path_factory, *overrides: str) -> Path:
    """A finished `relpos train` run dir, for module-scoped reference fixtures."""
    run_dir = tmp_path_factory.mktemp("run") / "run"
    run_cli("train", *overrides, f"hydra.run.dir={run_dir}")
    return run_dir
