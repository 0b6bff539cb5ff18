"""NoPE with length-scaled attention: no position encoding, but each query's logits are multiplied
by a temperature, so that attention does not spread thinner as the context grows past training.

Kazemnejad et al. 2023 show that a causal decoder without position encoding (NoPE) generalises in
length only so far; Wang et al. 2024 ("Length Generalization of Causal Transformers without
Position Encoding") trace its failure to attention that spreads over more tokens than in training
and sharpen it with a temperature per head. Two temperatures (``temperature``):

- ``log_length``: query i's logits times max(1, log(i + 1) / log(L)), L = train.seq_len: exactly
  NoPE within the training length, sharper past it, no parameter. Reference: Qwen's ``logn``
  attention (``logn_list = [log(i, seq_length) if i > seq_length else 1 for i in range(1, ...)]``,
  multiplied into the queries).
- ``learned``: one temperature per (layer, head), a parameter initialised to 1 and trained with
  the model (Wang et al.'s head-based scale), the same at every position; a fine-tuned run
  (init_from) at a longer length adapts it there, which is how the paper uses it.

A temperature multiplies q . k, so it is applied to the queries before the dot product (the rotate
hook, leaving keys alone): every attention kernel runs it as it runs NoPE, with no bias.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from relpos_cli.errors import RelposError
from relpos_cli.positions import register
from relpos_cli.positions.base import ModelShape, PositionScheme

TEMPERATURES = ("log_length", "learned")


@register("nope_scaled")
class ScaledNoPE(PositionScheme):
    paper = "Kazemnejad et al. 2023; Wang et al. 2024 (NoPE, scaled)"
    decay_reference = "the learned temperature is a gain, not decayed (as nanoGPT's gains); log_length learns nothing"
    relative = False  # log_length reads the query's index

    def __init__(self, shape: ModelShape, temperature: str = "log_length"):
        super().__init__(shape)
        if temperature not in TEMPERATURES:
            raise RelposError(f"pos.temperature={temperature!r}; choose one of: {', '.join(TEMPERATURES)}")
        if temperature == "log_length" and shape.train_seq_len < 2:
            raise RelposError(f"pos.temperature=log_length divides by log(train.seq_len); train.seq_len={shape.train_seq_len} must be >= 2")
        self.temperature = temperature
        if temperature == "learned":
            self.head_temperature = nn.Parameter(torch.ones(shape.n_layers, shape.n_heads))

    @property
    def reads_positions(self) -> bool:  # randomized positions change log_length's temperatures, not a learned one's
        return self.temperature == "log_length"

    def query_temperature(self, layer: int, positions: Tensor) -> Tensor:
        """What multiplies each query's logits: positions (T,) -> (H or 1, T, 1)."""
        if self.temperature == "learned":
            return self.head_temperature[layer][:, None, None]  # (H, 1, 1)
        log_count = torch.log1p(positions.to(torch.float32))  # log(i + 1): the keys query i sees
        return log_count.div(math.log(self.shape.train_seq_len)).clamp(min=1.0)[None, :, None]  # (1, T, 1)

    def rotate(self, layer: int, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        return q * self.query_temperature(layer, positions).to(q.dtype), k
