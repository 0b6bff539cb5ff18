"""Sandwich (Chi et al. 2023, "Dissecting Transformer Length Extrapolation via the Lens of
Receptive Field Analysis"): the inner product of sinusoidal embeddings as a parameter-free bias.

logits[h, i, j] += (p_i . p_j - d'/2) / (8 h / H), h = 1..H, with the paper's
p_i . p_j = sum_{k=1..d'/2} cos((i - j) / 10000^(2k/d')): frequencies k = 1..d'/2, as in the
paper's equation and NeMo's ``sandwich_pos_bias`` (Vaswani's table, k = 0..d'/2-1, would add the
frequency-1 term cos(i - j) and drop the slowest one). Subtracting d'/2 makes the bias 0 at distance
0 and only shifts each row (softmax ignores it); the per-head compression 8h/H gives heads
ALiBi-like receptive fields.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relpos_cli.errors import RelposError
from relpos_cli.positions import register
from relpos_cli.positions.base import BiasInput, ModelShape, PositionScheme, per_head


# first k of the sum: the paper's k = 1..d'/2, or Vaswani's table k = 0..d'/2-1 (relpos before; kept
# so runs trained with it evaluate as trained)
FREQUENCIES = {"paper": 1, "vaswani": 0}
FREQUENCY_BLOCK_ELEMENTS = 2**24  # cosines held at once by distance_bias: 64 MiB in float32


@register("sandwich")
class Sandwich(PositionScheme):
    paper = "Chi et al. 2023 (Sandwich)"
    bias_input = BiasInput.DISTANCE
    added_options = {"frequencies": "vaswani"}

    def __init__(self, shape: ModelShape, dim: int = 128, frequencies: str = "paper"):
        super().__init__(shape)
        if dim < 2 or dim % 2:
            raise RelposError(f"pos.dim={dim} must be an even number >= 2")
        if frequencies not in FREQUENCIES:
            raise RelposError(f"pos.frequencies={frequencies!r}; choose one of: {', '.join(FREQUENCIES)}")
        self.dim = dim
        k = torch.arange(dim // 2, dtype=torch.float32) + FREQUENCIES[frequencies]
        omega = 10000.0 ** (-2 * k / dim)  # (d'/2,)
        heads = torch.arange(1, shape.n_heads + 1, dtype=torch.float32)
        self.register_buffer("omega", omega, persistent=False)
        self.register_buffer("head_scale", shape.n_heads / (8.0 * heads), persistent=False)  # (H,)

    def distance_table_layer(self, layer: int) -> int:
        return 0  # fixed: every layer's bias is the same

    def distance_bias(self, layer: int, distance: Tensor) -> Tensor:
        distance = distance.to(torch.float32)
        # as many frequencies per kernel as keep the (..., chunk) cosines under FREQUENCY_BLOCK_ELEMENTS: a
        # training step's (T,) table is one chunk (one frequency per kernel was 128 launches per layer and
        # step: Sandwich trained at 0.39x NoPE's rate on an H100, KERPLE's same kernel at 0.64x), an
        # evaluation block's (Tq, Tk) distances a few
        chunk = max(1, FREQUENCY_BLOCK_ELEMENTS // max(1, distance.numel()))
        inner = torch.zeros_like(distance)
        for start in range(0, self.omega.numel(), chunk):
            inner += torch.cos(distance[..., None] * self.omega[start : start + chunk]).sum(-1)
        return (inner - self.dim / 2) * per_head(self.head_scale, distance)  # (H, ...)
