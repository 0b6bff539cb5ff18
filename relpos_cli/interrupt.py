"""Long work that stops within a second on Ctrl-C, `kill` (SIGTERM) or a closed terminal (SIGHUP),
with one line.

CPython raises KeyboardInterrupt only between bytecodes, so a single kernel call that runs for
minutes (attention over a 1M-token example, Arrow building a large dataset) used to hold Ctrl-C
off until it returned. `in_worker` runs such work in a thread of its own while the main thread
waits in short joins, where signals are handled at once: the interruption unwinds the command
(its lock is released, temp files removed, nothing is written), and the process ends with
`os._exit` rather than finalising the interpreter under a thread that is still inside a kernel.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TypeVar

from relpos_cli.errors import Interrupted

T = TypeVar("T")
_abandoned: list[threading.Event] = []  # the `done` events of workers an interruption left running
# Ctrl-C, `kill` / a job manager, a closed terminal or ssh session: each asks the command to stop
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(KeyboardInterrupt):
    """A stop signal raised the way Ctrl-C raises KeyboardInterrupt, with its number: a
    BaseException, so no `except Exception` on the way takes it for a failure of the work."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop(signum: int, frame: Any) -> None:
    name = signal.Signals(signum).name
    raise Interrupted(f"{name}: stopped; nothing was written, run the command again to start over", signum)


def _stop_like_ctrl_c(signum: int, frame: Any) -> None:
    raise Stopped(signum)


@contextmanager
def signal_handlers(handler: Callable[[int, Any], None]) -> Iterator[None]:
    """handler for SIGINT, SIGTERM and SIGHUP inside the block, the previous handlers restored after it."""
    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextmanager
def main_thread_handlers(handler: Callable[[int, Any], None]) -> Iterator[None]:
    """signal_handlers(handler) in the main thread, where Python runs signal handlers; in a worker
    thread the handlers stay as they are."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    with signal_handlers(handler):
        yield


def stop_on_signals():
    """SIGINT, SIGTERM and SIGHUP raise Interrupted (exit 130 / 143 / 129, one line) in the main
    thread inside the block."""
    return main_thread_handlers(_stop)


def signals_as_ctrl_c():
    """SIGINT, SIGTERM and SIGHUP raise Stopped (a KeyboardInterrupt) in the main thread inside the
    block: work that cleans up on Ctrl-C (`except KeyboardInterrupt`, `except BaseException`) cleans
    up on `kill` and a closed terminal too, and names the signal."""
    return main_thread_handlers(_stop_like_ctrl_c)


def in_worker(work: Callable[[], T]) -> T:
    """work() in a worker thread, the main thread left to take Ctrl-C, SIGTERM and SIGHUP at once; its
    result or its exception, as if called here."""
    if threading.current_thread() is not threading.main_thread():
        return work()
    outcome: dict[str, Any] = {}
    done = threading.Event()  # not Thread.is_alive: in Python 3.11 a join() cut short by a signal marks
    # the thread stopped while it still runs (threading._wait_for_tstate_lock releases its lock)

    def run() -> None:
        try:
            outcome["value"] = work()
        except BaseException as e:  # handed to the main thread, which raises it
            outcome["error"] = e
        finally:
            done.set()

    worker = threading.Thread(target=run, name="relpos-work", daemon=True)
    with stop_on_signals():
        worker.start()
        try:
            while not done.wait(0.1):
                pass
        except BaseException:
            _abandoned.append(done)
            raise
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def leave(code: int) -> None:
    """End the command with `code`: SystemExit, or os._exit when an interrupted worker still runs
    (finalising the interpreter under it could crash or wait for its kernel)."""
    if not all(done.is_set() for done in _abandoned):
        exit_now(code)
    raise SystemExit(code)


def exit_now(code: int) -> None:
    """os._exit(code) once what was printed is out: no interpreter shutdown, no waiting on anything."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
