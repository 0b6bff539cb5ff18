"""xPos (Sun et al. 2023, "A Length-Extrapolatable Transformer"): RoPE whose q/k pairs also decay
with distance.

Reference implementation: x-transformers ``RotaryEmbedding(use_xpos=True)`` /
``apply_rotary_pos_emb``. Rotated pair i is scaled by zeta_i^(n / scale_base) on queries and
zeta_i^(-n / scale_base) on keys, zeta_i = (2i + 0.4 d) / (1.4 d) < 1, so q_m . k_n carries
zeta_i^((m - n) / scale_base): a decay in the distance only. Positions are centred on the middle of
the window (as x-transformers does) to keep both factors finite at long lengths. Layout here is
half-split like ``rope`` (x-transformers interleaves pairs; the logits are the same up to that
permutation of head dimensions).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import Tensor

from relpos_cli.positions import register
from relpos_cli.positions.base import ModelShape, check_above
from relpos_cli.positions.rope import RoPE, apply_rotary_pair


@register("xpos")
class XPos(RoPE):
    paper = "Sun et al. 2023 (xPos)"

    def __init__(self, shape: ModelShape, base: float = 10000.0, scale_base: float = 512.0, rotary_fraction: float = 1.0,
                 scaling: Mapping[str, Any] | None = None, *, eval_scaling: Mapping[str, Any] | None = None):
        super().__init__(shape, base, rotary_fraction, scaling, eval_scaling=eval_scaling)
        check_above("scale_base", scale_base, 0, ": the decay's exponent is (m - n) / scale_base")
        self.scale_base = float(scale_base)
        dim = self.rotary_dim
        zeta = (torch.arange(0, dim, 2, dtype=torch.float32) + 0.4 * dim) / (1.4 * dim)  # (Dr/2,)
        self.register_buffer("zeta", zeta, persistent=False)

    def decay(self, positions: Tensor, centre: Tensor | None = None) -> Tensor:
        """Query scale (T, Dr); the key scale is its reciprocal. Centred on `centre` (default the
        middle of `positions`): queries and keys must share it for the logits to carry zeta^(i - j)."""
        centre = (positions.max() + 1) // 2 if centre is None else centre
        centred = positions - centre
        power = centred.to(torch.float32)[:, None] / self.scale_base  # (T, 1)
        scale = self.zeta[None, :] ** power  # (T, Dr/2)
        return torch.cat((scale, scale), dim=-1)

    def rotation_tables(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """RoPE's cos and sin times the decay for q, divided by it for k (kept, as RoPE's, for every
        layer and step: RoPE.rotation)."""
        cos, sin = self.cos_sin(positions)
        scale = self.decay(positions)
        return (cos * scale).to(dtype), (sin * scale).to(dtype), (cos / scale).to(dtype), (sin / scale).to(dtype)

    def rotate_apart(self, layer: int, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        length = q_pos.shape[0]  # the queries are the whole sequence (PositionScheme.rotate_apart)
        q_cos, q_sin = self.cos_sin(q_pos, length)
        k_cos, k_sin = self.cos_sin(k_pos, length)
        centre = (torch.maximum(q_pos.max(), k_pos.max()) + 1) // 2
        q_scale, k_scale = self.decay(q_pos, centre), self.decay(k_pos, centre)
        return apply_rotary_pair(q, k, (q_cos * q_scale).to(q.dtype), (q_sin * q_scale).to(q.dtype),
                                 (k_cos / k_scale).to(k.dtype), (k_sin / k_scale).to(k.dtype))
