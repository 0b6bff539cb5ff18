"""Rotary position embedding (Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary
Position Embedding").

Reference implementation: ``transformers`` LlamaRotaryEmbedding / ``apply_rotary_pos_emb``
(half-split layout: dimension i pairs with i + d/2). q_m . k_n then depends on m - n only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relpos_cli.errors import RelposError
from relpos_cli.positions import register
from relpos_cli.positions.base import ModelShape, PositionScheme


def rope_inv_freq(head_dim: int, base: float = 10000.0) -> Tensor:
    """Rotation frequencies theta_i = base^(-2i/d), i = 0..d/2-1 -> (head_dim/2,)."""
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: (B, H, T, Dr), cos/sin: (T, Dr)."""
    return x * cos + rotate_half(x) * sin


@register("rope")
class Rotary(PositionScheme):
    paper = "Su et al. 2021 (RoFormer)"
    extrapolates = False

    def __init__(self, shape: ModelShape, base: float = 10000.0):
        super().__init__(shape)
        if shape.head_dim % 2:  # rotation turns pairs of dimensions
            raise RelposError(f"pos=rope needs an even head dim; model.d_model / model.n_heads = {shape.head_dim}")
        self.base = base
        self.register_buffer("inv_freq", rope_inv_freq(shape.head_dim, base), persistent=False)

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # (T, Dh/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, Dh)
        return emb.cos(), emb.sin()

    def rotate(self, layer: int, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = self.cos_sin(positions)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
