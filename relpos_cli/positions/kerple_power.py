"""KERPLE, power variant (Chi et al. 2022, "KERPLE: Kernelized Relative Positional Embedding for
Length Extrapolation").

logits[h, i, j] += -r1_h * |i - j|^r2_h with r1 > 0 and 0 < r2 <= 2 (the paper's conditional
positive definiteness constraint), learnable per layer and head.

Reference implementation: github.com/chijames/KERPLE (``ParallelKerplePower``): r1 ~ U(0, 1),
r2 ~ U(0, 2) at init, clamped to [1e-2, 2] for r2 and >= 1e-2 for r1.
"""

from __future__ import annotations

from torch import Tensor

from relpos_cli.positions import register
from relpos_cli.positions.base import per_head
from relpos_cli.positions.kerple_log import KerpleBias


@register("kerple_power")
class KerplePower(KerpleBias):
    paper = "Chi et al. 2022 (KERPLE, power)"
    r2_init_scale = 2.0
    r2_max = 2.0

    def pair_bias(self, layer: int, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        r1, r2 = self.params(layer)
        distance = self.distance(q_pos, k_pos)
        return -per_head(r1, distance) * distance ** per_head(r2, distance)  # (H, Tq, Tk)
