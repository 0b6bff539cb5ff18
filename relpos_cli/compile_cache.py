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


# torch.compile's modes that replay the compiled step as CUDA graphs (torch._inductor.list_mode_options():
# triton.cudagraphs), on CUDA only: on a CPU they compile as the default mode does
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def replays_cuda_graphs(compile: bool | str) -> bool:
    """Whether train.compile's setting (false, true or a torch.compile mode) replays CUDA graphs."""
    return compile in CUDA_GRAPH_MODES


def compile_training_loss(loss_fn: Callable, compile: bool | str = True) -> Callable:
    """train.compile: loss_fn under torch.compile, its kernels cached on disk like every compile here,
    but not AOTAutograd's own cache of whole forward + backward graphs. In torch 2.13 on CPU a
    backward loaded from that cache read corrupted shapes (tests/test_attention.py, the second process
    to train ALiBi compiled: "invalid shape dimension -2947856013593472929"), and saving one
    segfaulted; the FX-graph and kernel caches alone keep the later compiles short.

    compile: true (torch.compile's default mode) or a mode by name. "reduce-overhead" replays the step
    as CUDA graphs: no launch from the host per kernel, the remedy for a step bound by its host
    (docs/gpu.md, "The first profile"), which the fused kernels' host code is, as no compile of the
    graph around them removes it (each stays one opaque op, relpos_cli/kernels/_ops.py)."""
    import torch
    import torch._functorch.config as functorch_config

    use_relpos_compile_cache()
    functorch_config.enable_autograd_cache = False
    return torch.compile(loss_fn, mode=None if compile is True else compile)
