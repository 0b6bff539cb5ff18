"""The interface every position scheme implements.

A scheme enters attention at up to three hook points (x-transformers' taxonomy) and nowhere else:

- ``embed(x, positions)``: add position information to the token embeddings (learned, sinusoidal);
- ``rotate(layer, q, k, positions)``: transform queries and keys before the dot product (RoPE, xPos);
- ``score_bias(layer, q, k, positions)``: an additive term for the attention logits
  (ALiBi, T5, KERPLE, FIRE, Shaw, ...).

Schemes whose bias depends only on the (query, key) index pair implement ``pair_bias`` as an
elementwise function of the two index tensors, so the same code yields a dense (H, Tq, Tk) bias
at training lengths and a per-element FlexAttention ``score_mod`` at long evaluation lengths.

The attention module only asks which hooks a scheme overrides (``uses_rotation``,
``uses_score_bias``); it never tests a scheme's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class ModelShape:
    """What a scheme may need to know about the model it is built for."""

    d_model: int
    n_heads: int
    n_layers: int
    train_seq_len: int

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class PositionScheme(nn.Module):
    """Base class: every hook is the identity / absent until a subclass overrides it."""

    name: str = ""
    paper: str = ""
    extrapolates: bool = False  # by design, not as measured
    relative: bool = True  # logits depend on positions only through i - j (shift invariant)

    def __init__(self, shape: ModelShape):
        super().__init__()
        self.shape = shape

    # ---- hook 1: embeddings -------------------------------------------------------------------
    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        """x: (B, T, D) token embeddings, positions: (T,) -> (B, T, D)."""
        return x

    # ---- hook 2: q/k rotation -----------------------------------------------------------------
    def rotate(self, layer: int, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """q, k: (B, H, T, Dh), positions: (T,) -> rotated (q, k)."""
        return q, k

    # ---- hook 3: additive logit bias ----------------------------------------------------------
    def pair_bias(self, layer: int, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """Bias for index pairs. q_pos (Tq, 1), k_pos (1, Tk) -> (H, Tq, Tk).

        Must be elementwise in (q_pos, k_pos): no op may mix different pairs."""
        raise NotImplementedError

    def score_bias(self, layer: int, q: Tensor, k: Tensor, positions: Tensor) -> Tensor:
        """Additive logits. q, k: (B, H, T, Dh) -> broadcastable to (B, H, T, T).

        Content-dependent schemes (Shaw, CoPE) override this; index-pair schemes get it from
        ``pair_bias``."""
        return self.pair_bias(layer, positions[:, None], positions[None, :])

    # ---- what attention asks -------------------------------------------------------------------
    @classmethod
    def _overrides(cls, method: str) -> bool:
        return getattr(cls, method) is not getattr(PositionScheme, method)

    @property
    def uses_rotation(self) -> bool:
        return self._overrides("rotate")

    @property
    def uses_score_bias(self) -> bool:
        return self._overrides("score_bias") or self._overrides("pair_bias")

    @property
    def uses_embedding(self) -> bool:
        return self._overrides("embed")

    @classmethod
    def hooks(cls) -> list[str]:
        found = [h for h in ("embed", "rotate") if cls._overrides(h)]
        if cls._overrides("score_bias") or cls._overrides("pair_bias"):
            found.append("score_bias")
        return found

    def check_length(self, length: int) -> None:
        """Raise RelposError if this scheme cannot represent sequences of `length`."""

    def configure_eval(self, length: int, eval_cfg: Mapping[str, Any]) -> None:
        """Called before scoring windows of `length` tokens; eval-time variants (RoPE scaling)
        read their settings from `eval_cfg` here. Training never calls it."""


def causal_distance(q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """i - j for query i and key j: >= 0 for every key a causal query may see."""
    return q_pos - k_pos


def per_head(values: Tensor, like: Tensor) -> Tensor:
    """(H,) per-head values shaped (H, 1, ..., 1) to broadcast against index tensors like `like`."""
    return values.view(-1, *([1] * like.dim()))


def float_positions(positions: Tensor) -> Tensor:
    return positions.to(torch.float32)
