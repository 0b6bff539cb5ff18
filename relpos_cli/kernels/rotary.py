"""Rotary position embedding applied to one tensor as one Triton kernel, forward and backward:
relpos_cli/positions/rope.apply_rotary's arithmetic in one pass over x instead of ~7 elementwise
kernels (two products, rotate_half's chunk, negation and concatenation, the sum) each way.

What it computes, for x (B, H, T, Dh) and cos, sin (T, Dr), Dr <= Dh even, half = Dr / 2, with
x1 = x[..., :half], x2 = x[..., half:Dr] (transformers' rotate_half pairing, GPT-NeoX's layout):

    out[..., :half]   = x1 * cos[:, :half] - x2 * sin[:, :half]
    out[..., half:Dr] = x2 * cos[:, half:] + x1 * sin[:, half:]
    out[..., Dr:]     = x[..., Dr:]

and its backward, the transpose of that map (cos and sin get no gradient: RoPE's frequencies and
xPos's scales are buffers):

    dx1 = g1 * cos[:, :half] + g2 * sin[:, half:],   dx2 = g2 * cos[:, half:] - g1 * sin[:, :half]

One program per BLOCK_T consecutive rows of one (b, h), all of a row's Dh columns; products and
sums in float32, rounded once to x's dtype (eager rounds each of its three ops in bf16).

Why: a RoPE training step of the 125M bench model on an H100 ran at 0.73-0.79x NoPE's tokens/s
(docs/results/gpu.md), its rotations ~14 kernels a layer forward and more backward against SDPA's one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from relpos_cli.errors import RelposError
from relpos_cli.kernels._launch import check_device, interpreting, token_major

INTERPRETED = interpreting()  # fixed when the kernel below is defined (triton.jit reads it then)
BLOCK_T = 16  # rows a program: Dh <= 256 columns each, a few registers a thread at 4 warps


@triton.jit
def _rotary(X, COS, SIN, OUT, stride_b, stride_h, stride_t, stride_ob, stride_oh, stride_ot, H, T, HALF, REST,
            BACKWARD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr):
    """Rows pid(0) * BLOCK_T.. of (b, h) = divmod(pid(1), H) of X into OUT, both strided with their last
    dimension contiguous; BACKWARD: the transposed map (X holds the output's gradient)."""
    # offsets in int64: a (B, H, T, Dh) tensor or q's strided view past 2^31 elements (Llama-3-8B's k at
    # 512k tokens) would wrap int32's
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    rt = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    rc = tl.arange(0, BLOCK_HALF)
    t_ok = rt < T
    ok = t_ok[:, None] & (rc < HALF)[None, :]
    x_row = X + b * stride_b + h * stride_h + rt[:, None] * stride_t  # (BLOCK_T, 1) pointers
    out_row = OUT + b * stride_ob + h * stride_oh + rt[:, None] * stride_ot
    table_row = rt[:, None] * (2 * HALF)  # cos and sin (T, Dr) contiguous
    x1 = tl.load(x_row + rc[None, :], mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF + rc[None, :], mask=ok, other=0.0).to(tl.float32)
    cos1 = tl.load(COS + table_row + rc[None, :], mask=ok, other=0.0).to(tl.float32)
    cos2 = tl.load(COS + table_row + HALF + rc[None, :], mask=ok, other=0.0).to(tl.float32)
    sin1 = tl.load(SIN + table_row + rc[None, :], mask=ok, other=0.0).to(tl.float32)
    sin2 = tl.load(SIN + table_row + HALF + rc[None, :], mask=ok, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = x1 * cos1 + x2 * sin2
        y2 = x2 * cos2 - x1 * sin1
    else:
        y1 = x1 * cos1 - x2 * sin1
        y2 = x2 * cos2 + x1 * sin2
    tl.store(out_row + rc[None, :], y1.to(OUT.dtype.element_ty), mask=ok)
    tl.store(out_row + HALF + rc[None, :], y2.to(OUT.dtype.element_ty), mask=ok)
    if BLOCK_REST > 0:  # the dimensions past Dr pass through
        rr = tl.arange(0, BLOCK_REST)
        rest_ok = t_ok[:, None] & (rr < REST)[None, :]
        rest = tl.load(x_row + 2 * HALF + rr[None, :], mask=rest_ok, other=0.0)
        tl.store(out_row + 2 * HALF + rr[None, :], rest.to(OUT.dtype.element_ty), mask=rest_ok)


def _launch(x: Tensor, cos: Tensor, sin: Tensor, backward: bool) -> Tensor:
    B, H, T, Dh = x.shape
    half, rest = cos.shape[1] // 2, Dh - cos.shape[1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = token_major(x.shape, x.dtype, x.device)
    _rotary[(triton.cdiv(T, BLOCK_T), B * H)](
        x, cos, sin, out, x.stride(0), x.stride(1), x.stride(2), out.stride(0), out.stride(1), out.stride(2), H, T,
        half, rest,
        BACKWARD=backward, BLOCK_T=BLOCK_T, BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_REST=triton.next_power_of_2(rest) if rest else 0, num_warps=4)
    return out


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor):
        ctx.save_for_backward(cos, sin)
        return _launch(x, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, grad: Tensor):
        cos, sin = ctx.saved_tensors
        return _launch(grad, cos, sin, backward=True), None, None


def rotary_embedding(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """apply_rotary(x, cos, sin) fused: x (B, H, T, Dh) in float32, bfloat16 or float16, any strides
    (the last dimension contiguous, or it is copied); cos, sin (T, Dr), Dr even and <= Dh, without
    gradients -> (B, H, T, Dh) in x's dtype, laid out as (B, T, H, Dh) (_launch.token_major: as the
    model's q, k come from its projection, and as the attention kernels, cuDNN's and relpos's, lay out
    theirs; x's gradient too, so it reaches the projection's without a copy), differentiable in x. CUDA
    tensors, or any under TRITON_INTERPRET=1 (set before this module is imported)."""
    if x.dim() != 4 or cos.dim() != 2 or cos.shape != sin.shape or cos.shape[0] != x.shape[2] \
            or cos.shape[1] % 2 or not 0 < cos.shape[1] <= x.shape[3]:
        raise RelposError(f"rotary_embedding takes x (B, H, T, Dh) and cos, sin (T, Dr), Dr even and <= Dh; got x "
                          f"{tuple(x.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    if cos.requires_grad or sin.requires_grad:
        raise RelposError("rotary_embedding gives cos and sin no gradient; got a cos or sin that requires one")
    check_device(INTERPRETED, x, cos, sin)
    return _Rotary.apply(x, cos.contiguous(), sin.contiguous())
