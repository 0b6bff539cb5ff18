import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
torch.set_num_threads(min(2, torch.get_num_threads()))

# The user's relpos cache, found before the sandbox below replaces HOME and RELPOS_CACHE: tests never read
# or write it (examples cached there by other code once let a broken task generator pass). A pytest-xdist
# worker starts inside its controller's sandbox, so it is told the controller's (pytest_configure_node).
USER_CACHE = Path(os.environ.get("RELPOS_CACHE", "~/.cache/relpos")).expanduser()


def sandbox_env(root: Path) -> dict[str, str]:
    """The variables that place caches, settings and temp files (relpos, XDG, Hugging Face, W&B, torch,
    Triton, matplotlib, TMPDIR), pointed into `root`, and offline settings. HOME gets a folder of its own that must
    stay empty: everything else has a place outside it.

    Args:
        root: an empty temp dir.
    """
    dirs = {"HOME": "home", "RELPOS_CACHE": "relpos", "TORCHINDUCTOR_CACHE_DIR": "relpos/inductor",
            "XDG_CACHE_HOME": "xdg/cache", "XDG_CONFIG_HOME": "xdg/config", "XDG_DATA_HOME": "xdg/data",
            "XDG_STATE_HOME": "xdg/state", "HF_HOME": "hf", "TORCH_HOME": "torch", "TRITON_CACHE_DIR": "triton",
            "MPLCONFIGDIR": "matplotlib", "WANDB_DIR": "wandb", "WANDB_CONFIG_DIR": "wandb/config",
            "WANDB_CACHE_DIR": "wandb/cache", "WANDB_DATA_DIR": "wandb/data",
            "CUDA_CACHE_PATH": "cuda",  # the driver's JIT cache (else ~/.nv, seen on an H100)
            "TMPDIR": "tmp"}  # what scripts and subprocesses make with tempfile or mktemp -t, removed with the rest
    return {**{key: str(root / sub) for key, sub in dirs.items()},
            "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def tree_state(root: Path) -> dict[str, tuple[int, int]] | None:
    """(mtime, size) of every path under root, None if root does not exist: equal states mean nothing
    was created, removed or written there."""
    if not root.exists():
        return None
    return {str(p.relative_to(root)): (p.lstat().st_mtime_ns, p.lstat().st_size) for p in [root, *root.rglob("*")]}


def pytest_configure(config):
    """Point the caches and HOME into a fresh temp dir before test modules are imported, so module
    constants (a subprocess env built at import), module- and session-scoped fixtures and every
    subprocess see it too, not only function-scoped fixtures."""
    config.relpos_sandbox = Path(tempfile.mkdtemp(prefix="relpos-tests-"))
    config.relpos_env = sandbox_env(config.relpos_sandbox)
    worker_input = getattr(config, "workerinput", None)
    config.relpos_user_cache_dir = Path(worker_input["relpos_user_cache_dir"]) if worker_input else USER_CACHE
    config.relpos_user_cache = tree_state(config.relpos_user_cache_dir)
    Path(config.relpos_env["HOME"]).mkdir()
    Path(config.relpos_env["TMPDIR"]).mkdir()
    os.environ.update(config.relpos_env)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """pytest-xdist, in the controller as it starts a worker: the user's cache it found, for the worker to guard."""
    node.workerinput["relpos_user_cache_dir"] = str(node.config.relpos_user_cache_dir)


def pytest_unconfigure(config):
    shutil.rmtree(config.relpos_sandbox, ignore_errors=True)


def home_and_cache_faults(config) -> list[str]:
    """What the tests wrote to the sandbox HOME (which is then emptied, so the next test starts clean)
    and whether the user's relpos cache changed."""
    home = Path(config.relpos_env["HOME"])
    faults = [f"wrote {p} under $HOME" for p in sorted(home.iterdir())]
    for p in home.iterdir():
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    user_cache = config.relpos_user_cache_dir
    if tree_state(user_cache) != config.relpos_user_cache:
        faults.append(f"changed the user's relpos cache {user_cache}")
        config.relpos_user_cache = tree_state(user_cache)
    return faults


@pytest.fixture(scope="session", autouse=True)
def home_untouched_by_fixtures(request):
    """Session end: module- and session-scoped fixtures' teardowns wrote nothing to HOME or the user's cache."""
    yield
    faults = home_and_cache_faults(request.config)
    if faults:
        pytest.fail("; ".join(faults), pytrace=False)


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    """The session's token cache (RELPOS_CACHE): the stdlib corpus is tokenized once."""
    return Path(os.environ["RELPOS_CACHE"])


@pytest.fixture(autouse=True)
def offline_env(monkeypatch, request):
    """Each test starts in the sandbox (even if one before it changed the environment) and fails if
    it, or a fixture set up for it, wrote to HOME or to the user's relpos cache."""
    for key, value in request.config.relpos_env.items():
        monkeypatch.setenv(key, value)
    yield
    faults = home_and_cache_faults(request.config)
    if faults:
        pytest.fail("; ".join(faults), pytrace=False)


TINY = ["model=tiny", "train.steps=4", "train.batch_size=4", "train.seq_len=32", "train.log_every=2",
        "train.val_batches=1", "wandb.mode=disabled"]


def run_cli(*args: str, cwd: Path | None = None, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m relpos_cli ARGS` in a subprocess, as a user would run it."""
    # the checkout first, then what the caller's PYTHONPATH brings (a GPU machine's wheels, say)
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    full_env = {**os.environ, "PYTHONPATH": path, "COLUMNS": "200", **(env or {})}
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
def tiny_run(tmp_path_factory) -> Path:
    """One finished tiny alibi run (8 steps) for tests that only read it or evaluate it."""
    cwd = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    try:
        run_dir = tmp_path_factory.mktemp("tiny") / "12-00-00-000000_alibi"
        code, _, err = run_in_process("train", *TINY, "train.steps=8", "pos=alibi", f"hydra.run.dir={run_dir}")
        assert code == 0, err
    finally:
        os.chdir(cwd)
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


def tiny_trained(tmp_path_factory, *overrides: str) -> Path:
    """A finished tiny run (TINY and the overrides) trained in this process: faster than
    trained_run's subprocess, for modules that work in a temp dir (in_temp_cwd)."""
    run_dir = tmp_path_factory.mktemp("run") / "run"
    code, _, err = run_in_process("train", *TINY, *overrides, f"hydra.run.dir={run_dir}")
    assert code == 0, err
    return run_dir


def redraw_weights(run_dir: Path, seed: int = 0) -> Path:
    """The run's checkpointed weights drawn again, N(0, 1) seeded: a few training steps leave a tiny
    model near uniform predictions, where positions, and so a wrong rotation or a missing extension
    method, hardly move a logit."""
    checkpoint = torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=False)
    generator = torch.Generator().manual_seed(seed)
    checkpoint["model"] = {k: torch.randn(v.shape, generator=generator) if v.is_floating_point() else v
                           for k, v in checkpoint["model"].items()}
    torch.save(checkpoint, run_dir / "checkpoint.pt")
    return run_dir
