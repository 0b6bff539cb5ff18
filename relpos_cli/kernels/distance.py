"""Attention with a bias read from a per-head table of the distance, as one fused Triton kernel:
forward and backward, no (T, T) tensor.

What it computes, for query i (the last Tq of the Tk positions, so at position Tk - Tq + i) and key
j at or before it:

    logits_ij = q_i . k_j / sqrt(Dh) + table[h, min(pos_i - j, L - 1)],   out_i = softmax_j(logits_i) @ v

with table (H, L) the bias of each distance 0..L-1, the last entry also that of every farther
distance: what the schemes whose bias is a function of the distance give through
``distance_bias(layer, arange(L))`` (T5's buckets, KERPLE, Sandwich, ALiBi; relpos_cli/positions/),
L >= Tk, or shorter where the bias stops changing (T5 past max_distance:
PositionScheme.distance_bias_flat_from). Gradients for q, k, v and the table, which the caller
computed with autograd from the scheme's parameters, so they get theirs through it.

FlashAttention-2's scheme, as relpos_cli/kernels/forgetting.py: one program per tile of BLOCK_M
queries walks the key tiles up to the diagonal with an online softmax and stores each query's
log-sum-exp; the backward recomputes the probabilities from it, one program per query tile for dq
and the table's gradient, launched first, which also stores its rows' dO . O (FlashAttention-2's D,
which has a kernel of its own there), then one program per key tile for dk and dv.

Three walks over a query tile's key tiles (relpos_cli/kernels/shaw.py's far walk, FlashAttention's
split of the diagonal): first the tiles whose every pair is L - 1 or more apart, which add the
head's last entry, one scalar, and gather nothing; then the tiles before the diagonal, every pair
visible, which gather without a causal mask; last the tiles on the diagonal, masked. With a table
of L >= Tk entries the first walk is empty. dq's backward walks the same three ways, and sums the
table's gradient on its way (below): a far tile's dS into one total per row, a near tile's along its
diagonals. The key-tile program of dk and dv walks its query tiles with no branch inside a loop,
in four loops: the masked tiles on the diagonal; the tiles whose queries all see all its keys (none
past Tq) without the causal mask, first the near ones, which gather, then the far ones, which add
the last entry; and the masked last, partial one (FlashAttention's split again: a padded query,
with no log-sum-exp, would exponentiate its logit unmasked). When that program summed the table's
gradient too, a far loop of its own took it past 255 registers into spills (64 x 64, 8 warps, bf16,
triton 3.9's ptxas), and a branch per tile (the far tiles' scores without the gather) put the
score's tl.dot under an scf.if in the pipelined loop, which triton 3.6's build made illegal memory
accesses of on an H100 in bf16 at 6f29d3e, where the branchless loop of 43ed42b had passed the same
tests (docs/gpu.md: the likely cause, unconfirmed). Without the sums the far loop compiles in 252
registers without a spill at 64 x 64 with 8 warps (a 128-byte spill with 4, 112 without the far loop).

Reading the table. A near tile's distances span BLOCK_M + BLOCK_N - 1 consecutive entries of its head's
row; each score loads its own entry from global memory (a gather the L1 cache serves, those few
hundred bytes being read over and over). A contiguous load of the span and a tl.gather into the
tile would need the span broadcast to (BLOCK_M, span) first, tl.gather taking an index of its
source's rank: more registers than the loads save.

With a slope per head instead of a table (the LINEAR constexpr: linear_distance_attention, ALiBi's
bias, which a scheme declares through linear_distance_slopes), each score's bias is slope * distance,
one multiply: nothing is gathered, no key tile is far (LAST is Tk) and the slopes, fixed, get no
gradient.

The table's gradient, d table[h, d] = sum over the batch and the pairs with min(pos_i - j, L - 1) = d
of dS_ij (dS = P (dP - delta), the softmax's backward), is summed by the dq program, which walks the
far tiles apart: the pairs L - 1 or more apart all add to the last entry, so a far tile's dS is summed
per row in registers (no gather, no atomic) and each program adds its rows' total in one atomic (the
far tiles' diagonals' sums would be BLOCK_M + BLOCK_N - 1 atomics at that one address, which the
hardware serialises). With T5's table (L = max_distance + 1 = 129 at 1,024 tokens) most tiles are far,
so most of the diagonal sums the key-tile program made (sixth run: 8.6 ms of T5's step, against 2.9 ms
for FoX's key-tile program) are gone; KERPLE's and Sandwich's tables (L = T) have no far tile, and
their sums move from one program to the other (untimed). FlexAttention gets it with one atomic add per score
into the ~BLOCK_M + BLOCK_N addresses of a tile, heavily contended. Here each dS tile is first
reduced along its diagonals in registers, and only those sums are added, one atomic per diagonal
(BLOCK_M + BLOCK_N - 1 per tile instead of BLOCK_M * BLOCK_N: 127 instead of 4096 at the
backward's 64 x 64 on CUDA).

How a tile is reduced along its diagonals: column c of the tile is rolled up by c rows with
tl.gather, skewed[r, c] = dS[(r + c) % BLOCK_M, c]. The pair at skewed[r, c] has distance
base + r - w BLOCK_M, w = (r + c) // BLOCK_M being how often the roll wrapped (base: the distance
of the tile's first query and first key), so for each w a sum over the columns of the entries of
that wrap gives one diagonal per row. WRAPS = (BLOCK_M + BLOCK_N - 2) // BLOCK_M + 1 such masked
sums: 2 for BLOCK_N <= BLOCK_M (CUDA's 64 x 64), 3 for 16 x 32. Exact (each dS is added
once, to the sum of its own distance). Register cost: the skewed copy, one more float32 tile
(BLOCK_M * BLOCK_N / threads: 16 per thread at 64 x 64 and 8 warps), which takes dS's place once
dk has used it, and WRAPS vectors of BLOCK_M. Chosen over (1) a masked broadcast compare of the
tile against an iota of its BLOCK_M + BLOCK_N - 1 diagonals, a 3-D (diagonals, M, N) temporary,
127 times the tile at 64 x 64; (2) rolling rows by their index with tl.gather along the keys,
which wraps (BLOCK_M + BLOCK_N - 2) // BLOCK_N + 1 times, 3 at 128 x 64: rolling along the longer
side wraps least (with square tiles either does). On CUDA the gather along the queries
crosses warps, so Triton lowers it through shared memory (16 KB at 64 x 64): one more round trip
of the tile, on top of the tl.dot that reads dS (unmeasured). Padded queries of the last query tile
(no log-sum-exp: their exp may overflow, and dS be inf * 0) are zeroed before a tile is summed.

Not done: keeping the sums per program across its key tiles (consecutive key tiles shift the
distances by BLOCK_N, so a window of sums could be flushed BLOCK_N at a time: BLOCK_N atomics per
tile instead of BLOCK_M + BLOCK_N - 1). Worth half the atomics at 64 x 64, if a profile says the
atomics still weigh.

The atomics make the table's gradient not bit-for-bit deterministic on CUDA (the order of the
float32 additions varies); q, k, v's gradients are.

Written for relpos after FlashAttention-2 (Dao 2023) and relpos_cli/kernels/forgetting.py.
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
# _launch.KernelTiles. On an H200 (bf16, 8 x 12 heads x 1024, scripts/bench_kernels.py at 138ab3e) a training
# call took 0.82 ms with every kernel at 64 x 64 with 4 warps against 1.09 ms at 64 x 64 with 8 warps for the
# key tiles and 128 x 64 with 8 for the rest; the forward keeps 128 x 64 with 8 warps, which evaluated a 16k
# window in 3.97 ms against 5.98 ms with 4. The table's gradient then summed in the key-tile program, which
# spilled 384 bytes a thread there (triton 3.9's ptxas). Since it sums in the query-tile program, compiled
# for sm_90 in bf16 (tests/kernel_compile_probe.py) the key-tile program, with its far tiles' loop, spills
# 128 bytes at 64 x 64 with 4 warps (none with 8, 252 registers), and the query-tile program with the
# table's gradient spills 56 bytes with 4 warps and none with 8 (197 registers), so it runs with 8; neither
# change is timed on a GPU yet. In float32 (IEEE dots) the key-tile program compiled without spills at
# 32 x 32 with triton 3.6.
FORWARD_TILES = KernelTiles(narrow=Tiles(128, 64, 8), wide=Tiles(64, 32, 8))
BACKWARD_KV_TILES = KernelTiles(narrow=Tiles(64, 64, 4), wide=Tiles(32, 32, 8))
BACKWARD_Q_TILES = KernelTiles(narrow=Tiles(64, 64, 8), wide=Tiles(64, 32, 8))


@triton.jit
def _biased_scores(q, k, table_row, slope, rm, rn, m_ok, n_ok, offset, scale, LAST, PRECISION: tl.constexpr,
                   MASKED: tl.constexpr, LINEAR: tl.constexpr):
    """One near tile of pairs: q . k / sqrt(Dh) + table[h, min(distance, LAST)] (BLOCK_M, BLOCK_N),
    or with LINEAR + slope * distance (the head's slope, a scalar: no table read), and which pairs are
    visible (key at or before the query, inside Tk). MASKED=False: a tile before the diagonal, every
    pair visible (padded queries past TQ read the table at LAST or nearer)."""
    distance = offset + rm[:, None] - rn[None, :]
    if MASKED:
        visible = (distance >= 0) & n_ok[None, :]
    else:
        visible = distance >= 0  # all true here; the unmasked callers discard it (compiled away)
    if LINEAR:
        bias = slope * distance.to(tl.float32)  # exact: distances below 2^24
    elif MASKED:
        # padded queries (rm >= TQ) read nothing: their distances may pass the table's end
        bias = tl.load(table_row + tl.minimum(distance, LAST), mask=visible & m_ok[:, None], other=0.0)
    else:
        bias = tl.load(table_row + tl.minimum(distance, LAST))
    return tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale + bias, visible


@triton.jit
def _head_bias(table_row, LAST, LINEAR: tl.constexpr):
    """-> (slope, far_bias): with LINEAR the head's slope (its table is one entry) and no far bias
    (LAST is then TK: no pair is that far), else the last entry, every far pair's bias."""
    if LINEAR:
        return tl.load(table_row), 0.0
    else:
        return 0.0, tl.load(table_row + LAST)


@triton.jit
def _far_scores(q, k, far_bias, scale, PRECISION: tl.constexpr):
    """One far tile, every pair LAST or more apart: q . k / sqrt(Dh) + the head's last entry."""
    return tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale + far_bias


@triton.jit
def _add_diagonal_sums(ds, dtable_row, base, TK, LAST, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       WRAPS: tl.constexpr):
    """Adds the sums of the near tile ds (BLOCK_M, BLOCK_N) along its diagonals to dtable_row at their
    distances (LAST for the farther ones), one atomic per diagonal. base: the distance of the tile's
    first query and first key (the module docstring says how)."""
    r = tl.arange(0, BLOCK_M)
    rolled = r[:, None] + tl.arange(0, BLOCK_N)[None, :]
    skewed = tl.gather(ds, rolled % BLOCK_M, 0)  # skewed[r, c] = ds[(r + c) % BLOCK_M, c]
    wrap = rolled // BLOCK_M
    for w in tl.static_range(WRAPS):
        sums = tl.sum(tl.where(wrap == w, skewed, 0.0), 1)
        distance = base + r - w * BLOCK_M
        # row r has a pair of wrap w iff r + BLOCK_N - 1 >= w BLOCK_M; negative distances are future
        # keys (dS 0), those past TK - 1 padded queries' (dS 0): neither gets an atomic
        has_pairs = (r + BLOCK_N - 1 >= w * BLOCK_M) & (distance >= 0) & (distance < TK)
        # nothing reads the gradient before the kernel ends: no ordering needed
        tl.atomic_add(dtable_row + tl.minimum(distance, LAST), sums, mask=has_pairs, sem="relaxed")


@triton.jit
def _probabilities_and_ds(s, lse, delta, do, v, PRECISION: tl.constexpr):
    """The backward's recomputation for one tile of logits s (BLOCK_M, BLOCK_N), -inf where a pair
    does not count: P from the forward's log-sum-exp, and dS = P (dO . v - delta)."""
    p = tl.exp(s - lse[:, None])
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    return p, p * (dp - delta[:, None])


@triton.jit
def _key_walks(offset, start_m, LAST, BLOCK_N: tl.constexpr):
    """Where a query tile's three walks over the key tiles split (the module docstring): key tiles
    [0, far_end) hold only keys LAST or more before the tile's first query (hence every query),
    [far_end, near_end) only keys at or before it."""
    far_end = tl.maximum(offset + start_m - LAST + 1, 0) // BLOCK_N * BLOCK_N
    near_end = tl.maximum(unmasked_key_end(offset, start_m, BLOCK_N), far_end)
    return far_end, near_end


@triton.jit
def _distance_forward(Q, K, V, TABLE, O, LSE,
                      stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_table,
                      stride_ob, stride_oh, stride_ot,
                      H, GROUP, TQ, TK, LAST, scale,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      PRECISION: tl.constexpr, LINEAR: tl.constexpr):
    bh, b, h, hk, offset, start_m, rm, rd, m_ok, d_ok = query_tile(H, GROUP, TQ, TK, HEAD_DIM, BLOCK_M, BLOCK_D)
    q = load_rows(Q, b, h, rm, rd, m_ok, d_ok, stride_qb, stride_qh, stride_qt)
    table_row = TABLE + h * stride_table
    slope, far_bias = _head_bias(table_row, LAST, LINEAR)
    k_base, v_base = key_head(K, V, b, hk, stride_kb, stride_kh)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    far_end, near_end = _key_walks(offset, start_m, LAST, BLOCK_N)
    hi = tl.minimum(TK, offset + start_m + BLOCK_M)  # keys up to the tile's last query
    for start_n in range(0, far_end, BLOCK_N):
        rn, n_ok, _, k, v = load_kv(k_base, v_base, start_n, rd, d_ok, TK, stride_kt, BLOCK_N)
        s = _far_scores(q, k, far_bias, scale, PRECISION)
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s, v, PRECISION)
    for start_n in range(far_end, near_end, BLOCK_N):
        rn, n_ok, _, k, v = load_kv(k_base, v_base, start_n, rd, d_ok, TK, stride_kt, BLOCK_N)
        s, _ = _biased_scores(q, k, table_row, slope, rm, rn, m_ok, n_ok, offset, scale, LAST, PRECISION, False, LINEAR)
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s, v, PRECISION)
    for start_n in range(near_end, hi, BLOCK_N):
        rn, n_ok, _, k, v = load_kv(k_base, v_base, start_n, rd, d_ok, TK, stride_kt, BLOCK_N)
        s, visible = _biased_scores(q, k, table_row, slope, rm, rn, m_ok, n_ok, offset, scale, LAST, PRECISION, True,
                                    LINEAR)
        s = tl.where(visible, s, float("-inf"))
        # every row sees key 0 in the first tile walked, so m_i is finite from there on
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s, v, PRECISION)

    acc = acc / l_i[:, None]
    tl.store(O + b * stride_ob + h * stride_oh + rm[:, None] * stride_ot + rd[None, :], acc.to(O.dtype.element_ty),
             mask=m_ok[:, None] & d_ok[None, :])
    tl.store(LSE + bh * TQ + rm, m_i + tl.log(l_i), mask=m_ok)


