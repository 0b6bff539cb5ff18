"""Fused Triton kernels for the schemes whose attention no stock kernel computes (issue 39).

- ``forgetting_attention(q, k, v, log_forget_cumsum)``: FoX (relpos_cli/positions/fox.py), softmax
  attention with the bias D_i - D_j, FlashAttention-2 style (relpos_cli/kernels/forgetting.py).
- ``stickbreaking_attention(q, k, v, attend_current=False)``: stick-breaking attention
  (relpos_cli/positions/stickbreaking.py), no softmax (relpos_cli/kernels/stickbreaking.py).
- ``cope_attention(q, k, v, per_position)``: CoPE (relpos_cli/positions/cope.py), softmax attention
  with the bias of each query's gate count (relpos_cli/kernels/cope.py).
- ``dape_attention(q, k, v, base, w1, b1, w2, b2)``: DAPE (relpos_cli/positions/dape.py) over a
  distance base, the MLP over all heads' logits run on each tile (relpos_cli/kernels/dape.py).
- ``distance_attention(q, k, v, table)``: softmax attention plus a per-head table of the distance
  (ALiBi, T5, KERPLE, Sandwich; FIRE up to its threshold), the table's gradient reduced along each
  tile's diagonals before its atomics; a table that ends where the bias stops changing (T5's
  max_distance) leaves the far tiles one entry to read (relpos_cli/kernels/distance.py).
- ``linear_distance_attention(q, k, v, slopes)``: the same kernels with the bias slopes[h] * (i - j)
  computed per score, no table read (ALiBi; relpos_cli/kernels/distance.py).
- ``fire_attention(q, k, v, grid, constants, positions)``: FIRE past its threshold, where its bias is
  no table of distances: psi of the distance over each query's normaliser, the MLP read off a grid,
  per score; forward only, for evaluation (relpos_cli/kernels/fire.py).
- ``shaw_attention(q, k, v, per_distance)``: Shaw et al.'s relative positions, each query's bias
  per clipped distance (relpos_cli/positions/shaw.py, relpos_cli/kernels/shaw.py).
- ``rotary_embedding(x, cos, sin)``, ``rotary_embedding_pair(q, k, q_cos, q_sin, k_cos, k_sin)``: no
  attention, RoPE's rotation of q or k, or of both in one launch, in one pass
  (relpos_cli/positions/rope.apply_rotary and apply_rotary_pair on CUDA; relpos_cli/kernels/rotary.py).

Each attention kernel but fire_attention is differentiable, eagerly through an autograd Function and
inside torch.compile as a torch.library op (relpos_cli/kernels/_ops.py). They run on CUDA tensors, or
on any under Triton's interpreter (TRITON_INTERPRET=1, set before the kernels are first imported).
Triton is optional: this package imports without it, and ``available()`` says whether the kernels can
be used.
What they compute and how they are tested: docs/gpu.md.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from relpos_cli.kernels._launch import interpreter_computes, interpreting, padded_head_dim, power_of_two

__all__ = ["available", "serves", "cope_attention", "dape_attention", "distance_attention", "fire_attention",
           "forgetting_attention", "linear_distance_attention", "rotary_embedding", "rotary_embedding_pair",
           "shaw_attention", "stickbreaking_attention"]


# whether triton can be imported, looked up once, here: attention asks on every fused call, and inside
# torch.compile a lookup then (importlib's find_spec) is a graph break per layer in torch 2.11
TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def serves(name: str, q: torch.Tensor, needs_grad: bool) -> bool:
    """Whether kernel `name` runs a call with queries q (B, H, T, Dh): all do, but none on CPU
    tensors (Triton's interpreter) in bfloat16 (_launch.interpreter_computes: eval.precision=bf16
    on CPU), and DAPE on CUDA where its program's tiles would not fit a GPU's shared memory
    (DAPE_FOOTPRINT; the interpreter has no shared memory to run out of)."""
    if not q.is_cuda:
        return interpreter_computes(q.dtype)
    if name != "dape_attention":
        return True
    footprint = power_of_two(q.shape[1]) * padded_head_dim(q.shape[-1]) * q.element_size()  # as dape.py pads them
    return footprint <= DAPE_FOOTPRINT["backward" if needs_grad else "forward"]


def available(device_is_cuda: bool) -> bool:
    """Whether the kernels can run on tensors of that kind: Triton importable, and CUDA tensors or
    the interpreter."""
    return TRITON_INSTALLED and (device_is_cuda or interpreting())


# DAPE's program holds every head's key and value tiles (relpos_cli/kernels/dape.py), so its shared
# memory grows with the heads (padded to a power of two) times the head size (padded, >= 16) times the
# element's bytes, already at the smallest tiles tl.dot takes. Compiled for sm_90
# (tests/test_kernels_compile.py), 16 heads of 64 in bf16 take 96 KiB forward and 128 KiB backward;
# twice the footprint takes twice that, past an H100's 227 KiB per block in the backward (float32,
# head size 128, 32 heads). The largest footprint, heads x head size x bytes, each direction fits;
# a call past it runs as auto would (serves).
DAPE_FOOTPRINT = {"forward": 16 * 64 * 4, "backward": 16 * 64 * 2}

KERNEL_MODULES = {"forgetting_attention": "forgetting", "stickbreaking_attention": "stickbreaking",
                  "cope_attention": "cope", "dape_attention": "dape", "distance_attention": "distance",
                  "linear_distance_attention": "distance", "shaw_attention": "shaw", "fire_attention": "fire"}


# the attention kernels above take tiles (block_m, block_n, num_warps); the rotation, elementwise, does not
OTHER_MODULES = {"rotary_embedding": "rotary", "rotary_embedding_pair": "rotary"}


def __getattr__(name: str):  # the kernel modules import triton: only when asked for
    if name in KERNEL_MODULES or name in OTHER_MODULES:
        module = KERNEL_MODULES.get(name) or OTHER_MODULES[name]
        return getattr(importlib.import_module(f"relpos_cli.kernels.{module}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
