"""CoPE, contextual position encoding (Golovneva et al. 2024, "Contextual Position Encoding:
Learning to Count What's Important").

Positions are counted by the content: gate g_ij = sigmoid(q_i . k_j / sqrt(d)), position
p_ij = sum_{t=j..i} g_it (how many gated keys lie between j and i), clamped to max_positions - 1.
The bias is q_i . e[p_ij], with e[p] linearly interpolated between the learned integer position
embeddings e[floor(p)] and e[ceil(p)] (one table of head size per layer, shared by the heads,
zero-initialised so training starts like NoPE).

Reference implementation: the paper's Appendix B and x-transformers ``CoPE`` (oracle in the tests).
Per (query, key) pair the bias is a lookup of the per-query table q_i . e[:] (B, H, T, max_positions)
at p_ij, but p_ij is a suffix sum over the query's row, so it must be computed for the whole row
first: CoPE declares a content bias (``content_bias`` on blocks of whole query rows).

Gates are positive, so p_ij only grows as the key moves away from the query: once it reaches
max_positions - 1 it stays clamped there for every earlier key, whose bias is then q_i . e[-1]
whatever the key (``has_far_bias``). Evaluation builds the bias only for the keys nearer than
that, found by summing the gates over a window before each block of queries (``far_keys``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from relpos_cli.errors import RelposError
from relpos_cli.positions import register
from relpos_cli.positions.base import BiasInput, ModelShape, PositionScheme


@register("cope")
class CoPE(PositionScheme):
    paper = "Golovneva et al. 2024 (CoPE)"
    reads_positions = False  # it counts positions from gates on q . k; the indices only mask the future
    bias_input = BiasInput.CONTENT
    decayed_parameters = ("pos_emb",)
    decay_reference = ("x-transformers' CoPE and the paper's listing give no rule: its position embeddings "
                       "decay like the token embeddings")

    def __init__(self, shape: ModelShape, max_positions: int = 64):
        super().__init__(shape)
        if max_positions < 2:
            raise RelposError(f"pos.max_positions={max_positions} must be >= 2")
        self.max_positions = max_positions
        self.pos_emb = nn.Parameter(torch.zeros(shape.n_layers, max_positions, shape.head_dim))

    has_far_bias = True  # a key whose count reached max_positions - 1 reads e[-1]
    content_rule = "gate_count"  # on CUDA, model.attn_backend=fused runs relpos_cli/kernels/cope.py

    def kernel_inputs(self, layer: int, q: Tensor) -> tuple[Tensor]:
        """Each query's bias per position (B, H, T, max_positions), in float32 whatever q's dtype or autocast:
        the kernel interpolates it, and rounded to bf16 (about 0.03 at its size) it put bf16 CoPE
        over 0.03 off eager attention on an H100."""
        with torch.autocast(q.device.type, enabled=False):
            return (q.float() @ self.pos_emb[layer].float().T,)

    @staticmethod
    def gates(q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """sigmoid(q_i . k_j / sqrt(Dh)) of every pair, 0 where key j follows query i: what each key adds
        to its query's count (B, H, Tq, Tk)."""
        future = k_pos[None, :] > q_pos[:, None]  # (Tq, Tk)
        return torch.sigmoid((q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])).masked_fill(future, 0.0)  # (B, H, Tq, Tk)

    def far_keys(self, layer: int, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> int:
        """The keys before a window [start, block) in which the gates of every query of the block
        already sum to max_positions - 1; the window doubles until they do or it reaches key 0."""
        first_query = k.shape[-2] - q.shape[-2]
        width = 2 * self.max_positions  # saturated by gates averaging one half
        while (start := max(0, first_query - width)) > 0:
            counts = self.gates(q, k[:, :, start:], q_pos, k_pos[start:]).sum(-1)  # (B, H, Tq): keys start..i
            if bool((counts >= self.max_positions - 1).all()):
                return start
            width *= 2
        return 0

    def far_bias(self, layer: int, q: Tensor, q_pos: Tensor) -> Tensor:
        return q @ self.pos_emb[layer, -1].to(q.dtype)  # (B, H, Tq)

    def content_bias(self, layer: int, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """q (B, H, Tq, Dh) at q_pos, k (B, H, Tk, Dh) at k_pos -> (B, H, Tq, Tk); whole rows, so
        query blocks (the memory-linear chunked path) give the same numbers."""
        gates = self.gates(q, k, q_pos, k_pos)
        pos = gates.flip(-1).cumsum(-1).flip(-1).clamp(max=self.max_positions - 1)  # keys j..i counted
        per_position = q @ self.pos_emb[layer].to(q.dtype).T  # (B, H, T, max_positions)
        floor = pos.floor()
        weight = pos - floor
        at_floor = per_position.gather(-1, floor.long())
        at_ceil = per_position.gather(-1, pos.ceil().long())
        return at_ceil * weight + at_floor * (1 - weight)  # (B, H, T, T)
