"""Fixed sinusoidal absolute embeddings (Vaswani et al. 2017, "Attention Is All You Need"), added
with a learnt scale as x-transformers' ScaledSinusoidalEmbedding does.

PE[p, 2i] = sin(p / base^(2i/d)), PE[p, 2i+1] = cos(p / base^(2i/d)); the embedding is
x + g * PE with g a learnt scalar.

The initial g keeps x-transformers' ratio of position to token signal. There g starts at d^-0.5
over token embeddings drawn with kaiming_normal (std sqrt(2/d)), so the sinusoid's RMS per
coordinate (g / sqrt(2)) is half the tokens' (sqrt(2/d)). relpos draws token embeddings with
std 0.02 (GPT-2), so the same ratio gives g = 0.02 / sqrt(2) ~ 0.0141 at init.

Why it matters: over the training window the slow frequencies are constant (cos ~ 1 in about a
fifth of the dimensions), a vector added to every token. With g = d^-0.5 over 0.02 embeddings
that vector is 1.6x the norm of a token embedding, every position starts with nearly the same
input, the output collapses to one direction shared by all positions, and Adam moves every byte
that never occurs in the corpus coherently along it (tied embeddings); when that direction turns
(step 20 on English text) those bytes take most of the probability mass at once and the training
loss jumps from 3.5 to 9.0 (README, "Fair baselines").
"""

import math

import torch
from torch import Tensor, nn

from relpos_cli.errors import RelposError
from relpos_cli.positions import register
from relpos_cli.positions.base import TOKEN_EMBEDDING_STD, ModelShape, PositionScheme, check_above

# x-transformers: sinusoid RMS / token RMS = (d^-0.5 / sqrt(2)) / sqrt(2 / d) = 1/2
POSITION_TO_TOKEN_RMS = 0.5


def sinusoidal_table(positions: Tensor, dim: int, base: float) -> Tensor:
    """(T,) positions -> (T, dim) interleaved sin/cos table."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # (T, dim/2)
    table = torch.stack((angles.sin(), angles.cos()), dim=-1)  # (T, dim/2, 2)
    return table.flatten(-2)[:, :dim]


# learnt: x-transformers' learnt scale at its position-to-token ratio; fixed_inverse_sqrt_d: a fixed
# d^-0.5 (relpos before; kept so runs trained with it evaluate as trained)
SCALES = ("learnt", "fixed_inverse_sqrt_d")


@register("sinusoidal")
class Sinusoidal(PositionScheme):
    paper = "Vaswani et al. 2017"
    relative = False
    decayed_parameters = ()
    decay_reference = "x-transformers ScaledSinusoidalEmbedding gives no rule; its scale is a gain, not decayed (as nanoGPT's gains)"
    added_options = {"scale": "fixed_inverse_sqrt_d"}

    def __init__(self, shape: ModelShape, base: float = 10000.0, scale: str = "learnt"):
        super().__init__(shape)
        if scale not in SCALES:
            raise RelposError(f"pos.scale={scale!r}; choose one of: {', '.join(SCALES)}")
        check_above("base", base, 1, ": the sinusoids' wavelengths grow as base^(2i/d)")
        self.base = base
        if scale == "learnt":
            # the table's RMS per coordinate is 1/sqrt(2): g = ratio * token std * sqrt(2)
            self.scale = nn.Parameter(torch.tensor(POSITION_TO_TOKEN_RMS * TOKEN_EMBEDDING_STD * math.sqrt(2)))
        else:
            self.register_buffer("scale", torch.tensor(shape.d_model**-0.5), persistent=False)

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        return x + self.scale.to(x.dtype) * sinusoidal_table(positions, self.shape.d_model, self.base).to(x.dtype)
