"""Stick-breaking attention as one fused Triton kernel: forward and backward, no (T, T) tensor.

What it computes (relpos_cli/positions/stickbreaking.py), for query i (the last Tq of the Tk
positions) and the keys it shares its stick among, j < i (j <= i with attend_current):

    z_ij = q_i . k_j / sqrt(Dh),   s_ij = softplus(z_ij) = -log(1 - sigmoid(z_ij))
    A_ij = sigmoid(z_ij) * prod_{j < l visible} (1 - sigmoid(z_il)),  log A_ij = z_ij - sum_{l >= j} s_il
    out_i = sum_j A_ij v_j                                       (no softmax; the leftover stick dropped)

Forward: one program per tile of BLOCK_M queries walks the key tiles nearest first, carrying each
query's stick spent so far (sum of s over the nearer keys, in log space); within a tile the suffix
sums come from a reversed cumulative sum. Backward: the same walk per query tile recomputes A and,
with g_ij = A_ij dA_ij (dA_ij = dO_i . v_j),

    dz_ij = g_ij - sigmoid(z_ij) * sum_{m <= j} g_im,   sum_{m <= j} g_im = dO_i . out_i - sum_{m > j} g_im

(the near-to-far walk carries sum_{m > j}); dq is the program's own, dk and dv are added with
atomics into float32 buffers (several query tiles read one key tile).

Written for relpos following shawntan/stickbreaking-attention (stickbreaking_attention/sb_attn,
sb_varlen, MIT) and flash-linear-attention's fla/ops/stickbreaking_attn (MIT): the same walk from
the nearest keys, not their code.

Precision: dO_i . out_i is taken from the forward's float32 output, and the backward rounds A to
the inputs' dtype wherever the forward's A @ v did, so that sum_{m <= j} g_im, the difference of
two sums of the same terms, is not left with the rounding of A: for far keys it is ~0, and an error
there is not damped by a small A. fp32 tiles use IEEE dots here whatever TF32 setting.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from relpos_cli.errors import RelposError
from relpos_cli.kernels._launch import (KernelTiles, Tiles, check_device, check_qkv, input_gradient, interpreting,
                                        launch_tiles, tile_constexprs, token_major)
from relpos_cli.kernels._ops import fused_function
from relpos_cli.kernels._tiles import key_head, load_rows, query_tile, row_delta

INTERPRETED = interpreting()  # fixed when the kernels below are defined (triton.jit reads it then)
# _launch.KernelTiles; the backward, one program per query tile holding dq and the stick's running
# sums besides the scores, spills at 128 x 64 even with 8 warps and not at 128 x 32
FORWARD_TILES = KernelTiles(narrow=Tiles(128, 64, 8), wide=Tiles(64, 32, 8))
BACKWARD_TILES = KernelTiles(narrow=Tiles(128, 32, 8), wide=Tiles(32, 32, 8))


@triton.jit
def _softplus(z):
    return tl.maximum(z, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(z)))


@triton.jit
def _stick_tile(q, k_base, start_n, rm, rd, d_ok, acc_s, stride_kt, scale, offset, TK,
                BLOCK_N: tl.constexpr, ATTEND_CURRENT: tl.constexpr):
    """One key tile against the query tile: z, the visible mask, s, A, the key tile and its offsets."""
    rn = start_n + tl.arange(0, BLOCK_N)
    n_ok = rn < TK
    k = tl.load(k_base + rn[:, None] * stride_kt + rd[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    z = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    if ATTEND_CURRENT:
        visible = (rn[None, :] <= rm[:, None] + offset) & n_ok[None, :]
    else:
        visible = (rn[None, :] < rm[:, None] + offset) & n_ok[None, :]
    s = tl.where(visible, _softplus(z), 0.0)
    spent = tl.cumsum(s, axis=1, reverse=True) + acc_s[:, None]  # sum over visible l >= j of s_il
    a = tl.exp(tl.where(visible, z - spent, float("-inf")))
    return z, visible, s, a, rn, n_ok


@triton.jit
def _stick_forward(Q, K, V, O, O32,
                   stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_ob, stride_oh, stride_ot,
                   H, GROUP, TQ, TK, scale,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   ATTEND_CURRENT: tl.constexpr):
    bh, b, h, hk, offset, start_m, rm, rd, m_ok, d_ok = query_tile(H, GROUP, TQ, TK, HEAD_DIM, BLOCK_M, BLOCK_D)
    q_mask = m_ok[:, None] & d_ok[None, :]
    q = load_rows(Q, b, h, rm, rd, m_ok, d_ok, stride_qb, stride_qh, stride_qt)
    k_base, v_base = key_head(K, V, b, hk, stride_kb, stride_kh)

    acc_s = tl.zeros([BLOCK_M], tl.float32)  # the stick each query has given the nearer keys, -log(left)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n_tiles = tl.cdiv(tl.minimum(TK, offset + start_m + BLOCK_M), BLOCK_N)
    for t in range(0, n_tiles):
        start_n = (n_tiles - 1 - t) * BLOCK_N  # nearest tile first
        z, visible, s, a, rn, n_ok = _stick_tile(q, k_base, start_n, rm, rd, d_ok, acc_s, stride_kt, scale, offset, TK,
                                                 BLOCK_N, ATTEND_CURRENT)
        v = tl.load(v_base + rn[:, None] * stride_kt + rd[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        acc += tl.dot(a.to(v.dtype), v, input_precision="ieee")
        acc_s += tl.sum(s, 1)

    out = b * stride_ob + h * stride_oh + rm[:, None] * stride_ot + rd[None, :]  # O, O32 laid out alike
    tl.store(O + out, acc.to(O.dtype.element_ty), mask=q_mask)
    tl.store(O32 + out, acc, mask=q_mask)


@triton.jit
def _stick_backward(Q, K, V, DO, O, DQ, DK, DV,
                    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                    stride_dob, stride_doh, stride_dot, stride_dqb, stride_dqh, stride_dqt,
                    H, GROUP, TQ, TK, scale,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    ATTEND_CURRENT: tl.constexpr):
    bh, b, h, hk, offset, start_m, rm, rd, m_ok, d_ok = query_tile(H, GROUP, TQ, TK, HEAD_DIM, BLOCK_M, BLOCK_D)
    q_mask = m_ok[:, None] & d_ok[None, :]
    q = load_rows(Q, b, h, rm, rd, m_ok, d_ok, stride_qb, stride_qh, stride_qt)
    do = load_rows(DO, b, h, rm, rd, m_ok, d_ok, stride_dob, stride_doh, stride_dot)
    delta = row_delta(O, do, b, h, rm, rd, m_ok, d_ok, stride_dqb, stride_dqh, stride_dqt)  # = sum_j g_ij
    k_base, v_base = key_head(K, V, b, hk, stride_kb, stride_kh)
    kv_grad = (b * (H // GROUP) + hk) * TK * HEAD_DIM  # (B, Hk, Tk, Dh) float32 buffers

    acc_s = tl.zeros([BLOCK_M], tl.float32)
    acc_g = tl.zeros([BLOCK_M], tl.float32)  # sum of g over the nearer tiles' keys
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n_tiles = tl.cdiv(tl.minimum(TK, offset + start_m + BLOCK_M), BLOCK_N)
    for t in range(0, n_tiles):
        start_n = (n_tiles - 1 - t) * BLOCK_N
        z, visible, s, a, rn, n_ok = _stick_tile(q, k_base, start_n, rm, rd, d_ok, acc_s, stride_kt, scale, offset, TK,
                                                 BLOCK_N, ATTEND_CURRENT)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        v = tl.load(v_base + rn[:, None] * stride_kt + rd[None, :], mask=kv_mask, other=0.0)
        k = tl.load(k_base + rn[:, None] * stride_kt + rd[None, :], mask=kv_mask, other=0.0)
        a_used = a.to(v.dtype)  # A as the forward's A @ v read it
        da = tl.dot(do, tl.trans(v), input_precision="ieee")  # rows past the last query: dO = 0
        g = a_used.to(tl.float32) * da
        nearer_g = tl.cumsum(g, axis=1, reverse=True) - g + acc_g[:, None]  # sum over m > j of g_im
        dz = tl.where(visible & m_ok[:, None], g - tl.sigmoid(z) * (delta[:, None] - nearer_g), 0.0)
        dq += tl.dot(dz.to(k.dtype), k, input_precision="ieee")
        dk = tl.dot(tl.trans(dz.to(q.dtype)), q, input_precision="ieee") * scale
        dv = tl.dot(tl.trans(a_used), do, input_precision="ieee")
        out = kv_grad + rn[:, None] * HEAD_DIM + rd[None, :]
        tl.atomic_add(DK + out, dk, mask=kv_mask)
        tl.atomic_add(DV + out, dv, mask=kv_mask)
        acc_s += tl.sum(s, 1)
        acc_g += tl.sum(g, 1)

    tl.store(DQ + b * stride_dqb + h * stride_dqh + rm[:, None] * stride_dqt + rd[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=q_mask)


def _forward(q: Tensor, k: Tensor, v: Tensor, attend_current: bool, block_m: int | None, block_n: int | None,
             num_warps: int | None) -> tuple[Tensor, Tensor]:
    """-> (out, out in float32 for the backward: empty when out is float32 itself, an op's outputs
    never being one tensor twice), both laid out as _launch.token_major's; q, k, v as
    _launch.kernel_layout leaves them, checked."""
    B, H, Tq, Dh = q.shape
    Hk, Tk = k.shape[1], k.shape[2]
    tiles = launch_tiles(FORWARD_TILES, q, block_m, block_n, num_warps, INTERPRETED)
    o, o32 = _forward_fake(q, k, v, attend_current, block_m, block_n, num_warps)
    o32 = o32 if o32.numel() else o
    _stick_forward[(triton.cdiv(Tq, tiles.block_m), B * H)](
        q, k, v, o, o32,
        *q.stride()[:3], *k.stride()[:3], *o.stride()[:3],
        H, H // Hk, Tq, Tk, 1.0 / math.sqrt(Dh), ATTEND_CURRENT=attend_current, **tile_constexprs(q, tiles))
    return o, o32 if o32 is not o else o.new_empty(0)


def _forward_fake(q: Tensor, k: Tensor, v: Tensor, attend_current: bool, block_m: int | None, block_n: int | None,
                  num_warps: int | None) -> tuple[Tensor, Tensor]:
    """_forward's outputs, allocated (also the forward op's fake)."""
    o32 = token_major(q.shape, torch.float32, q.device) if q.dtype != torch.float32 else q.new_empty(0, dtype=torch.float32)
    return token_major(q.shape, q.dtype, q.device), o32


def _backward(q: Tensor, k: Tensor, v: Tensor, attend_current: bool, block_m: int | None, block_n: int | None,
              num_warps: int | None, o: Tensor, o32: Tensor, do: Tensor, needs: list[bool]) -> list[Tensor]:
    """-> dq, dk, dv (in their inputs' dtypes, laid out as _launch.token_major's)."""
    B, H, Tq, Dh = q.shape
    Hk, Tk = k.shape[1], k.shape[2]
    dq = token_major(q.shape, q.dtype, q.device)  # laid out as o and o32: the kernel reads out with dq's strides
    dk = torch.zeros((B, Hk, Tk, Dh), dtype=torch.float32, device=q.device)  # atomics add into these
    dv = torch.zeros_like(dk)
    tiles = launch_tiles(BACKWARD_TILES, q, block_m, block_n, num_warps, INTERPRETED)
    _stick_backward[(triton.cdiv(Tq, tiles.block_m), B * H)](
        q, k, v, do, o32 if o32.numel() else o, dq, dk, dv,
        *q.stride()[:3], *k.stride()[:3], *do.stride()[:3], *dq.stride()[:3],
        H, H // Hk, Tq, Tk, 1.0 / math.sqrt(Dh), ATTEND_CURRENT=attend_current, **tile_constexprs(q, tiles))
    return [dq, input_gradient(dk, k), input_gradient(dv, v)]


_stickbreaking = fused_function("stickbreaking_attention", _forward, _forward_fake, _backward, tensors=3)


def stickbreaking_attention(q: Tensor, k: Tensor, v: Tensor, attend_current: bool = False, block_m: int | None = None,
                            block_n: int | None = None, num_warps: int | None = None) -> Tensor:
    """Stick-breaking attention (no softmax), fused: no (Tq, Tk) tensor.

    q (B, H, Tq, Dh): the last Tq of the Tk positions (Tq == Tk in training);
    k, v (B, Hk, Tk, Dh), Hk dividing H (grouped-query attention: query head h reads key head
    h // (H // Hk)); one dtype of float32, bfloat16, float16 -> out (B, H, Tq, Dh) in q's dtype:
    out_i = sum_j A_ij v_j with A as relpos_cli/positions/stickbreaking.py defines it, over keys
    j < i (j <= i with attend_current; the scheme's pos.attend_current); out laid out as (B, Tq, H, Dh)
    (_launch.token_major).

    Differentiable in q, k, v (dk, dv through float32 atomics: not bit-for-bit deterministic on CUDA).
    block_m / block_n / num_warps: tile sizes (powers of two, >= 16) and warps for the call's kernels,
    FORWARD_TILES and BACKWARD_TILES where not given (_launch.launch_tiles). CUDA tensors, or any
    under TRITON_INTERPRET=1 (set before this module is imported).
    """
    check_qkv(q, k, v)
    if not isinstance(attend_current, bool):
        raise RelposError(f"attend_current={attend_current!r} must be true or false")
    check_device(INTERPRETED, q, k, v)
    return _stickbreaking(q, k, v, attend_current, block_m, block_n, num_warps)
