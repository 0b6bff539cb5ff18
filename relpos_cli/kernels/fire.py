"""FIRE's attention where no table of distances serves, as one fused Triton kernel, forward only:
the bias of every score computed from its distance and its query's normaliser, the MLP read off a grid.

What it computes, for query i (the last Tq of the Tk positions, at position p_i) and key j at or
before it (p_i - p_j = Tk - Tq + i - j: the positions are consecutive):

    x_ij = log(c (p_i - p_j) + 1) / (log(c max(p_i, L) + 1) + eps)       in [0, 1]
    bias_hij = grid[h, n] + (G x_ij - n) (grid[h, n + 1] - grid[h, n]),  n = min(floor(G x_ij), G - 1)
    out_i = softmax_j(q_i . k_j / sqrt(Dh) + bias_hij) @ v

c (taken as |c|: FIRE's psi(x) = log(|c x| + 1)), the threshold L and eps being one layer's, and grid
(H, G + 1) that layer's MLP at G + 1 evenly spaced points of [0, 1]: relpos_cli/positions/fire.py,
``FireLayer.score_formula``, whose FlexAttention score_mod computes the same numbers. FIRE's MLP is
piecewise linear, so the interpolation is exact in a cell without a knot and within
``FireLayer.formula_error_bound()`` of the MLP in the others.

Why it exists: queries past L each have a normaliser of their own, so the bias is no function of the
distance alone and the distance kernel (relpos_cli/kernels/distance.py), which runs FIRE up to L,
cannot; a long evaluation window passes L. On an H200 such a 16k window took 11.7x NoPE's time on
FlexAttention with the same formula (docs/results/gpu.md, 0b1c743).

Forward only. The per-head grid, c and L would get their gradients from every score by atomics (as
flex's captured buffers would); training runs up to L through the distance kernel's table, and a run
whose queries pass a learned L trains as auto would. So nothing is stored for a backward (no
log-sum-exp), and inputs that record a gradient are refused.

FlashAttention-2's forward, as the distance kernel's: one program per tile of BLOCK_M queries of one
(batch, head) walks the key tiles before its first query without the causal mask, then the tiles on
the diagonal with it. Per tile of queries: each query's normaliser, one log each. Per score: one log,
a few multiplies, and two loads from the head's grid row (G + 1 floats, 32 KiB at FIRE's G = 8,192;
neighbouring scores read neighbouring cells, which the L1 cache serves).

Written for relpos after FlashAttention-2 (Dao 2023), FIRE (Li et al. 2023, "Functional Interpolation
for Relative Positions Improves Long Context Transformers") and relpos_cli/kernels/distance.py.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from relpos_cli.errors import RelposError
from relpos_cli.kernels._launch import (KernelTiles, Tiles, check_device, check_qkv, dot_precision, interpreting,
                                        kernel_layout, launch_tiles, tile_constexprs, token_major)
from relpos_cli.kernels._tiles import key_head, load_kv, load_rows, online_softmax_step, query_tile, unmasked_key_end

INTERPRETED = interpreting()  # fixed when the kernels below are defined (triton.jit reads it then)
# _launch.KernelTiles; not timed on a GPU yet. Compiled for sm_90 (tests/kernel_compile_probe.py, triton 3.9), the
# two gathers per score hold more registers than the distance kernel's one: in bf16 at the distance forward's
# 128 x 64 with 8 warps 255 registers a thread and a 296-byte spill (208 KiB of shared memory), at 128 x 32 with
# 8 warps 254 and none (120 KiB); in float32 64 x 32 with 8 warps takes 205, no spill
FORWARD_TILES = KernelTiles(narrow=Tiles(128, 32, 8), wide=Tiles(64, 32, 8))


@triton.jit
def _fire_scores(q, k, grid_row, c, inv_norm, rm, rn, offset, scale, CELLS: tl.constexpr, PRECISION: tl.constexpr):
    """One tile of logits (BLOCK_M, BLOCK_N): q . k / sqrt(Dh) plus the MLP off the grid at
    log(c d + 1) * inv_norm, d the pair's distance (future pairs, which the caller masks, read d = 0)."""
    distance = tl.maximum(offset + rm[:, None] - rn[None, :], 0).to(tl.float32)  # exact: distances below 2^24
    at = tl.log(c * distance + 1.0) * inv_norm[:, None] * CELLS
    cell = tl.minimum(tl.floor(at), CELLS - 1.0)  # at >= 0
    n = cell.to(tl.int32)
    below = tl.load(grid_row + n)
    above = tl.load(grid_row + n + 1)
    return tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale + below + (at - cell) * (above - below)


