"""Fixed sinusoidal absolute embeddings (Vaswani et al. 2017, "Attention Is All You Need").

PE[p, 2i] = sin(p / base^(2i/d)), PE[p, 2i+1] = cos(p / base^(2i/d)). Added to the token
embeddings scaled by d^-0.5 (x-transformers' ScaledSinusoidalEmbedding initial scale), so the
position signal does not drown the small-initialised token embeddings.
"""

import math

import torch
from torch import Tensor

from relpos_cli.positions import register
from relpos_cli.positions.base import ModelShape, PositionScheme


def sinusoidal_table(positions: Tensor, dim: int, base: float) -> Tensor:
    """(T,) positions -> (T, dim) interleaved sin/cos table."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # (T, dim/2)
    table = torch.stack((angles.sin(), angles.cos()), dim=-1)  # (T, dim/2, 2)
    return table.flatten(-2)[:, :dim]


@register("sinusoidal")
class Sinusoidal(PositionScheme):
    paper = "Vaswani et al. 2017"
    extrapolates = False
    relative = False

    def __init__(self, shape: ModelShape, base: float = 10000.0):
        super().__init__(shape)
        self.base = base
        self.scale = 1.0 / math.sqrt(shape.d_model)

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        return x + self.scale * sinusoidal_table(positions, self.shape.d_model, self.base).to(x.dtype)
