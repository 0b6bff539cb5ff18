"""One writer per run dir: an OS lock (flock, through `filelock`) held by every command that writes
into a run dir (train, resume, eval-length, inspect, eval-task), and the check that a fresh run
goes only into an empty dir or one relpos made.

The lock is released by the kernel when its process ends, however it ends (kill -9 included), so
a stale lock never blocks a run; the holder's PID is written beside it for the refusal message.

Where runs go: `outputs/latest` links to the newest run (or sweep) dir, from the moment its training
starts (a run stopped at any step is found there), and under torchrun every rank is given rank 0's
run-dir name.
"""

from __future__ import annotations

import datetime
import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from filelock import FileLock, Timeout
from omegaconf import OmegaConf

from relpos_cli.atomic import atomic_write_text
from relpos_cli.config import conf_dir
from relpos_cli.console import describe_os_error, print_note
from relpos_cli.errors import RelposError, RunDirTaken
from relpos_cli.results import FAILED_FILE, LOG_FILE

LOCK_FILE = ".relpos.lock"
PID_FILE = ".relpos.pid"
# what a relpos job leaves in a dir before it has trained anything: Hydra's files, a failure record
NOT_YET_A_RUN = {".hydra", LOG_FILE, FAILED_FILE, LOCK_FILE, PID_FILE}


class RunDirInUse(RunDirTaken):
    """Another process holds the run dir's lock."""


@contextmanager
def run_dir_lock(run_dir: Path, command: str) -> Iterator[None]:
    """Hold run_dir's lock for the block; another holder -> RunDirInUse naming its PID."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirTaken(f"{run_dir} is a file, not a run dir: pick another path")
    if not run_dir.is_dir():
        raise RunDirTaken(f"run dir not found: {run_dir}")
    lock = FileLock(run_dir / LOCK_FILE, blocking=False)
    try:
        lock.acquire()
    except Timeout:
        raise RunDirInUse(
            f"{run_dir} is in use by another relpos process ({holder(run_dir)}); wait for it to end, or stop it"
        ) from None
    try:
        atomic_write_text(run_dir / PID_FILE, f"{os.getpid()} {command}\n")
        yield
    finally:
        (run_dir / PID_FILE).unlink(missing_ok=True)
        lock.release()


def holder(run_dir: Path) -> str:
    try:
        pid, _, command = (Path(run_dir) / PID_FILE).read_text().strip().partition(" ")
    except OSError:
        return "PID unknown"
    return f"PID {pid}, relpos {command}" if command else f"PID {pid}"


def check_fresh_run_dir(run_dir: Path) -> None:
    """A fresh run goes into a new or empty dir, or one relpos made (it holds the lock file or a
    failed.json); never into a dir of other files (hydra.run.dir=. or a folder of the user's own).
    Runs before the lock is taken, so a refused dir gets nothing written into it."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirTaken(f"{run_dir} is a file, not a run dir: pick another hydra.run.dir")
    others = sorted(p.name for p in run_dir.iterdir() if p.name not in NOT_YET_A_RUN) if run_dir.is_dir() else []
    made_by_relpos = (run_dir / LOCK_FILE).exists() or (run_dir / FAILED_FILE).exists()
    if others and not made_by_relpos:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise RunDirTaken(
            f"{run_dir} is not empty and holds no relpos run (it holds {shown}); nothing in it was touched: "
            f"pick a new or empty hydra.run.dir"
        )


def check_sweep_dir(sweep_dir: Path) -> None:
    """A sweep goes into a new or empty dir, or an earlier sweep's (Hydra's multirun.yaml is there);
    never into a folder of other files, where Hydra would write (or replace) its multirun.yaml."""
    sweep_dir = Path(sweep_dir)
    if sweep_dir.exists() and not sweep_dir.is_dir():
        raise RunDirTaken(f"{sweep_dir} is a file, not a sweep dir: pick another hydra.sweep.dir")
    others = sorted(p.name for p in sweep_dir.iterdir()) if sweep_dir.is_dir() else []
    if others and not (sweep_dir / "multirun.yaml").exists():
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise RunDirTaken(f"{sweep_dir} is not empty and holds no sweep (it holds {shown}); nothing in it was "
                          f"touched: pick a new or empty hydra.sweep.dir")


def refuse_if_trained(run_dir: Path, holds_training_state: bool) -> None:
    if holds_training_state:
        raise RunDirTaken(
            f"{run_dir} already holds a run; continue it with resume={run_dir} or pick another hydra.run.dir"
        )


LATEST = Path("outputs") / "latest"


def check_latest_is_a_link() -> None:
    """Before training: outputs/latest must be relpos's link (or absent), or the run could not be
    pointed at after hours of training."""
    if LATEST.exists() and not LATEST.is_symlink():
        kind = "directory" if LATEST.is_dir() else "file"
        raise RelposError(f"{LATEST} is a {kind}, where relpos keeps a link to the newest run: move it away "
                          f"(mv {LATEST} {LATEST}.mine) and run again")


def point_latest_at(target: Path) -> None:
    """outputs/latest -> the newest run (or sweep) dir, so `relpos eval-length outputs/latest` works;
    a run points it as its training starts and again as it ends (relpos_cli/train.py). A failure here
    (outputs/ read-only, full) is a note: the run itself goes on, or is done."""
    # a temp name of this process's own: parallel jobs (joblib, several shells) finish at once
    tmp = LATEST.with_name(f".latest.{os.getpid()}.tmp")
    try:
        LATEST.parent.mkdir(parents=True, exist_ok=True)
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(target.resolve(), target_is_directory=True)
        tmp.replace(LATEST)
    except OSError as e:
        print_note(f"outputs/latest not updated: {describe_os_error(e)}")


def torchrun_overrides(overrides: list[str], multirun: bool, is_main: bool, broadcast_from_main) -> list[str]:
    """Every torchrun rank composes its own config: all of them get rank 0's run dir (its name holds
    rank 0's clock), and rank 0 alone writes Hydra's files and log there. broadcast_from_main:
    distributed.broadcast_from_main, passed in (distributed sits a layer above and imports torch)."""
    if multirun:
        raise RelposError("-m sweeps do not run under torchrun: start one torchrun per run, or sweep with a launcher")
    extra = []
    if not any(o.startswith("hydra.run.dir=") for o in overrides):
        pattern = OmegaConf.to_container(OmegaConf.load(conf_dir() / "config.yaml").hydra.run)["dir"]  # unresolved
        now = datetime.datetime.now()
        run_dir = re.sub(r"\$\{now:([^}]*)\}", lambda m: now.strftime(m[1]), pattern)  # ${pos.name} stays for Hydra
        extra.append(f"hydra.run.dir={broadcast_from_main(run_dir)}")
    if not is_main:
        extra += ["hydra.output_subdir=null", "hydra/job_logging=disabled"]
    return [*overrides, *extra]
