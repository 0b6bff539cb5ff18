"""Inference hands large freed blocks back to the OS.

Long evaluation allocates (block x L) tensors whose size changes with every query block. glibc's
malloc serves a request below its mmap threshold from the heap, and raises that threshold (up to
32 MiB) each time a larger mmapped block is freed, so these tensors end up on the heap, which then
fragments: a fresh 16384-token FIRE evaluation peaked at 1475 MiB, and at 612 MiB with the
threshold fixed (scripts/bench_eval.py). A fixed threshold stops that adjustment: every block of
LARGE_BLOCK or more is mmapped and unmapped when freed. 1 MiB sits below the per-head maps of a
16 MiB query block at long lengths (attention.BLOCK_BYTES; 2 MiB at L = 16384, 8 heads), which a
4 MiB threshold left on the heap."""

from __future__ import annotations

import ctypes
import sys

M_MMAP_THRESHOLD = -3  # glibc's <malloc.h>
LARGE_BLOCK = 2**20


def release_large_blocks() -> bool:
    """Fix glibc's mmap threshold at LARGE_BLOCK; False where this is not glibc (nothing to do)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # musl has no mallopt
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, LARGE_BLOCK))
