"""Numeric precision of training: bf16 autocast and TF32 on CUDA, plain fp32 on CPU.

bf16 on this project's CPUs is ~100x slower than fp32, so `auto` means bf16 only on CUDA. Weights
and optimizer state stay fp32 (autocast casts per op), so checkpoints move between CPU and GPU.
"""

from __future__ import annotations

import contextlib

import torch

from relpos_cli.errors import RelposError

PRECISIONS = ("auto", "fp32", "bf16")


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """The context the forward pass runs in; also turns TF32 on for CUDA matmuls."""
    if precision not in PRECISIONS:
        raise RelposError(f"train.precision={precision!r}; choose one of: {', '.join(PRECISIONS)}")
    if precision == "bf16" and device.type != "cuda":
        raise RelposError("train.precision=bf16 needs a CUDA device; use train.precision=auto or fp32 on CPU")
    if device.type != "cuda" or precision == "fp32":  # fp32 means full fp32 matmuls too: no TF32
        return contextlib.nullcontext()
    # CUDA paths: not exercised by the CPU test suite
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return torch.autocast("cuda", dtype=torch.bfloat16)
