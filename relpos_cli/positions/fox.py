"""The Forgetting Transformer, FoX (Lin et al. 2025, "Forgetting Transformer: Softmax Attention with
a Forget Gate", ICLR 2025).

Each token t gets a forget gate per head, f_t = sigmoid(w_h . x_t + b_h), from the attention layer's
input x_t; query i weighs key j by the gates between them, logits[h, i, j] += sum_{l=j+1..i} log f_l
= D_i - D_j with D the cumulative sum of log f. No other position encoding: the decay is the only
position signal, data-dependent and never longer than the sequence, so FoX extrapolates like a
learned, content-gated ALiBi.

Reference implementation: the authors' ``ForgettingAttentionLayer`` (zhixuan-lin/forgetting-
transformer, ``fgate_type="full"``: ``fgate_proj = nn.Linear(hidden_size, num_heads, bias=True)``,
weights N(0, 0.02) and a zero bias, ``log_fgate = logsigmoid(fgate_proj(hidden_states).float())``)
and flash-linear-attention's ``naive_forgetting_attn`` (``gc = g.cumsum``, ``+ gc_i - gc_j``).
The cumulative sum is taken in float64: at 16k tokens D reaches thousands, where float32 keeps
only a few decimals of the differences that matter.

FoX declares a token-difference bias (``BiasInput.TOKEN_DIFFERENCE``), not a generic content bias:
attention needs only the keys' D_j, one (B, H, T) vector, so long evaluation builds no (Tq, Tk) bias.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from relpos_cli.positions import register
from relpos_cli.positions.base import TOKEN_EMBEDDING_STD, BiasInput, ModelShape, PositionScheme


@register("fox")
class FoX(PositionScheme):
    paper = "Lin et al. 2025 (Forgetting Transformer, FoX)"
    decayed_parameters = ("gates.*.weight",)
    decay_reference = ("the FoX code names no exclusion for its gate; relpos decays the gate's projection like "
                       "the model's other weight matrices and leaves its bias out (nanoGPT's rule)")
    reads_positions = False  # the gates read tokens; positions only order them
    bias_input = BiasInput.TOKEN_DIFFERENCE

    def __init__(self, shape: ModelShape):
        super().__init__(shape)
        self.gates = nn.ModuleList(nn.Linear(shape.d_model, shape.n_heads) for _ in range(shape.n_layers))
        for gate in self.gates:  # as the reference's _initialize_weights
            nn.init.normal_(gate.weight, std=TOKEN_EMBEDDING_STD)
            nn.init.zeros_(gate.bias)

    def log_forget(self, layer: int, x: Tensor) -> Tensor:
        """log f_t for x (B, T, D) -> (B, H, T), in float32 as the reference (under autocast too)."""
        return F.logsigmoid(self.gates[layer](x).float()).transpose(1, 2)

    def token_values(self, layer: int, x: Tensor) -> Tensor:
        # cast and laid out (B, H, T) in one copy: the fused kernel reads D contiguous
        log_forget = self.log_forget(layer, x).to(torch.float64, memory_format=torch.contiguous_format)
        return log_forget.cumsum(-1)  # (B, H, T): D_t = sum of log f up to t
