"""Stick-breaking attention (Tan et al. 2025, "Scaling Stick-Breaking Attention: An Efficient
Implementation and In-depth Study", ICLR 2025).

No position encoding: order comes from how attention is shared out. Query i looks at its keys from
the nearest back; key j takes the share beta_ij = sigmoid(z_ij), z_ij = q_i . k_j / sqrt(d), of the
stick the nearer keys left:

    A_ij = beta_ij * prod_{j < l < i} (1 - beta_il)        (keys j < i; j <= i with attend_current)

The weights sum to at most 1 and are used as they are: no softmax. In log space,
log A_ij = z_ij - sum_{l = j}^{i - 1} softplus(z_il), so the scheme declares a content bias,
b_ij = -sum_{l=j}^{i-1} softplus(z_il) (a suffix sum over the query's row, like CoPE's counts;
-inf on keys the query does not see), and that its weights are not normalised
(``normalises = False``): attention takes exp(logits + bias) without dividing by their sum.

Reference implementation: flash-linear-attention ``fla/ops/stickbreaking_attn/naive.py``
(``naive_stickbreaking_attn``, ``attend_current=False`` by default, as its layer uses it, the
leftover stick dropped).

Far keys weigh nothing: once the keys nearer to query i than key j have taken enough of the stick,
sum_{l=j+1}^{i-1} softplus(z_il) >= 110, A_ij <= e^-110 is below what float32 (and bfloat16) can
hold and rounds to exactly 0. Evaluation finds, per block of queries, the keys before which that
holds for every query of the block (``far_keys``, ``far_bias`` = -inf) and leaves them out.
"""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import Tensor

from relpos_cli.errors import RelposError
from relpos_cli.positions import register
from relpos_cli.positions.base import BiasInput, ModelShape, PositionScheme

SPENT = 110.0  # e^-110 rounds to 0 in float32 (below half its smallest subnormal, e^-103.3)


@register("stickbreaking")
class StickBreaking(PositionScheme):
    paper = "Tan et al. 2025 (stick-breaking attention)"
    reads_positions = False  # the shares read q . k; the indices only order the keys
    bias_input = BiasInput.CONTENT
    normalises = False
    weight_rule = "stick_breaking"  # on CUDA attention runs the fused kernel (relpos_cli/kernels/stickbreaking.py)

    def __init__(self, shape: ModelShape, attend_current: bool = False):
        super().__init__(shape)
        if not isinstance(attend_current, bool):
            raise RelposError(f"pos.attend_current={attend_current!r} must be true or false")
        self.attend_current = attend_current
        self.attends_to_itself = attend_current

    def visible(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """(Tq, Tk): the keys each query shares its stick among."""
        return k_pos[None, :] <= q_pos[:, None] if self.attend_current else k_pos[None, :] < q_pos[:, None]

    def taken(self, q: Tensor, k: Tensor, visible: Tensor) -> Tensor:
        """-log(1 - beta_ij) = softplus(z_ij): what each visible key takes off the stick, in log, (B, H, Tq, Tk)."""
        return F.softplus((q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])).masked_fill(~visible, 0.0)

    def content_bias(self, layer: int, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """q (B, H, Tq, Dh) at q_pos, k (B, H, Tk, Dh) at k_pos -> (B, H, Tq, Tk): whole rows."""
        visible = self.visible(q_pos, k_pos)
        left = self.taken(q, k, visible).flip(-1).cumsum(-1).flip(-1)  # sum over keys l >= j of the row, nearest first
        return (-left).masked_fill(~visible, float("-inf"))

    has_far_bias = True  # keys behind a spent stick weigh exactly 0

    def far_keys(self, layer: int, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> int:
        """The keys before a window [start, block's end) over which every query of the block has
        spent at least SPENT of its stick (in log); the window doubles until so or it reaches key 0."""
        first_query = k.shape[-2] - q.shape[-2]
        width = 256
        while (start := max(0, first_query - width)) > 0:
            spent = self.taken(q, k[:, :, start:], self.visible(q_pos, k_pos[start:])).sum(-1)  # (B, H, Tq)
            if bool((spent >= SPENT).all()):
                return start
            width *= 2
        return 0

    def far_bias(self, layer: int, q: Tensor, q_pos: Tensor) -> Tensor:
        return q.new_full(q.shape[:-1], float("-inf"))  # (B, H, Tq): no weight
