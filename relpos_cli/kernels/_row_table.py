"""The forward's host side the kernels share whose bias reads a table per query, (B, H, Tq, P), that
the caller forms from q (CoPE's per-position logits, Shaw's per-distance logits): one program per tile
of queries of one (batch, head), storing each query's log-sum-exp. Each backward is its module's own
(FlashAttention-2's split, relpos_cli/kernels/cope.py, shaw.py), as is what each kernel reads of the
table."""

from __future__ import annotations

import math
from typing import Any, Callable

import triton
from torch import Tensor

from relpos_cli.kernels._launch import KernelTiles, dot_precision, launch_tiles, tile_constexprs
from relpos_cli.kernels._ops import fused_function, softmax_outputs

Backward = Callable[..., list[Tensor]]  # (q, k, v, table, block_m, block_n, num_warps, o, lse, do, needs) -> grads


def row_table_attention(name: str, forward_kernel: Callable[[], Any], tiles: KernelTiles,
                        table_size: Callable[[int], int], interpreted: bool,
                        backward: Backward) -> Callable[..., Tensor]:
    """The call (q, k, v, table, block_m, block_n, num_warps) -> out (q, k, v as _launch.kernel_layout
    leaves them, table contiguous, all checked) running forward_kernel() (looked up at each call, so a
    tool that swaps a module's kernels, as tests/kernel_compile_probe.py does, is heard) with its tiles
    on CUDA (_launch.launch_tiles; the caller's block_m, block_n, num_warps where given), and
    `backward`, as the ops relpos::<name> and its backward (_ops.fused_function). The forward kernel's
    arguments: q, k, v, table, out, lse; the first three strides of q, k and out; H, the group size, Tq,
    Tk, table_size(P) (the kernel's own reading of the table's last dimension P) and 1 / sqrt(Dh).
    interpreted: whether the kernel module was imported under Triton's interpreter."""

    def forward(q: Tensor, k: Tensor, v: Tensor, table: Tensor, block_m: int | None, block_n: int | None,
                num_warps: int | None) -> tuple[Tensor, Tensor]:
        B, H, Tq, Dh = q.shape
        Hk, Tk = k.shape[1], k.shape[2]
        o, lse = softmax_outputs(q)
        launched = launch_tiles(tiles, q, block_m, block_n, num_warps, interpreted)
        forward_kernel()[(triton.cdiv(Tq, launched.block_m), B * H)](
            q, k, v, table, o, lse, *q.stride()[:3], *k.stride()[:3], *o.stride()[:3],
            H, H // Hk, Tq, Tk, table_size(table.shape[3]), 1.0 / math.sqrt(Dh),
            PRECISION=dot_precision(q.dtype, interpreted), **tile_constexprs(q, launched))
        return o, lse

    return fused_function(name, forward, softmax_outputs, backward, tensors=4)
