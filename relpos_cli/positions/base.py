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
        self._translation_invariant: dict[int, bool] = {}  # per layer, filled by distance_table

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

    def bias_table(self, layer: int, q: Tensor, k: Tensor, q_pos: Tensor) -> Tensor:
        """Optional seam for content-dependent biases of the form table[b, h, i, table_index(i, j)]
        (Shaw: q_i . a_clip(j - i)). q: (B, H, Tq, Dh) at q_pos (Tq,) -> table (B, H, Tq, R).

        Overriding it (with ``table_index``) gives the scheme a FlexAttention score_mod (a gather
        per logit) and memory-linear chunked attention without writing ``score_bias``."""
        raise NotImplementedError

    def table_index(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """Elementwise int64 index into the last axis of ``bias_table`` for (q_pos, k_pos) pairs."""
        raise NotImplementedError

    def score_bias_block(self, layer: int, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """Additive logits for a block of queries: q (B, H, Tq, Dh) at q_pos (Tq,), k (B, H, Tk, Dh)
        at k_pos (Tk,) -> broadcastable to (B, H, Tq, Tk).

        Content-dependent schemes that fit neither ``pair_bias`` nor ``bias_table`` (CoPE) override
        this rather than ``score_bias``: attention then evaluates long lengths query block by query
        block, keeping memory linear in L."""
        if self._overrides("bias_table"):
            table = self.bias_table(layer, q, k, q_pos)  # (B, H, Tq, R)
            index = self.table_index(q_pos[:, None], k_pos[None, :])  # (Tq, Tk)
            return table.gather(-1, index.expand(*table.shape[:2], *index.shape))
        return self.pair_bias(layer, q_pos[:, None], k_pos[None, :])

    def score_bias(self, layer: int, q: Tensor, k: Tensor, positions: Tensor) -> Tensor:
        """Additive logits. q, k: (B, H, T, Dh) -> broadcastable to (B, H, T, T).

        Index-pair schemes get it from ``pair_bias``, content-dependent ones from ``bias_table`` or
        ``score_bias_block``. Overriding it directly still works, but then long evaluation
        materialises the full (B, H, T, T) bias."""
        return self.score_bias_block(layer, q, k, positions, positions)

    def score_mod(self, layer: int, q: Tensor, k: Tensor, positions: Tensor):
        """FlexAttention score_mod adding this scheme's bias one logit at a time (no L x L tensor),
        or None when the bias cannot be expressed that way (attention then chunks queries).

        Every lookup is a captured tensor indexed by (h, computed index): Inductor's pointwise
        lowering of score_mods gets that right, whereas evaluating ``pair_bias`` per element and
        then picking the head miscompiles gathers (torch 2.13, checked against eager)."""
        if self._overrides("bias_table"):
            table = self.bias_table(layer, q, k, positions)  # (B, H, T, R)

            def table_mod(score, b, h, q_idx, kv_idx):
                return score + table[b, h, q_idx, self.table_index(positions[q_idx], positions[kv_idx])]

            return table_mod
        distance_bias = self.distance_table(layer, positions)
        if distance_bias is None:
            return None

        def distance_mod(score, b, h, q_idx, kv_idx):
            # masked (future) pairs have negative distances: clamp keeps the lookup in bounds
            return score + distance_bias[h, (q_idx - kv_idx).clamp(min=0)]

        return distance_mod

    def distance_table(self, layer: int, positions: Tensor, probe: int = 64) -> Tensor | None:
        """pair_bias as a function of the causal distance i - j: (H, T) for distances 0..T-1, or None
        when the bias is not translation invariant (checked on a probe block against pair_bias).

        Assumes positions are consecutive (arange + offset), as the model always passes them."""
        last = positions[-1:]
        table = self.pair_bias(layer, last[:, None], (last - torch.arange(len(positions), device=last.device))[None, :])
        table = table.reshape(table.shape[0], -1)  # (H, T)
        if layer in self._translation_invariant:
            return table if self._translation_invariant[layer] else None
        p = positions[:probe]
        dense = self.pair_bias(layer, p[:, None], p[None, :]).expand(table.shape[0], len(p), len(p))  # (H, P, P)
        dist = (p[:, None] - p[None, :]).clamp(min=0)  # (P, P)
        causal = p[:, None] >= p[None, :]
        invariant = torch.allclose(dense[:, causal], table[:, dist][:, causal], atol=1e-6)
        # a property of the formula, so remembered per layer (no check, no host sync, on later steps);
        # but a bias that is still constant (zero-initialised parameters) proves nothing yet
        if not invariant or bool((dense[:, causal].amax(-1) > dense[:, causal].amin(-1)).any()):
            self._translation_invariant[layer] = invariant
        return table if invariant else None

    # ---- what attention asks -------------------------------------------------------------------
    @classmethod
    def _overrides(cls, method: str) -> bool:
        return getattr(cls, method) is not getattr(PositionScheme, method)

    @property
    def uses_rotation(self) -> bool:
        return self._overrides("rotate")

    _BIAS_HOOKS = ("pair_bias", "bias_table", "score_bias_block", "score_bias")

    @property
    def uses_score_bias(self) -> bool:
        return any(self._overrides(h) for h in self._BIAS_HOOKS)

    @property
    def has_pair_bias(self) -> bool:
        """The bias depends on the index pair only: cacheable per (q_len, k_len)."""
        return self._overrides("pair_bias") and not any(self._overrides(h) for h in self._BIAS_HOOKS[1:])

    @property
    def has_score_mod(self) -> bool:
        """The bias may be a FlexAttention score_mod (pair_bias or bias_table, nothing overridden
        after); ``score_mod`` still returns None for index-pair biases that are not translation
        invariant."""
        return (self._overrides("pair_bias") or self._overrides("bias_table")) and not (
            self._overrides("score_bias_block") or self._overrides("score_bias")
        )

    @property
    def chunkable(self) -> bool:
        """Attention may ask for the bias one query block at a time (score_bias not overridden)."""
        return self.uses_score_bias and not self._overrides("score_bias")

    @property
    def uses_embedding(self) -> bool:
        return self._overrides("embed")

    @classmethod
    def hooks(cls) -> list[str]:
        found = [h for h in ("embed", "rotate") if cls._overrides(h)]
        if any(cls._overrides(h) for h in cls._BIAS_HOOKS):
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
