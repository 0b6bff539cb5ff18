"""Rotary position embedding applied to one tensor, or to q and k together, as one Triton kernel, forward
and backward: relpos_cli/positions/rope.apply_rotary's arithmetic in one pass over x instead of ~7
elementwise kernels (two products, rotate_half's chunk, negation and concatenation, the sum) each way,
and q's and k's rotations in one launch (rotary_embedding_pair: a launch costs the host tens of
microseconds, and a training step on a GPU waits on its host).

What it computes, for x (B, H, T, Dh) and cos, sin (T, Dr), Dr <= Dh even, half = Dr / 2, with
x1 = x[..., :half], x2 = x[..., half:Dr] (transformers' rotate_half pairing, GPT-NeoX's layout):

    out[..., :half]   = x1 * cos[:, :half] - x2 * sin[:, :half]
    out[..., half:Dr] = x2 * cos[:, half:] + x1 * sin[:, half:]
    out[..., Dr:]     = x[..., Dr:]

and its backward, the transpose of that map (cos and sin get no gradient: RoPE's frequencies and
xPos's scales are buffers):

    dx1 = g1 * cos[:, :half] + g2 * sin[:, half:],   dx2 = g2 * cos[:, half:] - g1 * sin[:, :half]

One program per BLOCK_T consecutive rows of one (b, h), all of a row's Dh columns (with a pair, the
programs past q's heads take k's); products and sums in float32, rounded once to x's dtype (eager rounds
each of its three ops in bf16).

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
def _rotate_rows(X, COS, SIN, OUT, bh, stride_b, stride_h, stride_t, stride_ob, stride_oh, stride_ot, H, T, HALF, REST,
                 BACKWARD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr):
    """Rows pid(0) * BLOCK_T.. of (b, h) = divmod(bh, H) of X into OUT, both strided with their last
    dimension contiguous; BACKWARD: the transposed map (X holds the output's gradient)."""
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


@triton.jit
def _rotary(X, COS, SIN, OUT, stride_b, stride_h, stride_t, stride_ob, stride_oh, stride_ot, H,
            X2, COS2, SIN2, OUT2, stride2_b, stride2_h, stride2_t, stride2_ob, stride2_oh, stride2_ot, H2, B, T, HALF, REST,
            PAIR: tl.constexpr, BACKWARD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr,
            BLOCK_REST: tl.constexpr):
    """Grid (row blocks, B * H (+ B * H2 with PAIR)): program pid(1) rotates X's (b, h) of its rows, or,
    past X's B * H, X2's with its own tables (PAIR: q and k in one launch, with their own head counts
    and tables, xPos's scales)."""
    # offsets in int64: a (B, H, T, Dh) tensor or q's strided view past 2^31 elements (Llama-3-8B's k at
    # 512k tokens) would wrap int32's
    bh = tl.program_id(1).to(tl.int64)
    if PAIR and bh >= B * H:
        _rotate_rows(X2, COS2, SIN2, OUT2, bh - B * H, stride2_b, stride2_h, stride2_t, stride2_ob, stride2_oh,
                     stride2_ot, H2, T, HALF, REST, BACKWARD, BLOCK_T, BLOCK_HALF, BLOCK_REST)
    else:
        _rotate_rows(X, COS, SIN, OUT, bh, stride_b, stride_h, stride_t, stride_ob, stride_oh, stride_ot, H, T,
                     HALF, REST, BACKWARD, BLOCK_T, BLOCK_HALF, BLOCK_REST)


def _launch(xs: tuple[Tensor, ...], tables: tuple[tuple[Tensor, Tensor], ...], backward: bool) -> tuple[Tensor, ...]:
    """Rotates each x of xs (one, or two of one B, T and Dh) by its (cos, sin) in one launch -> their
    outputs, laid out as _launch.token_major's."""
    xs = tuple(x if x.stride(-1) == 1 else x.contiguous() for x in xs)
    outs = tuple(token_major(x.shape, x.dtype, x.device) for x in xs)
    B, _, T, Dh = xs[0].shape
    half, rest = tables[0][0].shape[1] // 2, Dh - tables[0][0].shape[1]
    heads = sum(x.shape[1] for x in xs)
    first = (xs[0], *tables[0], outs[0], *xs[0].stride()[:3], *outs[0].stride()[:3], xs[0].shape[1])
    second = first if len(xs) == 1 else (xs[1], *tables[1], outs[1], *xs[1].stride()[:3], *outs[1].stride()[:3],
                                         xs[1].shape[1])
    _rotary[(triton.cdiv(T, BLOCK_T), B * heads)](
        *first, *second, B, T, half, rest, PAIR=len(xs) == 2,
        BACKWARD=backward, BLOCK_T=BLOCK_T, BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_REST=triton.next_power_of_2(rest) if rest else 0, num_warps=4)
    return outs


class _Rotary(torch.autograd.Function):
    """x (and x2) rotated by their tables: one launch forward, one backward."""

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor, x2: Tensor | None, cos2: Tensor | None, sin2: Tensor | None):
        pair = x2 is not None
        ctx.output_specs = [(t.shape, t.dtype, t.device) for t in ((x, x2) if pair else (x,))]
        ctx.save_for_backward(cos, sin, *((cos2, sin2) if pair else ()))
        outs = _launch((x, x2) if pair else (x,), ((cos, sin), (cos2, sin2)) if pair else ((cos, sin),), backward=False)
        return outs if pair else outs[0]

    @staticmethod
    def backward(ctx, *grads: Tensor | None):
        saved = ctx.saved_tensors
        tables = tuple(zip(saved[::2], saved[1::2]))
        # an output the loss did not reach gets a zero gradient
        grads = tuple(torch.zeros(shape, dtype=dtype, device=device) if g is None else g
                      for g, (shape, dtype, device) in zip(grads, ctx.output_specs))
        dx = _launch(grads, tables, backward=True)
        return dx[0], None, None, (dx[1] if len(dx) == 2 else None), None, None


