"""Relative position representations (Shaw et al. 2018, "Self-Attention with Relative Position
Representations"), keys only: e_ij = q_i . (k_j + r_clip(j - i, -K, K)) / sqrt(d).

A learned table R of 2K + 1 vectors of head size per layer, shared by the heads (as in the paper).
Computed as Shaw et al. suggest and Tensor2Tensor does (``_relative_attention_inner``), without an
L x L x d tensor: q @ R^T gives every query's logit against every clipped distance, (B, H, T, 2K+1),
then each (i, j) gathers column clip(j - i) + K. So the bias of a (query, key) pair is a lookup in
a per-query table indexed by the pair's clipped distance; a FlexAttention score_mod can read that
(B, H, T, 2K+1) table captured from outside: the ``bias_table`` / ``table_index`` seam. Reference: Tensor2Tensor ``dot_product_attention_relative``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from relpos_cli.errors import RelposError
from relpos_cli.positions import register
from relpos_cli.positions.base import ModelShape, PositionScheme


@register("shaw")
class ShawRelative(PositionScheme):
    paper = "Shaw et al. 2018 (relative positions)"
    extrapolates = True  # every distance past K shares r_K

    def __init__(self, shape: ModelShape, max_distance: int = 16):
        super().__init__(shape)
        if max_distance < 1:
            raise RelposError(f"pos.max_distance={max_distance} must be >= 1")
        self.max_distance = max_distance
        self.table = nn.Parameter(torch.randn(shape.n_layers, 2 * max_distance + 1, shape.head_dim) * 0.02)

    def bias_table(self, layer: int, q: Tensor, k: Tensor, q_pos: Tensor) -> Tensor:
        """Every query's logit against every clipped distance: (B, H, Tq, 2K+1)."""
        return q @ self.table[layer].to(q.dtype).T / math.sqrt(q.shape[-1])

    def table_index(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """Column of the table for each (query i, key j) pair: clip(j - i, -K, K) + K."""
        return (k_pos - q_pos).clamp(-self.max_distance, self.max_distance) + self.max_distance
