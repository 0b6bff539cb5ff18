"""relpos's commands put large CPU tensors in 2 MiB pages (relpos_cli/jobs.py, use_huge_pages); a
library import does not. Each case runs in a fresh interpreter: torch reads the switch at its first
allocation."""

import os
import subprocess
import sys

import pytest

from conftest import REPO

HUGE_PAGES = """
import sys
from relpos_cli.cli import main
if sys.argv[1:] == ["command"]:  # the entry point's start, as `relpos --version` runs it
    sys.argv = ["relpos", "--version"]
    try:
        main()
    except SystemExit:
        pass
import torch
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
    def huge_mib(how: str, **env) -> float:
        out = subprocess.run([sys.executable, "-c", HUGE_PAGES, how], cwd=REPO, capture_output=True, text=True,
                             check=True, env={k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"} | env)
        return float(out.stdout.splitlines()[-1])

    assert huge_mib("command") >= 14  # all but the unaligned ends of the 16 MiB
    assert huge_mib("command", THP_MEM_ALLOC_ENABLE="0") == 0
    assert huge_mib("import") == 0  # importing relpos (its CLI module too) leaves the allocator alone
