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
FlashAttention-2's online softmax, the log-sum-exp stored.

Backward, per query tile, with dS_ij = P_ij (dO_i . v_j - dO_i . out_i) (softmax) and
dp_ij = dS_ij (Z[i, ceil] - Z[i, floor]) (dcount below; floor and ceil carry no gradient; above
P - 1 the clamp passes none, and there floor = ceil = P - 1 makes the difference 0):

    dz_it = dS_it + g_it (1 - g_it) sum_{j <= t} dp_ij,   dZ[i, floor] += dS (1 - w),   dZ[i, ceil] += dS w

sum_{j <= t} runs over the farther keys, which the nearest-first walk reaches last, so the backward
walks twice: the first walk sums each row's dp (and adds dv = P^T dO), the second takes
sum_{j <= t} dp_ij = total_i - sum_{j > t} dp_ij with the nearer sum carried. A count is never formed
as a difference (row total of gates minus a prefix): at long rows that would cost float32 the
count's fraction, which is the interpolation weight. dk, dv go through float32 atomics (several
query tiles read one key tile); dZ through atomics into the program's own rows (several keys of a
tile share an index), except the saturated keys (count clamped at P - 1, all reading Z[i, P - 1]),
summed per row in registers and added once.

Written for relpos after the paper's Appendix B (Golovneva et al. 2024, "Contextual Position
Encoding: Learning to Count What's Important") and x-transformers' ``CoPE`` (MIT), in the same walk
as relpos_cli/kernels/stickbreaking.py: the same mathematics, not their code.

Precision: counts, weights and logits are float32 whatever the inputs' dtype, and Z is read into
float32; dO_i . out_i is taken from the output in q's dtype (as FlashAttention-2 does). fp32 tiles
use TF32 dots only where torch allows TF32 matmuls (relpos_cli/kernels/_launch.dot_precision).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from relpos_cli.errors import RelposError
from relpos_cli.kernels._launch import KernelTiles, Tiles, check_device, check_qkv, interpreting, padded_head_dim
from relpos_cli.kernels._row_table import atomic_backward, row_table_attention
from relpos_cli.kernels._tiles import key_head, load_rows, online_softmax_step, query_tile, row_delta

INTERPRETED = interpreting()  # fixed when the kernels below are defined (triton.jit reads it then)
# _launch.KernelTiles of the forward and the backward: both carry each query's gate count and the
# gates' tiles besides the scores; the forward spills at 128 x 64 even with 8 warps, the backward
# (two walks, dk, dv and the table's gradient) at 64 x 32; 64 queries a program (64 x 16 fits) add
# half the atomics into dk and dv that 32 would
FORWARD_TILES = KernelTiles(narrow=Tiles(64, 64, 8), wide=Tiles(32, 32, 8))
BACKWARD_TILES = KernelTiles(narrow=Tiles(64, 16, 8), wide=Tiles(32, 32, 8))


