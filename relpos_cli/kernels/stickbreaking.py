"""Stick-breaking attention as one fused Triton kernel: forward and backward, no (T, T) tensor.

What it computes (relpos_cli/positions/stickbreaking.py), for query i (the last Tq of the Tk
positions) and the keys it shares its stick among, j < i (j <= i with attend_current):

    z_ij = q_i . k_j / sqrt(Dh),   s_ij = softplus(z_ij) = -log(1 - sigmoid(z_ij))
    A_ij = sigmoid(z_ij) * prod_{j < l visible} (1 - sigmoid(z_il)),  log A_ij = z_ij - sum_{l >= j} s_il
    out_i = sum_j A_ij v_j                                       (no softmax; the leftover stick dropped)

Forward: one program per tile of BLOCK_M queries walks the key tiles nearest first, carrying each
query's stick spent so far (sum of s over the nearer keys, in log space); within a tile the suffix
sums come from a reversed cumulative sum. The walk stops once every query of the tile has spent
STICK_SPENT = 110 (e^-110 of its stick left, _stick_left): each farther A is then below half of
float32's least subnormal and rounds to 0, so the keys left add exactly nothing (the output is the
full walk's, bit for bit). It checks every _tiles.STOP_CHECK_TILES key tiles, each chunk a for loop
that Triton pipelines (a tile past the point adds 0). Logits near 0 (a model at initialisation) spend
a stick in about 160 keys; a trained model's queries as their logits say, and logits well below 0
keep it for thousands (scripts/walk_stops.py measures a run's).

Backward, with g_ij = A_ij dA_ij (dA_ij = dO_i . v_j),

    dz_ij = g_ij - sigmoid(z_ij) * sum_{m <= j} g_im,   sum_{m <= j} g_im = dO_i . out_i - sum_{m > j} g_im

in FlashAttention-2's split. First one program per query tile walks the key tiles as the forward
does, recomputing A and carrying sum_{m > j} (the near-to-far walk reaches the nearer keys first):
dq, in registers, up to where the forward's walk stopped (past it A = 0, so g and dz are 0: the full
walk added sigmoid(z) times the rounding of sum_{m <= j} g there, whose true value is 0); and for the
second, its rows' dO . out and, at the end of each key tile, each row's stick spent on the keys after
the tile and its sum of g over them (past the stop, both as they stood there), (B, H, Tk / BLOCK_N, Tq)
float32 each: 1 / BLOCK_N of a score matrix, quadratic in the length, held for one layer's backward
(12 MiB each at 8 x 12 heads x 1,024 and BLOCK_N 32; 384 MiB each for 12 heads x 16k). A memory
cost the atomics did not have, for dk and dv without them. Then one program per key tile of
one query head for dk and dv, in registers: over the query tiles that see it, STOP_CHECK_TILES at a
time, skipping a chunk whose every query spent its stick before the tile, A and dz from those two
sums, the in-tile suffix sums as the forward takes them. Under grouped-query attention dk, dv
are per query head, summed over a group after. The backward first ran as the one query-tile program
adding dk and dv with float32 atomics for every key tile it visited (12.4 ms a training step in the
sixth run's profile on an H200, 12 layers at 8 x 12 heads x 1,024, 0b1c743): the split has none.

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
from relpos_cli.kernels._ops import fused_function, key_tile_states, split_backward_outputs
from relpos_cli.kernels._tiles import (STOP_CHECK_TILES, key_head, key_tile, key_tile_state, load_kv, load_rows,
                                       query_tile, row_delta, some_row_below)
from relpos_cli.positions.stickbreaking import SPENT

INTERPRETED = interpreting()  # fixed when the kernels below are defined (triton.jit reads it then)
# _launch.KernelTiles. The backward's two programs share BLOCK_N (the query-tile program stores its rows'
# state at the end of each of the key-tile program's key tiles): the key-tile program's, which the
# query-tile program's gives way to. Compiled for sm_90 in bf16 (tests/kernel_compile_probe.py) at head size
# 64, with triton 3.9 / 3.6 (the GPU machine's): the forward at 128 x 64 with 8 warps 217 / 231 registers, the
# query-tile program at 128 x 32 with 8 warps 241 / 243 (it spilled 32 bytes at 64 x 64), the key-tile program
# at 64 x 32 with 8 warps 192 / 212 (8 bytes spilled at 128 x 32, 136 at 64 x 64), none spilling; at head
# size 128 all three at 32 x 32, no spill; nor in float32 at head size 64 (the forward at 32 x 32: 64 x 32
# spilled 520 bytes with triton 3.9 once its walk could stop). Untimed on a GPU.
FORWARD_TILES = KernelTiles(narrow=Tiles(128, 64, 8), wide=Tiles(32, 32, 8))
BACKWARD_Q_TILES = KernelTiles(narrow=Tiles(128, 32, 8), wide=Tiles(32, 32, 8))
BACKWARD_KV_TILES = KernelTiles(narrow=Tiles(64, 32, 8), wide=Tiles(32, 32, 8))


@triton.jit
def _softplus(z):
    return tl.maximum(z, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(z)))


# the stick spent, -log(left), past which a query's walk may stop: every farther A is then e^-110 or less,
# below half of float32's least subnormal (2^-150 ~ e^-104), and rounds to 0; the scheme's own bound, which
# its evaluation on CPU leaves the far keys out by (StickBreaking.far_keys)
STICK_SPENT = tl.constexpr(SPENT)


@triton.jit
def _stick_left(spent, m_ok):
    """Whether a query of the tile (m_ok) has stick left for the keys after those walked: spent (BLOCK_M,)
    each query's stick given the nearer keys, -log(left). Past STICK_SPENT the farther keys add exactly
    nothing to the output, and nothing to any gradient."""
    return some_row_below(spent, m_ok, STICK_SPENT)


@triton.jit
def _stick_scores(q, k, rm, rn, n_ok, acc_s, scale, offset, ATTEND_CURRENT: tl.constexpr):
    """A tile of queries rm against keys rn (k loaded), with acc_s each query's stick spent on the keys
    after the tile: z, the visible mask, s and A."""
    z = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    if ATTEND_CURRENT:
        visible = (rn[None, :] <= rm[:, None] + offset) & n_ok[None, :]
    else:
        visible = (rn[None, :] < rm[:, None] + offset) & n_ok[None, :]
    s = tl.where(visible, _softplus(z), 0.0)
    spent = tl.cumsum(s, axis=1, reverse=True) + acc_s[:, None]  # sum over visible l >= j of s_il
    a = tl.exp(tl.where(visible, z - spent, float("-inf")))
    return z, visible, s, a


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
    walked = 0
    while (walked < n_tiles) & _stick_left(acc_s, m_ok):  # nearest tile first, until every stick is spent
        for t in range(walked, tl.minimum(walked + STOP_CHECK_TILES, n_tiles)):
            start_n = (n_tiles - 1 - t) * BLOCK_N
            rn, n_ok, _, k, v = load_kv(k_base, v_base, start_n, rd, d_ok, TK, stride_kt, BLOCK_N)
            z, visible, s, a = _stick_scores(q, k, rm, rn, n_ok, acc_s, scale, offset, ATTEND_CURRENT)
            acc += tl.dot(a.to(v.dtype), v, input_precision="ieee")
            acc_s += tl.sum(s, 1)
        walked += STOP_CHECK_TILES

    out = b * stride_ob + h * stride_oh + rm[:, None] * stride_ot + rd[None, :]  # O, O32 laid out alike
    tl.store(O + out, acc.to(O.dtype.element_ty), mask=q_mask)
    tl.store(O32 + out, acc, mask=q_mask)


@triton.jit
def _stick_backward_q(Q, K, V, DO, O, DELTA, SPENT, NEARER_G, DQ,
                      stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                      stride_dob, stride_doh, stride_dot, stride_dqb, stride_dqh, stride_dqt,
                      stride_dkb, stride_dkh, stride_dkt, H, GROUP, TQ, TK, scale,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      ATTEND_CURRENT: tl.constexpr):
    """One query tile: dq, over the forward's walk from the nearest key tile; for the dk/dv kernel,
    launched after this one, its rows' dO . out (DELTA) and, at the end of each key tile it walks, each
    row's stick spent on the keys after the tile (SPENT) and sum of g over them (NEARER_G): (B, H,
    cdiv(Tk, BLOCK_N), Tq) float32, the dk/dv kernel's key tiles being this kernel's."""
    bh, b, h, hk, offset, start_m, rm, rd, m_ok, d_ok = query_tile(H, GROUP, TQ, TK, HEAD_DIM, BLOCK_M, BLOCK_D)
    q = load_rows(Q, b, h, rm, rd, m_ok, d_ok, stride_qb, stride_qh, stride_qt)
    do = load_rows(DO, b, h, rm, rd, m_ok, d_ok, stride_dob, stride_doh, stride_dot)
    # delta_i = sum_j g_ij
    delta = row_delta(O, do, DELTA, bh, b, h, rm, rd, m_ok, d_ok, TQ, stride_dqb, stride_dqh, stride_dqt)
    k_base, v_base = key_head(K, V, b, hk, stride_kb, stride_kh)

    acc_s = tl.zeros([BLOCK_M], tl.float32)
    acc_g = tl.zeros([BLOCK_M], tl.float32)  # sum of g over the nearer tiles' keys
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n_tiles = tl.cdiv(tl.minimum(TK, offset + start_m + BLOCK_M), BLOCK_N)
    walked = 0
    while (walked < n_tiles) & _stick_left(acc_s, m_ok):  # nearest tile first, until every stick is spent
        for t in range(walked, tl.minimum(walked + STOP_CHECK_TILES, n_tiles)):
            tile = n_tiles - 1 - t
            start_n = tile * BLOCK_N
            state = key_tile_state(bh, tile, TQ, TK, BLOCK_N) + rm
            tl.store(SPENT + state, acc_s, mask=m_ok)
            tl.store(NEARER_G + state, acc_g, mask=m_ok)
            rn, n_ok, _, k, v = load_kv(k_base, v_base, start_n, rd, d_ok, TK, stride_kt, BLOCK_N)
            z, visible, s, a = _stick_scores(q, k, rm, rn, n_ok, acc_s, scale, offset, ATTEND_CURRENT)
            _, g, dz = _stick_grads(z, visible & m_ok[:, None], a, do, v, delta, acc_g)
            dq += tl.dot(dz.to(k.dtype), k, input_precision="ieee")
            acc_s += tl.sum(s, 1)
            acc_g += tl.sum(g, 1)
        walked += STOP_CHECK_TILES
    for far in range(walked, n_tiles):  # A = 0 from here on, so g = 0 and dz = 0: the sums as they stand
        state = key_tile_state(bh, n_tiles - 1 - far, TQ, TK, BLOCK_N) + rm
        tl.store(SPENT + state, acc_s, mask=m_ok)
        tl.store(NEARER_G + state, acc_g, mask=m_ok)

    tl.store(DQ + b * stride_dqb + h * stride_dqh + rm[:, None] * stride_dqt + rd[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


@triton.jit
def _stick_grads(z, visible, a, do, v, delta, nearer_tiles_g):
    """A tile's backward from its A: A as the forward's A @ v read it, g = A dA and dz (module
    docstring), 0 where not visible; nearer_tiles_g: each row's sum of g over the keys after the tile."""
    a_used = a.to(v.dtype)
    da = tl.dot(do, tl.trans(v), input_precision="ieee")  # rows past the last query: dO = 0
    g = a_used.to(tl.float32) * da
    nearer_g = tl.cumsum(g, axis=1, reverse=True) - g + nearer_tiles_g[:, None]  # sum over m > j of g_im
    dz = tl.where(visible, g - tl.sigmoid(z) * (delta[:, None] - nearer_g), 0.0)
    return a_used, g, dz


