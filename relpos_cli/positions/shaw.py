"""Relative position representations (Shaw et al. 2018, "Self-Attention with Relative Position
Representations"), keys only: e_ij = q_i . (k_j + r_clip(j - i, -K, K)) / sqrt(d).

A learned table R of 2K + 1 vectors of head size per layer, shared by the heads (as in the paper).
Computed as Shaw et al. suggest and Tensor2Tensor does (``_relative_attention_inner``), without an
L x L x d tensor: q @ R^T gives every query's logit against every clipped distance, (B, H, T, 2K+1),
then each (i, j) gathers column clip(j - i) + K. The bias depends on the query's content, so it is
declared a content bias: attention evaluates it one block of queries at a time at long lengths,
and since every distance from K on reads r_-K (``has_far_bias``), builds it only near the diagonal.
Reference: Tensor2Tensor ``dot_product_attention_relative``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from relpos_cli.errors import RelposError
from relpos_cli.positions import register
from relpos_cli.positions.base import BiasInput, ModelShape, PositionScheme


@register("shaw")
class Shaw(PositionScheme):
    paper = "Shaw et al. 2018 (relative positions)"
    bias_input = BiasInput.CONTENT
    decayed_parameters = ("table",)
    decay_reference = "Tensor2Tensor (optimize.weight_decay): every variable but biases is decayed"

    def __init__(self, shape: ModelShape, max_distance: int = 16):
        super().__init__(shape)
        if max_distance < 1:
            raise RelposError(f"pos.max_distance={max_distance} must be >= 1")
        self.max_distance = max_distance
        self.table = nn.Parameter(torch.randn(shape.n_layers, 2 * max_distance + 1, shape.head_dim) * 0.02)

    has_far_bias = True  # every distance >= K reads r_-K
    content_rule = "clipped_distance"  # on CUDA, model.attn_backend=fused runs relpos_cli/kernels/shaw.py
    content_bias_per_pair = True  # q_i . r[clip(j - i)]

    def kernel_inputs(self, layer: int, q: Tensor) -> tuple[Tensor]:
        return (q @ self.table[layer].to(q.dtype).T / math.sqrt(q.shape[-1]),)  # (B, H, T, 2K + 1)

    def far_keys(self, layer: int, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> int:
        # a key K or more before the block's first query is that far from all of them
        return int(torch.searchsorted(k_pos, q_pos[:1] - self.max_distance, right=True))

    def far_bias(self, layer: int, q: Tensor, q_pos: Tensor) -> Tensor:
        return q @ self.table[layer, 0].to(q.dtype) / math.sqrt(q.shape[-1])  # (B, H, Tq): r_-K is column 0

    def content_bias(self, layer: int, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        per_distance = q @ self.table[layer].to(q.dtype).T / math.sqrt(q.shape[-1])  # (B, H, Tq, 2K+1)
        column = (k_pos[None, :] - q_pos[:, None]).clamp(-self.max_distance, self.max_distance) + self.max_distance
        return per_distance.gather(-1, column.expand(*per_distance.shape[:2], *column.shape))  # (B, H, Tq, Tk)
