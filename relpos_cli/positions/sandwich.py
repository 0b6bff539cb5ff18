"""Sandwich (Chi et al. 2023, "Dissecting Transformer Length Extrapolation via the Lens of
Receptive Field Analysis"): the inner product of sinusoidal embeddings as a parameter-free bias.

logits[h, i, j] += (p_i . p_j - d'/2) / (8 h / H),  p = the d'-dimensional sinusoid of Vaswani et
al., so p_i . p_j = sum_k cos((i - j) w_k), w_k = 10000^(-2k/d'). Subtracting d'/2 only shifts each
row (softmax ignores it); the per-head compression 8h/H gives heads ALiBi-like receptive fields.

Reference implementation: NeMo ``sandwich_pos_bias`` (megatron position_embedding/sandwich), which
follows the same per-head scaling; here the sum of cosines is written out as in the paper.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relpos_cli.errors import RelposError
from relpos_cli.positions import register
from relpos_cli.positions.base import ModelShape, PositionScheme, causal_distance, per_head


@register("sandwich")
class Sandwich(PositionScheme):
    paper = "Chi et al. 2023 (Sandwich)"
    extrapolates = True

    def __init__(self, shape: ModelShape, dim: int = 128):
        super().__init__(shape)
        if dim < 2 or dim % 2:
            raise RelposError(f"pos.dim={dim} must be an even number >= 2")
        self.dim = dim
        omega = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float32) / dim)  # (d'/2,)
        heads = torch.arange(1, shape.n_heads + 1, dtype=torch.float32)
        self.register_buffer("omega", omega, persistent=False)
        self.register_buffer("head_scale", shape.n_heads / (8.0 * heads), persistent=False)  # (H,)

    def pair_bias(self, layer: int, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        distance = causal_distance(q_pos, k_pos).to(torch.float32)  # (Tq, Tk)
        inner = torch.zeros_like(distance)
        for w in self.omega:  # one frequency at a time keeps memory at O(Tq Tk)
            inner = inner + torch.cos(distance * w)
        return (inner - self.dim / 2) * per_head(self.head_scale, distance)  # (H, Tq, Tk)
