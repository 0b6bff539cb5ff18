"""Forgetting attention (FoX) as one fused Triton kernel: forward and backward, no (T, T) tensor.

What it computes, for query i (the last Tq of the Tk positions) and key j <= i:

    logits_ij = q_i . k_j / sqrt(Dh) + D_i - D_j,   out_i = softmax_j(logits_i) @ v

with D = log_forget_cumsum, the cumulative sum of the log forget gates (relpos_cli/positions/fox.py,
``ForgettingGate.token_values``), and gradients for q, k, v and D.

FlashAttention-2's scheme: one program per tile of BLOCK_M queries walks the key tiles up to the
diagonal with an online softmax and stores each query's log-sum-exp; the backward recomputes the
probabilities from it, one program per query tile for dq, launched first, which also stores its rows'
dO . O for the next, then one program per key tile for dk, dv and dD. D_t enters as a query's D_i,
which shifts the whole row i alike, and as a key's -D_j: softmax ignores a row's shift, so the
queries' share of dD, sum_j dS_ij = delta_i - delta_i sum_j P_ij, is 0, and dD_j is the keys' share
alone, -sum_i dS_ij (autograd through eager attention adds the queries' share, 0 up to rounding). Each walk takes
the tiles off the diagonal without the causal mask (every pair visible, no padding), as
relpos_cli/kernels/distance.py does: the mask's compare and select per score weigh as much as FoX's
bias, D_i - D_j, itself.

Written for relpos following the Forgetting Transformer's Triton kernel (zhixuan-lin/forgetting-
transformer, src/forgetting_transformer/ops/forgetting_attention.py, MIT; itself adapted from
FlagAttention's flash.py) and flash-linear-attention's fla/ops/forgetting_attn (MIT): the same
mathematics, not their code.

Precision: D reaches thousands at long lengths (relpos keeps it in float64). Each tile subtracts
D at its first query from the D it loads, in D's dtype, before going to float32, so a logit's bias
is a difference of two numbers near 0 and keeps float32's precision where the bias is small, the
only place it weighs.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from relpos_cli.errors import RelposError
from relpos_cli.kernels._launch import (KernelTiles, Tiles, check_device, check_qkv, dot_precision, interpreting,
                                        input_gradient, launch_tiles, tile_constexprs)
from relpos_cli.kernels._ops import fused_function, softmax_outputs, split_backward_outputs
from relpos_cli.kernels._tiles import (key_head, key_tile, load_kv, load_row_stats, load_rows, online_softmax_step,
                                       query_tile, query_walks, row_delta, unmasked_key_end)

INTERPRETED = interpreting()  # fixed when the kernels below are defined (triton.jit reads it then)
# _launch.KernelTiles of the forward and of both backward kernels: at 128 x 64 none of the three
# spills with 8 warps in 16-bit, but they ran faster with 4, spilling a little (tests/test_kernels_compile.py
# SPILLING; dq's no longer since it leaves out the queries' share of dD, which is 0): on an H200 (bf16,
# scripts/bench_kernels.py at 138ab3e) a training call of 8 x 12 heads x 1024 took 0.80 ms against 0.99
# ms, a 16k evaluation window 2.81 ms against 3.05 ms. In float32 the backward's key-tile program spills
# above 32 x 32
FORWARD_TILES = KernelTiles(narrow=Tiles(128, 64, 4), wide=Tiles(32, 64, 8))
BACKWARD_TILES = KernelTiles(narrow=Tiles(128, 64, 4), wide=Tiles(32, 32, 8))


@triton.jit
def _fox_scores(q, k, d_q, d_row, rn, n_ok, ref, scale, PRECISION: tl.constexpr):
    """q . k / sqrt(Dh) + D_i - D_j for one tile (BLOCK_M, BLOCK_N): d_q the queries' D less ref (D at
    the query tile's first query, module docstring), the keys' D read here and shifted alike."""
    d_k = (tl.load(d_row + rn, mask=n_ok, other=0.0) - ref).to(tl.float32)
    return tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale + d_q[:, None] - d_k[None, :]


@triton.jit
def _fox_forward(Q, K, V, D, O, LSE,
                 stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                 stride_db, stride_dh, stride_ob, stride_oh, stride_ot,
                 H, GROUP, TQ, TK, scale,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 PRECISION: tl.constexpr):
    bh, b, h, hk, offset, start_m, rm, rd, m_ok, d_ok = query_tile(H, GROUP, TQ, TK, HEAD_DIM, BLOCK_M, BLOCK_D)
    q = load_rows(Q, b, h, rm, rd, m_ok, d_ok, stride_qb, stride_qh, stride_qt)
    d_row = D + b * stride_db + h * stride_dh
    ref = tl.load(d_row + offset + start_m)  # D at the tile's first query
    d_q = (tl.load(d_row + offset + rm, mask=m_ok, other=0.0) - ref).to(tl.float32)
    k_base, v_base = key_head(K, V, b, hk, stride_kb, stride_kh)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = tl.minimum(TK, offset + start_m + BLOCK_M)  # keys up to the tile's last query
    near_end = unmasked_key_end(offset, start_m, BLOCK_N)
    for start_n in range(0, near_end, BLOCK_N):
        rn, n_ok, _, k, v = load_kv(k_base, v_base, start_n, rd, d_ok, TK, stride_kt, BLOCK_N)
        s = _fox_scores(q, k, d_q, d_row, rn, n_ok, ref, scale, PRECISION)
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s, v, PRECISION)
    for start_n in range(near_end, hi, BLOCK_N):  # the tiles on the diagonal
        rn, n_ok, _, k, v = load_kv(k_base, v_base, start_n, rd, d_ok, TK, stride_kt, BLOCK_N)
        s = _fox_scores(q, k, d_q, d_row, rn, n_ok, ref, scale, PRECISION)
        visible = (rn[None, :] <= rm[:, None] + offset) & n_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        # every row sees key 0 in the first tile, so m_i is finite from there on
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s, v, PRECISION)

    acc = acc / l_i[:, None]
    tl.store(O + b * stride_ob + h * stride_oh + rm[:, None] * stride_ot + rd[None, :], acc.to(O.dtype.element_ty),
             mask=m_ok[:, None] & d_ok[None, :])
    tl.store(LSE + bh * TQ + rm, m_i + tl.log(l_i), mask=m_ok)


@triton.jit
def _fox_key_tile_step(Q, DO, LSE, DELTA, d_row, b, h, bh, start_m, rn, rd, n_ok, d_ok, k, v, d_k_abs, dk, dv, dd_k,
                       offset, TQ, scale, stride_qb, stride_qh, stride_qt, stride_dob, stride_doh, stride_dot,
                       BLOCK_M: tl.constexpr, PRECISION: tl.constexpr, MASKED: tl.constexpr):
    """A key tile's backward over query tile start_m: its dS added to dk, dv and the keys' dD -> dk, dv,
    dd_k. MASKED=False: every query of the tile real and seeing every key of the tile."""
    rm = start_m + tl.arange(0, BLOCK_M)
    m_ok = rm < TQ
    q = load_rows(Q, b, h, rm, rd, m_ok, d_ok, stride_qb, stride_qh, stride_qt)
    do = load_rows(DO, b, h, rm, rd, m_ok, d_ok, stride_dob, stride_doh, stride_dot)
    lse, delta = load_row_stats(LSE, DELTA, bh, rm, m_ok, TQ)
    ref = tl.load(d_row + offset + start_m)  # as the forward's tile
    d_q = (tl.load(d_row + offset + rm, mask=m_ok, other=0.0) - ref).to(tl.float32)
    d_k = (d_k_abs - ref).to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale + d_q[:, None] - d_k[None, :]
    if MASKED:
        visible = (rn[None, :] <= rm[:, None] + offset) & n_ok[None, :] & m_ok[:, None]
        s = tl.where(visible, s, float("-inf"))
    p = tl.exp(s - lse[:, None])  # (BLOCK_M, BLOCK_N)
    dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    ds = p * (dp - delta[:, None])  # d logits
    dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
    dd_k -= tl.sum(ds, 0)
    return dk, dv, dd_k


@triton.jit
def _fox_backward_kv(Q, K, V, D, DO, LSE, DELTA, DK, DV, DD,
                     stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                     stride_db, stride_dh, stride_dob, stride_doh, stride_dot, stride_dqb, stride_dqh, stride_dqt,
                     stride_dkb, stride_dkh, stride_dkt, H, GROUP, TQ, TK, scale,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     PRECISION: tl.constexpr):
    """One key tile of one query head: dk, dv (per query head, summed over a group outside) and
    dD, the keys' share, -sum over queries of dS (the queries' share is 0), in DD's dtype (D's). DK, DV:
    per query head, laid out alike."""
    bh, b, h, offset, start_n, rn, rd, n_ok, d_ok, kv_mask, k, v = key_tile(
        K, V, H, GROUP, TQ, TK, stride_kb, stride_kh, stride_kt, HEAD_DIM, BLOCK_N, BLOCK_D)
    d_row = D + b * stride_db + h * stride_dh
    d_k_abs = tl.load(d_row + rn, mask=n_ok, other=0.0)

    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dd_k = tl.zeros([BLOCK_N], tl.float32)
    # FoX's bias never stops changing with the distance: its unmasked tiles run on to full_hi (near_hi unused)
    lo, full_lo, _, full_hi = query_walks(start_n, offset, TQ, TQ, BLOCK_M, BLOCK_N)
    for start_m in range(lo, tl.minimum(full_lo, TQ), BLOCK_M):
        dk, dv, dd_k = _fox_key_tile_step(Q, DO, LSE, DELTA, d_row, b, h, bh, start_m, rn, rd, n_ok, d_ok, k, v,
                                          d_k_abs, dk, dv, dd_k, offset, TQ, scale, stride_qb, stride_qh, stride_qt,
                                          stride_dob, stride_doh, stride_dot, BLOCK_M, PRECISION, True)
    for start_m in range(full_lo, full_hi, BLOCK_M):
        dk, dv, dd_k = _fox_key_tile_step(Q, DO, LSE, DELTA, d_row, b, h, bh, start_m, rn, rd, n_ok, d_ok, k, v,
                                          d_k_abs, dk, dv, dd_k, offset, TQ, scale, stride_qb, stride_qh, stride_qt,
                                          stride_dob, stride_doh, stride_dot, BLOCK_M, PRECISION, False)
    for start_m in range(tl.maximum(full_lo, full_hi), TQ, BLOCK_M):
        dk, dv, dd_k = _fox_key_tile_step(Q, DO, LSE, DELTA, d_row, b, h, bh, start_m, rn, rd, n_ok, d_ok, k, v,
                                          d_k_abs, dk, dv, dd_k, offset, TQ, scale, stride_qb, stride_qh, stride_qt,
                                          stride_dob, stride_doh, stride_dot, BLOCK_M, PRECISION, True)

    out = b * stride_dkb + h * stride_dkh + rn[:, None] * stride_dkt + rd[None, :]
    tl.store(DK + out, (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=kv_mask)
    tl.store(DD + bh * TK + rn, dd_k.to(DD.dtype.element_ty), mask=n_ok)


@triton.jit
def _fox_query_tile_step(q, do, lse, delta, d_q, d_row, ref, rm, m_ok, k_base, v_base, start_n, rd, d_ok, dq,
                         offset, TK, scale, stride_kt, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                         MASKED: tl.constexpr):
    """A query tile's backward over key tile start_n: its dS added to dq -> dq. MASKED=False: a tile
    before the diagonal (unmasked_key_end)."""
    rn, n_ok, _, k, v = load_kv(k_base, v_base, start_n, rd, d_ok, TK, stride_kt, BLOCK_N)
    s = _fox_scores(q, k, d_q, d_row, rn, n_ok, ref, scale, PRECISION)
    if MASKED:
        visible = (rn[None, :] <= rm[:, None] + offset) & n_ok[None, :] & m_ok[:, None]
        s = tl.where(visible, s, float("-inf"))
    p = tl.exp(s - lse[:, None])
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    ds = p * (dp - delta[:, None])
    return dq + tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)


@triton.jit
def _fox_backward_q(Q, K, V, D, DO, LSE, O, DELTA, DQ,
                    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                    stride_db, stride_dh, stride_dob, stride_doh, stride_dot, stride_dqb, stride_dqh, stride_dqt,
                    stride_dkb, stride_dkh, stride_dkt, H, GROUP, TQ, TK, scale,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    PRECISION: tl.constexpr):
    """One query tile: dq; and its rows' dO . O, stored in DELTA for the dk/dv kernel, launched after this
    one. The queries' share of dD, sum over keys of dS, is 0 (module docstring): not computed."""
    bh, b, h, hk, offset, start_m, rm, rd, m_ok, d_ok = query_tile(H, GROUP, TQ, TK, HEAD_DIM, BLOCK_M, BLOCK_D)
    q = load_rows(Q, b, h, rm, rd, m_ok, d_ok, stride_qb, stride_qh, stride_qt)
    do = load_rows(DO, b, h, rm, rd, m_ok, d_ok, stride_dob, stride_doh, stride_dot)
    lse = tl.load(LSE + bh * TQ + rm, mask=m_ok, other=0.0)
    delta = row_delta(O, do, DELTA, bh, b, h, rm, rd, m_ok, d_ok, TQ, stride_dqb, stride_dqh, stride_dqt)
    d_row = D + b * stride_db + h * stride_dh
    ref = tl.load(d_row + offset + start_m)
    d_q = (tl.load(d_row + offset + rm, mask=m_ok, other=0.0) - ref).to(tl.float32)
    k_base, v_base = key_head(K, V, b, hk, stride_kb, stride_kh)

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = tl.minimum(TK, offset + start_m + BLOCK_M)
    near_end = unmasked_key_end(offset, start_m, BLOCK_N)
    # without a mask a padded query's row may hold inf or nan: its dq and dD are never stored
    for start_n in range(0, near_end, BLOCK_N):
        dq = _fox_query_tile_step(q, do, lse, delta, d_q, d_row, ref, rm, m_ok, k_base, v_base, start_n, rd, d_ok,
                                  dq, offset, TK, scale, stride_kt, BLOCK_N, PRECISION, False)
    for start_n in range(near_end, hi, BLOCK_N):  # the tiles on the diagonal
        dq = _fox_query_tile_step(q, do, lse, delta, d_q, d_row, ref, rm, m_ok, k_base, v_base, start_n, rd, d_ok,
                                  dq, offset, TK, scale, stride_kt, BLOCK_N, PRECISION, True)

    out = b * stride_dqb + h * stride_dqh + rm[:, None] * stride_dqt + rd[None, :]
    tl.store(DQ + out, (dq * scale).to(DQ.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


def _forward(q: Tensor, k: Tensor, v: Tensor, D: Tensor, block_m: int | None, block_n: int | None,
             num_warps: int | None) -> tuple[Tensor, Tensor]:
    """-> (out, each query's log-sum-exp (B, H, Tq) float32); q, k, v as _launch.kernel_layout leaves
    them, D contiguous, all checked."""
    B, H, Tq, Dh = q.shape
    Hk, Tk = k.shape[1], k.shape[2]
    tiles = launch_tiles(FORWARD_TILES, q, block_m, block_n, num_warps, INTERPRETED)
    o, lse = softmax_outputs(q)
    _fox_forward[(triton.cdiv(Tq, tiles.block_m), B * H)](
        q, k, v, D, o, lse,
        *q.stride()[:3], *k.stride()[:3], D.stride(0), D.stride(1), *o.stride()[:3],
        H, H // Hk, Tq, Tk, 1.0 / math.sqrt(Dh),
        PRECISION=dot_precision(q.dtype, INTERPRETED), **tile_constexprs(q, tiles))
    return o, lse



def _backward(q: Tensor, k: Tensor, v: Tensor, D: Tensor, block_m: int | None, block_n: int | None,
              num_warps: int | None, o: Tensor, lse: Tensor, do: Tensor, needs: list[bool]) -> list[Tensor]:
    """-> dq, dk, dv (_ops.split_backward_outputs, dk and dv through _launch.input_gradient), dD."""
    B, H, Tq, Dh = q.shape
    Hk, Tk = k.shape[1], k.shape[2]
    delta, dq, dk, dv = split_backward_outputs(q, k)
    dd = torch.empty((B, H, Tk), dtype=D.dtype, device=q.device)  # the keys' share, all of dD: the dk/dv kernel's
    common = (*q.stride()[:3], *k.stride()[:3], D.stride(0), D.stride(1), *do.stride()[:3], *dq.stride()[:3],
              *dk.stride()[:3], H, H // Hk, Tq, Tk, 1.0 / math.sqrt(Dh))
    tiles = launch_tiles(BACKWARD_TILES, q, block_m, block_n, num_warps, INTERPRETED)
    meta = tile_constexprs(q, tiles) | {"PRECISION": dot_precision(q.dtype, INTERPRETED)}
    _fox_backward_q[(triton.cdiv(Tq, tiles.block_m), B * H)](q, k, v, D, do, lse, o, delta, dq, *common, **meta)
    _fox_backward_kv[(triton.cdiv(Tk, tiles.block_n), B * H)](q, k, v, D, do, lse, delta, dk, dv, dd, *common, **meta)
    return [dq, input_gradient(dk, k), input_gradient(dv, v), dd]


_forgetting = fused_function("forgetting_attention", _forward, softmax_outputs, _backward, tensors=4)


def forgetting_attention(q: Tensor, k: Tensor, v: Tensor, log_forget_cumsum: Tensor, block_m: int | None = None,
                         block_n: int | None = None, num_warps: int | None = None) -> Tensor:
    """Causal softmax attention with FoX's forget-gate bias, fused: no (Tq, Tk) tensor.

    q (B, H, Tq, Dh): the last Tq of the Tk positions (Tq == Tk in training);
    k, v (B, Hk, Tk, Dh), Hk dividing H (grouped-query attention: query head h reads key head
    h // (H // Hk)); q, k, v in float32, bfloat16 or float16, one dtype;
    log_forget_cumsum (B, H, Tk): D, the cumulative sum of the log forget gates (float32 or float64),
    query i's bias on key j being D_i - D_j -> out (B, H, Tq, Dh) in q's dtype, laid out as
    (B, Tq, H, Dh) (_launch.token_major).

    Differentiable in q, k, v and log_forget_cumsum. block_m / block_n / num_warps: tile sizes
    (powers of two, >= 16) and warps for the call's kernels, FORWARD_TILES and BACKWARD_TILES where
    not given (_launch.launch_tiles). CUDA tensors, or any under TRITON_INTERPRET=1 (set before this
    module is imported).
    """
    B, H, Hk, Tq, Tk, Dh = check_qkv(q, k, v)
    if log_forget_cumsum.shape != (B, H, Tk) or log_forget_cumsum.dtype not in (torch.float32, torch.float64):
        raise RelposError(f"log_forget_cumsum must be (B, H, Tk) = {(B, H, Tk)} in float32 or float64; got "
                          f"{tuple(log_forget_cumsum.shape)} {log_forget_cumsum.dtype}")
    check_device(INTERPRETED, q, k, v, log_forget_cumsum)
    return _forgetting(q, k, v, log_forget_cumsum.contiguous(), block_m, block_n, num_warps)