@triton.jit
def _distance_key_tile_step(Q, DO, LSE, DELTA, table_row, slope, far_bias, b, h, bh, start_m, rn, rd, n_ok, d_ok, k, v,
                            dk, dv, offset, TQ, LAST, scale, stride_qb, stride_qh, stride_qt, stride_dob, stride_doh,
                            stride_dot, BLOCK_M: tl.constexpr, PRECISION: tl.constexpr, MASKED: tl.constexpr,
                            LINEAR: tl.constexpr, FAR: tl.constexpr):
    """A key tile's backward over query tile start_m: its dS added to dk, dv -> dk, dv. MASKED=False:
    every query of the tile real and seeing every key of the tile (no causal mask, no padding); FAR
    (unmasked only): every pair LAST or more apart, the head's last entry its bias (far_bias: no gather)."""
    rm = start_m + tl.arange(0, BLOCK_M)
    m_ok = rm < TQ
    q = load_rows(Q, b, h, rm, rd, m_ok, d_ok, stride_qb, stride_qh, stride_qt)
    do = load_rows(DO, b, h, rm, rd, m_ok, d_ok, stride_dob, stride_doh, stride_dot)
    lse, delta = load_row_stats(LSE, DELTA, bh, rm, m_ok, TQ)
    if FAR:
        s = _far_scores(q, k, far_bias, scale, PRECISION)
    else:
        s, visible = _biased_scores(q, k, table_row, slope, rm, rn, m_ok, n_ok, offset, scale, LAST, PRECISION, MASKED,
                                    LINEAR)
        if MASKED:
            s = tl.where(visible & m_ok[:, None], s, float("-inf"))
    p, ds = _probabilities_and_ds(s, lse, delta, do, v, PRECISION)
    dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
    dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _distance_backward_kv(Q, K, V, TABLE, DO, LSE, DELTA, DK, DV,
                          stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_table,
                          stride_dob, stride_doh, stride_dot, stride_dqb, stride_dqh, stride_dqt,
                          stride_dkb, stride_dkh, stride_dkt, H, GROUP, TQ, TK, LAST, scale,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, LINEAR: tl.constexpr):
    """One key tile of one query head: dk, dv (per query head, summed over a group outside). DK, DV:
    per query head, laid out alike."""
    bh, b, h, offset, start_n, rn, rd, n_ok, d_ok, kv_mask, k, v = key_tile(
        K, V, H, GROUP, TQ, TK, stride_kb, stride_kh, stride_kt, HEAD_DIM, BLOCK_N, BLOCK_D)
    table_row = TABLE + h * stride_table
    slope, far_bias = _head_bias(table_row, LAST, LINEAR)

    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    # the far query tiles (every pair LAST or more apart) read no table
    lo, full_lo, near_hi, full_hi = query_walks(start_n, offset, TQ, LAST, BLOCK_M, BLOCK_N)
    for start_m in range(lo, tl.minimum(full_lo, TQ), BLOCK_M):
        dk, dv = _distance_key_tile_step(Q, DO, LSE, DELTA, table_row, slope, far_bias, b, h, bh, start_m, rn, rd,
                                         n_ok, d_ok, k, v, dk, dv, offset, TQ, LAST, scale, stride_qb, stride_qh,
                                         stride_qt, stride_dob, stride_doh, stride_dot, BLOCK_M, PRECISION, True,
                                         LINEAR, False)
    for start_m in range(full_lo, near_hi, BLOCK_M):
        dk, dv = _distance_key_tile_step(Q, DO, LSE, DELTA, table_row, slope, far_bias, b, h, bh, start_m, rn, rd,
                                         n_ok, d_ok, k, v, dk, dv, offset, TQ, LAST, scale, stride_qb, stride_qh,
                                         stride_qt, stride_dob, stride_doh, stride_dot, BLOCK_M, PRECISION, False,
                                         LINEAR, False)
    for start_m in range(near_hi, full_hi, BLOCK_M):
        dk, dv = _distance_key_tile_step(Q, DO, LSE, DELTA, table_row, slope, far_bias, b, h, bh, start_m, rn, rd,
                                         n_ok, d_ok, k, v, dk, dv, offset, TQ, LAST, scale, stride_qb, stride_qh,
                                         stride_qt, stride_dob, stride_doh, stride_dot, BLOCK_M, PRECISION, False,
                                         LINEAR, True)
    for start_m in range(tl.maximum(full_lo, full_hi), TQ, BLOCK_M):
        dk, dv = _distance_key_tile_step(Q, DO, LSE, DELTA, table_row, slope, far_bias, b, h, bh, start_m, rn, rd,
                                         n_ok, d_ok, k, v, dk, dv, offset, TQ, LAST, scale, stride_qb, stride_qh,
                                         stride_qt, stride_dob, stride_doh, stride_dot, BLOCK_M, PRECISION, True,
                                         LINEAR, False)

    out = b * stride_dkb + h * stride_dkh + rn[:, None] * stride_dkt + rd[None, :]
    tl.store(DK + out, (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _distance_backward_q(Q, K, V, TABLE, DO, LSE, O, DELTA, DQ, DTABLE,
                         stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_table,
                         stride_dob, stride_doh, stride_dot, stride_dqb, stride_dqh, stride_dqt,
                         stride_dkb, stride_dkh, stride_dkt, H, GROUP, TQ, TK, LAST, scale,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         WRAPS: tl.constexpr, TABLE_GRAD: tl.constexpr, PRECISION: tl.constexpr,
                         LINEAR: tl.constexpr):
    """One query tile: dq, over the forward's three walks; its rows' dO . O, stored in DELTA for the
    dk/dv kernel, launched after this one; and with TABLE_GRAD its pairs' share of the table's gradient,
    added into DTABLE (H, L): the far tiles' dS summed in registers, one atomic at LAST for them all,
    each near tile's by diagonal (the module docstring)."""
    bh, b, h, hk, offset, start_m, rm, rd, m_ok, d_ok = query_tile(H, GROUP, TQ, TK, HEAD_DIM, BLOCK_M, BLOCK_D)
    q = load_rows(Q, b, h, rm, rd, m_ok, d_ok, stride_qb, stride_qh, stride_qt)
    do = load_rows(DO, b, h, rm, rd, m_ok, d_ok, stride_dob, stride_doh, stride_dot)
    lse = tl.load(LSE + bh * TQ + rm, mask=m_ok, other=0.0)
    delta = row_delta(O, do, DELTA, bh, b, h, rm, rd, m_ok, d_ok, TQ, stride_dqb, stride_dqh, stride_dqt)
    table_row = TABLE + h * stride_table
    dtable_row = DTABLE + h * stride_table  # laid out as the table (made so by the caller)
    slope, far_bias = _head_bias(table_row, LAST, LINEAR)
    k_base, v_base = key_head(K, V, b, hk, stride_kb, stride_kh)

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    far_rows = tl.zeros([BLOCK_M], tl.float32)  # each row's dS summed over its far tiles
    far_end, near_end = _key_walks(offset, start_m, LAST, BLOCK_N)
    hi = tl.minimum(TK, offset + start_m + BLOCK_M)
    for start_n in range(0, far_end, BLOCK_N):
        rn, n_ok, _, k, v = load_kv(k_base, v_base, start_n, rd, d_ok, TK, stride_kt, BLOCK_N)
        s = _far_scores(q, k, far_bias, scale, PRECISION)
        _, ds = _probabilities_and_ds(s, lse, delta, do, v, PRECISION)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
        if TABLE_GRAD:  # a padded query (no log-sum-exp) may hold inf * 0 here: left out
            far_rows += tl.sum(tl.where(m_ok[:, None], ds, 0.0), 1)
    for start_n in range(far_end, near_end, BLOCK_N):
        rn, n_ok, _, k, v = load_kv(k_base, v_base, start_n, rd, d_ok, TK, stride_kt, BLOCK_N)
        s, _ = _biased_scores(q, k, table_row, slope, rm, rn, m_ok, n_ok, offset, scale, LAST, PRECISION, False, LINEAR)
        _, ds = _probabilities_and_ds(s, lse, delta, do, v, PRECISION)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
        if TABLE_GRAD:
            _add_diagonal_sums(tl.where(m_ok[:, None], ds, 0.0), dtable_row, offset + start_m - start_n, TK, LAST,
                               BLOCK_M, BLOCK_N, WRAPS)
    for start_n in range(near_end, hi, BLOCK_N):
        rn, n_ok, _, k, v = load_kv(k_base, v_base, start_n, rd, d_ok, TK, stride_kt, BLOCK_N)
        s, visible = _biased_scores(q, k, table_row, slope, rm, rn, m_ok, n_ok, offset, scale, LAST, PRECISION, True,
                                    LINEAR)
        s = tl.where(visible & m_ok[:, None], s, float("-inf"))
        _, ds = _probabilities_and_ds(s, lse, delta, do, v, PRECISION)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
        if TABLE_GRAD:
            _add_diagonal_sums(ds, dtable_row, offset + start_m - start_n, TK, LAST, BLOCK_M, BLOCK_N, WRAPS)
    if TABLE_GRAD:
        # nothing reads the gradient before the kernel ends: no ordering needed
        tl.atomic_add(dtable_row + LAST, tl.sum(far_rows, 0), mask=far_end > 0, sem="relaxed")

    out = b * stride_dqb + h * stride_dqh + rm[:, None] * stride_dqt + rd[None, :]
    tl.store(DQ + out, (dq * scale).to(DQ.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


def _last(table: Tensor, Tk: int, linear: bool) -> int:
    """LAST, the kernels' farthest distance with an entry of its own: the table's last, or with a slope
    per head (linear) Tk, farther than any pair, so no key tile is walked as far."""
    return Tk if linear else table.shape[1] - 1


def _run_forward(q: Tensor, k: Tensor, v: Tensor, table: Tensor, block_m: int | None, block_n: int | None,
                 num_warps: int | None, linear: bool) -> tuple[Tensor, Tensor]:
    """-> (out, each query's log-sum-exp (B, H, Tq) float32); q, k, v as _launch.kernel_layout leaves
    them, table contiguous ((H, 1) slopes where linear), all checked."""
    B, H, Tq, Dh = q.shape
    Hk, Tk = k.shape[1], k.shape[2]
    tiles = launch_tiles(FORWARD_TILES, q, block_m, block_n, num_warps, INTERPRETED)
    o, lse = softmax_outputs(q)
    _distance_forward[(triton.cdiv(Tq, tiles.block_m), B * H)](
        q, k, v, table, o, lse,
        *q.stride()[:3], *k.stride()[:3], table.stride(0), *o.stride()[:3],
        H, H // Hk, Tq, Tk, _last(table, Tk, linear), 1.0 / math.sqrt(Dh),
        PRECISION=dot_precision(q.dtype, INTERPRETED), LINEAR=linear, **tile_constexprs(q, tiles))
    return o, lse


def _run_backward(q: Tensor, k: Tensor, v: Tensor, table: Tensor, block_m: int | None, block_n: int | None,
                  num_warps: int | None, linear: bool, o: Tensor, lse: Tensor, do: Tensor,
                  needs: list[bool]) -> list[Tensor]:
    """-> dq, dk, dv (_ops.split_backward_outputs, dk and dv through _launch.input_gradient), d table (an empty one
    where needs[3] is false: a fixed table, ALiBi's, skips its gather and atomics; and fixed slopes)."""
    B, H, Tq, Dh = q.shape
    Hk, Tk = k.shape[1], k.shape[2]
    delta, dq, dk, dv = split_backward_outputs(q, k)
    table_grad = needs[3] and not linear
    # the atomics add into it; distances past Tk - 1 short of the last entry stay 0 (no pair reads them)
    dtable = torch.zeros_like(table) if table_grad else table.new_empty(0)
    common = (*q.stride()[:3], *k.stride()[:3], table.stride(0), *do.stride()[:3], *dq.stride()[:3], *dk.stride()[:3],
              H, H // Hk, Tq, Tk, _last(table, Tk, linear), 1.0 / math.sqrt(Dh))
    precision = dot_precision(q.dtype, INTERPRETED)
    rows = launch_tiles(BACKWARD_Q_TILES, q, block_m, block_n, num_warps, INTERPRETED)
    _distance_backward_q[(triton.cdiv(Tq, rows.block_m), B * H)](
        q, k, v, table, do, lse, o, delta, dq, dtable, *common,
        WRAPS=(rows.block_m + rows.block_n - 2) // rows.block_m + 1, TABLE_GRAD=table_grad, PRECISION=precision,
        LINEAR=linear, **tile_constexprs(q, rows))
    kv = launch_tiles(BACKWARD_KV_TILES, q, block_m, block_n, num_warps, INTERPRETED)
    _distance_backward_kv[(triton.cdiv(Tk, kv.block_n), B * H)](
        q, k, v, table, do, lse, delta, dk, dv, *common, PRECISION=precision, LINEAR=linear, **tile_constexprs(q, kv))
    return [dq, input_gradient(dk, k), input_gradient(dv, v), dtable]


# the two public functions' ops (torch.library reads each op's schema off its function's annotations)
def _forward(q: Tensor, k: Tensor, v: Tensor, table: Tensor, block_m: int | None, block_n: int | None,
             num_warps: int | None) -> tuple[Tensor, Tensor]:
    return _run_forward(q, k, v, table, block_m, block_n, num_warps, False)


def _backward(q: Tensor, k: Tensor, v: Tensor, table: Tensor, block_m: int | None, block_n: int | None,
              num_warps: int | None, o: Tensor, lse: Tensor, do: Tensor, needs: list[bool]) -> list[Tensor]:
    return _run_backward(q, k, v, table, block_m, block_n, num_warps, False, o, lse, do, needs)


def _linear_forward(q: Tensor, k: Tensor, v: Tensor, slopes: Tensor, block_m: int | None, block_n: int | None,
                    num_warps: int | None) -> tuple[Tensor, Tensor]:
    return _run_forward(q, k, v, slopes, block_m, block_n, num_warps, True)


def _linear_backward(q: Tensor, k: Tensor, v: Tensor, slopes: Tensor, block_m: int | None, block_n: int | None,
                     num_warps: int | None, o: Tensor, lse: Tensor, do: Tensor, needs: list[bool]) -> list[Tensor]:
    return _run_backward(q, k, v, slopes, block_m, block_n, num_warps, True, o, lse, do, needs)


_distance = fused_function("distance_attention", _forward, softmax_outputs, _backward, tensors=4)
_linear_distance = fused_function("linear_distance_attention", _linear_forward, softmax_outputs, _linear_backward,
                                  tensors=4)


def distance_attention(q: Tensor, k: Tensor, v: Tensor, table: Tensor, block_m: int | None = None,
                       block_n: int | None = None, num_warps: int | None = None) -> Tensor:
    """Causal softmax attention adding table[h, i - j], fused: no (Tq, Tk) tensor.

    q (B, H, Tq, Dh): the last Tq of the Tk positions (Tq == Tk in training);
    k, v (B, Hk, Tk, Dh), Hk dividing H (grouped-query attention: query head h reads key head
    h // (H // Hk)); q, k, v in float32, bfloat16 or float16, one dtype;
    table (H, L) float32: query head h's bias at distances 0..L-1 (a scheme's
    ``distance_bias(layer, arange(L))``), table[h, L - 1] also at every farther distance: L >= Tk,
    or fewer where the bias stops changing (the far key tiles then gather nothing)
    -> out (B, H, Tq, Dh) in q's dtype, laid out as (B, Tq, H, Dh) (_launch.token_major).

    Differentiable in q, k, v and table (the table's gradient through float32 atomics, one per
    diagonal of each tile: not bit-for-bit deterministic on CUDA; not computed for a table that
    needs none, such as ALiBi's). block_m / block_n / num_warps:
    tile sizes (powers of two, >= 16) and warps for every kernel of the call, each kernel's own
    where not given (FORWARD_TILES...: _launch.launch_tiles). CUDA tensors, or any under
    TRITON_INTERPRET=1 (set before this module is imported).
    """
    B, H, Hk, Tq, Tk, Dh = check_qkv(q, k, v)
    if table.dim() != 2 or table.shape[0] != H or table.shape[1] < 1 or table.dtype != torch.float32:
        raise RelposError(f"table must be (H, L) = ({H}, >= 1) in float32 (the bias of distances 0..L-1 per query "
                          f"head, the last entry also that of farther ones); got {tuple(table.shape)} {table.dtype}")
    check_device(INTERPRETED, q, k, v, table)
    return _distance(q, k, v, table.contiguous(), block_m, block_n, num_warps)


def linear_distance_attention(q: Tensor, k: Tensor, v: Tensor, slopes: Tensor, block_m: int | None = None,
                              block_n: int | None = None, num_warps: int | None = None) -> Tensor:
    """Causal softmax attention adding slopes[h] * (i - j), fused, the bias computed per score: one
    multiply where distance_attention reads a table (ALiBi's bias, slopes = -m_h; a scheme's
    ``linear_distance_slopes``). Nothing is gathered, and no key tile is far.

    q, k, v as distance_attention's; slopes (H,) float32, fixed: q, k and v get gradients, the slopes
    none (a RelposError for slopes that record one: a learned bias trains through distance_attention's
    table) -> out (B, H, Tq, Dh) in q's dtype, laid out as (B, Tq, H, Dh) (_launch.token_major).
    block_m / block_n / num_warps as distance_attention's.
    """
    B, H, Hk, Tq, Tk, Dh = check_qkv(q, k, v)
    if slopes.shape != (H,) or slopes.dtype != torch.float32:
        raise RelposError(f"slopes must be ({H},) in float32 (the bias per unit of distance of each query head); "
                          f"got {tuple(slopes.shape)} {slopes.dtype}")
    if slopes.requires_grad:
        raise RelposError("linear_distance_attention takes fixed slopes and gives them no gradient; a learned "
                          "linear bias trains through distance_attention's table")
    check_device(INTERPRETED, q, k, v, slopes)
    return _linear_distance(q, k, v, slopes.reshape(H, 1).contiguous(), block_m, block_n, num_warps)
