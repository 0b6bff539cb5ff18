"""KERPLE, logarithmic variant (Chi et al. 2022, "KERPLE: Kernelized Relative Positional Embedding
for Length Extrapolation").

logits[h, i, j] += -r1_h * log(1 + r2_h * |i - j|), r1, r2 > 0 learnable per head.

Reference implementation: the authors' GPT-NeoX fork (github.com/chijames/KERPLE,
``ParallelKerpleLog``): r1 ~ U(0, 2), r2 ~ U(0, 1) at init; one module built once and handed to
every layer, so all layers share one (r1, r2) per head (``shared_layers=true``, the default here;
``false`` learns one set per layer). The constraint r >= 1e-2 is kept by projection: the stored
value is clamped before it is used (there, at every forward; here, after every optimizer step via
``constrain_parameters`` and at init, which gives the same values), so a parameter at the bound
still gets its gradient and can move back up. With r1, r2 > 0 the bias is non-increasing in distance.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from relpos_cli.positions import register
from relpos_cli.positions.base import BiasInput, ModelShape, PositionScheme, per_head

EPS = 1e-2  # lower bound on r1, r2 as in the reference


class KerpleBias(PositionScheme):
    """What both KERPLE variants share: r1, r2 per head (and per layer unless shared), projected
    into [EPS, r1_max] x [EPS, r2_max] after every optimizer step."""

    bias_input = BiasInput.DISTANCE
    decayed_parameters = ()
    decay_reference = "KERPLE's code (chijames/KERPLE kerple_configs/train.yml): weight-decay 0.0"
    added_options = {"shared_layers": False}
    r1_init_scale = 1.0
    r2_init_scale = 1.0
    r1_max = float("inf")
    r2_max = float("inf")

    def __init__(self, shape: ModelShape, shared_layers: bool = True):
        super().__init__(shape)
        self.shared_layers = shared_layers
        n_sets = 1 if shared_layers else shape.n_layers
        self.r1 = nn.Parameter(torch.rand(n_sets, shape.n_heads) * self.r1_init_scale)
        self.r2 = nn.Parameter(torch.rand(n_sets, shape.n_heads) * self.r2_init_scale)
        self.constrain_parameters()

    @torch.no_grad()
    def constrain_parameters(self) -> None:
        self.r1.clamp_(EPS, self.r1_max)
        self.r2.clamp_(EPS, self.r2_max)

    def distance_table_layer(self, layer: int) -> int:
        return 0 if self.shared_layers else layer

    def distance_bias(self, layer: int, distance: Tensor) -> Tensor:
        index = self.distance_table_layer(layer)
        distance = distance.abs().to(torch.float32)
        return self.kernel(per_head(self.r1[index], distance), per_head(self.r2[index], distance), distance)

    def kernel(self, r1: Tensor, r2: Tensor, distance: Tensor) -> Tensor:
        """r1, r2: (H, 1, ...) against distance |i - j| (...) -> (H, ...); or all three of one shape."""
        raise NotImplementedError


@register("kerple_log")
class KerpleLog(KerpleBias):
    paper = "Chi et al. 2022 (KERPLE, log)"
    r1_init_scale = 2.0

    def kernel(self, r1: Tensor, r2: Tensor, distance: Tensor) -> Tensor:
        return -r1 * torch.log1p(r2 * distance)
