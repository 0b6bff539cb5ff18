"""p-RoPE (Barbero et al. 2024, "Round and Round We Go! What makes Rotary Positional Encodings
useful?"): RoPE without its lowest frequencies.

The paper finds that RoPE's lowest frequencies rotate so little over the training length that they
act as a semantic channel that position still perturbs at long range; p-RoPE keeps the fraction
``keep`` (the paper's p) of the highest frequencies and sets the others to zero, so those pairs of
dimensions pass through unrotated (p = 1 is RoPE, p -> 0 tends to NoPE). The kept frequencies are
RoPE's own, base^(-2k/d) for the first int(keep * d / 2) pairs k: the frequencies are not
respread over the kept pairs.

Reference: the definition as Gemma implements it (google-deepmind/gemma ``apply_rope`` with
``rope_proportion``: ``rope_angles = int(p * head_dim // 2)``, the remaining timescales padded with
infinity), in the same half-split layout as ``rope``. RoPE scaling (pos.scaling, eval.rope_scaling)
rescales the kept frequencies; the dropped ones stay zero.
"""

from __future__ import annotations

from typing import Any, Mapping

from torch import Tensor

from relpos_cli.errors import RelposError
from relpos_cli.positions import register
from relpos_cli.positions.base import ModelShape
from relpos_cli.positions.rope import RoPE


@register("p_rope")
class PRoPE(RoPE):
    paper = "Barbero et al. 2024 (p-RoPE)"

    def __init__(self, shape: ModelShape, base: float = 10000.0, keep: float = 0.75,
                 scaling: Mapping[str, Any] | None = None, *, eval_scaling: Mapping[str, Any] | None = None):
        if isinstance(keep, bool) or not isinstance(keep, (int, float)) or not 0 < keep <= 1:
            raise RelposError(f"pos.keep={keep!r} must be a fraction in (0, 1]: the share of RoPE's frequencies kept")
        self.kept = int(keep * shape.head_dim // 2)  # rotated pairs, as Gemma counts them
        if self.kept < 1:
            raise RelposError(f"pos.keep={keep} keeps no frequency of head_dim={shape.head_dim} "
                              f"({shape.head_dim // 2} pairs); give at least {2 / shape.head_dim:g}")
        self.keep = float(keep)
        super().__init__(shape, base, 1.0, scaling, eval_scaling=eval_scaling)

    def frequencies(self, scaling: Mapping[str, Any] | None, length: int) -> tuple[Tensor, float]:
        inv_freq, attention_scale = super().frequencies(scaling, length)
        inv_freq[self.kept:] = 0.0  # (Dh/2,): the lowest frequencies, last in RoPE's order, do not rotate
        return inv_freq, attention_scale
