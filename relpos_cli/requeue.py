"""Sweep jobs on SLURM (Hydra's submitit launcher) outlive the time limit: checkpoint, requeue, resume.

submitit asks SLURM for a signal `signal_delay_s` before the limit (SIGUSR2 unless
SUBMITIT_PREEMPT_SIGNAL names another) and on it calls the launcher's `checkpoint`, which resubmits
the same Hydra job, then requeues. relpos takes that signal first:

- while training, the loop finishes its step and saves a checkpoint (train.StopRequest), then hands
  the signal on;
- at any point of the job, the run dir is marked `requeued.json` before submitit requeues;
- the requeued job finds the mark in its run dir and resumes the run (or, if training had finished,
  goes straight to its evaluation; if the signal came before the first checkpoint, starts it as the
  first attempt did) instead of refusing a dir that "already holds a run".
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from relpos_cli.atomic import atomic_write_text
from relpos_cli.logs import log

MARKER = "requeued.json"
_handler: dict[int, Any] = {}  # the preemption signal -> relpos's handler, while a job runs


def preemption_signal() -> int | None:
    """The signal submitit's job environment requeues on, or None outside a submitit job."""
    if not os.environ.get("SUBMITIT_EXECUTOR"):
        return None
    from submitit import JobEnvironment

    return int(getattr(signal, f"SIG{JobEnvironment.USR_SIG}"))


@contextmanager
def requeue_on_preemption(run_dir: Path) -> Iterator[None]:
    """Inside a submitit job: the preemption signal marks run_dir requeued, then lets submitit
    checkpoint (resubmit) the job and requeue it. Elsewhere: nothing."""
    sig = preemption_signal()
    if sig is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    submitit_handler = signal.getsignal(sig)

    def requeue(signum: int, frame: Any) -> None:
        atomic_write_text(Path(run_dir) / MARKER, json.dumps({"signal": signal.Signals(signum).name, "time": time.time()}))
        log.warning(f"{signal.Signals(signum).name}: requeued through submitit; the job resumes this run dir")
        if callable(submitit_handler):
            submitit_handler(signum, frame)  # pickles launcher.checkpoint()'s resubmission, requeues, exits

    signal.signal(sig, requeue)
    _handler[sig] = requeue
    try:
        yield
    finally:
        _handler.pop(sig, None)
        signal.signal(sig, submitit_handler)


def active_preemption_signal() -> int | None:
    """The preemption signal while requeue_on_preemption is active (training defers it to a step end)."""
    return next(iter(_handler), None)


def was_requeued(run_dir: Path) -> bool:
    """True once per requeue: the mark is consumed by the job that resumes."""
    marker = Path(run_dir) / MARKER
    if not marker.is_file():
        return False
    marker.unlink()
    return True
