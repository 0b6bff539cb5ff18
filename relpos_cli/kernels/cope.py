"""CoPE (contextual position encoding) attention as one fused Triton kernel: forward and backward,
no (T, T) tensor.

What it computes (relpos_cli/positions/cope.py, ``CoPE.content_bias``), for query i (the last Tq
of the Tk positions) and key j <= i, with P = max_positions:

    z_ij = q_i . k_j / sqrt(Dh),   g_ij = sigmoid(z_ij)
    p_ij = min(sum_{t=j..i} g_it, P - 1),   w_ij = p_ij - floor(p_ij)
    logits_ij = z_ij + (1 - w_ij) Z[i, floor(p_ij)] + w_ij Z[i, ceil(p_ij)],   out_i = softmax_j(logits_i) @ v

with Z = per_position (B, H, Tq, P) = q @ pos_emb[layer].T, formed by the caller (so autograd takes
Z's gradient on to q and the embeddings); the kernel returns dZ with dq, dk, dv.

Forward: one program per tile of BLOCK_M queries walks the key tiles nearest first (the diagonal
tile first), carrying each query's gate count over the nearer keys; within a tile the counts come
from a reversed cumulative sum. Z[i, floor] and Z[i, ceil] are gathered from the query's row of Z;
FlashAttention-2's online softmax, the log-sum-exp stored. Once every query of the tile has counted
P - 1 over the keys walked, every farther key's count is P - 1 or more (the gates are positive), so
its logit is z_ij + Z[i, P - 1] exactly (w = 0, floor = ceil = P - 1): the rest of the walk computes
that, without the gates, their sums and the gathers (_cope_saturated_scores; the same numbers, bit
for bit). The walk checks every _tiles.STOP_CHECK_TILES key tiles, each chunk a for loop that Triton
pipelines; a key tile walked in full past the point computes the same numbers. A count of P - 1 = 63
(the default) is about 126 keys of gates near one half (a model at initialisation); how soon a
trained model's counts get there depends on its gates (scripts/walk_stops.py measures a run's).

Backward, FlashAttention-2's split, with dS_ij = P_ij (dO_i . v_j - dO_i . out_i) (softmax) and
dp_ij = dS_ij (Z[i, ceil] - Z[i, floor]) (dcount below; floor and ceil carry no gradient; above
P - 1 the clamp passes none, and there floor = ceil = P - 1 makes the difference 0):

    dz_it = dS_it + g_it (1 - g_it) sum_{j <= t} dp_ij,   dZ[i, floor] += dS (1 - w),   dZ[i, ceil] += dS w

sum_{j <= t} runs over the farther keys, which the nearest-first walk reaches last, so the query-tile
program walks twice: the first walk sums each row's dp, the second takes sum_{j <= t} dp_ij =
total_i - sum_{j > t} dp_ij with the nearer sum carried. A count is never formed as a difference (row
total of gates minus a prefix): at long rows that would cost float32 the count's fraction, which is
the interpolation weight. Both walks do the full arithmetic only up to where the forward's stops:
past it dp is 0, so the first walk ends there and the second takes dz = dS (total - nearer is 0
there, the same sums in the same order). That program computes dq and dZ: dZ through atomics into
its own rows (several keys of a tile share an index), except the saturated keys (count clamped at
P - 1, all reading Z[i, P - 1]), summed per row in registers and added once. For the key-tile program it stores
its rows' dO . out and total, and at the end of each key tile each row's gate count over the keys
after the tile and sum of dp over them, (B, H, Tk / BLOCK_N, Tq) float32 each (1 / BLOCK_N of a score
matrix, quadratic in the length, held for one layer's backward: 12 MiB each at 8 x 12 heads x 1,024
and BLOCK_N 32; past where its walk stopped, the count and sum as they stood there). The key-tile
program, one per key tile of one query head, then computes dk and dv in registers over the query tiles
that see it, its counts and sums from those, STOP_CHECK_TILES query tiles at a time: a chunk whose
every stored count is P - 1 or more takes dz = dS and the logits z + Z[i, P - 1], the others the full
arithmetic. Under grouped-query attention dk, dv are per query head, summed over a group after. The
backward first ran as the query-tile program alone, adding dk and dv with float32 atomics for every
key tile it visited.

Written for relpos after the paper's Appendix B (Golovneva et al. 2024, "Contextual Position
Encoding: Learning to Count What's Important") and x-transformers' ``CoPE`` (MIT), in the same walk
as relpos_cli/kernels/stickbreaking.py: the same mathematics, not their code.

Precision: counts, weights and logits are float32 whatever the inputs' dtype, and Z is read into
float32; dO_i . out_i is taken from the output in q's dtype (as FlashAttention-2 does). fp32 tiles
use TF32 dots only where torch allows TF32 matmuls (relpos_cli/kernels/_launch.dot_precision).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from relpos_cli.errors import RelposError
from relpos_cli.kernels._launch import (KernelTiles, Tiles, check_device, check_qkv, dot_precision, input_gradient,
                                        interpreting, launch_tiles, padded_head_dim, tile_constexprs)
from relpos_cli.kernels._ops import key_tile_states, split_backward_outputs
from relpos_cli.kernels._row_table import row_table_attention
from relpos_cli.kernels._tiles import (key_head, key_tile, key_tile_state, load_kv, load_row_stats, load_rows,
                                       STOP_CHECK_TILES, online_softmax_step, query_tile, row_delta,
                                       some_row_below)

INTERPRETED = interpreting()  # fixed when the kernels below are defined (triton.jit reads it then)
# _launch.KernelTiles. The forward carries each query's gate count and the gates' tile besides the scores;
# with its two walks pipelined (_tiles.STOP_CHECK_TILES) it spills 80 bytes at 64 x 64 with 8 warps, none at
# 64 x 32. The backward's two programs share BLOCK_N (the query-tile program stores its rows' state at the end
# of each of the key-tile program's key tiles): the key-tile program's, which the query-tile program's gives
# way to. Compiled for sm_90 in bf16 (tests/kernel_compile_probe.py) at head size 64, with triton 3.9 / 3.6
# (the GPU machine's): the forward at 64 x 32 with 8 warps 230 / 232 registers, the query-tile program at
# 32 x 32 with 8 warps 252 / 255, the key-tile program at 32 x 32 233 / 253, none spilling (at 64 x 16 the
# key-tile program spilled 280 bytes, at 64 x 32 1,352); at head size 128 16 x 32, none spilling either, nor
# in float32 at head size 64 (the wide tiles). Untimed on a GPU.
FORWARD_TILES = KernelTiles(narrow=Tiles(64, 32, 8), wide=Tiles(32, 32, 8))
BACKWARD_Q_TILES = KernelTiles(narrow=Tiles(32, 32, 8), wide=Tiles(16, 32, 8))
BACKWARD_KV_TILES = KernelTiles(narrow=Tiles(32, 32, 8), wide=Tiles(16, 32, 8))


@triton.jit
def _cope_scores(q, k, z_row, rm, rn, n_ok, m_ok, acc_g, scale, offset, MAX_POS, PRECISION: tl.constexpr):
    """A tile of queries rm against keys rn (k loaded), with acc_g each query's gate count over the keys
    after the tile and z_row (BLOCK_M, 1) its row of Z: the logits (-inf where not visible), the visible
    mask, the gates, the unclamped counts, the interpolation weight, the gathered Z[i, floor] and
    Z[i, ceil] and their offsets in the row."""
    z = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    visible = (rn[None, :] <= rm[:, None] + offset) & n_ok[None, :] & m_ok[:, None]
    g = tl.where(visible, tl.sigmoid(z), 0.0)
    count = tl.cumsum(g, axis=1, reverse=True) + acc_g[:, None]  # sum over visible t >= j of g_it
    pos = tl.minimum(count, MAX_POS - 1)
    lo = tl.floor(pos)
    w = pos - lo
    lo_idx = lo.to(tl.int32)
    hi_idx = tl.ceil(pos).to(tl.int32)
    z_lo = tl.load(z_row + lo_idx, mask=visible, other=0.0).to(tl.float32)
    z_hi = tl.load(z_row + hi_idx, mask=visible, other=0.0).to(tl.float32)
    s = tl.where(visible, z + (1.0 - w) * z_lo + w * z_hi, float("-inf"))
    return s, visible, g, count, w, z_lo, z_hi, lo_idx, hi_idx


@triton.jit
def _cope_saturated_scores(q, k, z_last, rm, rn, n_ok, m_ok, scale, offset, PRECISION: tl.constexpr):
    """_cope_scores of a tile whose every count is P - 1 or more (the key tiles past where a query tile's
    counts over the nearer keys all reached it), z_last (BLOCK_M, 1) each query's Z[i, P - 1]: the
    logits z + Z[i, P - 1] (-inf where not visible), the same numbers (w = 0, floor = ceil = P - 1)
    without the gates, their sums and the gathers, and the visible mask."""
    z = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    visible = (rn[None, :] <= rm[:, None] + offset) & n_ok[None, :] & m_ok[:, None]
    return tl.where(visible, z + z_last, float("-inf")), visible


@triton.jit
def _cope_ds(s, z_lo, z_hi, lse, delta, do, v, PRECISION: tl.constexpr):
    """A tile's backward from its logits: the probabilities P, dS and d count."""
    p = tl.exp(s - lse[:, None])
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    ds = p * (dp - delta[:, None])  # d logits
    # d count through the interpolation; the clamp needs no mask of its own: a count at P - 1 or
    # above gathers Z[i, P - 1] twice, so z_hi - z_lo is exactly 0 there
    return p, ds, ds * (z_hi - z_lo)