@triton.jit
def _fire_forward(Q, K, V, GRID, CONSTANTS, POSITIONS, O,
                  stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_grid,
                  stride_ob, stride_oh, stride_ot,
                  H, GROUP, TQ, TK, scale,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  CELLS: tl.constexpr, PRECISION: tl.constexpr):
    bh, b, h, hk, offset, start_m, rm, rd, m_ok, d_ok = query_tile(H, GROUP, TQ, TK, HEAD_DIM, BLOCK_M, BLOCK_D)
    q = load_rows(Q, b, h, rm, rd, m_ok, d_ok, stride_qb, stride_qh, stride_qt)
    c = tl.load(CONSTANTS)
    threshold = tl.load(CONSTANTS + 1)
    eps = tl.load(CONSTANTS + 2)
    position = tl.load(POSITIONS + offset + rm, mask=m_ok, other=0).to(tl.float32)  # the queries' own
    inv_norm = 1.0 / (tl.log(c * tl.maximum(position, threshold) + 1.0) + eps)  # (BLOCK_M,)
    grid_row = GRID + h * stride_grid
    k_base, v_base = key_head(K, V, b, hk, stride_kb, stride_kh)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = tl.minimum(TK, offset + start_m + BLOCK_M)  # keys up to the tile's last query
    near_end = unmasked_key_end(offset, start_m, BLOCK_N)
    for start_n in range(0, near_end, BLOCK_N):
        rn, n_ok, _, k, v = load_kv(k_base, v_base, start_n, rd, d_ok, TK, stride_kt, BLOCK_N)
        s = _fire_scores(q, k, grid_row, c, inv_norm, rm, rn, offset, scale, CELLS, PRECISION)
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s, v, PRECISION)
    for start_n in range(near_end, hi, BLOCK_N):  # the tiles on the diagonal
        rn, n_ok, _, k, v = load_kv(k_base, v_base, start_n, rd, d_ok, TK, stride_kt, BLOCK_N)
        s = _fire_scores(q, k, grid_row, c, inv_norm, rm, rn, offset, scale, CELLS, PRECISION)
        s = tl.where((rn[None, :] <= rm[:, None] + offset) & n_ok[None, :], s, float("-inf"))
        # every row sees key 0 in the first tile walked, so m_i is finite from there on
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s, v, PRECISION)

    acc = acc / l_i[:, None]
    tl.store(O + b * stride_ob + h * stride_oh + rm[:, None] * stride_ot + rd[None, :], acc.to(O.dtype.element_ty),
             mask=m_ok[:, None] & d_ok[None, :])


def fire_attention(q: Tensor, k: Tensor, v: Tensor, grid: Tensor, constants: Tensor, positions: Tensor,
                   block_m: int | None = None, block_n: int | None = None, num_warps: int | None = None) -> Tensor:
    """Causal softmax attention adding FIRE's bias, computed per score off an interpolation grid (the
    module docstring): fused, forward only, no (Tq, Tk) tensor.

    q (B, H, Tq, Dh): the last Tq of the Tk positions; k, v (B, Hk, Tk, Dh), Hk dividing H
    (grouped-query attention); q, k, v in float32, bfloat16 or float16, one dtype;
    grid (H, G + 1) float32, G >= 1: each query head's MLP at G + 1 evenly spaced points of [0, 1];
    constants (3,) float32: |c|, the threshold L and eps (FIRE's psi(x) = log(|c x| + 1)), read on the
    device (no sync); positions (Tk,) integers, the keys' positions, consecutive (the queries' are the
    last Tq; not checked, which would read the device)
    -> out (B, H, Tq, Dh) in q's dtype, laid out as (B, Tq, H, Dh) (_launch.token_major).

    No gradient: a RelposError for inputs that record one. block_m / block_n / num_warps: tile sizes
    (powers of two, >= 16) and warps, FORWARD_TILES where not given (_launch.launch_tiles). CUDA
    tensors, or any under TRITON_INTERPRET=1 (set before this module is imported).
    """
    B, H, Hk, Tq, Tk, Dh = check_qkv(q, k, v)
    if grid.dim() != 2 or grid.shape[0] != H or grid.shape[1] < 2 or grid.dtype != torch.float32:
        raise RelposError(f"grid must be (H, G + 1) = ({H}, >= 2) in float32 (each head's MLP at G + 1 evenly spaced "
                          f"points of [0, 1]); got {tuple(grid.shape)} {grid.dtype}")
    if constants.shape != (3,) or constants.dtype != torch.float32:
        raise RelposError(f"constants must be (3,) in float32 (|c|, the threshold L, eps); got "
                          f"{tuple(constants.shape)} {constants.dtype}")
    if positions.shape != (Tk,) or positions.dtype not in (torch.int32, torch.int64):
        raise RelposError(f"positions must be the {Tk} keys' positions, (Tk,) = ({Tk},) integers; got "
                          f"{tuple(positions.shape)} {positions.dtype}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, grid, constants)):
        raise RelposError("fire_attention computes no gradients (evaluation only): FIRE trains up to its threshold "
                          "through distance_attention's table, and past it as model.attn_backend=auto does")
    check_device(INTERPRETED, q, k, v, grid, constants, positions)
    q, k, v = kernel_layout(q, k, v)
    grid = grid.contiguous()
    tiles = launch_tiles(FORWARD_TILES, q, block_m, block_n, num_warps, INTERPRETED)
    o = token_major(q.shape, q.dtype, q.device)
    _fire_forward[(triton.cdiv(Tq, tiles.block_m), B * H)](
        q, k, v, grid, constants.contiguous(), positions.contiguous(), o,
        *q.stride()[:3], *k.stride()[:3], grid.stride(0), *o.stride()[:3],
        H, H // Hk, Tq, Tk, 1.0 / math.sqrt(Dh),
        CELLS=grid.shape[1] - 1, PRECISION=dot_precision(q.dtype, INTERPRETED), **tile_constexprs(q, tiles))
    return o
