"""Inference gives large freed blocks back to the OS (relpos_cli/heap.py). Each case runs in a
fresh interpreter: the allocator's state is per process."""

import os
import platform
import subprocess
import sys

import pytest

from conftest import REPO

SCRIPT = """
import sys, torch
from relpos_cli.heap import keep_large_blocks, release_large_blocks
def resident_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
big = torch.ones(24 * 2**18); del big  # 24 MiB mmapped, then freed: glibc raises its threshold past 2 MiB
if sys.argv[1] in ("fixed", "fixed, then kept for training"):
    release_large_blocks()
if sys.argv[1] == "fixed, then kept for training":
    assert keep_large_blocks()
before = resident_mib()
block = torch.ones(2 * 2**18); del block  # 2 MiB, like one head's map of a query block at L = 16384
print(resident_mib() - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_a_freed_2_mib_block_stays_resident_by_default_and_goes_back_once_fixed():
    def kept_mib(mode: str) -> float:
        out = subprocess.run([sys.executable, "-c", SCRIPT, mode], cwd=REPO, capture_output=True, text=True, check=True)
        return float(out.stdout)

    assert kept_mib("default") > 1.9  # the failure: heap-served, and held after free
    assert kept_mib("fixed") < 0.5
    assert kept_mib("fixed, then kept for training") > 1.9  # training reuses it instead of mapping it afresh


HUGE_PAGES = """
import relpos_cli, torch
block = torch.ones(16 * 2**18)  # 16 MiB, like one query block's bias at L = 16384
with open("/proc/self/smaps_rollup") as f:
    print(next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:")) / 1024)
"""


def _transparent_huge_pages() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read()
    except OSError:
        return "[never]"


@pytest.mark.skipif("[never]" in _transparent_huge_pages(), reason="the kernel has transparent huge pages off")
def test_large_tensors_get_huge_pages_unless_the_user_says_otherwise():
    def huge_mib(**env) -> float:
        out = subprocess.run([sys.executable, "-c", HUGE_PAGES], cwd=REPO, capture_output=True, text=True, check=True,
                             env={k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"} | env)
        return float(out.stdout)

    assert huge_mib() >= 14  # all but the unaligned ends of the 16 MiB
    assert huge_mib(THP_MEM_ALLOC_ENABLE="0") == 0