@triton.jit
def _cope_forward(Q, K, V, Z, O, LSE,
                  stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_ob, stride_oh, stride_ot,
                  H, GROUP, TQ, TK, MAX_POS, scale,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  PRECISION: tl.constexpr):
    bh, b, h, hk, offset, start_m, rm, rd, m_ok, d_ok = query_tile(H, GROUP, TQ, TK, HEAD_DIM, BLOCK_M, BLOCK_D)
    q_mask = m_ok[:, None] & d_ok[None, :]
    q = load_rows(Q, b, h, rm, rd, m_ok, d_ok, stride_qb, stride_qh, stride_qt)
    z_row = Z + (bh * TQ + rm[:, None]) * MAX_POS  # (B, H, Tq, P) contiguous: each query's row of Z
    k_base, v_base = key_head(K, V, b, hk, stride_kb, stride_kh)

    acc_g = tl.zeros([BLOCK_M], tl.float32)  # each query's gate count over the nearer tiles' keys
    # finite: the diagonal tile, walked first, may hold no key of a query above it (Tq < Tk, or a
    # query tile across a key-tile edge), and -inf - -inf would make that row's rescaling NaN
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n_tiles = tl.cdiv(tl.minimum(TK, offset + start_m + BLOCK_M), BLOCK_N)
    walked = 0
    while (walked < n_tiles) & some_row_below(acc_g, m_ok, MAX_POS - 1):  # nearest tile first
        for t in range(walked, tl.minimum(walked + STOP_CHECK_TILES, n_tiles)):
            start_n = (n_tiles - 1 - t) * BLOCK_N
            rn, n_ok, _, k, v = load_kv(k_base, v_base, start_n, rd, d_ok, TK, stride_kt, BLOCK_N)
            s, visible, g, count, w, z_lo, z_hi, lo_idx, hi_idx = _cope_scores(
                q, k, z_row, rm, rn, n_ok, m_ok, acc_g, scale, offset, MAX_POS, PRECISION)
            m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s, v, PRECISION)
            acc_g += tl.sum(g, 1)
        walked += STOP_CHECK_TILES
    z_last = tl.load(z_row + MAX_POS - 1, mask=m_ok[:, None], other=0.0).to(tl.float32)
    for far in range(walked, n_tiles):  # the rest: every query's counts at P - 1 or above
        rn, n_ok, _, k, v = load_kv(k_base, v_base, (n_tiles - 1 - far) * BLOCK_N, rd, d_ok, TK, stride_kt, BLOCK_N)
        s, _ = _cope_saturated_scores(q, k, z_last, rm, rn, n_ok, m_ok, scale, offset, PRECISION)
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s, v, PRECISION)

    l_i = tl.where(m_ok, l_i, 1.0)  # rows past the last query: nothing stored, no 0/0 either
    acc = acc / l_i[:, None]
    tl.store(O + b * stride_ob + h * stride_oh + rm[:, None] * stride_ot + rd[None, :], acc.to(O.dtype.element_ty),
             mask=q_mask)
    tl.store(LSE + bh * TQ + rm, m_i + tl.log(l_i), mask=m_ok)


