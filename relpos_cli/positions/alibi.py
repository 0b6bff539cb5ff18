"""ALiBi (Press et al. 2022, "Train Short, Test Long: Attention with Linear Biases Enables Input
Length Extrapolation").

logits[h, i, j] += -m_h * |i - j| with fixed geometric slopes m_h. Slopes for head counts that
are not powers of two follow the paper's recipe as in fairseq and ``transformers`` Bloom
(``build_alibi_tensor``): the slopes of the closest power of two, then every other slope of
twice that many. The causal mask hides j > i, so |i - j| equals the paper's i - j where it counts.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from relpos_cli.positions import register
from relpos_cli.positions.base import BiasInput, ModelShape, PositionScheme, per_head


def alibi_slopes(n_heads: int) -> Tensor:
    """Per-head slopes (n_heads,): 2^(-8/n), 2^(-16/n), ... for n a power of two."""

    def power_of_two_slopes(n: int) -> list[float]:
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if n_heads < 1:
        raise ValueError("n_heads must be positive")
    closest = 2 ** math.floor(math.log2(n_heads))
    slopes = power_of_two_slopes(closest)
    if closest != n_heads:
        slopes += power_of_two_slopes(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


@register("alibi")
class ALiBi(PositionScheme):
    paper = "Press et al. 2022 (ALiBi)"
    bias_input = BiasInput.DISTANCE

    def __init__(self, shape: ModelShape):
        super().__init__(shape)
        self.register_buffer("slopes", alibi_slopes(shape.n_heads), persistent=False)
        # what the fused kernel multiplies each distance by, negated once here rather than in every layer and step
        self.register_buffer("bias_per_distance", -self.slopes, persistent=False)

    def distance_bias(self, layer: int, distance: Tensor) -> Tensor:
        distance = distance.abs().to(torch.float32)
        return -per_head(self.slopes, distance) * distance  # (H, ...)

    def distance_table_layer(self, layer: int) -> int:
        return 0  # fixed: every layer's bias is the same

    def linear_distance_slopes(self, layer: int) -> Tensor:
        return self.bias_per_distance

    def score_formula(self, layer: int):
        slopes = self.slopes  # fixed: no gradient to gather

        def alibi(head: Tensor, i: Tensor, j: Tensor) -> Tensor:
            return -slopes[head] * (i - j).abs().to(torch.float32)

        return alibi
