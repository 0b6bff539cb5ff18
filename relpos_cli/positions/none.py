"""NoPE: no explicit position information.

A causal decoder can still infer positions from the mask (Haviv et al. 2022, "Transformer Language
Models without Positional Encodings Still Learn Positional Information"; Kazemnejad et al. 2023,
"The Impact of Positional Encoding on Length Generalization in Transformers").
"""

from relpos_cli.positions import register
from relpos_cli.positions.base import PositionScheme


@register("none")
class NoPE(PositionScheme):
    paper = "Haviv et al. 2022; Kazemnejad et al. 2023 (NoPE)"
    reads_positions = False
