"""KERPLE, power variant (Chi et al. 2022, "KERPLE: Kernelized Relative Positional Embedding for
Length Extrapolation").

logits[h, i, j] += -r1_h * |i - j|^r2_h with r1 > 0 and 0 < r2 <= 2 (the paper's conditional
positive definiteness constraint), learnable per head, shared by the layers by default.

Reference implementation: github.com/chijames/KERPLE (``ParallelKerplePower``, ``bias_a`` = r1,
``bias_p`` = r2): r1 ~ U(0, 1), r2 ~ U(0, 2) at init, projected into r1 >= 1e-2, r2 in [1e-2, 2]
(see kerple_log for the projection and the sharing).
"""

from __future__ import annotations

from torch import Tensor

from relpos_cli.positions import register
from relpos_cli.positions.kerple_log import KerpleBias


@register("kerple_power")
class KerplePower(KerpleBias):
    paper = "Chi et al. 2022 (KERPLE, power)"
    r2_init_scale = 2.0
    r2_max = 2.0

    def kernel(self, r1: Tensor, r2: Tensor, distance: Tensor) -> Tensor:
        return -r1 * distance**r2
