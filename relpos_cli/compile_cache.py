"""Where torch.compile keeps its compiled kernels: under relpos's cache, so a later process (the
next eval-length, the next sweep job) loads them instead of compiling again."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

CACHE_ENV, DEFAULT_CACHE = "RELPOS_CACHE", "~/.cache/relpos"  # as conf/data/*.yaml's cache_dir


def use_relpos_compile_cache() -> Path:
    """Point Inductor's on-disk caches (FX graphs, kernels) at $RELPOS_CACHE/inductor before the first
    compile. A TORCHINDUCTOR_CACHE_DIR the user set wins. Returns the directory in use."""
    default = Path(os.environ.get(CACHE_ENV, DEFAULT_CACHE)).expanduser() / "inductor"
    return Path(os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(default)))


def compile_training_loss(loss_fn: Callable, mode: str | None = None) -> Callable:
    """train.compile: loss_fn under torch.compile, its kernels cached on disk like every compile here,
    but not AOTAutograd's own cache of whole forward + backward graphs. In torch 2.13 on CPU a
    backward loaded from that cache read corrupted shapes (tests/test_attention.py, the second process
    to train ALiBi compiled: "invalid shape dimension -2947856013593472929"), and saving one
    segfaulted; the FX-graph and kernel caches alone keep the later compiles short.

    mode: torch.compile's (None: its default, what train.compile runs). scripts/gpu_check.py's compile
    part also times "reduce-overhead" (the step replayed as CUDA graphs: no launch from the host per
    kernel), the remedy if a step is bound by its host (docs/gpu.md, "The first profile")."""
    import torch
    import torch._functorch.config as functorch_config

    use_relpos_compile_cache()
    functorch_config.enable_autograd_cache = False
    return torch.compile(loss_fn, mode=mode)
