"""The host side the kernels share whose bias reads a table per query, (B, H, Tq, P), that the
caller forms from q (CoPE's per-position logits, Shaw's per-distance logits): launching a kernel with
one program per tile of queries of one (batch, head), the forward (storing each query's log-sum-exp)
and, for CoPE, the backward that adds dk, dv and the table's gradient with float32 atomics. Shaw's
backward is FlashAttention-2's split, launched by its own module. What each kernel reads of the
table is its own (relpos_cli/kernels/cope.py, shaw.py)."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import triton
from torch import Tensor

from relpos_cli.kernels._launch import (KernelTiles, Tiles, dot_precision, input_gradient, launch_tiles,
                                        tile_constexprs, token_major)
from relpos_cli.kernels._ops import fused_function, softmax_outputs

Backward = Callable[..., list[Tensor]]  # (q, k, v, table, block_m, block_n, num_warps, o, lse, do, needs) -> grads


def launch_query_tiles(kernel: Any, tensors: tuple[Tensor, ...], rows: tuple[Tensor, ...], q: Tensor, k: Tensor,
                       table_size: int, launched: Tiles, interpreted: bool, stages: int | None = None) -> None:
    """Launch `kernel` on a grid (query tiles, B * H) with `tensors`, then the strides of q, k and `rows`
    (each (B, H, T, Dh) tensor's first three), H, the group size, Tq, Tk, table_size (the kernel's own
    reading of the table's last dimension) and 1 / sqrt(Dh); tiles `launched`; num_stages `stages`
    where given (_launch.pipeline_stages' otherwise)."""
    B, H, Tq, Dh = q.shape
    Hk, Tk = k.shape[1], k.shape[2]
    meta = tile_constexprs(q, launched) | ({} if stages is None else {"num_stages": stages})
    kernel[(triton.cdiv(Tq, launched.block_m), B * H)](
        *tensors,
        *(stride for t in (q, k, *rows) for stride in t.stride()[:3]),
        H, H // Hk, Tq, Tk, table_size, 1.0 / math.sqrt(Dh),
        PRECISION=dot_precision(q.dtype, interpreted), **meta)


def atomic_backward(kernel: Callable[[], Any], tiles: KernelTiles, table_size: Callable[[int], int],
                    interpreted: bool, stages: Callable[[Tensor], int | None] = lambda q: None) -> Backward:
    """The backward of one kernel() (looked up at each call) per query tile: dq its own, dk, dv and the
    table's gradient added with float32 atomics; its arguments (q, k, v, table, do, lse, o, dq, dk, dv,
    dtable), then launch_query_tiles' with the strides of dO and dq (the kernel reads out, for its
    dO . out, with dq's: _tiles.row_delta). stages(q): num_stages where it must differ from
    _launch.pipeline_stages', None elsewhere."""

    def backward(q: Tensor, k: Tensor, v: Tensor, table: Tensor, block_m: int | None, block_n: int | None,
                 num_warps: int | None, o: Tensor, lse: Tensor, do: Tensor, needs: list[bool]) -> list[Tensor]:
        dq = token_major(q.shape, q.dtype, q.device)  # laid out as o: the kernel reads o's rows with dq's strides
        dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)  # atomics add into these (B, Hk, Tk, Dh)
        dv = torch.zeros_like(dk)
        dtable = torch.zeros(table.shape, dtype=torch.float32, device=q.device)  # entries no key reads stay 0
        launch_query_tiles(kernel(), (q, k, v, table, do, lse, o, dq, dk, dv, dtable), (do, dq), q, k,
                           table_size(table.shape[3]), launch_tiles(tiles, q, block_m, block_n, num_warps, interpreted),
                           interpreted, stages(q))
        return [dq, input_gradient(dk, k), input_gradient(dv, v), dtable.to(table.dtype)]

    return backward


def row_table_attention(name: str, forward_kernel: Callable[[], Any], tiles: KernelTiles,
                        table_size: Callable[[int], int], interpreted: bool,
                        backward: Backward) -> Callable[..., Tensor]:
    """The call (q, k, v, table, block_m, block_n, num_warps) -> out (q, k, v as _launch.kernel_layout
    leaves them, table contiguous, all checked) running forward_kernel() (looked up at each call, so a
    tool that swaps a module's kernels, as tests/kernel_compile_probe.py does, is heard) with its tiles
    on CUDA (_launch.launch_tiles; the caller's block_m, block_n, num_warps where given), and
    `backward`, as the ops relpos::<name> and its backward (_ops.fused_function). The forward's
    arguments: (q, k, v, table, out, lse), then launch_query_tiles' with the strides of out and
    table_size(P), P the table's last dimension. interpreted: whether the kernel module was imported
    under Triton's interpreter."""

    def forward(q: Tensor, k: Tensor, v: Tensor, table: Tensor, block_m: int | None, block_n: int | None,
                num_warps: int | None) -> tuple[Tensor, Tensor]:
        o, lse = softmax_outputs(q)
        launch_query_tiles(forward_kernel(), (q, k, v, table, o, lse), (o,), q, k, table_size(table.shape[3]),
                           launch_tiles(tiles, q, block_m, block_n, num_warps, interpreted), interpreted)
        return o, lse

    return fused_function(name, forward, softmax_outputs, backward, tensors=4)
