"""The tile prologues the fused kernels share: which (batch, head) and tile a program owns, and the
loads of its rows of q (or dO), its row statistics and a key tile's k and v; where a query tile's
key tiles stop being walked without the causal mask, and where a key tile's query tiles split
(FlashAttention-2's dk/dv program); and FlashAttention-2's online-softmax step.

For the kernels that run one program per tile of one (batch, query head), grid axis 1 being
batch * H + head (relpos_cli/kernels/dape.py's programs own all heads and read their own tiles).
Imported by the kernel modules only (it imports triton): triton.jit reads TRITON_INTERPRET when
these helpers are defined, on the first kernel module's import, as it does for the kernels.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _program_head(H, GROUP, TQ, TK):
    """-> bh (grid axis 1), b, h, the key head hk that query head h reads (grouped-query attention)
    and offset = TK - TQ (query i sits at position offset + i)."""
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUP
    offset = TK - TQ
    return bh, b, h, hk, offset


@triton.jit
def query_tile(H, GROUP, TQ, TK, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """A program of a grid (query tiles, B * H) -> bh, b, h, hk, offset (_program_head), start_m,
    rm (BLOCK_M,) its queries, rd (BLOCK_D,), m_ok (BLOCK_M,) rm < TQ, d_ok (BLOCK_D,) rd < HEAD_DIM."""
    bh, b, h, hk, offset = _program_head(H, GROUP, TQ, TK)
    start_m = tl.program_id(0) * BLOCK_M
    rm = start_m + tl.arange(0, BLOCK_M)
    rd = tl.arange(0, BLOCK_D)
    return bh, b, h, hk, offset, start_m, rm, rd, rm < TQ, rd < HEAD_DIM


@triton.jit
def load_rows(X, b, h, rm, rd, m_ok, d_ok, stride_qb, stride_qh, stride_qt):
    """Rows rm of (b, h) of X laid out as q (B, H, Tq, Dh) -> (BLOCK_M, BLOCK_D), 0 outside."""
    return tl.load(X + b * stride_qb + h * stride_qh + rm[:, None] * stride_qt + rd[None, :],
                   mask=m_ok[:, None] & d_ok[None, :], other=0.0)


@triton.jit
def load_row_stats(LSE, DELTA, bh, rm, m_ok, TQ):
    """Rows rm of (B * H, Tq) float32 LSE and DELTA (dO_i . out_i) -> lse, delta (BLOCK_M,), 0 outside."""
    lse = tl.load(LSE + bh * TQ + rm, mask=m_ok, other=0.0)
    delta = tl.load(DELTA + bh * TQ + rm, mask=m_ok, other=0.0)
    return lse, delta


@triton.jit
def row_delta(O, do, DELTA, bh, b, h, rm, rd, m_ok, d_ok, TQ, stride_b, stride_h, stride_t):
    """FlashAttention-2's D_i = dO_i . O_i of rows rm, float32 (BLOCK_M,), 0 outside: from the program's
    rows of dO (do, loaded) and of the forward's output O, read with the strides given (dq's: dq and O are
    both _launch.token_major of q's shape); stored in DELTA (B * H, Tq) for the key-tile program launched
    after the query-tile program that computes it. Computed where a backward program holds its rows of
    dO, not by a kernel of its own before it (relpos_cli/kernels/output_grad.py): one launch fewer a
    layer and step."""
    o = load_rows(O, b, h, rm, rd, m_ok, d_ok, stride_b, stride_h, stride_t)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + bh * TQ + rm, delta, mask=m_ok)
    return delta


@triton.jit
def key_tile_state(bh, tile, TQ, TK, BLOCK_N: tl.constexpr):
    """Where key tile `tile`'s entries of (bh, Tq) start in a (B * H, cdiv(Tk, BLOCK_N), Tq) tensor of
    per-row state at each key tile's end, which a query-tile program stores for the key-tile program
    (stick-breaking's spent stick, CoPE's gate counts): + rm for rows rm."""
    return (bh * tl.cdiv(TK, BLOCK_N) + tile) * TQ


# key tiles walked between two of some_row_below's checks: the walk that may stop is a `while` over these
# chunks, each a `for` loop, which Triton software-pipelines (a `while` loop, or an `if` around a tile's
# work, it does not: compiled for sm_90 the loads then wait each tile, and float32 tiles spill)
STOP_CHECK_TILES = tl.constexpr(4)


@triton.jit
def some_row_below(x, m_ok, bound):
    """Whether a query of the tile (m_ok) holds x (BLOCK_M,) below bound, a scalar: the walks from the
    nearest key tile (stick-breaking's spent stick, CoPE's gate count) do their full arithmetic while
    one does, and past that every key left gives each query the same (nothing, or Z[i, P - 1])."""
    return tl.min(tl.where(m_ok, x, float("inf")), 0) < bound


@triton.jit
def unmasked_key_end(offset, start_m, BLOCK_N: tl.constexpr):
    """The end of a query tile's key tiles that lie wholly at or before its first query (position
    offset + start_m): every pair of them visible, every key inside Tk, so walked without a mask;
    the tiles from there to the tile's last query hold the diagonal and are masked (FlashAttention's
    split: per score, the mask's compare and select cost as much as the bias)."""
    return (offset + start_m + 1) // BLOCK_N * BLOCK_N