@triton.jit
def _cope_backward_q(Q, K, V, Z, DO, LSE, O, DELTA, TOTAL, COUNT, NEARER, DQ, DZ,
                     stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                     stride_dob, stride_doh, stride_dot, stride_dqb, stride_dqh, stride_dqt,
                     stride_dkb, stride_dkh, stride_dkt, H, GROUP, TQ, TK, MAX_POS, scale,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     PRECISION: tl.constexpr):
    """One query tile, in two walks from the nearest key tile: dq and dZ. For the dk/dv kernel, launched
    after this one: its rows' dO . out (DELTA) and total of d count (TOTAL), and at the end of each key
    tile each row's gate count over the keys after the tile (COUNT) and sum of d count over them
    (NEARER), (B, H, cdiv(Tk, BLOCK_N), Tq) float32, the dk/dv kernel's key tiles being this kernel's."""
    bh, b, h, hk, offset, start_m, rm, rd, m_ok, d_ok = query_tile(H, GROUP, TQ, TK, HEAD_DIM, BLOCK_M, BLOCK_D)
    q = load_rows(Q, b, h, rm, rd, m_ok, d_ok, stride_qb, stride_qh, stride_qt)
    do = load_rows(DO, b, h, rm, rd, m_ok, d_ok, stride_dob, stride_doh, stride_dot)
    lse = tl.load(LSE + bh * TQ + rm, mask=m_ok, other=0.0)
    # delta_i = sum_j P_ij dP_ij
    delta = row_delta(O, do, DELTA, bh, b, h, rm, rd, m_ok, d_ok, TQ, stride_dqb, stride_dqh, stride_dqt)
    z_row = Z + (bh * TQ + rm[:, None]) * MAX_POS
    dz_row = DZ + (bh * TQ + rm[:, None]) * MAX_POS  # float32 (B, H, Tq, P), zeroed by the caller
    k_base, v_base = key_head(K, V, b, hk, stride_kb, stride_kh)
    n_tiles = tl.cdiv(tl.minimum(TK, offset + start_m + BLOCK_M), BLOCK_N)

    # first walk: each row's sum of dcount over all its keys, over the tiles up to where the forward's
    # walk found every count at P - 1 (past there dcount is 0)
    acc_g = tl.zeros([BLOCK_M], tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    walked = 0
    while (walked < n_tiles) & some_row_below(acc_g, m_ok, MAX_POS - 1):
        for t in range(walked, tl.minimum(walked + STOP_CHECK_TILES, n_tiles)):
            start_n = (n_tiles - 1 - t) * BLOCK_N
            rn, n_ok, _, k, v = load_kv(k_base, v_base, start_n, rd, d_ok, TK, stride_kt, BLOCK_N)
            s, visible, g, count, w, z_lo, z_hi, lo_idx, hi_idx = _cope_scores(
                q, k, z_row, rm, rn, n_ok, m_ok, acc_g, scale, offset, MAX_POS, PRECISION)
            p, ds, dcount = _cope_ds(s, z_lo, z_hi, lse, delta, do, v, PRECISION)
            total += tl.sum(dcount, 1)
            acc_g += tl.sum(g, 1)
        walked += STOP_CHECK_TILES
    tl.store(TOTAL + bh * TQ + rm, total, mask=m_ok)

    # second walk: sum_{j <= t} dcount_ij = total_i - sum_{j > t} dcount_ij, the nearer keys' sum carried
    acc_g = tl.zeros([BLOCK_M], tl.float32)
    acc_dcount = tl.zeros([BLOCK_M], tl.float32)
    dz_last = tl.zeros([BLOCK_M], tl.float32)  # dZ[i, P - 1] from the saturated keys
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    walked = 0
    while (walked < n_tiles) & some_row_below(acc_g, m_ok, MAX_POS - 1):
        for t in range(walked, tl.minimum(walked + STOP_CHECK_TILES, n_tiles)):
            tile = n_tiles - 1 - t
            state = key_tile_state(bh, tile, TQ, TK, BLOCK_N) + rm
            tl.store(COUNT + state, acc_g, mask=m_ok)
            tl.store(NEARER + state, acc_dcount, mask=m_ok)
            rn, n_ok, _, k, v = load_kv(k_base, v_base, tile * BLOCK_N, rd, d_ok, TK, stride_kt, BLOCK_N)
            s, visible, g, count, w, z_lo, z_hi, lo_idx, hi_idx = _cope_scores(
                q, k, z_row, rm, rn, n_ok, m_ok, acc_g, scale, offset, MAX_POS, PRECISION)
            p, ds, dcount = _cope_ds(s, z_lo, z_hi, lse, delta, do, v, PRECISION)
            nearer = tl.cumsum(dcount, axis=1, reverse=True) - dcount + acc_dcount[:, None]  # sum over j > t
            dz = tl.where(visible, ds + (total[:, None] - nearer) * g * (1.0 - g), 0.0)
            dq += tl.dot(dz.to(k.dtype), k, input_precision=PRECISION)
            # a saturated count (at P - 1 or above; at exactly P - 1 floor = ceil = P - 1 too) reads Z[i, P - 1]
            saturated = count >= MAX_POS - 1
            free = visible & (count < MAX_POS - 1)
            tl.atomic_add(dz_row + lo_idx, ds * (1.0 - w), mask=free)
            tl.atomic_add(dz_row + hi_idx, ds * w, mask=free)
            dz_last += tl.sum(tl.where(saturated & visible, ds, 0.0), 1)
            acc_dcount += tl.sum(dcount, 1)
            acc_g += tl.sum(g, 1)
        walked += STOP_CHECK_TILES
    # the rest, every count at P - 1 or above: dcount is 0, so total - nearer is too (the same sums, in
    # the same order) and dz = dS; the key-tile program reads the counts and sums as they stand
    z_last = tl.load(z_row + MAX_POS - 1, mask=m_ok[:, None], other=0.0).to(tl.float32)
    for far in range(walked, n_tiles):
        tile = n_tiles - 1 - far
        state = key_tile_state(bh, tile, TQ, TK, BLOCK_N) + rm
        tl.store(COUNT + state, acc_g, mask=m_ok)
        tl.store(NEARER + state, acc_dcount, mask=m_ok)
        rn, n_ok, _, k, v = load_kv(k_base, v_base, tile * BLOCK_N, rd, d_ok, TK, stride_kt, BLOCK_N)
        s, visible = _cope_saturated_scores(q, k, z_last, rm, rn, n_ok, m_ok, scale, offset, PRECISION)
        p, ds, _ = _cope_ds(s, z_last, z_last, lse, delta, do, v, PRECISION)
        dz = tl.where(visible, ds, 0.0)
        dq += tl.dot(dz.to(k.dtype), k, input_precision=PRECISION)
        dz_last += tl.sum(dz, 1)

    tl.store(DQ + b * stride_dqb + h * stride_dqh + rm[:, None] * stride_dqt + rd[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    # an atomic too: the walk's atomics may have added to the same entries from other threads
    tl.atomic_add(DZ + (bh * TQ + rm) * MAX_POS + MAX_POS - 1, dz_last, mask=m_ok)


@triton.jit
def _cope_query_rows(Q, Z, DO, LSE, DELTA, b, h, bh, start_m, rd, d_ok, TQ, MAX_POS,
                     stride_qb, stride_qh, stride_qt, stride_dob, stride_doh, stride_dot, BLOCK_M: tl.constexpr):
    """The key-tile program's query tile from start_m: rm, m_ok, its rows of q and dO, their log-sum-exp and
    dO . out, and the pointers to their rows of Z. A padded query has no log-sum-exp: masked (m_ok), or its
    P could overflow."""
    rm = start_m + tl.arange(0, BLOCK_M)
    m_ok = rm < TQ
    q = load_rows(Q, b, h, rm, rd, m_ok, d_ok, stride_qb, stride_qh, stride_qt)
    do = load_rows(DO, b, h, rm, rd, m_ok, d_ok, stride_dob, stride_doh, stride_dot)
    lse, delta = load_row_stats(LSE, DELTA, bh, rm, m_ok, TQ)
    return rm, m_ok, q, do, lse, delta, Z + (bh * TQ + rm[:, None]) * MAX_POS


@triton.jit
def _cope_backward_kv(Q, K, V, Z, DO, LSE, DELTA, TOTAL, COUNT, NEARER, DK, DV,
                      stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                      stride_dob, stride_doh, stride_dot, stride_dqb, stride_dqh, stride_dqt,
                      stride_dkb, stride_dkh, stride_dkt, H, GROUP, TQ, TK, MAX_POS, scale,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      PRECISION: tl.constexpr):
    """One key tile of one query head: dk, dv (per query head, summed over a group outside), over the
    query tiles from the first holding a query that sees its first key; each row's gate count and sum
    of d count over the keys after the tile read from the dq kernel's COUNT and NEARER. DK, DV: per
    query head, laid out alike."""
    bh, b, h, offset, start_n, rn, rd, n_ok, d_ok, kv_mask, k, v = key_tile(
        K, V, H, GROUP, TQ, TK, stride_kb, stride_kh, stride_kt, HEAD_DIM, BLOCK_N, BLOCK_D)
    state = key_tile_state(bh, tl.program_id(0), TQ, TK, BLOCK_N)  # this key tile's row of COUNT, NEARER
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    # the query tiles STOP_CHECK_TILES at a time: a chunk whose every count is P - 1 or more before this key
    # tile takes dz = dS and the logits z + Z[i, P - 1], as the query-tile program's far walk, the others the
    # full arithmetic; each chunk a for loop, which Triton pipelines (an `if` per query tile it does not)
    chunk = BLOCK_M * STOP_CHECK_TILES
    for start_chunk in range((tl.maximum(start_n - offset, 0) // BLOCK_M) * BLOCK_M, TQ, chunk):
        rows = start_chunk + tl.arange(0, BLOCK_M * STOP_CHECK_TILES)
        end_chunk = tl.minimum(start_chunk + chunk, TQ)
        if some_row_below(tl.load(COUNT + state + rows, mask=rows < TQ, other=0.0), rows < TQ, MAX_POS - 1):
            for start_m in range(start_chunk, end_chunk, BLOCK_M):
                rm, m_ok, q, do, lse, delta, z_row = _cope_query_rows(
                    Q, Z, DO, LSE, DELTA, b, h, bh, start_m, rd, d_ok, TQ, MAX_POS,
                    stride_qb, stride_qh, stride_qt, stride_dob, stride_doh, stride_dot, BLOCK_M)
                acc_g = tl.load(COUNT + state + rm, mask=m_ok, other=0.0)
                total = tl.load(TOTAL + bh * TQ + rm, mask=m_ok, other=0.0)
                acc_dcount = tl.load(NEARER + state + rm, mask=m_ok, other=0.0)
                s, visible, g, count, w, z_lo, z_hi, lo_idx, hi_idx = _cope_scores(
                    q, k, z_row, rm, rn, n_ok, m_ok, acc_g, scale, offset, MAX_POS, PRECISION)
                p, ds, dcount = _cope_ds(s, z_lo, z_hi, lse, delta, do, v, PRECISION)
                nearer = tl.cumsum(dcount, axis=1, reverse=True) - dcount + acc_dcount[:, None]
                dz = tl.where(visible, ds + (total[:, None] - nearer) * g * (1.0 - g), 0.0)
                dk += tl.dot(tl.trans(dz.to(q.dtype)), q, input_precision=PRECISION)
                dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
        else:
            for start_m in range(start_chunk, end_chunk, BLOCK_M):
                rm, m_ok, q, do, lse, delta, z_row = _cope_query_rows(
                    Q, Z, DO, LSE, DELTA, b, h, bh, start_m, rd, d_ok, TQ, MAX_POS,
                    stride_qb, stride_qh, stride_qt, stride_dob, stride_doh, stride_dot, BLOCK_M)
                z_last = tl.load(z_row + MAX_POS - 1, mask=m_ok[:, None], other=0.0).to(tl.float32)
                s, visible = _cope_saturated_scores(q, k, z_last, rm, rn, n_ok, m_ok, scale, offset, PRECISION)
                p, ds, _ = _cope_ds(s, z_last, z_last, lse, delta, do, v, PRECISION)
                dz = tl.where(visible, ds, 0.0)
                dk += tl.dot(tl.trans(dz.to(q.dtype)), q, input_precision=PRECISION)
                dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)

    out = b * stride_dkb + h * stride_dkh + rn[:, None] * stride_dkt + rd[None, :]
    tl.store(DK + out, (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=kv_mask)


def _backward(q: Tensor, k: Tensor, v: Tensor, per_position: Tensor, block_m: int | None, block_n: int | None,
              num_warps: int | None, o: Tensor, lse: Tensor, do: Tensor, needs: list[bool]) -> list[Tensor]:
    """-> dq, dk, dv (_ops.split_backward_outputs, dk and dv through _launch.input_gradient), dper_position
    (float32 in the kernel, cast to per_position's dtype)."""
    B, H, Tq, Dh = q.shape
    Hk, Tk = k.shape[1], k.shape[2]
    delta, dq, dk, dv = split_backward_outputs(q, k)
    dz = torch.zeros(per_position.shape, dtype=torch.float32, device=q.device)  # atomics add into it
    total = torch.empty_like(delta)
    keys = launch_tiles(BACKWARD_KV_TILES, q, block_m, block_n, num_warps, INTERPRETED)
    rows = launch_tiles(BACKWARD_Q_TILES, q, block_m, block_n, num_warps, INTERPRETED)
    rows, count, nearer = key_tile_states(q, k, rows, keys)  # the query-tile program on the key tiles' BLOCK_N
    common = (*q.stride()[:3], *k.stride()[:3], *do.stride()[:3], *dq.stride()[:3], *dk.stride()[:3],
              H, H // Hk, Tq, Tk, per_position.shape[3], 1.0 / math.sqrt(Dh))
    # triton 3.6 (the GPU machine's) cannot compile the backward software-pipelined at a padded head size of 16
    # with 16-bit q and the float32 table CoPE.kernel_inputs gives ("Fatal pipeliner error", "PassManager::run
    # failed"; found on an H200 when it was one kernel, reproduced by tests/kernel_compile_probe.py --head-dim 16
    # with triton 3.6): both programs run unpipelined there, as every float32 kernel does (_launch.pipeline_stages)
    meta = {"PRECISION": dot_precision(q.dtype, INTERPRETED)} | (
        {"num_stages": 1} if padded_head_dim(Dh) == 16 else {})
    _cope_backward_q[(triton.cdiv(Tq, rows.block_m), B * H)](
        q, k, v, per_position, do, lse, o, delta, total, count, nearer, dq, dz, *common,
        **(tile_constexprs(q, rows) | meta))
    _cope_backward_kv[(triton.cdiv(Tk, keys.block_n), B * H)](
        q, k, v, per_position, do, lse, delta, total, count, nearer, dk, dv, *common,
        **(tile_constexprs(q, keys) | meta))
    return [dq, input_gradient(dk, k), input_gradient(dv, v), dz.to(per_position.dtype)]


def _max_positions(columns: int) -> int:
    """The kernels' MAX_POS: the table's last dimension, P, as it is."""
    return columns


_cope = row_table_attention("cope_attention", lambda: _cope_forward, FORWARD_TILES, _max_positions, INTERPRETED,
                            _backward)


def cope_attention(q: Tensor, k: Tensor, v: Tensor, per_position: Tensor, block_m: int | None = None,
                   block_n: int | None = None, num_warps: int | None = None) -> Tensor:
    """Causal softmax attention with CoPE's contextual position bias, fused: no (Tq, Tk) tensor.

    q (B, H, Tq, Dh): the last Tq of the Tk positions (Tq == Tk in training);
    k, v (B, Hk, Tk, Dh), Hk dividing H (grouped-query attention: query head h reads key head
    h // (H // Hk)); q, k, v in float32, bfloat16 or float16, one dtype;
    per_position (B, H, Tq, P): q @ pos_emb[layer].T, each query's bias at the integer positions
    0..P-1 (P = max_positions >= 2), in float32 or q's dtype -> out (B, H, Tq, Dh) in q's dtype:
    softmax over keys j <= i of z_ij plus per_position[i] interpolated at the clamped gate count
    p_ij, as CoPE.content_bias defines it (relpos_cli/positions/cope.py), times v.

    Differentiable in q, k, v and per_position (dper_position through float32 atomics: not
    bit-for-bit deterministic on CUDA; dq, dk, dv are). block_m / block_n / num_warps: tile sizes
    (powers of two, >= 16) and warps for the call's kernels, FORWARD_TILES, BACKWARD_Q_TILES and
    BACKWARD_KV_TILES where not given (_launch.launch_tiles). CUDA tensors, or any under
    TRITON_INTERPRET=1 (set before this module is imported).
    """
    B, H, _, Tq, _, _ = check_qkv(q, k, v)
    if (per_position.dim() != 4 or tuple(per_position.shape[:3]) != (B, H, Tq) or per_position.shape[3] < 2
            or per_position.dtype not in (torch.float32, q.dtype)):
        raise RelposError(f"per_position must be (B, H, Tq, P) = {(B, H, Tq)} + (P >= 2,) in float32 or q's "
                          f"{q.dtype}; got {tuple(per_position.shape)} {per_position.dtype}")
    check_device(INTERPRETED, q, k, v, per_position)
    return _cope(q, k, v, per_position.contiguous(), block_m, block_n, num_warps)
