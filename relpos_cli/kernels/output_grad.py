"""FlashAttention-2's preprocessing of a softmax attention's backward, as one Triton kernel: each query
row's delta_i = dO_i . O_i (= sum_j P_ij dP_ij), in float32, from the output and its gradient in their
own dtype, read through their strides.

Eagerly, `(o.float() * do.float()).sum(-1)` is four kernels per layer and step, three of them over a
whole (B, T, D) tensor (two casts to float32 and the product); here one reads o and dO once. Used by
DAPE's backward, whose programs hold every head's rows. The other kernels compute it where a backward
program loads its rows of dO (relpos_cli/kernels/_tiles.row_delta): one launch fewer a layer and step.

Reference: Dao, "FlashAttention-2" (2023), Algorithm 2 line 4 (D_i = rowsum(dO_i o O_i)), and its
Triton tutorial's `_attn_bwd_preprocess`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from relpos_cli.kernels._launch import INTERPRETER_BLOCK, interpreting, padded_head_dim
from relpos_cli.kernels._tiles import load_rows

INTERPRETED = interpreting()  # fixed when the kernel below is defined (triton.jit reads it then)
ROWS = 64  # query rows a program reduces on CUDA: 64 x 64 16-bit elements of o and dO, 16 KiB


@triton.jit
def _attention_backward_delta(O, DO, DELTA, stride_ob, stride_oh, stride_ot, stride_dob, stride_doh, stride_dot, H, T,
                              HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """One tile of BLOCK_T rows of one (batch, head): DELTA (B * H, T) float32 at those rows."""
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rd = tl.arange(0, BLOCK_D)
    t_ok, d_ok = rt < T, rd < HEAD_DIM
    o = load_rows(O, b, h, rt, rd, t_ok, d_ok, stride_ob, stride_oh, stride_ot)
    do = load_rows(DO, b, h, rt, rd, t_ok, d_ok, stride_dob, stride_doh, stride_dot)
    tl.store(DELTA + bh * T + rt, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=t_ok)


def output_grad_dot(o: Tensor, do: Tensor) -> Tensor:
    """delta = dO_i . O_i per query row: o, do (B, H, T, Dh), each with its last stride 1 (the kernels'
    output and the gradient _ops.fused_function hands their backward) -> (B, H, T) float32."""
    B, H, T, Dh = o.shape
    delta = torch.empty((B, H, T), dtype=torch.float32, device=o.device)
    rows = INTERPRETER_BLOCK if INTERPRETED else ROWS
    _attention_backward_delta[(triton.cdiv(T, rows), B * H)](
        o, do, delta, *o.stride()[:3], *do.stride()[:3], H, T,
        HEAD_DIM=Dh, BLOCK_T=rows, BLOCK_D=padded_head_dim(Dh))
    return delta
