"""relpos.log in each run dir: what happened to the run, in plain lines, through Python logging.

Training writes its config, every log step, validations, checkpoints, warnings, errors and its final
line; eval-length and inspect add theirs. The terminal gets the same lines (or a progress bar on a
TTY) from the commands themselves, so records do not also go to the console.
"""

from __future__ import annotations

import logging
import os
import shlex
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

from relpos_cli.errors import RelposError
from relpos_cli.results import LOG_FILE

log = logging.getLogger("relpos")
_FORMAT = "%(asctime)s %(levelname)s %(message)s"

# The command line as typed, set by the CLI as a command starts (start_command): Hydra's jobs see a
# sys.argv rewritten for Hydra (`relpos pos=rope ... --multirun`, no `train`), and a sweep's worker
# processes (joblib, submitit) another program's; they inherit the environment.
COMMAND_ENV = "RELPOS_COMMAND"
# relpos.log files this command has already headed with its provenance line: a sweep job trains and
# then evaluates its run, one command, two writers of the file
_headed: set[str] = set()


def start_command(args: Sequence[str]) -> None:
    """A relpos command starts with these arguments (those after `relpos`): its provenance line names
    them, and heads each run dir's relpos.log once however many times the command opens it."""
    os.environ[COMMAND_ENV] = shlex.join(["relpos", *args])
    _headed.clear()


@contextmanager
def run_log(run_dir: Path) -> Iterator[logging.Logger]:
    """Append the `relpos` logger's records and Python warnings to run_dir/relpos.log inside the block.

    Re-entrant: a command that trains then evaluates the same run dir opens the file once."""
    path = (Path(run_dir) / LOG_FILE).resolve()
    if any(getattr(h, "baseFilename", None) == str(path) for h in log.handlers):
        yield log
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = _CommandRecords(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter(_FORMAT))
    warnings_log = logging.getLogger("py.warnings")
    log.addHandler(handler)
    warnings_log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False  # the console shows its own lines; records are for the file
    logging.captureWarnings(True)
    try:
        yield log
    finally:
        logging.captureWarnings(False)
        log.removeHandler(handler)
        warnings_log.removeHandler(handler)
        handler.close()


class _CommandRecords(logging.FileHandler):
    """relpos.log's handler for one command: its first record is preceded by provenance_line() (a
    command that logs nothing, a refused rerun, leaves the file as it was)."""

    started = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.started:
            self.started = True
            if self.baseFilename not in _headed:
                _headed.add(self.baseFilename)
                head = logging.LogRecord(record.name, logging.INFO, __file__, 0, provenance_line(), None, None)
                # stamped with the record it heads: it is made after it (git takes milliseconds), and a
                # later time put the file's records out of order
                head.created, head.msecs, head.relativeCreated = record.created, record.msecs, record.relativeCreated
                super().emit(head)
        super().emit(record)


def provenance_line() -> str:
    """What a result needs to be reproduced, at the head of each command's records: the command line,
    relpos's version and (in a git checkout) its commit, Python, torch and its thread count (when
    loaded: `relpos --help` never imports it) and the host."""
    import platform
    import socket
    import sys

    from relpos_cli import __version__

    command = os.environ.get(COMMAND_ENV) or shlex.join(["relpos", *sys.argv[1:]])
    parts = [f"command: {command}", f"relpos {__version__}{_checkout_commit()}", f"python {platform.python_version()}"]
    torch = sys.modules.get("torch")
    if torch is not None:
        threads = torch.get_num_threads()
        parts.append(f"torch {torch.__version__} ({threads} thread{'s' if threads != 1 else ''})")
    parts.append(f"host {socket.gethostname()}")
    return "; ".join(parts)


def _checkout_commit() -> str:
    """` at <commit>` (`+ changes` for a dirty tree) where relpos runs from a git checkout, else ''
    (an installed relpos inside another repo's venv is not that repo's code)."""
    root = Path(__file__).resolve().parent.parent
    state = git_state(root) if (root / ".git").exists() else None
    return "" if state is None else f" at {state[0]}" + (" + changes" if state[1] else "")


def git_state(repo: Path) -> tuple[str, bool] | None:
    """(the commit checked out at `repo`, whether tracked files differ from it); None where git cannot
    say (no checkout, no git)."""
    import subprocess

    try:
        commit, changes = (subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=5,
                                          check=True).stdout.strip()
                           for args in (["rev-parse", "HEAD"], ["status", "--porcelain", "--untracked-files=no"]))
    except (OSError, subprocess.SubprocessError):
        return None
    return commit, bool(changes)


@contextmanager
def recorded_writer(run_dir: Path, command: str) -> Iterator[logging.Logger]:
    """What a command that adds results to a run dir holds while it works: the dir's lock (one
    writer: not while the run trains or another evaluation writes) and relpos.log, where an error
    that stops it is recorded before it reaches the terminal."""
    from relpos_cli.rundir import run_dir_lock  # here: the CLI imports this module as it starts

    with run_dir_lock(run_dir, command), run_log(run_dir) as log:
        try:
            yield log
        except RelposError as e:
            log.error(f"{command}: error: {e}")
            raise


def plain(markup: str) -> str:
    """Console markup ([bold]...[/]) as the plain text a log line holds."""
    from rich.text import Text

    return Text.from_markup(markup).plain
