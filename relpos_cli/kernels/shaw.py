"""Shaw et al.'s relative position representations (keys only) as one fused Triton kernel: forward
and backward, no (T, T) tensor.

What it computes (relpos_cli/positions/shaw.py, ``Shaw.content_bias``), for query i (the last Tq of
the Tk positions, at position Tk - Tq + i) and key j <= i, with K = max_distance = (P - 1) / 2:

    logits_ij = q_i . k_j / sqrt(Dh) + Z[i, K - min(i - j, K)],   out_i = softmax_j(logits_i) @ v

with Z = per_distance (B, H, Tq, P = 2K + 1) = q @ table[layer].T / sqrt(Dh), formed by the caller
(so autograd takes Z's gradient on to q and the table); the kernel returns dZ with dq, dk, dv. This
is the causal half of Shaw's column clip(j - i, -K, K) + K: columns K + 1..2K (keys after the query)
are never read and get a zero gradient.

Forward: one program per tile of BLOCK_M queries walks the key tiles up to the diagonal with
FlashAttention-2's online softmax and stores each query's log-sum-exp. Every key K or more before
its query reads column 0, so the key tiles that lie that far from the tile's first query (hence
from all its queries) are walked first without any gather: each row's Z[i, 0] is read once. The
tiles nearer the diagonal gather Z[i, K - min(i - j, K)] per score.

Backward, FlashAttention-2's split, with dS_ij = P_ij (dO_i . v_j - dO_i . out_i). First one program
per query tile, the forward's two walks: dq in registers; dZ[i, 0] = sum over the far keys of dS_ij,
summed per row in registers and stored once; dZ[i, c] for c = 1..K is the share of the single key
at distance K - c, so it is scattered with plain stores, no atomics (one writer per entry: dZ is
deterministic); and each row's dO . out, stored for the second. Then one program per key tile of
one query head for dk and dv, in registers, over the query tiles that see it
(_tiles.query_walks): the tiles on the diagonal and the last, partial one masked; the unmasked
ones gathering Z[i, K - min(i - j, K)] per score as the forward does, until the query tiles whose
every query is K or more after every key of the tile, which read each row's Z[i, 0]. Under
grouped-query attention dk, dv are per query head, summed over a group after. The backward first
ran as one program per query tile adding dk, dv with float32 atomics for every key tile it visited
(about 10^8 atomic adds a layer at 8 x 12 heads x 1,024 with 64 x 32 tiles; 12.1 ms a training
step in the sixth run's profile on an H200, 12 layers, 0b1c743): the split has none.

Written for relpos after Shaw et al. 2018 ("Self-Attention with Relative Position Representations",
section 3.3, the q @ R^T form Tensor2Tensor's ``_relative_attention_inner`` computes), in the walk of
relpos_cli/kernels/cope.py: the same mathematics, not their code.

Precision: logits are float32 whatever the inputs' dtype, and Z is read into float32; dO_i . out_i
is taken from the output in q's dtype (as FlashAttention-2 does). fp32 tiles use TF32 dots only
where torch allows TF32 matmuls (relpos_cli/kernels/_launch.dot_precision).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from relpos_cli.errors import RelposError
from relpos_cli.kernels._launch import (KernelTiles, Tiles, check_device, check_qkv, dot_precision, input_gradient,
                                        interpreting, launch_tiles, tile_constexprs)
from relpos_cli.kernels._ops import split_backward_outputs
from relpos_cli.kernels._row_table import row_table_attention
from relpos_cli.kernels._tiles import (key_head, key_tile, load_kv, load_row_stats, load_rows, online_softmax_step,
                                       query_tile, query_walks, row_delta)

INTERPRETED = interpreting()  # fixed when the kernels below are defined (triton.jit reads it then)
# _launch.KernelTiles of the forward and the backward's two programs. Compiled for sm_90 in bf16
# (tests/kernel_compile_probe.py, triton 3.9) at head size 64: the query-tile program holds 229 registers
# at 64 x 64 with 8 warps, the key-tile program 246, neither spilling (the key-tile program spills 96 bytes
# at 64 x 64 with 4 warps, 80 at 128 x 64 with 8); at head size 128 the key-tile program spills at 64 x 32
# and 32 x 64, not at 32 x 32. In float32 at head size 64 the query-tile program spills 472 bytes at 64 x 32
# with triton 3.6 (the GPU machine's) and none at 32 x 32 (8 bytes with 3.9). With triton 3.6 the narrow
# tiles spill nothing either (197 and 255 registers). Untimed on a GPU.
FORWARD_TILES = KernelTiles(narrow=Tiles(128, 64, 8), wide=Tiles(32, 32, 8))
BACKWARD_Q_TILES = KernelTiles(narrow=Tiles(64, 64, 8), wide=Tiles(32, 32, 8))
BACKWARD_KV_TILES = KernelTiles(narrow=Tiles(64, 64, 8), wide=Tiles(32, 32, 8))


@triton.jit
def _shaw_tile(q, k_base, v_base, z_row, z_far, start_n, rm, rd, m_ok, d_ok, stride_kt, scale, offset, TK, MAX_DIST,
               FAR: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """One key tile against the query tile: k, v, the logits (-inf where not visible), the visible
    mask, each pair's distance i - j, and the key offsets. FAR: every key of the tile is K or more
    before every query, so the bias is the row's Z[i, 0] (z_far) and nothing is gathered."""
    rn, n_ok, _, k, v = load_kv(k_base, v_base, start_n, rd, d_ok, TK, stride_kt, BLOCK_N)
    z = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    distance = rm[:, None] + offset - rn[None, :]
    if FAR:
        visible = m_ok[:, None] & n_ok[None, :]  # a far tile lies wholly before the queries: only padding rows hide
        s = tl.where(visible, z + z_far[:, None], float("-inf"))
    else:
        visible = (distance >= 0) & n_ok[None, :] & m_ok[:, None]
        column = MAX_DIST - tl.minimum(distance, MAX_DIST)
        bias = tl.load(z_row + column, mask=visible, other=0.0).to(tl.float32)
        s = tl.where(visible, z + bias, float("-inf"))
    return k, v, s, visible, distance, rn


