"""Numeric precision of training and evaluation: bf16 autocast (and TF32 while training) on CUDA,
plain fp32 on CPU.

bf16 on this project's CPUs is ~100x slower than fp32, so `auto` means bf16 only on CUDA. Weights
and optimizer state stay fp32 (autocast casts per op), so checkpoints move between CPU and GPU.

TF32 is switched on only inside the context, and the previous flags are restored on leaving it:
a training step runs in it, nothing else does. Set globally, it stayed on for the rest of the
process, so a sweep job's evaluation (in the training process) ran its matmuls in TF32 while a
separate `relpos eval-length` ran them in fp32, and a library user's own matmuls changed too.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from relpos_cli.errors import RelposError
from relpos_cli.settings import PRECISIONS


class CudaMixedPrecision:
    """bf16 autocast with TF32 matmuls on CUDA, re-entrable (one `with` per training step); leaving
    it restores the TF32 flags found on entering."""

    def __init__(self) -> None:
        self._saved: list[tuple[bool, bool]] = []
        self._autocast: list[Any] = []

    def __enter__(self) -> "CudaMixedPrecision":
        self._saved.append((torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32))
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        self._autocast.append(torch.autocast("cuda", dtype=torch.bfloat16))
        self._autocast[-1].__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self._autocast.pop().__exit__(*exc)
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self._saved.pop()


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """The context the training step runs in: bf16 autocast and TF32 on CUDA (auto, bf16), nothing
    on CPU or with fp32. Settings are checked here, before anything is written."""
    if precision not in PRECISIONS:
        raise RelposError(f"train.precision={precision!r}; choose one of: {', '.join(PRECISIONS)}")
    if precision == "bf16" and device.type != "cuda":
        raise RelposError("train.precision=bf16 needs a CUDA device; use train.precision=auto or fp32 on CPU")
    if device.type != "cuda" or precision == "fp32":  # fp32 means full fp32 matmuls too: no TF32
        return contextlib.nullcontext()
    return CudaMixedPrecision()


def eval_precision(setting: str, device: torch.device) -> str:
    """eval.precision -> the precision scoring runs in: auto is bf16 on CUDA (as lm-evaluation-harness
    and RULER evaluate: the GPU's bf16 units, ~15x its fp32 rate on an H100) and fp32 on CPU (where
    bf16 is ~100x slower); fp32 and bf16 as named (bf16 on CPU runs, slowly)."""
    if setting not in PRECISIONS:
        raise RelposError(f"eval.precision={setting!r}; choose one of: {', '.join(PRECISIONS)}")
    if setting == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return setting


def eval_autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """The context scoring runs in: bf16 autocast for bf16 (matmuls and attention in bf16; logits
    cast to fp32 before the loss and the argmax, losses summed in fp64), nothing for fp32 (full
    fp32 matmuls, no TF32)."""
    return torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
