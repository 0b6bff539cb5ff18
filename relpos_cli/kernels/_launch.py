"""What the fused kernels share: where they may run and the tiles and warps they run with."""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
from torch import Tensor

from relpos_cli.errors import RelposError

# under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors, numpy underneath) every tile is a
# numpy array and every program runs one after the other: small tiles keep the tests quick
INTERPRETER_BLOCK = 16
OFFSET_LIMIT = 2**31  # the kernels' element offsets are 32-bit integers


def interpreting() -> bool:
    """Whether TRITON_INTERPRET asks for Triton's interpreter. triton.jit reads it when a kernel is
    defined, so a kernel module records it on import (its INTERPRETED) and keeps that mode."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def interpreter_computes(dtype: torch.dtype) -> bool:
    """Whether Triton's interpreter computes tl.dot right on tiles of `dtype`: not on bfloat16, whose
    raw bit patterns it multiplies (values ~1e10 for inputs in [-2, 2], triton 3.9;
    triton-lang/triton#11584, "we just don't support it yet"), so every kernel's output would be garbage."""
    return dtype != torch.bfloat16


def check_device(interpreted: bool, q: Tensor, *tensors: Tensor) -> None:
    """interpreted: whether the kernel modules were imported under the interpreter (their kernels
    are then numpy programs that take tensors on any device, but not bfloat16 q, k, v:
    interpreter_computes)."""
    if interpreted:
        if not interpreter_computes(q.dtype):
            raise RelposError(f"the fused Triton kernels compute garbage on {q.dtype} under TRITON_INTERPRET=1 (Triton's "
                              f"interpreter multiplies bfloat16's raw bits in tl.dot); use float32 or float16 there, "
                              f"bfloat16 on CUDA")
        return
    if all(t.is_cuda for t in (q, *tensors)):
        return
    raise RelposError(f"the fused Triton kernels run on CUDA tensors (or under TRITON_INTERPRET=1); "
                      f"got tensors on {q.device}")


class Tiles(NamedTuple):
    """How one kernel is launched: BLOCK_M queries by BLOCK_N keys per tile, and Triton's num_warps."""
    block_m: int
    block_n: int
    num_warps: int


class KernelTiles(NamedTuple):
    """A kernel's Tiles on CUDA: `narrow` for 16-bit q, k, v at head dims up to 64, `wide` for the
    rest (float32 tiles, or wider heads: twice the bytes a row, twice the accumulator registers).

    Chosen per kernel as the largest tiles that compile for an H100 (sm_90) without spilling
    registers to local memory, with triton 3.6 (the GPU machine's) and 3.9: all kernels but DAPE's
    first ran on an H100 at 128 x 64 with 4 warps in bf16, where every one of them spills (56 to
    4,352 bytes a thread with triton 3.9, 8 to 3,648 with 3.6; tests/test_kernels_compile.py prints
    the figures, and fails on a spill at the narrow tiles). Not timed on a GPU yet:
    scripts/bench_kernels.py times the alternatives."""
    narrow: Tiles
    wide: Tiles


def launch_tiles(cuda: KernelTiles, q: Tensor, block_m: int | None, block_n: int | None, num_warps: int | None,
                 interpreted: bool) -> Tiles:
    """The Tiles a kernel launches with for queries q: the caller's where given (tests use them to
    check tiles that differ; scripts/bench_kernels.py to time them), else INTERPRETER_BLOCK square
    under the interpreter (num_warps means nothing to it), else the kernel's own on CUDA.
    RelposError for a tile that is not a power of two >= 16 or a warp count that is not one of
    1, 2, 4, 8, 16 (what tl.arange and a CUDA block of 512 threads take)."""
    if interpreted:
        default = Tiles(INTERPRETER_BLOCK, INTERPRETER_BLOCK, 4)
    else:
        default = cuda.narrow if q.shape[-1] <= 64 and q.dtype != torch.float32 else cuda.wide
    given = Tiles(block_m, block_n, num_warps)
    tiles = Tiles(*(mine if mine is not None else own for mine, own in zip(given, default)))
    for name, size in (("block_m", tiles.block_m), ("block_n", tiles.block_n)):
        if size < 16 or size & (size - 1):
            raise RelposError(f"{name}={size} must be a power of two >= 16")
    if tiles.num_warps not in (1, 2, 4, 8, 16):
        raise RelposError(f"num_warps={tiles.num_warps} must be 1, 2, 4, 8 or 16")
    return tiles


def pipeline_stages(dtype: torch.dtype) -> int:
    """num_stages of a kernel's launch: Triton's default of 3 for 16-bit tiles; 1 for float32 tiles,
    whose staged copies of the key tiles do not fit an H100's shared memory next to the rest, and
    whose software pipelining of CoPE's masked gathers triton 3.6 cannot compile ("pipeliner doesn't
    know how to predicate this op"; tests/test_kernels_compile.py). The interpreter ignores it."""
    return 1 if dtype == torch.float32 else 3


def dot_precision(dtype: torch.dtype, interpreted: bool) -> str:
    """tl.dot's input precision for fp32 tiles: TF32 where torch lets matmuls use it
    (torch.backends.cuda.matmul.allow_tf32), else IEEE fp32; half-precision tiles ignore it."""
    return "tf32" if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 and not interpreted else "ieee"


def power_of_two(n: int) -> int:
    """The least power of two >= n >= 1: a tile's side (tl.arange takes powers of two)."""
    return 1 << (n - 1).bit_length()


def padded_head_dim(head_dim: int) -> int:
    """BLOCK_D: the head size padded to a power of two, at least the 16 tl.dot takes."""
    return max(16, power_of_two(head_dim))


def tile_constexprs(q: Tensor, tiles: Tiles) -> dict:
    """What a kernel over tiles of q's rows is launched with besides its arguments and its precision:
    HEAD_DIM, BLOCK_D (padded_head_dim), the tiles, num_warps and num_stages (pipeline_stages)."""
    head_dim = q.shape[-1]
    return dict(HEAD_DIM=head_dim, BLOCK_D=padded_head_dim(head_dim), BLOCK_M=tiles.block_m,
                BLOCK_N=tiles.block_n, num_warps=tiles.num_warps, num_stages=pipeline_stages(q.dtype))


def kernel_layout(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v (B, H, T, Dh) as the kernels read them, through strides: each row of Dh elements one
    run (last stride 1), k and v laid out alike (one set of strides serves both), and every element's
    offset below 2^31 (the kernels compute offsets such as b * stride_b in 32 bits); a tensor that is
    not is copied, contiguous. The model's q, k, v, views of its qkv projection (B, T, (H + 2 Hk) Dh),
    pass as they are: a copy of each would be three strided copies a layer and step."""
    def readable(t: Tensor) -> bool:
        return t.stride(-1) == 1 and OFFSET_LIMIT > sum((n - 1) * stride for n, stride in zip(t.shape, t.stride()))

    q = q if readable(q) else q.contiguous()
    if not (readable(k) and readable(v)) or k.stride() != v.stride():
        k, v = k.contiguous(), v.contiguous()
    return q, k, v


def token_major(shape: torch.Size | tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """An empty (B, H, T, Dh) laid out as (B, T, H, Dh), as cuDNN's attention lays out its output: what
    the kernels write their output and q, k, v's gradients into. The model reads the output as
    (B, T, D) (out.transpose(1, 2).reshape: then a view, no copy) and hands q, k, v's gradients to its
    qkv projection's, (B, T, (H + 2 Hk) Dh), by the same views; the output's gradient comes back laid
    out so too."""
    B, H, T, Dh = shape
    return torch.empty((B, T, H, Dh), dtype=dtype, device=device).transpose(1, 2)


def input_gradient(grad: Tensor, x: Tensor) -> Tensor:
    """A gradient the kernels computed per query head (B, H, T, Dh), in float32 or x's dtype -> x's
    gradient, x (B, Hx, T, Dh): in x's dtype, laid out as token_major's (grad itself where it already
    is). Under grouped-query attention (Hx < H) a key head's gradient sums over the query heads that
    read it."""
    B, H, T, Dh = grad.shape
    if x.shape[1] != H:
        grad = grad.view(B, x.shape[1], H // x.shape[1], T, Dh).sum(2)
    if grad.dtype == x.dtype and grad.transpose(1, 2).is_contiguous():
        return grad
    return token_major(x.shape, x.dtype, x.device).copy_(grad)


def check_qkv(q: Tensor, k: Tensor, v: Tensor) -> tuple[int, int, int, int, int, int]:
    """q (B, H, Tq, Dh), k and v (B, Hk, Tk, Dh) with Hk dividing H (grouped-query attention) and
    Tq <= Tk (queries are the last Tq positions) -> (B, H, Hk, Tq, Tk, Dh)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise RelposError(f"q, k, v must be (B, H, T, Dh); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, H, Tq, Dh = q.shape
    Bk, Hk, Tk, Dk = k.shape
    if tuple(v.shape) != tuple(k.shape) or Bk != B or Dk != Dh or H % Hk or Tq > Tk:
        raise RelposError(f"q {tuple(q.shape)} and k, v {tuple(k.shape)}, {tuple(v.shape)}: k and v must match, "
                          f"share B and Dh with q, have a number of heads dividing q's, and Tq <= Tk")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise RelposError(f"q, k, v must share one dtype of float32, bfloat16, float16; got {q.dtype}, {k.dtype}, {v.dtype}")
    return B, H, Hk, Tq, Tk, Dh