@triton.jit
def query_walks(start_n, offset, TQ, LAST, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Where a key tile's walks over the query tiles split (FlashAttention-2's dk/dv program; the
    query tiles as the forward tiles them) -> lo, full_lo, near_hi, full_hi. [lo, full_lo): the tiles on
    the diagonal, from the first holding a query that sees key start_n, masked; [full_lo, near_hi):
    tiles whose every query sees every key of the tile and none is padding, unmasked; [near_hi,
    full_hi): those whose every pair is also LAST or more apart (a bias that stops changing there: a
    distance table's last entry, Shaw's column 0); [max(full_lo, full_hi), TQ): the last, partial tile,
    masked (a padded query has no log-sum-exp: its logit would be exponentiated unmasked)."""
    lo = (tl.maximum(start_n - offset, 0) // BLOCK_M) * BLOCK_M
    far = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 + LAST - offset, 0), BLOCK_M) * BLOCK_M
    full_lo = tl.maximum(tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - offset, 0), BLOCK_M) * BLOCK_M, lo)
    full_hi = TQ // BLOCK_M * BLOCK_M
    near_hi = tl.maximum(tl.minimum(far, full_hi), full_lo)
    return lo, full_lo, near_hi, full_hi


@triton.jit
def key_head(K, V, b, hk, stride_kb, stride_kh):
    """Pointers to key head hk of batch b in K and V, (B, Hk, Tk, Dh) -> k_base, v_base (load_kv)."""
    return K + b * stride_kb + hk * stride_kh, V + b * stride_kb + hk * stride_kh


@triton.jit
def load_kv(k_base, v_base, start_n, rd, d_ok, TK, stride_kt, BLOCK_N: tl.constexpr):
    """Keys start_n.. of one key head (k_base, v_base at its (b, hk)) -> rn (BLOCK_N,), n_ok (BLOCK_N,)
    rn < TK, kv_mask (BLOCK_N, BLOCK_D), k, v (BLOCK_N, BLOCK_D), 0 outside."""
    rn = start_n + tl.arange(0, BLOCK_N)
    n_ok = rn < TK
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k = tl.load(k_base + rn[:, None] * stride_kt + rd[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_base + rn[:, None] * stride_kt + rd[None, :], mask=kv_mask, other=0.0)
    return rn, n_ok, kv_mask, k, v


@triton.jit
def key_tile(K, V, H, GROUP, TQ, TK, stride_kb, stride_kh, stride_kt,
             HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """A program of a grid (key tiles, B * H), one key tile of one query head -> bh, b, h, offset
    (_program_head), start_n, rn, rd, n_ok, d_ok, kv_mask, and its keys' k, v (load_kv)."""
    bh, b, h, hk, offset = _program_head(H, GROUP, TQ, TK)
    start_n = tl.program_id(0) * BLOCK_N
    rd = tl.arange(0, BLOCK_D)
    d_ok = rd < HEAD_DIM
    k_base, v_base = key_head(K, V, b, hk, stride_kb, stride_kh)
    rn, n_ok, kv_mask, k, v = load_kv(k_base, v_base, start_n, rd, d_ok, TK, stride_kt, BLOCK_N)
    return bh, b, h, offset, start_n, rn, rd, n_ok, d_ok, kv_mask, k, v


@triton.jit
def online_softmax_step(m_i, l_i, acc, s, v, PRECISION: tl.constexpr):
    """FlashAttention-2's update of a query tile by one key tile: running max m_i and sum l_i
    (BLOCK_M,), accumulator acc (BLOCK_M, BLOCK_D), the tile's logits s (BLOCK_M, BLOCK_N) (-inf where
    not visible; m_i finite once a row has seen a key) and values v (BLOCK_N, BLOCK_D) -> m_i, l_i, acc."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc
