"""Learned absolute position embeddings, as in GPT-2 (Radford et al. 2019).

Reference implementation: ``transformers`` GPT2Model ``wpe``. Positions past ``max_positions``
have no embedding, so evaluating there is refused with an error naming the limit; positions
between the training length and ``max_positions`` exist but were never trained.
"""

from torch import Tensor, nn

from relpos_cli.errors import RelposError
from relpos_cli.positions import register
from relpos_cli.positions.base import ModelShape, PositionScheme


@register("learned")
class Learned(PositionScheme):
    paper = "Radford et al. 2019 (GPT-2); Gehring et al. 2017"
    relative = False
    decayed_parameters = ("table.weight",)
    decay_reference = "nanoGPT (GPT-2): the position embedding is in the decayed group"

    def __init__(self, shape: ModelShape, max_positions: int = 4096):
        super().__init__(shape)
        if max_positions < shape.train_seq_len:
            raise RelposError(
                f"pos.max_positions={max_positions} is shorter than train.seq_len={shape.train_seq_len}"
            )
        self.max_positions = max_positions
        self.table = nn.Embedding(max_positions, shape.d_model)
        nn.init.normal_(self.table.weight, std=0.02)

    def check_length(self, length: int) -> None:
        if length > self.max_positions:
            raise RelposError(
                f"pos=learned has a table of {self.max_positions} positions; length {length} is past it "
                f"(train with a larger pos.max_positions to evaluate there)"
            )

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        self.check_length(int(positions[-1]) + 1)
        return x + self.table(positions)  # (B, T, D) + (T, D)