@triton.jit
def _stick_backward_kv(Q, K, V, DO, DELTA, SPENT, NEARER_G, DK, DV,
                       stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                       stride_dob, stride_doh, stride_dot, stride_dqb, stride_dqh, stride_dqt,
                       stride_dkb, stride_dkh, stride_dkt, H, GROUP, TQ, TK, scale,
                       HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       ATTEND_CURRENT: tl.constexpr):
    """One key tile of one query head: dk, dv (per query head, summed over a group outside), over the
    query tiles from the first holding a query that sees its first key; each row's stick spent after
    the tile and sum of g there read from the dq kernel's SPENT and NEARER_G. DK, DV: per query head,
    laid out alike."""
    bh, b, h, offset, start_n, rn, rd, n_ok, d_ok, kv_mask, k, v = key_tile(
        K, V, H, GROUP, TQ, TK, stride_kb, stride_kh, stride_kt, HEAD_DIM, BLOCK_N, BLOCK_D)
    state = key_tile_state(bh, tl.program_id(0), TQ, TK, BLOCK_N)  # this key tile's row of SPENT, NEARER_G
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    # the query tiles STOP_CHECK_TILES at a time: a chunk whose every query spent its stick before this key
    # tile gets nothing of it and is skipped; the others are walked by a for loop, which Triton pipelines
    chunk = BLOCK_M * STOP_CHECK_TILES
    for start_chunk in range((tl.maximum(start_n - offset, 0) // BLOCK_M) * BLOCK_M, TQ, chunk):
        rows = start_chunk + tl.arange(0, BLOCK_M * STOP_CHECK_TILES)
        if _stick_left(tl.load(SPENT + state + rows, mask=rows < TQ, other=0.0), rows < TQ):
            for start_m in range(start_chunk, tl.minimum(start_chunk + chunk, TQ), BLOCK_M):
                rm = start_m + tl.arange(0, BLOCK_M)
                m_ok = rm < TQ
                q = load_rows(Q, b, h, rm, rd, m_ok, d_ok, stride_qb, stride_qh, stride_qt)
                do = load_rows(DO, b, h, rm, rd, m_ok, d_ok, stride_dob, stride_doh, stride_dot)
                delta = tl.load(DELTA + bh * TQ + rm, mask=m_ok, other=0.0)
                spent = tl.load(SPENT + state + rm, mask=m_ok, other=0.0)
                nearer_g = tl.load(NEARER_G + state + rm, mask=m_ok, other=0.0)
                z, visible, s, a = _stick_scores(q, k, rm, rn, n_ok, spent, scale, offset, ATTEND_CURRENT)
                # a padded query adds nothing unmasked: its dO, delta and sums load as 0, so g = 0 and dz = 0
                a_used, g, dz = _stick_grads(z, visible, a, do, v, delta, nearer_g)
                dk += tl.dot(tl.trans(dz.to(q.dtype)), q, input_precision="ieee")
                dv += tl.dot(tl.trans(a_used), do, input_precision="ieee")

    out = b * stride_dkb + h * stride_dkh + rn[:, None] * stride_dkt + rd[None, :]
    tl.store(DK + out, (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=kv_mask)


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
    """-> dq, dk, dv (_ops.split_backward_outputs, dk and dv through _launch.input_gradient)."""
    B, H, Tq, Dh = q.shape
    Hk, Tk = k.shape[1], k.shape[2]
    delta, dq, dk, dv = split_backward_outputs(q, k)  # dq laid out as o and o32: the kernel reads out with dq's strides
    keys = launch_tiles(BACKWARD_KV_TILES, q, block_m, block_n, num_warps, INTERPRETED)
    rows = launch_tiles(BACKWARD_Q_TILES, q, block_m, block_n, num_warps, INTERPRETED)
    rows, spent, nearer_g = key_tile_states(q, k, rows, keys)  # the query-tile program on the key tiles' BLOCK_N
    common = (*q.stride()[:3], *k.stride()[:3], *do.stride()[:3], *dq.stride()[:3], *dk.stride()[:3],
              H, H // Hk, Tq, Tk, 1.0 / math.sqrt(Dh))
    _stick_backward_q[(triton.cdiv(Tq, rows.block_m), B * H)](
        q, k, v, do, o32 if o32.numel() else o, delta, spent, nearer_g, dq, *common, ATTEND_CURRENT=attend_current,
        **tile_constexprs(q, rows))
    _stick_backward_kv[(triton.cdiv(Tk, keys.block_n), B * H)](
        q, k, v, do, delta, spent, nearer_g, dk, dv, *common, ATTEND_CURRENT=attend_current,
        **tile_constexprs(q, keys))
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

    Differentiable in q, k, v; each gradient entry has one writer, no atomics. block_m / block_n /
    num_warps: tile sizes (powers of two, >= 16) and warps for the call's kernels, FORWARD_TILES,
    BACKWARD_Q_TILES and BACKWARD_KV_TILES where not given (_launch.launch_tiles). CUDA tensors, or any
    under TRITON_INTERPRET=1 (set before this module is imported).
    """
    check_qkv(q, k, v)
    if not isinstance(attend_current, bool):
        raise RelposError(f"attend_current={attend_current!r} must be true or false")
    check_device(INTERPRETED, q, k, v)
    return _stickbreaking(q, k, v, attend_current, block_m, block_n, num_warps)