def _check_rotation(x: Tensor, cos: Tensor, sin: Tensor) -> None:
    """RelposError (one line) unless x (B, H, T, Dh) and cos, sin (T, Dr), Dr even and <= Dh, without
    gradients, on a device the kernel takes."""
    if x.dim() != 4 or cos.dim() != 2 or cos.shape != sin.shape or cos.shape[0] != x.shape[2] \
            or cos.shape[1] % 2 or not 0 < cos.shape[1] <= x.shape[3]:
        raise RelposError(f"rotary_embedding takes x (B, H, T, Dh) and cos, sin (T, Dr), Dr even and <= Dh; got x "
                          f"{tuple(x.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    if cos.requires_grad or sin.requires_grad:
        raise RelposError("rotary_embedding gives cos and sin no gradient; got a cos or sin that requires one")
    check_device(INTERPRETED, x, cos, sin)


def rotary_embedding(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """apply_rotary(x, cos, sin) fused: x (B, H, T, Dh) in float32, bfloat16 or float16, any strides
    (the last dimension contiguous, or it is copied); cos, sin (T, Dr), Dr even and <= Dh, without
    gradients -> (B, H, T, Dh) in x's dtype, laid out as (B, T, H, Dh) (_launch.token_major: as the
    model's q, k come from its projection, and as the attention kernels, cuDNN's and relpos's, lay out
    theirs; x's gradient too, so it reaches the projection's without a copy), differentiable in x. CUDA
    tensors, or any under TRITON_INTERPRET=1 (set before this module is imported)."""
    _check_rotation(x, cos, sin)
    return _Rotary.apply(x, cos.contiguous(), sin.contiguous(), None, None, None)


def rotary_embedding_pair(q: Tensor, k: Tensor, q_cos: Tensor, q_sin: Tensor, k_cos: Tensor,
                          k_sin: Tensor) -> tuple[Tensor, Tensor]:
    """(rotary_embedding(q, q_cos, q_sin), rotary_embedding(k, k_cos, k_sin)) in one launch each way
    (a training step's attention layer rotates both: half the launches, each a few tens of microseconds
    of the host's time, docs/gpu.md "Sixth run"). q (B, H, T, Dh) and k (B, Hk, T, Dh) share B, T, Dh
    and dtype, their tables one shape (xPos scales q's and k's apart)."""
    _check_rotation(q, q_cos, q_sin)
    _check_rotation(k, k_cos, k_sin)
    if q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:] or q.dtype != k.dtype or q_cos.shape != k_cos.shape:
        raise RelposError(f"rotary_embedding_pair takes q and k of one batch, length, head size and dtype, and tables "
                          f"of one shape; got q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype}, tables "
                          f"{tuple(q_cos.shape)} and {tuple(k_cos.shape)}")
    return _Rotary.apply(q, q_cos.contiguous(), q_sin.contiguous(), k, k_cos.contiguous(), k_sin.contiguous())