@triton.jit
def _shaw_forward(Q, K, V, Z, O, LSE,
                  stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_ob, stride_oh, stride_ot,
                  H, GROUP, TQ, TK, MAX_DIST, scale,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  PRECISION: tl.constexpr):
    bh, b, h, hk, offset, start_m, rm, rd, m_ok, d_ok = query_tile(H, GROUP, TQ, TK, HEAD_DIM, BLOCK_M, BLOCK_D)
    q_mask = m_ok[:, None] & d_ok[None, :]
    q = load_rows(Q, b, h, rm, rd, m_ok, d_ok, stride_qb, stride_qh, stride_qt)
    z_row = Z + (bh * TQ + rm[:, None]) * (2 * MAX_DIST + 1)  # (B, H, Tq, P) contiguous: each query's row of Z
    z_far = tl.load(Z + (bh * TQ + rm) * (2 * MAX_DIST + 1), mask=m_ok, other=0.0).to(tl.float32)  # Z[i, 0]
    k_base, v_base = key_head(K, V, b, hk, stride_kb, stride_kh)

    # keys 0 .. offset + start_m - K are K or more before every query of the tile; whole tiles of them are far
    far_end = tl.maximum(offset + start_m - MAX_DIST + 1, 0) // BLOCK_N * BLOCK_N
    end = tl.cdiv(tl.minimum(TK, offset + start_m + BLOCK_M), BLOCK_N) * BLOCK_N
    # finite: a padding row past the last query sees no key, and -inf - -inf would make its rescaling NaN
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(0, far_end, BLOCK_N):
        k, v, s, visible, distance, rn = _shaw_tile(
            q, k_base, v_base, z_row, z_far, start_n, rm, rd, m_ok, d_ok, stride_kt, scale, offset, TK, MAX_DIST,
            True, BLOCK_N, PRECISION)
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s, v, PRECISION)
    for start_n in range(far_end, end, BLOCK_N):
        k, v, s, visible, distance, rn = _shaw_tile(
            q, k_base, v_base, z_row, z_far, start_n, rm, rd, m_ok, d_ok, stride_kt, scale, offset, TK, MAX_DIST,
            False, BLOCK_N, PRECISION)
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s, v, PRECISION)

    l_i = tl.where(m_ok, l_i, 1.0)  # rows past the last query: nothing stored, no 0/0 either
    acc = acc / l_i[:, None]
    tl.store(O + b * stride_ob + h * stride_oh + rm[:, None] * stride_ot + rd[None, :], acc.to(O.dtype.element_ty),
             mask=q_mask)
    tl.store(LSE + bh * TQ + rm, m_i + tl.log(l_i), mask=m_ok)


