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


def run_in_process(*args: str):
    """(exit code, stdout, stderr) of `relpos ARGS` run in this process: no interpreter start, so
    fast; an uncaught exception fails the test. In-process runs point outputs/latest in the cwd:
    modules using this change into a temp dir (the `in_temp_cwd` fixture)."""
    from typer.testing import CliRunner

    from relpos_cli.cli import app

    argv = sys.argv[:]
    try:
        result = CliRunner().invoke(app, list(args), catch_exceptions=False)
    finally:
        sys.argv = argv
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture(scope="module")
def in_temp_cwd(tmp_path_factory):
    cwd = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    yield
    os.chdir(cwd)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, cache_dir) -> Path:
    """One finished tiny alibi run (8 steps) for tests that only read it or evaluate it."""
    cwd = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    old_cache = os.environ.get("RELPOS_CACHE")
    os.environ["RELPOS_CACHE"] = str(cache_dir)  # the function-scoped offline_env is not set up yet here
    try:
        run_dir = tmp_path_factory.mktemp("tiny") / "12-00-00-000000_alibi"
        code, _, err = run_in_process("train", *TINY, "train.steps=8", "pos=alibi", f"hydra.run.dir={run_dir}")
        assert code == 0, err
    finally:
        os.chdir(cwd)
        if old_cache is None:
            os.environ.pop("RELPOS_CACHE")
        else:
            os.environ["RELPOS_CACHE"] = old_cache
    return run_dir


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
