"""The host side the kernels share whose bias reads a table per query, (B, H, Tq, P), that the
caller forms from q (CoPE's per-position logits, Shaw's per-distance logits): launching the forward
(one program per tile of queries of one (batch, head), storing each query's log-sum-exp) and the
backward (dq its own, dk, dv and the table's gradient added with float32 atomics). What each kernel
reads of the table is its own (relpos_cli/kernels/cope.py, shaw.py)."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import triton
from torch import Tensor

from relpos_cli.kernels._launch import (KernelTiles, Tiles, dot_precision, input_gradient, launch_tiles,
                                        tile_constexprs, token_major)
from relpos_cli.kernels._ops import fused_function, softmax_outputs


def row_table_attention(name: str, kernels: Callable[[], tuple[Any, Any]], tiles: tuple[KernelTiles, KernelTiles],
                        table_size: Callable[[int], int], interpreted: bool,
                        backward_stages: Callable[[Tensor], int | None] = lambda q: None) -> Callable[..., Tensor]:
    """The call (q, k, v, table, block_m, block_n, num_warps) -> out (q, k, v as _launch.kernel_layout
    leaves them, table contiguous, all checked) running the kernels that kernels() gives, (forward, backward), looked up at each call (so
    a tool that swaps a module's kernels, as tests/kernel_compile_probe.py does, is heard), with their
    tiles on CUDA (_launch.launch_tiles; the caller's block_m, block_n, num_warps where given), as the
    ops relpos::<name> and its backward (_ops.fused_function). Their arguments after the tensors: the
    strides of q and k, the forward's of out, the backward's of dO and dq (each (B, H, T, Dh) tensor's
    first three; the backward reads out, for its dO . out, with dq's: _tiles.row_delta), H, the group
    size, Tq, Tk, table_size(P) (the kernel's own reading of the table's last dimension P) and
    1 / sqrt(Dh). interpreted: whether the kernel module was imported
    under Triton's interpreter. backward_stages(q): the backward's num_stages where it must differ from
    _launch.pipeline_stages', None elsewhere."""

    def launch(kernel: Any, tensors: tuple[Tensor, ...], rows: tuple[Tensor, ...], q: Tensor, k: Tensor,
               table: Tensor, launched: Tiles, stages: int | None = None) -> None:
        B, H, Tq, Dh = q.shape
        Hk, Tk = k.shape[1], k.shape[2]
        meta = tile_constexprs(q, launched) | ({} if stages is None else {"num_stages": stages})
        kernel[(triton.cdiv(Tq, launched.block_m), B * H)](
            *tensors,
            *(t.stride(i) for t in (q, k, *rows) for i in range(3)),
            H, H // Hk, Tq, Tk, table_size(table.shape[3]), 1.0 / math.sqrt(Dh),
            PRECISION=dot_precision(q.dtype, interpreted), **meta)

    def forward(q: Tensor, k: Tensor, v: Tensor, table: Tensor, block_m: int | None, block_n: int | None,
                num_warps: int | None) -> tuple[Tensor, Tensor]:
        o, lse = softmax_outputs(q)
        launch(kernels()[0], (q, k, v, table, o, lse), (o,), q, k, table,
               launch_tiles(tiles[0], q, block_m, block_n, num_warps, interpreted))
        return o, lse


    def backward(q: Tensor, k: Tensor, v: Tensor, table: Tensor, block_m: int | None, block_n: int | None,
                 num_warps: int | None, o: Tensor, lse: Tensor, do: Tensor, needs: list[bool]) -> list[Tensor]:
        dq = token_major(q.shape, q.dtype, q.device)  # laid out as o: the kernel reads o's rows with dq's strides
        dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)  # atomics add into these (B, Hk, Tk, Dh)
        dv = torch.zeros_like(dk)
        dtable = torch.zeros(table.shape, dtype=torch.float32, device=q.device)  # entries no key reads stay 0
        launch(kernels()[1], (q, k, v, table, do, lse, o, dq, dk, dv, dtable), (do, dq), q, k, table,
               launch_tiles(tiles[1], q, block_m, block_n, num_warps, interpreted), backward_stages(q))
        return [dq, input_gradient(dk, k), input_gradient(dv, v), dtable.to(table.dtype)]

    return fused_function(name, forward, softmax_outputs, backward, tensors=4)