@triton.jit
def _shaw_query_tile_step(q, do, lse, delta, dq, dz_far, k_base, v_base, z_row, dz_row, z_far, start_n, rm, rd, m_ok,
                          d_ok, stride_kt, scale, offset, TK, MAX_DIST,
                          FAR: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """A query tile's backward over key tile start_n: stores the rows' near dZ entries; returns dq and
    each row's far share of dZ[i, 0], the tile's part added."""
    k, v, s, visible, distance, rn = _shaw_tile(
        q, k_base, v_base, z_row, z_far, start_n, rm, rd, m_ok, d_ok, stride_kt, scale, offset, TK, MAX_DIST,
        FAR, BLOCK_N, PRECISION)
    p = tl.exp(s - lse[:, None])  # 0 where not visible
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    ds = p * (dp - delta[:, None])  # d logits, which is also d bias
    dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    if FAR:
        dz_far += tl.sum(ds, 1)
    else:
        dz_far += tl.sum(tl.where(distance >= MAX_DIST, ds, 0.0), 1)
        # a near key (distance d < K) is the only key of its row at column K - d: one writer, a store
        tl.store(dz_row + MAX_DIST - distance, ds, mask=visible & (distance < MAX_DIST))
    return dq, dz_far


@triton.jit
def _shaw_backward_q(Q, K, V, Z, DO, LSE, O, DELTA, DQ, DZ,
                     stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                     stride_dob, stride_doh, stride_dot, stride_dqb, stride_dqh, stride_dqt,
                     stride_dkb, stride_dkh, stride_dkt, H, GROUP, TQ, TK, MAX_DIST, scale,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     PRECISION: tl.constexpr):
    """One query tile: dq and dZ over the forward's two walks; and its rows' dO . O, stored in DELTA for
    the dk/dv kernel, launched after this one."""
    bh, b, h, hk, offset, start_m, rm, rd, m_ok, d_ok = query_tile(H, GROUP, TQ, TK, HEAD_DIM, BLOCK_M, BLOCK_D)
    q = load_rows(Q, b, h, rm, rd, m_ok, d_ok, stride_qb, stride_qh, stride_qt)
    do = load_rows(DO, b, h, rm, rd, m_ok, d_ok, stride_dob, stride_doh, stride_dot)
    lse = tl.load(LSE + bh * TQ + rm, mask=m_ok, other=0.0)
    # delta_i = sum_j P_ij dP_ij
    delta = row_delta(O, do, DELTA, bh, b, h, rm, rd, m_ok, d_ok, TQ, stride_dqb, stride_dqh, stride_dqt)
    row = (bh * TQ + rm) * (2 * MAX_DIST + 1)
    z_row = Z + row[:, None]
    dz_row = DZ + row[:, None]  # float32 (B, H, Tq, P), zeroed by the caller: columns K + 1..2K stay 0
    z_far = tl.load(Z + row, mask=m_ok, other=0.0).to(tl.float32)
    k_base, v_base = key_head(K, V, b, hk, stride_kb, stride_kh)
    far_end = tl.maximum(offset + start_m - MAX_DIST + 1, 0) // BLOCK_N * BLOCK_N  # as in the forward
    end = tl.cdiv(tl.minimum(TK, offset + start_m + BLOCK_M), BLOCK_N) * BLOCK_N

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dz_far = tl.zeros([BLOCK_M], tl.float32)  # dZ[i, 0]: the share of every key K or more before query i
    for start_n in range(0, far_end, BLOCK_N):
        dq, dz_far = _shaw_query_tile_step(q, do, lse, delta, dq, dz_far, k_base, v_base, z_row, dz_row, z_far,
                                           start_n, rm, rd, m_ok, d_ok, stride_kt, scale, offset, TK, MAX_DIST, True,
                                           BLOCK_N, PRECISION)
    for start_n in range(far_end, end, BLOCK_N):
        dq, dz_far = _shaw_query_tile_step(q, do, lse, delta, dq, dz_far, k_base, v_base, z_row, dz_row, z_far,
                                           start_n, rm, rd, m_ok, d_ok, stride_kt, scale, offset, TK, MAX_DIST, False,
                                           BLOCK_N, PRECISION)

    tl.store(DQ + b * stride_dqb + h * stride_dqh + rm[:, None] * stride_dqt + rd[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    tl.store(DZ + row, dz_far, mask=m_ok)  # the walk's stores never touch column 0 (only near keys, columns >= 1)


@triton.jit
def _shaw_key_tile_step(Q, DO, LSE, DELTA, Z, b, h, bh, start_m, rn, rd, n_ok, d_ok, k, v, dk, dv, offset, TQ,
                        MAX_DIST, scale, stride_qb, stride_qh, stride_qt, stride_dob, stride_doh, stride_dot,
                        BLOCK_M: tl.constexpr, PRECISION: tl.constexpr, MASKED: tl.constexpr, FAR: tl.constexpr):
    """A key tile's backward over query tile start_m: its dS added to dk, dv -> dk, dv. MASKED=False:
    every query of the tile real and seeing every key of the tile (no causal mask, no padding); FAR
    (unmasked only): every pair K or more apart, each row's Z[i, 0] its bias (no gather)."""
    rm = start_m + tl.arange(0, BLOCK_M)
    m_ok = rm < TQ
    q = load_rows(Q, b, h, rm, rd, m_ok, d_ok, stride_qb, stride_qh, stride_qt)
    do = load_rows(DO, b, h, rm, rd, m_ok, d_ok, stride_dob, stride_doh, stride_dot)
    lse, delta = load_row_stats(LSE, DELTA, bh, rm, m_ok, TQ)
    z_row = Z + (bh * TQ + rm) * (2 * MAX_DIST + 1)  # (BLOCK_M,) each query's row of Z
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    if FAR:
        s += tl.load(z_row, mask=m_ok, other=0.0).to(tl.float32)[:, None]
    else:
        distance = rm[:, None] + offset - rn[None, :]
        column = z_row[:, None] + MAX_DIST - tl.minimum(distance, MAX_DIST)
        if MASKED:
            visible = (distance >= 0) & n_ok[None, :] & m_ok[:, None]
            s = tl.where(visible, s + tl.load(column, mask=visible, other=0.0).to(tl.float32), float("-inf"))
        else:  # every pair visible: each column lies in 0..K
            s += tl.load(column).to(tl.float32)
    p = tl.exp(s - lse[:, None])
    dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    ds = p * (dp - delta[:, None])  # d logits
    dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _shaw_backward_kv(Q, K, V, Z, DO, LSE, DELTA, DK, DV,
                      stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                      stride_dob, stride_doh, stride_dot, stride_dqb, stride_dqh, stride_dqt,
                      stride_dkb, stride_dkh, stride_dkt, H, GROUP, TQ, TK, MAX_DIST, scale,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      PRECISION: tl.constexpr):
    """One key tile of one query head: dk, dv (per query head, summed over a group outside), over the
    query tiles that see it in four walks (_tiles.query_walks), the far ones with no gather. DK, DV:
    per query head, laid out alike."""
    bh, b, h, offset, start_n, rn, rd, n_ok, d_ok, kv_mask, k, v = key_tile(
        K, V, H, GROUP, TQ, TK, stride_kb, stride_kh, stride_kt, HEAD_DIM, BLOCK_N, BLOCK_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    lo, full_lo, near_hi, full_hi = query_walks(start_n, offset, TQ, MAX_DIST, BLOCK_M, BLOCK_N)
    for start_m in range(lo, tl.minimum(full_lo, TQ), BLOCK_M):
        dk, dv = _shaw_key_tile_step(Q, DO, LSE, DELTA, Z, b, h, bh, start_m, rn, rd, n_ok, d_ok, k, v, dk, dv,
                                     offset, TQ, MAX_DIST, scale, stride_qb, stride_qh, stride_qt, stride_dob,
                                     stride_doh, stride_dot, BLOCK_M, PRECISION, True, False)
    for start_m in range(full_lo, near_hi, BLOCK_M):
        dk, dv = _shaw_key_tile_step(Q, DO, LSE, DELTA, Z, b, h, bh, start_m, rn, rd, n_ok, d_ok, k, v, dk, dv,
                                     offset, TQ, MAX_DIST, scale, stride_qb, stride_qh, stride_qt, stride_dob,
                                     stride_doh, stride_dot, BLOCK_M, PRECISION, False, False)
    for start_m in range(near_hi, full_hi, BLOCK_M):
        dk, dv = _shaw_key_tile_step(Q, DO, LSE, DELTA, Z, b, h, bh, start_m, rn, rd, n_ok, d_ok, k, v, dk, dv,
                                     offset, TQ, MAX_DIST, scale, stride_qb, stride_qh, stride_qt, stride_dob,
                                     stride_doh, stride_dot, BLOCK_M, PRECISION, False, True)
    for start_m in range(tl.maximum(full_lo, full_hi), TQ, BLOCK_M):
        dk, dv = _shaw_key_tile_step(Q, DO, LSE, DELTA, Z, b, h, bh, start_m, rn, rd, n_ok, d_ok, k, v, dk, dv,
                                     offset, TQ, MAX_DIST, scale, stride_qb, stride_qh, stride_qt, stride_dob,
                                     stride_doh, stride_dot, BLOCK_M, PRECISION, True, False)

    out = b * stride_dkb + h * stride_dkh + rn[:, None] * stride_dkt + rd[None, :]
    tl.store(DK + out, (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=kv_mask)


def _check_per_distance(per_distance: Tensor, q: Tensor, k: Tensor, v: Tensor, B: int, H: int, Tq: int) -> None:
    P = per_distance.shape[-1] if per_distance.dim() == 4 else 0
    if (per_distance.dim() != 4 or tuple(per_distance.shape[:3]) != (B, H, Tq) or P < 3 or P % 2 == 0
            or per_distance.dtype not in (torch.float32, q.dtype)):
        raise RelposError(f"per_distance must be (B, H, Tq, P) = {(B, H, Tq)} + (P = 2 * max_distance + 1, odd, >= 3,) "
                          f"in float32 or q's {q.dtype}; got {tuple(per_distance.shape)} {per_distance.dtype}")
    devices = {t.device for t in (q, k, v, per_distance)}
    if len(devices) > 1:  # check_device lets any device through under the interpreter
        raise RelposError(f"q, k, v and per_distance must be on one device; got {sorted(map(str, devices))}")


def _max_distance(columns: int) -> int:
    """The kernels' MAX_DIST, K, from the table's last dimension P = 2K + 1."""
    return (columns - 1) // 2


def _backward(q: Tensor, k: Tensor, v: Tensor, per_distance: Tensor, block_m: int | None, block_n: int | None,
              num_warps: int | None, o: Tensor, lse: Tensor, do: Tensor, needs: list[bool]) -> list[Tensor]:
    """-> dq, dk, dv (_ops.split_backward_outputs, dk and dv through _launch.input_gradient), dper_distance
    (float32 in the kernel, one writer an entry, cast to per_distance's dtype)."""
    B, H, Tq, Dh = q.shape
    Hk, Tk = k.shape[1], k.shape[2]
    delta, dq, dk, dv = split_backward_outputs(q, k)
    dz = torch.zeros(per_distance.shape, dtype=torch.float32, device=q.device)  # columns K + 1..2K stay 0
    common = (*q.stride()[:3], *k.stride()[:3], *do.stride()[:3], *dq.stride()[:3], *dk.stride()[:3],
              H, H // Hk, Tq, Tk, _max_distance(per_distance.shape[3]), 1.0 / math.sqrt(Dh))
    precision = dot_precision(q.dtype, INTERPRETED)
    rows = launch_tiles(BACKWARD_Q_TILES, q, block_m, block_n, num_warps, INTERPRETED)
    _shaw_backward_q[(triton.cdiv(Tq, rows.block_m), B * H)](
        q, k, v, per_distance, do, lse, o, delta, dq, dz, *common, PRECISION=precision, **tile_constexprs(q, rows))
    keys = launch_tiles(BACKWARD_KV_TILES, q, block_m, block_n, num_warps, INTERPRETED)
    _shaw_backward_kv[(triton.cdiv(Tk, keys.block_n), B * H)](
        q, k, v, per_distance, do, lse, delta, dk, dv, *common, PRECISION=precision, **tile_constexprs(q, keys))
    return [dq, input_gradient(dk, k), input_gradient(dv, v), dz.to(per_distance.dtype)]


_shaw = row_table_attention("shaw_attention", lambda: _shaw_forward, FORWARD_TILES, _max_distance, INTERPRETED,
                            _backward)


def shaw_attention(q: Tensor, k: Tensor, v: Tensor, per_distance: Tensor, block_m: int | None = None,
                   block_n: int | None = None, num_warps: int | None = None) -> Tensor:
    """Causal softmax attention with Shaw et al.'s relative position bias, fused: no (Tq, Tk) tensor.

    q (B, H, Tq, Dh): the last Tq of the Tk positions (Tq == Tk in training);
    k, v (B, Hk, Tk, Dh), Hk dividing H (grouped-query attention: query head h reads key head
    h // (H // Hk)); q, k, v in float32, bfloat16 or float16, one dtype;
    per_distance (B, H, Tq, 2K + 1): q @ table[layer].T / sqrt(Dh), each query's bias at the clipped
    relative distances -K..K (K = max_distance >= 1), in float32 or q's dtype -> out (B, H, Tq, Dh) in
    q's dtype: softmax over keys j <= i of q_i . k_j / sqrt(Dh) + per_distance[i, K - min(i - j, K)],
    as Shaw.content_bias defines it (relpos_cli/positions/shaw.py), times v.

    Differentiable in q, k, v and per_distance (its columns K + 1..2K, the keys after the query,
    get 0); each gradient entry has one writer, no atomics. block_m / block_n / num_warps: tile sizes
    (powers of two, >= 16) and warps for the call's kernels, FORWARD_TILES, BACKWARD_Q_TILES and
    BACKWARD_KV_TILES where not given (_launch.launch_tiles). CUDA tensors, or any under
    TRITON_INTERPRET=1 (set before this module is imported).
    """
    B, H, _, Tq, _, _ = check_qkv(q, k, v)
    _check_per_distance(per_distance, q, k, v, B, H, Tq)
    check_device(INTERPRETED, q, k, v, per_distance)
    return _shaw(q, k, v, per_distance.contiguous(), block_m, block_n, num_warps)
