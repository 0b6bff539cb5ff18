"""Stopping a sweep whose jobs run in local worker processes (`hydra/launcher=local`, joblib).

- SIGTERM (`kill`, `timeout`, a job manager) reaches the sweep's own process alone. It used to die
  and leave its workers orphaned, training on and taking the sweep's remaining jobs from the queue.
  The sweep now forwards it to its workers.
- Ctrl-C's SIGINT reaches the terminal's whole process group, workers included.

Either way each worker's training loop saves a checkpoint and stops, and the worker process exits
(`interrupted_worker_exits`). The sweep waits for that before it stops: joblib kills the workers it leaves
behind, which could cut a checkpoint short. A second signal stops the sweep at once.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from contextlib import contextmanager
from typing import Iterator

from relpos_cli.console import print_error
from relpos_cli.errors import Interrupted
from relpos_cli.interrupt import exit_now, signal_handlers

GRACE_S = 120  # a training step plus a checkpoint


@contextmanager
def workers_stop_with_the_sweep() -> Iterator[None]:
    stopping = False

    def stop(signum, frame):
        nonlocal stopping
        if stopping:
            raise KeyboardInterrupt
        stopping = True
        workers = multiprocessing.active_children()  # joblib's workers; none under the basic launcher
        if signum == signal.SIGTERM:
            for worker in workers:
                try:
                    os.kill(worker.pid, signum)
                except ProcessLookupError:  # it ended meanwhile
                    pass
        deadline = time.monotonic() + GRACE_S
        for worker in workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        raise KeyboardInterrupt

    with signal_handlers(stop):
        yield


def in_worker_process() -> bool:
    """This job runs in a worker process of the sweep (joblib), not in the sweep's own."""
    return multiprocessing.parent_process() is not None


@contextmanager
def interrupted_worker_exits() -> Iterator[None]:
    """A job in a worker process, stopped by Ctrl-C or SIGTERM (its checkpoint saved): say so and end
    the process, which the sweep waits for; the worker would otherwise wait for its next job."""
    try:
        yield
    except (Interrupted, KeyboardInterrupt) as e:
        if not in_worker_process():
            raise
        print_error(str(e) if isinstance(e, Interrupted) else "interrupted")
        exit_now(e.exit_code if isinstance(e, Interrupted) else 130)
