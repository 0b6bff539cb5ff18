"""Inference hands large freed blocks back to the OS.

Long evaluation allocates (block x L) tensors whose size changes with every query block. glibc's
malloc serves a request below its mmap threshold from the heap, and raises that threshold (up to
32 MiB) each time a larger mmapped block is freed, so these tensors end up on the heap, which then
fragments: a fresh 16384-token FIRE evaluation peaked at 1475 MiB, and at 612 MiB with the
threshold fixed (scripts/bench_eval.py). A fixed threshold stops that adjustment: every block of
LARGE_BLOCK or more is mmapped and unmapped when freed. 1 MiB sits below the per-head maps of a
16 MiB query block at long lengths (attention.BLOCK_BYTES; 2 MiB at L = 16384, 8 heads), which a
4 MiB threshold left on the heap.

Training wants the opposite, its blocks reused step after step: it undoes this (keep_large_blocks)
when a process that evaluated goes on to train, as a sweep's worker process does."""

from __future__ import annotations

import ctypes
import sys
from typing import Callable

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>
LARGE_BLOCK = 2**20
# the most glibc's own adjustment raises the mmap threshold to on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX);
# it sets the trim threshold to twice the mmap threshold as it goes
HELD_BLOCK = 32 * 2**20
_released = False


def _mallopt() -> Callable[[int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # musl has no mallopt
        return None


def release_large_blocks() -> bool:
    """Fix glibc's mmap threshold at LARGE_BLOCK; False where this is not glibc (nothing to do)."""
    global _released
    mallopt = _mallopt()
    _released = bool(mallopt and mallopt(M_MMAP_THRESHOLD, LARGE_BLOCK))
    return _released


def keep_large_blocks() -> bool:
    """Undo release_large_blocks before training in the same process; False if there was nothing to undo.

    A sweep's worker process (hydra/launcher=local) trains its next job after evaluating the last
    one. With every block of 1 MiB or more mapped afresh at each step, training spent a third of its
    time in the kernel: 7,077 tokens/s against 10,272 (the tasks preset's model, one thread). glibc
    cannot go back to adjusting its thresholds once one is fixed, so they are fixed where that
    adjustment takes them."""
    global _released
    mallopt = _mallopt()
    if not (_released and mallopt):
        return False
    _released = not (mallopt(M_MMAP_THRESHOLD, HELD_BLOCK) and mallopt(M_TRIM_THRESHOLD, 2 * HELD_BLOCK))
    return not _released
