"""KERPLE, logarithmic variant (Chi et al. 2022, "KERPLE: Kernelized Relative Positional Embedding
for Length Extrapolation").

logits[h, i, j] += -r1_h * log(1 + r2_h * |i - j|), r1, r2 > 0 learnable per layer and head.

Reference implementation: the authors' GPT-NeoX fork (github.com/chijames/KERPLE,
``ParallelKerpleLog``): r1 ~ U(0, 2), r2 ~ U(0, 1) at init, both clamped to >= 1e-2 (the paper's
constraint, a projection after each step there; a clamp in the forward pass here, which gives the
same values and no gradient past the bound). With r1, r2 > 0 the bias is non-increasing in distance.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from relpos_cli.positions import register
from relpos_cli.positions.base import ModelShape, PositionScheme, causal_distance, per_head

EPS = 1e-2  # lower bound on r1, r2 as in the reference


class KerpleBias(PositionScheme):
    """Shared parameters of the KERPLE variants: r1, r2 per (layer, head)."""

    extrapolates = True
    r1_init_scale = 1.0
    r2_init_scale = 1.0
    r2_max = float("inf")

    def __init__(self, shape: ModelShape):
        super().__init__(shape)
        self.r1 = nn.Parameter(torch.rand(shape.n_layers, shape.n_heads) * self.r1_init_scale)
        self.r2 = nn.Parameter(torch.rand(shape.n_layers, shape.n_heads) * self.r2_init_scale)

    def params(self, layer: int) -> tuple[Tensor, Tensor]:
        """(H,) each, inside the paper's constraints."""
        return self.r1[layer].clamp(min=EPS), self.r2[layer].clamp(min=EPS, max=self.r2_max)

    def distance(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        return causal_distance(q_pos, k_pos).abs().to(torch.float32)  # (Tq, Tk)


@register("kerple_log")
class KerpleLog(KerpleBias):
    paper = "Chi et al. 2022 (KERPLE, log)"
    r1_init_scale = 2.0

    def pair_bias(self, layer: int, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        r1, r2 = self.params(layer)
        distance = self.distance(q_pos, k_pos)
        return -per_head(r1, distance) * torch.log1p(per_head(r2, distance) * distance)  # (H, Tq, Tk)
