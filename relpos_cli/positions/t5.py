"""T5 relative position bias (Raffel et al. 2020, "Exploring the Limits of Transfer Learning with a
Unified Text-to-Text Transformer").

Reference implementation: ``transformers`` T5Attention ``_relative_position_bucket`` and
``compute_bias``. A learned scalar per (head, bucket); distances below num_buckets/2 get a bucket
each, larger ones share log-spaced buckets up to max_distance, beyond which all distances share the
last bucket. T5 shares one table across layers; ``shared_layers=false`` gives each layer its own.

``boundaries=[0, 1, 2, 5, 17]`` replaces the log buckets by explicit ones (the seeds' example:
0 | 1 | 2-4 | 5-16 | >=17): distance d falls in the bucket of the last boundary <= d. With
``bidirectional=true`` keys after the query get their own copy of the buckets (direction-aware).
The bucket is a function of the distance alone, so attention reads the bias from an (H, L) table.

``parameterization`` says how the table enters the logits, after the implementation named:
``xtransformers`` (default; x-transformers ``RelativePositionBias``: N(0, 1) times sqrt(head_dim)),
``hf`` (transformers T5: N(0, d_model^-0.5), as is), ``zero`` (zeros, as is; relpos before). With
``zero`` Adam can move the bias by only ~sum of the learning rates over a run (~1 logit), too little to
learn a distance decay; the large random start of ``xtransformers`` is what keeps ppl flat past the
training length (README, "Fair baselines").
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from relpos_cli.errors import RelposError
from relpos_cli.positions import register
from relpos_cli.positions.base import BiasInput, ModelShape, PositionScheme


def relative_position_bucket(
    relative_position: Tensor, bidirectional: bool = True, num_buckets: int = 32, max_distance: int = 128
) -> Tensor:
    """Bucket index for relative_position = key - query (same convention and result as HF T5)."""
    buckets = torch.zeros_like(relative_position, dtype=torch.long)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = -torch.clamp(relative_position, max=0)  # keys after the query share bucket 0
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    # clamp keeps log finite where is_small picks the exact bucket anyway
    log_ratio = torch.log(distance.clamp(min=1).float() / max_exact) / math.log(max_distance / max_exact)
    large = max_exact + (log_ratio * (num_buckets - max_exact)).long()
    large = torch.clamp(large, max=num_buckets - 1)
    return buckets + torch.where(is_small, distance, large)


def boundary_bucket(relative_position: Tensor, boundaries: list[int], bidirectional: bool = False) -> Tensor:
    """Bucket index for relative_position = key - query from explicit distance boundaries."""
    if bidirectional:
        distance = relative_position.abs()
        offset = (relative_position > 0).long() * len(boundaries)
    else:
        distance = -torch.clamp(relative_position, max=0)  # keys after the query share bucket 0
        offset = 0
    below = sum((distance >= b).long() for b in boundaries)  # how many boundaries are <= d
    return below - 1 + offset


def check_log_buckets(num_buckets, max_distance, bidirectional: bool) -> None:
    """T5's log buckets must grow with the distance: the first half of each direction's buckets
    holds one distance each (0 .. max_exact - 1), the second half spreads log(d / max_exact) /
    log(max_distance / max_exact) over the rest, so max_distance must exceed max_exact. At or below
    it the log ratio divides by zero or turns negative: buckets fall with distance and index the
    table from its end (num_buckets=64 max_distance=16 read distance 64 from distance 0's bucket).

    Args:
        num_buckets: pos.num_buckets, the table's rows (both directions with bidirectional).
        max_distance: pos.max_distance, the distance from which all share the last bucket.
        bidirectional: keys after the query have their own half of the buckets.
    """
    per_direction = 2 if bidirectional else 1
    for key, value in (("num_buckets", num_buckets), ("max_distance", max_distance)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise RelposError(f"pos.{key}={value!r} must be an integer")
    if num_buckets < 2 * per_direction:
        raise RelposError(f"pos.num_buckets={num_buckets} must be >= {2 * per_direction}: half of "
                          f"{'each direction' if bidirectional else 'them'} exact, half log-spaced")
    max_exact = num_buckets // per_direction // 2  # distances with a bucket each
    if max_distance <= max_exact:
        raise RelposError(f"pos.max_distance={max_distance} must exceed the {max_exact} distances that pos.num_buckets="
                          f"{num_buckets} gives a bucket each ({'a quarter' if bidirectional else 'half'} of them): "
                          f"raise pos.max_distance above {max_exact} or lower pos.num_buckets")


def check_boundaries(boundaries) -> list[int]:
    if isinstance(boundaries, str) or not isinstance(boundaries, Sequence) or not all(isinstance(b, int) and not isinstance(b, bool) for b in boundaries):
        raise RelposError(f"pos.boundaries={boundaries!r} must be a list of integers (distances), e.g. [0,1,2,5,17]")
    values = list(boundaries)
    if not values or values[0] != 0 or any(b >= c for b, c in zip(values, values[1:])):
        raise RelposError(f"pos.boundaries={values} must start at 0 and increase strictly, e.g. [0,1,2,5,17]")
    return values


# How the table enters the logits, after each implementation (attention here adds the bias to q.k / sqrt(Dh)):
# initial table std (None: zeros), multiplier on the table.
PARAMETERIZATIONS = {
    # x-transformers RelativePositionBias: nn.Embedding's N(0, 1), times sqrt(Dh) after the 1/sqrt(Dh)
    # logit scaling (as GPT-NeoX's T5 "rpe" too)
    "xtransformers": (1.0, "sqrt_head_dim"),
    # transformers T5: N(0, d_model^-0.5) (T5PreTrainedModel._init_weights), added to the logits as is
    "hf": ("d_model^-0.5", 1.0),
    # zeros, added as is: position-blind at step 0 (relpos before 0.2; follows no reference)
    "zero": (None, 1.0),
}


@register("t5")
class T5(PositionScheme):
    paper = "Raffel et al. 2020 (T5)"
    bias_input = BiasInput.DISTANCE
    decayed_parameters = ()
    decay_reference = ("transformers Trainer.get_decay_parameter_names: names holding 'bias' (T5's "
                       "relative_attention_bias) are not decayed; T5 itself trained with Adafactor, no decay")
    added_options = {"parameterization": "zero"}

    def __init__(
        self,
        shape: ModelShape,
        num_buckets: int = 32,
        max_distance: int = 128,
        bidirectional: bool = False,
        shared_layers: bool = True,
        boundaries: list[int] | None = None,
        parameterization: str = "xtransformers",
    ):
        super().__init__(shape)
        if parameterization not in PARAMETERIZATIONS:
            raise RelposError(f"pos.parameterization={parameterization!r}; choose one of: {', '.join(PARAMETERIZATIONS)}")
        self.boundaries = None if boundaries is None else check_boundaries(boundaries)
        if self.boundaries is not None:
            num_buckets = len(self.boundaries) * (2 if bidirectional else 1)
        else:
            check_log_buckets(num_buckets, max_distance, bidirectional)
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.bidirectional = bidirectional
        self.shared_layers = shared_layers
        self.parameterization = parameterization
        init_std, multiplier = PARAMETERIZATIONS[parameterization]
        n_tables = 1 if shared_layers else shape.n_layers
        self.tables = nn.Parameter(torch.zeros(n_tables, num_buckets, shape.n_heads))  # (tables, buckets, H)
        if init_std is not None:
            nn.init.normal_(self.tables, std=shape.d_model**-0.5 if init_std == "d_model^-0.5" else init_std)
        self.multiplier = math.sqrt(shape.head_dim) if multiplier == "sqrt_head_dim" else multiplier
        self._table_buckets: tuple[tuple[int, torch.device], Tensor] | None = None  # distance_table's, per length

    def buckets(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        if self.boundaries is not None:
            return boundary_bucket(k_pos - q_pos, self.boundaries, self.bidirectional)
        return relative_position_bucket(k_pos - q_pos, self.bidirectional, self.num_buckets, self.max_distance)

    def distance_bias_flat_from(self) -> int:
        # every distance from the last boundary, or from max_distance (the log bucket reaches the last one
        # there), is in the last bucket
        return self.boundaries[-1] if self.boundaries is not None else self.max_distance

    def distance_bias(self, layer: int, distance: Tensor) -> Tensor:
        return self.bias_of_buckets(layer, self.distance_buckets(distance))

    def distance_table_layer(self, layer: int) -> int:
        return 0 if self.shared_layers else layer

    def distance_buckets(self, distance: Tensor) -> Tensor:
        """The bucket of each distance i - j (...), key - query being -distance."""
        return self.buckets(distance, torch.zeros_like(distance))

    def bias_of_buckets(self, layer: int, buckets: Tensor) -> Tensor:
        """Bucket indices (...) -> the layer's bias (H, ...)."""
        table = self.tables[self.distance_table_layer(layer)]  # (buckets, H)
        # indexed along the transpose: a contiguous (H, ...), which the fused kernel reads without a copy per call
        return self.multiplier * table.T[:, buckets]  # (H, ...)

    def distance_table(self, layer: int, length: int, device: torch.device) -> Tensor:
        """The buckets of distances 0..length-1 computed once per length and device, not once per layer
        and step: about fifteen small kernels, each a launch from the host, of a training step's
        attention layers that the GPU waits on (docs/gpu.md, "Sixth run"). Computed afresh inside
        torch.compile (the graph fuses them) and under inference mode (whose tensors a later training
        pass could not save for its backward)."""
        if torch.compiler.is_compiling() or torch.is_inference_mode_enabled():
            return super().distance_table(layer, length, device)
        if self._table_buckets is None or self._table_buckets[0] != (length, device):
            self._table_buckets = ((length, device), self.distance_buckets(torch.arange(length, device=device)))
        return self.bias_of_buckets(layer, self._table_buckets[1])