@triton.jit
def _cope_tile(q, k_base, z_row, start_n, rm, rd, m_ok, d_ok, acc_g, stride_kt, scale, offset, TK, MAX_POS,
               BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """One key tile against the query tile: the key tile, z, the visible mask, the gates, the
    unclamped counts, the interpolation weight, the gathered Z[i, floor] and Z[i, ceil], their
    offsets in the row, and the key offsets."""
    rn = start_n + tl.arange(0, BLOCK_N)
    n_ok = rn < TK
    k = tl.load(k_base + rn[:, None] * stride_kt + rd[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
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
    return k, z, visible, g, count, w, z_lo, z_hi, lo_idx, hi_idx, rn, n_ok


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
    for t in range(0, n_tiles):
        start_n = (n_tiles - 1 - t) * BLOCK_N  # nearest tile first
        k, z, visible, g, count, w, z_lo, z_hi, lo_idx, hi_idx, rn, n_ok = _cope_tile(
            q, k_base, z_row, start_n, rm, rd, m_ok, d_ok, acc_g, stride_kt, scale, offset, TK, MAX_POS,
            BLOCK_N, PRECISION)
        v = tl.load(v_base + rn[:, None] * stride_kt + rd[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        s = tl.where(visible, z + (1.0 - w) * z_lo + w * z_hi, float("-inf"))
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s, v, PRECISION)
        acc_g += tl.sum(g, 1)

    l_i = tl.where(m_ok, l_i, 1.0)  # rows past the last query: nothing stored, no 0/0 either
    acc = acc / l_i[:, None]
    tl.store(O + b * stride_ob + h * stride_oh + rm[:, None] * stride_ot + rd[None, :], acc.to(O.dtype.element_ty),
             mask=q_mask)
    tl.store(LSE + bh * TQ + rm, m_i + tl.log(l_i), mask=m_ok)


@triton.jit
def _cope_tile_grad(q, do, lse, delta, k_base, v_base, z_row, start_n, rm, rd, m_ok, d_ok, acc_g,
                    stride_kt, scale, offset, TK, MAX_POS, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """One key tile of the backward: what _cope_tile gives (less z and the gathered values), the
    probabilities P, dS and d count."""
    k, z, visible, g, count, w, z_lo, z_hi, lo_idx, hi_idx, rn, n_ok = _cope_tile(
        q, k_base, z_row, start_n, rm, rd, m_ok, d_ok, acc_g, stride_kt, scale, offset, TK, MAX_POS,
        BLOCK_N, PRECISION)
    v = tl.load(v_base + rn[:, None] * stride_kt + rd[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    s = tl.where(visible, z + (1.0 - w) * z_lo + w * z_hi, float("-inf"))
    p = tl.exp(s - lse[:, None])
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    ds = p * (dp - delta[:, None])  # d logits
    # d count through the interpolation; the clamp needs no mask of its own: a count at P - 1 or
    # above gathers Z[i, P - 1] twice, so z_hi - z_lo is exactly 0 there
    dcount = ds * (z_hi - z_lo)
    return k, visible, g, count, w, lo_idx, hi_idx, rn, n_ok, p, ds, dcount


@triton.jit
def _cope_backward(Q, K, V, Z, DO, LSE, O, DQ, DK, DV, DZ,
                   stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                   stride_dob, stride_doh, stride_dot, stride_dqb, stride_dqh, stride_dqt,
                   H, GROUP, TQ, TK, MAX_POS, scale,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   PRECISION: tl.constexpr):
    bh, b, h, hk, offset, start_m, rm, rd, m_ok, d_ok = query_tile(H, GROUP, TQ, TK, HEAD_DIM, BLOCK_M, BLOCK_D)
    q_mask = m_ok[:, None] & d_ok[None, :]
    q = load_rows(Q, b, h, rm, rd, m_ok, d_ok, stride_qb, stride_qh, stride_qt)
    do = load_rows(DO, b, h, rm, rd, m_ok, d_ok, stride_dob, stride_doh, stride_dot)
    lse = tl.load(LSE + bh * TQ + rm, mask=m_ok, other=0.0)
    delta = row_delta(O, do, b, h, rm, rd, m_ok, d_ok, stride_dqb, stride_dqh, stride_dqt)  # = sum_j P_ij dP_ij
    z_row = Z + (bh * TQ + rm[:, None]) * MAX_POS
    dz_row = DZ + (bh * TQ + rm[:, None]) * MAX_POS  # float32 (B, H, Tq, P), zeroed by the caller
    k_base, v_base = key_head(K, V, b, hk, stride_kb, stride_kh)
    kv_grad = (b * (H // GROUP) + hk) * TK * HEAD_DIM  # (B, Hk, Tk, Dh) float32 buffers
    n_tiles = tl.cdiv(tl.minimum(TK, offset + start_m + BLOCK_M), BLOCK_N)

    # first walk: each row's sum of dcount over all its keys, and dv
    acc_g = tl.zeros([BLOCK_M], tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    for t in range(0, n_tiles):
        start_n = (n_tiles - 1 - t) * BLOCK_N
        k, visible, g, count, w, lo_idx, hi_idx, rn, n_ok, p, ds, dcount = _cope_tile_grad(
            q, do, lse, delta, k_base, v_base, z_row, start_n, rm, rd, m_ok, d_ok, acc_g,
            stride_kt, scale, offset, TK, MAX_POS, BLOCK_N, PRECISION)
        dv = tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
        tl.atomic_add(DV + kv_grad + rn[:, None] * HEAD_DIM + rd[None, :], dv, mask=n_ok[:, None] & d_ok[None, :])
        total += tl.sum(dcount, 1)
        acc_g += tl.sum(g, 1)

    # second walk: sum_{j <= t} dcount_ij = total_i - sum_{j > t} dcount_ij, the nearer keys' sum carried
    acc_g = tl.zeros([BLOCK_M], tl.float32)
    acc_dcount = tl.zeros([BLOCK_M], tl.float32)
    dz_last = tl.zeros([BLOCK_M], tl.float32)  # dZ[i, P - 1] from the saturated keys
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for t in range(0, n_tiles):
        start_n = (n_tiles - 1 - t) * BLOCK_N
        k, visible, g, count, w, lo_idx, hi_idx, rn, n_ok, p, ds, dcount = _cope_tile_grad(
            q, do, lse, delta, k_base, v_base, z_row, start_n, rm, rd, m_ok, d_ok, acc_g,
            stride_kt, scale, offset, TK, MAX_POS, BLOCK_N, PRECISION)
        nearer = tl.cumsum(dcount, axis=1, reverse=True) - dcount + acc_dcount[:, None]  # sum over j > t
        dg = total[:, None] - nearer
        dz = tl.where(visible, ds + dg * g * (1.0 - g), 0.0)
        dq += tl.dot(dz.to(k.dtype), k, input_precision=PRECISION)
        dk = tl.dot(tl.trans(dz.to(q.dtype)), q, input_precision=PRECISION) * scale
        tl.atomic_add(DK + kv_grad + rn[:, None] * HEAD_DIM + rd[None, :], dk, mask=n_ok[:, None] & d_ok[None, :])
        # a saturated count (at P - 1 or above; at exactly P - 1 floor = ceil = P - 1 too) reads Z[i, P - 1]
        saturated = count >= MAX_POS - 1
        free = visible & (count < MAX_POS - 1)
        tl.atomic_add(dz_row + lo_idx, ds * (1.0 - w), mask=free)
        tl.atomic_add(dz_row + hi_idx, ds * w, mask=free)
        dz_last += tl.sum(tl.where(saturated & visible, ds, 0.0), 1)
        acc_dcount += tl.sum(dcount, 1)
        acc_g += tl.sum(g, 1)

    tl.store(DQ + b * stride_dqb + h * stride_dqh + rm[:, None] * stride_dqt + rd[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=q_mask)
    # an atomic too: the walk's atomics may have added to the same entries from other threads
    tl.atomic_add(DZ + (bh * TQ + rm) * MAX_POS + MAX_POS - 1, dz_last, mask=m_ok)


def _max_positions(columns: int) -> int:
    """The kernels' MAX_POS: the table's last dimension, P, as it is."""
    return columns


# triton 3.6 (the GPU machine's) cannot compile the backward software-pipelined at a padded head size of 16
# with 16-bit q and the float32 table CoPE.kernel_inputs gives ("Fatal pipeliner error", "PassManager::run
# failed"; found on an H200, reproduced by tests/kernel_compile_probe.py --head-dim 16 with triton 3.6): it
# runs unpipelined there, as every float32 kernel does (_launch.pipeline_stages)
_cope = row_table_attention(
    "cope_attention", lambda: _cope_forward, FORWARD_TILES, _max_positions, INTERPRETED,
    atomic_backward(lambda: _cope_backward, BACKWARD_TILES, _max_positions, INTERPRETED,
                    stages=lambda q: 1 if padded_head_dim(q.shape[-1]) == 16 else None))


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

    Differentiable in q, k, v and per_position (dk, dv and dper_position through float32 atomics:
    not bit-for-bit deterministic on CUDA). block_m / block_n / num_warps: tile sizes (powers of two,
    >= 16) and warps for the call's kernels, FORWARD_TILES and BACKWARD_TILES where not given
    (_launch.launch_tiles). CUDA tensors, or any under TRITON_INTERPRET=1 (set before this module is
    imported).
    """
    B, H, _, Tq, _, _ = check_qkv(q, k, v)
    if (per_position.dim() != 4 or tuple(per_position.shape[:3]) != (B, H, Tq) or per_position.shape[3] < 2
            or per_position.dtype not in (torch.float32, q.dtype)):
        raise RelposError(f"per_position must be (B, H, Tq, P) = {(B, H, Tq)} + (P >= 2,) in float32 or q's "
                          f"{q.dtype}; got {tuple(per_position.shape)} {per_position.dtype}")
    check_device(INTERPRETED, q, k, v, per_position)
    return _cope(q, k, v, per_position.contiguous(), block_m, block_n, num_warps)
