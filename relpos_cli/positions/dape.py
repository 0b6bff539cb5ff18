"""DAPE, data-adaptive positional encoding (Zheng et al. 2024, "DAPE: Data-Adaptive Positional
Encoding for Length Extrapolation", NeurIPS 2024).

A base position bias B (ALiBi, KERPLE, FIRE, ...) is adapted to the content: a small MLP reads,
for each (query, key) pair, the attention logits of all heads and the base bias of all heads, and
adds its output per head:

    logits = A + B + f([A; B]),   A = q k^T / sqrt(d),   f: 2H -> width -> H, LeakyReLU

one MLP per layer. Since f reads A, the bias depends on the content: DAPE declares a content bias
(whole rows, evaluated one block of queries at a time at long lengths). The base is any scheme
whose bias is a function of positions alone (a distance or index-pair declaration), built with its
own options (``base_options``) and trained with the rest.

Reference implementation: the authors' code (chuanyang-Zheng/DAPE ``DAPE.py``: ``AliBi_DAPE``,
``ParallelKerpleLog_DAPE``, ``FIRE_DAPE``: ``mlp2 = Sequential(Linear(2H, mlp_width),
LeakyReLU(), Linear(mlp_width, H))`` on ``cat((x, bias), dim=1)``, x + bias + mlp2(...)), where
x are the scaled attention scores before the causal mask.

The base keeps relpos's defaults for that scheme, which are its own paper's, not always the DAPE
code's: ``kerple_log`` shares one (r1, r2) per head across layers as KERPLE's code does, while the
DAPE code builds one ``ParallelKerpleLog_DAPE`` per attention layer (``base_options:
{shared_layers: false}`` reproduces it); ``FIRE_DAPE``'s own MLP has a LeakyReLU where ``fire``
keeps the FIRE paper's ReLU.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from relpos_cli.errors import RelposError
from relpos_cli.positions import REGISTRY, build_scheme, register
from relpos_cli.positions.base import BiasInput, ModelShape, PositionScheme

BASE_INPUTS = (BiasInput.DISTANCE, BiasInput.INDEX_PAIR)
HIDDEN_BYTES = 16 * 2**20  # the MLP's hidden layer for one group of query rows at most this big (fp32)
LEAKY_SLOPE = 0.01  # nn.LeakyReLU's default, as the reference's Sequential uses it


@register("dape")
class DAPE(PositionScheme):
    paper = "Zheng et al. 2024 (DAPE)"
    decay_reference = ("DAPE's code names no exclusion; its MLP's weight matrices decay like the model's other "
                       "weight matrices, its biases do not (nanoGPT's rule), and the base keeps its own declaration")
    relative = False  # set per instance: the MLP reads content, not positions, so DAPE is as relative as its base
    bias_input = BiasInput.CONTENT
    content_bias_per_pair = True  # the MLP reads one pair's logits and base biases, every head's

    def __init__(self, shape: ModelShape, base: str = "alibi", base_options: Mapping[str, Any] | None = None,
                 mlp_width: int = 32):
        super().__init__(shape)
        bases = sorted(n for n, c in REGISTRY.items() if c.bias_input in BASE_INPUTS)
        if base not in REGISTRY or REGISTRY[base].bias_input not in BASE_INPUTS:
            what = ("not a scheme" if base not in REGISTRY
                    else "it replaces softmax's normalisation, it adds no bias" if not REGISTRY[base].normalises
                    else "its bias reads the content" if REGISTRY[base].bias_input.reads_input else "it adds no bias")
            raise RelposError(f"pos.base={base!r} cannot be DAPE's base ({what}); choose a bias of positions: {', '.join(bases)}")
        if isinstance(mlp_width, bool) or not isinstance(mlp_width, int) or mlp_width < 1:
            raise RelposError(f"pos.mlp_width={mlp_width!r} must be a positive integer")
        base_options = {} if base_options is None else base_options
        if not isinstance(base_options, Mapping):
            raise RelposError(f"pos.base_options={base_options!r} must be a mapping of the base's own options, "
                              "e.g. {shared_layers: false} for kerple_log")
        if "name" in base_options:  # it would replace pos.base after the check above
            raise RelposError(f"pos.base_options.name={base_options['name']!r}: the base is named by pos.base (pos.base={base!r})")
        self.base = build_scheme({"name": base, **base_options}, shape)
        # the fused kernel (relpos_cli/kernels/dape.py) reads the base as a table of distances
        self.content_rule = "head_mlp" if self.base.bias_input is BiasInput.DISTANCE else None
        self.reads_positions = self.base.reads_positions
        self.relative = self.base.relative
        self.decayed_parameters = ("mlps.*.0.weight", "mlps.*.2.weight", *(f"base.{p}" for p in self.base.decayed_parameters))
        H = shape.n_heads
        self.mlps = nn.ModuleList(
            nn.Sequential(nn.Linear(2 * H, mlp_width), nn.LeakyReLU(), nn.Linear(mlp_width, H)) for _ in range(shape.n_layers)
        )

    def constrain_parameters(self) -> None:
        self.base.constrain_parameters()

    def check_length(self, length: int) -> None:
        self.base.check_length(length)

    def forward_pass(self, positions: Tensor) -> contextlib.AbstractContextManager:
        """The base's pass: what its layers share is computed once in it (its distance table)."""
        return self.base.forward_pass(positions)

    def kernel_inputs(self, layer: int, q: Tensor) -> tuple[Tensor, ...]:
        """The base's (H, T) table of distances and the layer's MLP: (base, w1, b1, w2, b2)."""
        first, _, last = self.mlps[layer]
        base = self.base.pass_distance_table(layer, q.shape[-2], q.device)  # (H, T)
        return base, first.weight, first.bias, last.weight, last.bias

    def content_bias(self, layer: int, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """q (B, H, Tq, Dh) at q_pos, k (B, H, Tk, Dh) at k_pos -> B + f([A; B]) (B, H, Tq, Tk).

        The MLP runs over the heads axis in place, (B, width, rows, Tk), a few query rows at a time:
        its hidden layer is width / H times the logits (4x at 8 heads), so whole blocks of rows
        would hold several times the memory of the rest of attention. The first layer's weights
        are split between A and B instead of concatenating them (the same sum)."""
        first, _, last = self.mlps[layer]
        H = q.shape[1]
        w_logits, w_base = first.weight[:, :H], first.weight[:, H:]  # (width, H) each
        rows = max(1, HIDDEN_BYTES // (4 * q.shape[0] * first.out_features * k.shape[-2]))
        out = []
        for start in range(0, q.shape[-2], rows):
            part = slice(start, start + rows)
            logits = (q[:, :, part] @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, H, r, Tk)
            base = self.base.score_bias(layer, q[:, :, part], k, q_pos[part], k_pos).to(logits.dtype)  # (H or B, H, r, Tk)
            hidden = torch.einsum("wh,bhqk->bwqk", w_logits, logits) + torch.einsum("wh,...hqk->...wqk", w_base, base)
            hidden = F.leaky_relu(hidden.add_(first.bias[:, None, None]), LEAKY_SLOPE)  # (B, width, r, Tk)
            mixed = torch.einsum("hw,bwqk->bhqk", last.weight, hidden).add_(last.bias[:, None, None])
            out.append(mixed.add_(base))  # (B, H, r, Tk)
        return torch.cat(out, dim=2) if len(out) > 1 else out[0]  # (B, H, Tq, Tk)
