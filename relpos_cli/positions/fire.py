"""FIRE (Li et al. 2023, "Functional Interpolation for Relative Positions Improves Long Context
Transformers").

logits[h, i, j] += f_h(psi(i - j) / psi(max(L, i))), psi(x) = log(c x + 1), f a small MLP
(1 -> width -> H, ReLU), c and the threshold L learnable (L = |multiplier * init_L|, the
multiplier learned, as in the paper's appendix code, which is the reference implementation here).
The normaliser psi(max(L, i)) makes the input lie in [0, 1] at any length, which is what lets FIRE
extrapolate; it also depends on the query's absolute index, so FIRE is not shift invariant:
it declares an index-pair bias, not a distance one.
Each layer has its own FIRE (one per attention layer, as in the paper's code).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from relpos_cli.positions import register
from relpos_cli.positions.base import BiasInput, ModelShape, PositionScheme, records_gradient


class FireLayer(nn.Module):
    def __init__(self, n_heads: int, width: int, init_c: float, init_threshold: float, eps: float = 1e-6):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(1, width), nn.ReLU(), nn.Linear(width, n_heads))
        self.c = nn.Parameter(torch.tensor(float(init_c)))
        self.register_buffer("init_threshold", torch.tensor(float(init_threshold)))
        self.threshold_multiplier = nn.Parameter(torch.tensor(1.0))
        self.eps = eps

    def forward(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """Elementwise in the index pair: q_pos (Tq, 1), k_pos (1, Tk) -> (H, Tq, Tk)."""
        distance = (q_pos - k_pos).to(torch.float32)
        threshold = (self.threshold_multiplier * self.init_threshold).abs()
        normaliser = torch.maximum(q_pos.to(torch.float32), threshold)  # (Tq, 1)
        psi_distance = torch.log((self.c * distance).abs() + 1)
        psi_normaliser = torch.log((self.c * normaliser).abs() + 1) + self.eps
        normalised = psi_distance / psi_normaliser  # (Tq, Tk), in [0, 1] for causal pairs
        if records_gradient(*self.parameters()):
            return self.mlp(normalised[..., None]).movedim(-1, 0)  # (H, Tq, Tk)
        return self.piecewise_linear(normalised)

    def piecewise_linear(self, x: Tensor) -> Tensor:
        """The MLP at every x (Tq, Tk) -> (H, Tq, Tk), without its (Tq, Tk, width) hidden layer.

        With a scalar input, W2 relu(w1 x + b1) + b2 is piecewise linear in x, with a knot where each
        hidden unit switches on (x = -b1/w1): between knots it is slope * x + intercept, per head.
        So x only needs its segment (a search among width knots) and two gathers. At L = 16384 the
        hidden layer is what made FIRE's evaluation slow and large (width 32: 32 floats per pair).
        The gathers are index_select on the flat segments, from the (segments, H) tables seen as
        (H, segments): indexing slope.T[:, segment] took 4x as long for a (32 x 16384) block, and
        the same index_select from a contiguous (H, segments) table 2x (README, Speed)."""
        first, last = self.mlp[0], self.mlp[2]
        w1, b1 = first.weight[:, 0], first.bias  # (width,)
        knots = torch.where(w1 != 0, -b1 / w1, torch.full_like(b1, float("inf"))).sort().values  # (width,)
        finite = knots[knots.isfinite()]
        # one point inside each segment: below the first knot, between neighbours, above the last
        inside = torch.cat([finite[:1] - 1, (finite[1:] + finite[:-1]) / 2, finite[-1:] + 1]) if finite.numel() \
            else torch.zeros(1, device=x.device)
        active = ((w1 * inside[:, None] + b1) > 0).to(w1.dtype)  # (segments, width)
        slope = (active * w1) @ last.weight.T  # (segments, H)
        intercept = (active * b1) @ last.weight.T + last.bias  # (segments, H)
        segment = torch.searchsorted(finite, x.contiguous()).view(-1)  # (Tq Tk,); at a knot the MLP is continuous
        per_head = lambda table: table.T.index_select(1, segment).view(-1, *x.shape)  # noqa: E731  (H, Tq, Tk)
        return per_head(intercept).addcmul_(per_head(slope), x)


@register("fire")
class Fire(PositionScheme):
    paper = "Li et al. 2023 (FIRE)"
    extrapolates = True
    relative = False  # the normaliser psi(max(L, i)) sees the query's absolute index
    bias_input = BiasInput.INDEX_PAIR

    def __init__(self, shape: ModelShape, mlp_width: int = 32, init_c: float = 0.1, init_threshold: float | None = None):
        super().__init__(shape)
        threshold = shape.train_seq_len if init_threshold is None else init_threshold
        self.layers = nn.ModuleList(
            FireLayer(shape.n_heads, mlp_width, init_c, threshold) for _ in range(shape.n_layers)
        )

    def pair_bias(self, layer: int, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        return self.layers[layer](q_pos, k_pos)
