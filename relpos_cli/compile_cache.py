"""Where torch.compile keeps its compiled kernels: under relpos's cache, so a later process (the
next eval-length, the next sweep job) loads them instead of compiling again."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV, DEFAULT_CACHE = "RELPOS_CACHE", "~/.cache/relpos"  # as conf/data/*.yaml's cache_dir


def use_relpos_compile_cache() -> Path:
    """Point Inductor's on-disk caches (FX graphs, kernels) at $RELPOS_CACHE/inductor before the first
    compile. A TORCHINDUCTOR_CACHE_DIR the user set wins. Returns the directory in use."""
    default = Path(os.environ.get(CACHE_ENV, DEFAULT_CACHE)).expanduser() / "inductor"
    return Path(os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(default)))
