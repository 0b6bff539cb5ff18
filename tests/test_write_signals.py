"""SIGTERM (`kill`, a job manager) and SIGHUP (a closed terminal or ssh session) while a command
writes its files: one line, exit 128 + the signal, and no temp file (`.NAME.*.tmp`) or lock left.
These used to end the command at once, silently (exit -15 / -1), with the temp file of the write
it was in left beside its target. The write is held at its fsync (a marker file says when), so
the signal lands mid-write. `relpos import` has its own in test_import.py.

Mutation checked: dropping stop_on_signals from jobs.py's eval-length, compare and inspect
commands fails these (no message, the temp file left); SIGHUP left out of interrupt.STOP_SIGNALS
fails the inspect case."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO

# `relpos ARGS` whose first atomic write stalls at its fsync, its temp file written and not yet renamed
STALLED_WRITE = """
import os, pathlib, sys, time
marker = pathlib.Path(sys.argv.pop(1))
def stalled(fd):
    marker.touch()
    time.sleep(300)
os.fsync = stalled
from relpos_cli.cli import main
sys.argv[0] = "relpos"
main()
"""


@pytest.mark.parametrize("command,sig", [
    (["eval-length", "{run}", "eval.lengths=[32]", "eval.tokens=256"], signal.SIGTERM),
    (["inspect", "{run}"], signal.SIGHUP),
    (["compare", "{run}", "--out", "{out}"], signal.SIGTERM),
    (["inspect", "pos=alibi", "model=tiny", "hydra.run.dir={out}"], signal.SIGTERM),
], ids=["eval-length-SIGTERM", "inspect-SIGHUP", "compare-SIGTERM", "inspect-fresh-SIGTERM"])
def test_a_signal_mid_write_leaves_no_temp_file(tiny_run, tmp_path, command, sig):
    run, out, marker = tmp_path / "run", tmp_path / "cmp", tmp_path / "writing"
    shutil.copytree(tiny_run, run)
    args = [a.format(run=run, out=out) for a in command]
    proc = subprocess.Popen([sys.executable, "-c", STALLED_WRITE, str(marker), *args], cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert marker.exists(), proc.communicate()
    assert list(tmp_path.rglob("*.tmp"))  # mid-write: the temp file is there
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    assert err.strip().splitlines() == [f"error: {sig.name}: stopped; nothing was written, run the command again "
                                        f"to start over"]
    assert not list(tmp_path.rglob("*.tmp")) and not (run / ".relpos.pid").exists()
