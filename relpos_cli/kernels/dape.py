"""DAPE attention as one fused Triton kernel: forward and backward, no (T, T) tensor.

What it computes (relpos_cli/positions/dape.py, ``DAPE.content_bias``), for query i (the last Tq
of the Tk positions) and key j <= i, with all H heads of the pair (i, j) read together:

    A_h = q_h,i . k_h,j / sqrt(Dh),   B_h = base[h, i - j]           (the base bias of distance i - j)
    hidden = leaky_relu(W1 [A; B] + b1),   W1 (width, 2H), slope 0.01
    logits_h = A_h + B_h + (W2 hidden + b2)_h,   W2 (H, width)
    out_h,i = softmax_{j <= i}(logits_h) @ v_h                        (per head)

one layer's MLP (b2 shifts all of head h's logits in row i alike, so the softmax cancels it and the
kernel leaves it out); ``base`` is the base scheme's table of distances, ``distance_bias(layer,
arange(Tk))``, so only bases whose bias is a function of i - j are in scope. Tq == Tk in the
training and evaluation that call this; queries that are the last Tq of Tk keys work as well.
Gradients for q, k, v, the base table (hence the base's parameters, through the caller's
distance_bias) and the MLP's weights.

Reference: Zheng et al. 2024, "DAPE: Data-Adaptive Positional Encoding for Length Extrapolation"
(NeurIPS 2024), and the authors' code (chuanyang-Zheng/DAPE ``DAPE.py``: ``mlp2 =
Sequential(Linear(2H, width), LeakyReLU(), Linear(width, H))`` on ``cat((x, bias), dim=1)``, x +
bias + mlp2(...)); the same mathematics, not their code, which writes the (B, H, T, T) scores.

Design. The MLP mixes the heads of one pair, so a program owns all heads: one program per (tile of
BLOCK_M queries, batch element), H a constexpr padded to BLOCK_H, a power of two. It walks the key
tiles up to the diagonal; per key tile it computes every head's score tile at once as a batched
tl.dot, (BLOCK_H, BLOCK_M, Dh) @ (BLOCK_H, Dh, BLOCK_N), gathers the base bias of each pair's
distance from the (H, Tk) table, runs the MLP on the (BLOCK_H, BLOCK_M, BLOCK_N) tile, and updates
FlashAttention-2's online softmax per head with per-head accumulators (BLOCK_H, BLOCK_M, Dh),
and stores each row's log-sum-exp per head.

Backward: one program per (query tile, batch element) again walks the same key tiles, recomputes
the scores, the base bias and the MLP, the probabilities from the log-sum-exp, and dS = P (dP -
dO . O) per head; back through the MLP, hidden unit by hidden unit (its pre-activation recomputed,
so no (width, M, N) tensor is kept), it gets dA = dS + W1[:, :H]^T d pre and dB = dS + W1[:, H:]^T
d pre. dq is the program's own; dk, dv and d base (a sum over the pairs at each distance) are added
with float32 atomics, since several query tiles read one key tile and one distance; the MLP's
weight gradients are summed over the program's pairs in registers and stored as its share, summed
over programs afterwards (no atomics on a few hot addresses).

The MLP is a loop over the hidden units on CUDA cores: unit w is a sum over the head axis of the
tile weighted by W1's row w, then its LeakyReLU, then added to every head's logits times W2's column
w. Not tl.dot on a (pairs, 2H) layout, because (1) fp32 tl.dot rounds its inputs to TF32 where torch
allows TF32, and the MLP's inputs are the logits themselves; (2) the (H, M, N) -> (M N, 2H) relayout
and back goes through shared memory on every key tile; (3) tl.dot wants both sides of the width
padded to a power of two >= 16, and a loop takes any width. The cost: 3 H width FMAs per pair
(1152 at H=12, width 32), against H Dh = 768 tensor-core MACs for the scores, so the MLP is the
kernel's arithmetic. Compiled for sm_90, the tile's head axis lies across the 8 warps (the batched
tl.dot's layout, warpsPerCTA [8, 1, 1]), so each unit's sum over the heads is a reduction across
warps through shared memory: 32 of them a key tile at width 32 in the forward, more in the backward,
the likely cost (unmeasured). Tried: the MLP as IEEE tl.dot over the tile's pairs flattened,
(width, H) @ (H, M N), all units at once or 16 at a time; it passed the tests here but spilled more
when compiled for sm_90 (forward 344-488 bytes a thread, backward 2-16 KB, against 0 and 560), so
it is not used; a GPU profile would settle which costs more.

Registers and tiles on CUDA (not timed on a GPU yet). At H=12 (BLOCK_H 16: a quarter of the work is
padding), Dh=64, BLOCK_M = BLOCK_N = 16, a program holds the fp32
accumulators, 16 x 16 x 64 = 16K values, the queries (16K values, half as many registers in bf16),
three score-sized tiles (scores, base bias, logits: 3 x 16 x 16 x 16 = 12K) and the key and value
tiles passing through (2 x 16K values): ~50K 32-bit registers in bf16, against 64K per SM and
FlashAttention-2's ~20K at 128 queries of one head. Hence the tiles chosen for CUDA: 16 x 16 (the
smallest tl.dot takes), 8 warps (~200 registers a thread), one pipeline stage (the key and value
tiles of all heads are 64 KB of shared memory each in fp32, and more stages would not fit an H100's
228 KB). Compiled for sm_90 (tests/test_kernels_compile.py), the bf16 forward fits 238 registers a
thread with no spill (triton 3.9); what BLOCK_N or warp count is faster, only a GPU can tell; above
16 heads everything doubles. The backward holds more: q, dO and dq (3 x 16K) and some eight
score-sized tiles (A, B, logits, P, dP, dS, dA, dB: 32K) besides the key and value tiles, and
spills at every tile and warp count tried (560 bytes a thread at these; 4 and 16 warps, 32 x 16 and
16 x 32 spill more); splitting it in two kernels (dq; dk and dv) as relpos_cli/kernels/forgetting.py
does is the way out. Under the interpreter the tiles are 16 x 16 too (_launch.launch_tiles).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from relpos_cli.errors import RelposError
from relpos_cli.kernels import serves
from relpos_cli.kernels._launch import (KernelTiles, Tiles, check_device, check_qkv, dot_precision, interpreting,
                                        input_gradient, launch_tiles, padded_head_dim, power_of_two,
                                        token_major)
from relpos_cli.kernels._ops import fused_function, softmax_outputs
from relpos_cli.kernels.output_grad import output_grad_dot
from relpos_cli.positions.dape import LEAKY_SLOPE

INTERPRETED = interpreting()  # fixed when the kernels below are defined (triton.jit reads it then)
# CUDA launch settings (module docstring): a program holds all heads' state, so the smallest tiles
# tl.dot takes and no pipelining of the key tiles, forward and backward alike. 4 warps in 16 bits,
# though the forward spills there (tests/test_kernels_compile.py SPILLING) where it does not with 8: on
# an H200 (bf16, 12 heads, scripts/bench_kernels.py at 138ab3e) a training call of 8 x 1024 took 40.8 ms
# against 52.97 ms with 8 warps, a 16k evaluation window 118 ms against 271 ms. 8 warps for float32 tiles
# (twice the registers; untimed); with 16 each thread's 128 registers are too few
TILES = KernelTiles(narrow=Tiles(16, 16, 4), wide=Tiles(16, 16, 8))
CUDA_STAGES = 1


@triton.jit
def _dape_logits(q, kt, BASE, W1, B1, W2, rh, rm, rn, m_ok, n_ok, offset, stride_base, scale, slope,
                 H: tl.constexpr, WIDTH: tl.constexpr, PRECISION: tl.constexpr):
    """One tile of pairs, all heads: q (BLOCK_H, BLOCK_M, BLOCK_D), kt (BLOCK_H, BLOCK_D, BLOCK_N)
    -> scores A, base bias B, DAPE's logits (BLOCK_H, BLOCK_M, BLOCK_N) without b2 and unmasked,
    and which pairs are visible (BLOCK_M, BLOCK_N)."""
    h_ok = rh < H
    a = tl.dot(q, kt, input_precision=PRECISION) * scale
    distance = offset + rm[:, None] - rn[None, :]  # (BLOCK_M, BLOCK_N)
    visible = (distance >= 0) & n_ok[None, :]
    # rows past TQ stay out of the table, which holds distances up to TK - 1 only
    bias = tl.load(BASE + rh[:, None, None] * stride_base + distance[None, :, :],
                   mask=h_ok[:, None, None] & (visible & m_ok[:, None])[None, :, :], other=0.0)
    # padded heads get zero scores, bias and weights: finite logits, never stored
    logits = a + bias
    for w in range(WIDTH):  # hidden unit w of every pair in the tile, (BLOCK_M, BLOCK_N)
        w_scores = tl.load(W1 + w * 2 * H + rh, mask=h_ok, other=0.0)  # W1[w, :H]
        w_base = tl.load(W1 + w * 2 * H + H + rh, mask=h_ok, other=0.0)  # W1[w, H:]
        hidden = tl.sum(w_scores[:, None, None] * a + w_base[:, None, None] * bias, 0) + tl.load(B1 + w)
        hidden = tl.where(hidden >= 0, hidden, hidden * slope)
        w_out = tl.load(W2 + rh * WIDTH + w, mask=h_ok, other=0.0)  # W2[:, w]
        logits += w_out[:, None, None] * hidden[None, :, :]
    return a, bias, logits, visible


@triton.jit
def _dape_forward(Q, K, V, BASE, W1, B1, W2, O, LSE,
                  stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_base,
                  TQ, TK, scale, slope, stride_ob, stride_oh, stride_ot,
                  H: tl.constexpr, GROUP: tl.constexpr, WIDTH: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    offset = TK - TQ  # query i sits at position offset + i
    start_m = pid_m * BLOCK_M
    rh = tl.arange(0, BLOCK_H)
    rm = start_m + tl.arange(0, BLOCK_M)
    rd = tl.arange(0, BLOCK_D)
    h_ok = rh < H
    m_ok = rm < TQ
    d_ok = rd < HEAD_DIM
    h3 = rh[:, None, None]
    h3_ok = h_ok[:, None, None]
    q_mask = h3_ok & m_ok[None, :, None] & d_ok[None, None, :]
    q_rows = b * stride_qb + h3 * stride_qh + rm[None, :, None] * stride_qt + rd[None, None, :]

    q = tl.load(Q + q_rows, mask=q_mask, other=0.0)  # (BLOCK_H, BLOCK_M, BLOCK_D)
    kv_heads = (rh // GROUP)[:, None, None] * stride_kh  # grouped-query attention: query head h reads key head h // GROUP
    k_base = K + b * stride_kb + kv_heads
    v_base = V + b * stride_kb + kv_heads

    m_i = tl.full([BLOCK_H, BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H, BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_M, BLOCK_D], tl.float32)
    hi = tl.minimum(TK, offset + start_m + BLOCK_M)  # keys up to the tile's last query
    for start_n in range(0, hi, BLOCK_N):
        rn = start_n + tl.arange(0, BLOCK_N)
        n_ok = rn < TK
        kt = tl.load(k_base + rd[None, :, None] + rn[None, None, :] * stride_kt,
                     mask=h3_ok & d_ok[None, :, None] & n_ok[None, None, :], other=0.0)  # (BLOCK_H, BLOCK_D, BLOCK_N)
        v = tl.load(v_base + rn[None, :, None] * stride_kt + rd[None, None, :],
                    mask=h3_ok & n_ok[None, :, None] & d_ok[None, None, :], other=0.0)  # (BLOCK_H, BLOCK_N, BLOCK_D)
        _, _, logits, visible = _dape_logits(q, kt, BASE, W1, B1, W2, rh, rm, rn, m_ok, n_ok, offset, stride_base,
                                             scale, slope, H, WIDTH, PRECISION)
        logits = tl.where(visible[None, :, :], logits, float("-inf"))
        # every row sees key 0 in the first tile, so m_new is finite from there on
        m_new = tl.maximum(m_i, tl.max(logits, 2))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(logits - m_new[:, :, None])
        l_i = l_i * alpha + tl.sum(p, 2)
        acc = acc * alpha[:, :, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    acc = acc / l_i[:, :, None]
    tl.store(O + b * stride_ob + h3 * stride_oh + rm[None, :, None] * stride_ot + rd[None, None, :], acc.to(O.dtype.element_ty),
             mask=q_mask)
    tl.store(LSE + (b * H + rh[:, None]) * TQ + rm[None, :], m_i + tl.log(l_i), mask=h_ok[:, None] & m_ok[None, :])


@triton.jit
def _dape_backward(Q, K, V, BASE, W1, B1, W2, DO, LSE, DELTA, DQ, DK, DV, DBASE, DW1, DB1, DW2,
                   stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_base,
                   TQ, TK, scale, slope, stride_dob, stride_doh, stride_dot, stride_dqb, stride_dqh, stride_dqt,
                   stride_dkb, stride_dkh, stride_dkt,
                   H: tl.constexpr, GROUP: tl.constexpr, WIDTH: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """One query tile, all heads, the forward's walk: dq its own; dk, dv, d base added with atomics
    into float32 buffers (several query tiles read one key and one distance; DK and DV laid out
    alike); the MLP's gradients summed over the program's pairs and stored as this program's share."""
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    program = b * tl.num_programs(0) + pid_m
    offset = TK - TQ
    start_m = pid_m * BLOCK_M
    rh = tl.arange(0, BLOCK_H)
    rw = tl.arange(0, BLOCK_W)
    rm = start_m + tl.arange(0, BLOCK_M)
    rd = tl.arange(0, BLOCK_D)
    h_ok = rh < H
    w_ok = rw < WIDTH
    m_ok = rm < TQ
    d_ok = rd < HEAD_DIM
    h3 = rh[:, None, None]
    h3_ok = h_ok[:, None, None]
    q_mask = h3_ok & m_ok[None, :, None] & d_ok[None, None, :]
    q = tl.load(Q + b * stride_qb + h3 * stride_qh + rm[None, :, None] * stride_qt + rd[None, None, :], mask=q_mask,
                other=0.0)  # (BLOCK_H, BLOCK_M, BLOCK_D)
    do = tl.load(DO + b * stride_dob + h3 * stride_doh + rm[None, :, None] * stride_dot + rd[None, None, :], mask=q_mask,
                 other=0.0)
    row_stats = (b * H + rh[:, None]) * TQ + rm[None, :]
    lse = tl.load(LSE + row_stats, mask=h_ok[:, None] & m_ok[None, :], other=0.0)  # (BLOCK_H, BLOCK_M)
    delta = tl.load(DELTA + row_stats, mask=h_ok[:, None] & m_ok[None, :], other=0.0)
    kv_heads = (rh // GROUP)[:, None, None] * stride_kh
    k_base = K + b * stride_kb + kv_heads
    v_base = V + b * stride_kb + kv_heads

    dq = tl.zeros([BLOCK_H, BLOCK_M, BLOCK_D], tl.float32)
    dw1_scores = tl.zeros([BLOCK_W, BLOCK_H], tl.float32)  # d W1[:, :H]
    dw1_base = tl.zeros([BLOCK_W, BLOCK_H], tl.float32)  # d W1[:, H:]
    db1 = tl.zeros([BLOCK_W], tl.float32)
    dw2 = tl.zeros([BLOCK_H, BLOCK_W], tl.float32)
    hi = tl.minimum(TK, offset + start_m + BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        rn = start_n + tl.arange(0, BLOCK_N)
        n_ok = rn < TK
        kv_mask = h3_ok & n_ok[None, :, None] & d_ok[None, None, :]
        kt = tl.load(k_base + rd[None, :, None] + rn[None, None, :] * stride_kt,
                     mask=h3_ok & d_ok[None, :, None] & n_ok[None, None, :], other=0.0)  # (BLOCK_H, BLOCK_D, BLOCK_N)
        vt = tl.load(v_base + rd[None, :, None] + rn[None, None, :] * stride_kt,
                     mask=h3_ok & d_ok[None, :, None] & n_ok[None, None, :], other=0.0)
        a, bias, logits, visible = _dape_logits(q, kt, BASE, W1, B1, W2, rh, rm, rn, m_ok, n_ok, offset, stride_base,
                                                scale, slope, H, WIDTH, PRECISION)
        # rows past TQ and padded heads have no log-sum-exp: their probabilities are zeros, not exp(logits)
        pairs = h3_ok & (visible & m_ok[:, None])[None, :, :]
        p = tl.exp(tl.where(pairs, logits - lse[:, :, None], float("-inf")))  # (BLOCK_H, BLOCK_M, BLOCK_N)
        dp = tl.dot(do, vt, input_precision=PRECISION)
        ds = p * (dp - delta[:, :, None])  # d logits; b2 shifts a row alike, so they sum to 0 per row
        d_a = ds
        d_bias = ds
        for w in range(WIDTH):  # back through hidden unit w: its pre-activation recomputed
            w_scores = tl.load(W1 + w * 2 * H + rh, mask=h_ok, other=0.0)
            w_base = tl.load(W1 + w * 2 * H + H + rh, mask=h_ok, other=0.0)
            pre = tl.sum(w_scores[:, None, None] * a + w_base[:, None, None] * bias, 0) + tl.load(B1 + w)
            hidden = tl.where(pre >= 0, pre, pre * slope)  # (BLOCK_M, BLOCK_N)
            w_out = tl.load(W2 + rh * WIDTH + w, mask=h_ok, other=0.0)
            d_pre = tl.sum(w_out[:, None, None] * ds, 0)
            d_pre = tl.where(pre >= 0, d_pre, d_pre * slope)  # zero on hidden pairs, as ds is
            d_a += w_scores[:, None, None] * d_pre[None, :, :]
            d_bias += w_base[:, None, None] * d_pre[None, :, :]
            # this unit's weight gradients go to row / column w of the program's sums
            at_w = rw == w
            dw2 += tl.where(at_w[None, :], tl.sum(tl.sum(ds * hidden[None, :, :], 2), 1)[:, None], 0.0)
            dw1_scores += tl.where(at_w[:, None], tl.sum(tl.sum(d_pre[None, :, :] * a, 2), 1)[None, :], 0.0)
            dw1_base += tl.where(at_w[:, None], tl.sum(tl.sum(d_pre[None, :, :] * bias, 2), 1)[None, :], 0.0)
            db1 += tl.where(at_w, tl.sum(tl.sum(d_pre, 1), 0), 0.0)
        dq += tl.dot(d_a.to(kt.dtype), tl.permute(kt, (0, 2, 1)), input_precision=PRECISION)
        dk = tl.dot(tl.permute(d_a, (0, 2, 1)).to(q.dtype), q, input_precision=PRECISION)  # (BLOCK_H, BLOCK_N, BLOCK_D)
        dv = tl.dot(tl.permute(p, (0, 2, 1)).to(do.dtype), do, input_precision=PRECISION)
        kv_out = b * stride_dkb + (rh // GROUP)[:, None, None] * stride_dkh + rn[None, :, None] * stride_dkt + rd[None, None, :]
        tl.atomic_add(DK + kv_out, dk * scale, mask=kv_mask)
        tl.atomic_add(DV + kv_out, dv, mask=kv_mask)
        distance = offset + rm[:, None] - rn[None, :]
        tl.atomic_add(DBASE + h3 * stride_base + distance[None, :, :], d_bias, mask=pairs)

    tl.store(DQ + b * stride_dqb + h3 * stride_dqh + rm[None, :, None] * stride_dqt + rd[None, None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=q_mask)
    w_h = w_ok[:, None] & h_ok[None, :]
    tl.store(DW1 + program * WIDTH * 2 * H + rw[:, None] * 2 * H + rh[None, :], dw1_scores, mask=w_h)
    tl.store(DW1 + program * WIDTH * 2 * H + rw[:, None] * 2 * H + H + rh[None, :], dw1_base, mask=w_h)
    tl.store(DB1 + program * WIDTH + rw, db1, mask=w_ok)
    tl.store(DW2 + program * H * WIDTH + rh[:, None] * WIDTH + rw[None, :], dw2, mask=h_ok[:, None] & w_ok[None, :])


def _launch_settings(q: Tensor, k: Tensor, base32: Tensor, width: int, block_m: int | None, block_n: int | None,
                     num_warps: int | None) -> tuple[tuple[int, int], tuple, dict]:
    """(grid, the arguments after the tensors, the constexprs) of both kernels for this call."""
    B, H, Tq, Dh = q.shape
    Hk, Tk = k.shape[1], k.shape[2]
    tiles = launch_tiles(TILES, q, block_m, block_n, num_warps, INTERPRETED)
    meta = dict(H=H, GROUP=H // Hk, WIDTH=width, HEAD_DIM=Dh, BLOCK_H=power_of_two(H), BLOCK_D=padded_head_dim(Dh),
                BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, PRECISION=dot_precision(q.dtype, INTERPRETED),
                num_warps=tiles.num_warps, num_stages=CUDA_STAGES)
    common = (*q.stride()[:3], *k.stride()[:3], base32.stride(0), Tq, Tk, 1.0 / math.sqrt(Dh), LEAKY_SLOPE)
    return (triton.cdiv(Tq, tiles.block_m), B), common, meta


def _forward(q: Tensor, k: Tensor, v: Tensor, base: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor,
             block_m: int | None, block_n: int | None, num_warps: int | None) -> tuple[Tensor, Tensor]:
    """-> (out, each query's log-sum-exp (B, H, Tq) float32); q, k, v as _launch.kernel_layout leaves
    them, all checked. The base and the MLP run in float32."""
    base32, w1, b1, w2 = (t.float().contiguous() for t in (base, w1, b1, w2))
    grid, common, meta = _launch_settings(q, k, base32, w1.shape[0], block_m, block_n, num_warps)
    o, lse = softmax_outputs(q)
    _dape_forward[grid](q, k, v, base32, w1, b1, w2, o, lse, *common, *o.stride()[:3], **meta)
    return o, lse



def _backward(q: Tensor, k: Tensor, v: Tensor, base: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor,
              block_m: int | None, block_n: int | None, num_warps: int | None, o: Tensor, lse: Tensor, do: Tensor,
              needs: list[bool]) -> list[Tensor]:
    """-> the gradients of q, k, v, base, w1, b1, w2, b2, each in its tensor's dtype (all computed; q, k,
    v's laid out as _launch.token_major's)."""
    H, width = w2.shape
    dtypes = [t.dtype for t in (base, w1, b1, w2)]
    base32, w1, b1, w2 = (t.float().contiguous() for t in (base, w1, b1, w2))
    grid, common, meta = _launch_settings(q, k, base32, width, block_m, block_n, num_warps)
    programs = grid[0] * grid[1]
    delta = output_grad_dot(o, do)  # (B, H, Tq)
    dq = token_major(q.shape, q.dtype, q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)  # atomics add into these three
    dv = torch.zeros_like(dk)
    dbase = torch.zeros_like(base32)
    # each program's share of the MLP's gradients, summed here: no atomics on a few hot addresses
    dw1 = torch.empty((programs, width, 2 * H), dtype=torch.float32, device=q.device)
    db1 = torch.empty((programs, width), dtype=torch.float32, device=q.device)
    dw2 = torch.empty((programs, H, width), dtype=torch.float32, device=q.device)
    _dape_backward[grid](q, k, v, base32, w1, b1, w2, do, lse, delta, dq, dk, dv, dbase, dw1, db1, dw2,
                         *common, *do.stride()[:3], *dq.stride()[:3], *dk.stride()[:3], BLOCK_W=power_of_two(width), **meta)
    base_dtype, w1_dtype, b1_dtype, w2_dtype = dtypes
    db2 = torch.zeros_like(b2)  # the softmax cancels b2 (see the module docstring)
    return [dq, input_gradient(dk, k), input_gradient(dv, v), dbase.to(base_dtype), dw1.sum(0).to(w1_dtype),
            db1.sum(0).to(b1_dtype), dw2.sum(0).to(w2_dtype), db2]


_dape = fused_function("dape_attention", _forward, softmax_outputs, _backward, tensors=8)


def dape_attention(q: Tensor, k: Tensor, v: Tensor, base: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor,
                   block_m: int | None = None, block_n: int | None = None, num_warps: int | None = None) -> Tensor:
    """Causal softmax attention with DAPE's bias, fused: no (Tq, Tk) tensor.

    Args:
        q: (B, H, Tq, Dh), the last Tq of the Tk positions (Tq == Tk in evaluation and training).
        k, v: (B, Hk, Tk, Dh), Hk dividing H (query head h reads key head h // (H // Hk)); q, k, v in
            float32, bfloat16 or float16, one dtype.
        base: (H, L), L >= Tk: base[h, d] is head h's base bias at distance i - j = d, the base
            scheme's ``distance_bias(layer, torch.arange(L))``.
        w1, b1: the MLP's first layer, (width, 2H) and (width,); its input is [scores; base bias].
        w2, b2: its last layer, (H, width) and (H,). LeakyReLU between, slope 0.01. b2 adds one
            constant to all of a head's logits in a row, which the softmax cancels: its shape is
            checked, the kernel does not read it, and its gradient is zero.
        block_m, block_n, num_warps: queries and keys per tile (powers of two >= 16) and warps; by
            default TILES on CUDA, 16 x 16 under the interpreter (_launch.launch_tiles).

    Returns:
        (B, H, Tq, Dh) in q's dtype, laid out as (B, Tq, H, Dh) (_launch.token_major); base and the
        MLP run in float32. Differentiable in all eight
        tensors (dk, dv and d base through float32 atomics: not bit-for-bit deterministic on CUDA).

    CUDA tensors, or any under TRITON_INTERPRET=1 (set before this module is imported).
    """
    # here, not in forward: autograd runs forward with gradients off, and needs_input_grad ignores no_grad
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, base, w1, b1, w2, b2))
    # (a bad shape: check_qkv says so; a CPU tensor: check_device)
    if q.dim() == 4 and q.is_cuda and not serves("dape_attention", q, needs_grad):
        direction = "backward" if needs_grad else "forward"
        raise RelposError(f"dape_attention's {direction} for {q.shape[1]} heads of {q.shape[-1]} in "
                          f"{str(q.dtype).removeprefix('torch.')} needs more shared memory a block than a GPU has (227 KiB "
                          f"on an H100): its program holds every head's tiles (relpos_cli.kernels.DAPE_FOOTPRINT); call "
                          f"it with fewer or smaller heads, in bf16 or fp16, or without gradients "
                          f"(model.attn_backend=fused runs such a call as auto would)")
    B, H, Hk, Tq, Tk, Dh = check_qkv(q, k, v)
    if base.dim() != 2 or base.shape[0] != H or base.shape[1] < Tk:
        raise RelposError(f"base must be (H, L) = ({H}, L) with L >= Tk = {Tk}, the base bias per distance; "
                          f"got {tuple(base.shape)}")
    width = w1.shape[0] if w1.dim() == 2 else -1
    if w1.shape != (width, 2 * H) or b1.shape != (width,) or w2.shape != (H, width) or b2.shape != (H,) or width < 1:
        raise RelposError(f"DAPE's MLP for {H} heads must be w1 (width, {2 * H}), b1 (width,), w2 ({H}, width), "
                          f"b2 ({H},); got {tuple(w1.shape)}, {tuple(b1.shape)}, {tuple(w2.shape)}, {tuple(b2.shape)}")
    if not all(t.is_floating_point() for t in (base, w1, b1, w2, b2)):
        raise RelposError("base and DAPE's MLP weights must be floating point")
    check_device(INTERPRETED, q, k, v, base, w1, b1, w2, b2)
    return _dape(q, k, v, base, w1, b1, w2, b2, block_m, block_n, num_warps)
