"""The interface every position scheme implements.

A scheme enters attention at up to three hook points (x-transformers' taxonomy) and nowhere else:

- ``embed(x, positions)``: add position information to the token embeddings (learned, sinusoidal);
- ``rotate(layer, q, k, positions)``: transform queries and keys before the dot product (RoPE, xPos);
- an additive term for the attention logits (ALiBi, T5, KERPLE, FIRE, Shaw, CoPE, ...).

A bias scheme declares what its bias depends on (``bias_input``) and implements the one method
that goes with the declaration:

==================== ==================================================== ==============================
``bias_input``        method                                                 e.g.
==================== ==================================================== ==============================
``DISTANCE``          ``distance_bias(layer, distance)``: i - j only         ALiBi, T5, KERPLE, Sandwich
``INDEX_PAIR``        ``pair_bias(layer, q_pos, k_pos)``: the pair (i, j)    FIRE (normalised by max(L, i))
``CONTENT``           ``content_bias(layer, q, k, q_pos, k_pos)``: q, k too  Shaw, CoPE, stick-breaking
``TOKEN_DIFFERENCE``  ``token_values(layer, x)``: D_i - D_j, one value per    FoX (cumulative log forget
                      token read from the attention layer's input x          gates)
==================== ==================================================== ==============================

A token-difference bias D_i - D_j adds the query's own D_i to its whole row, which softmax ignores:
attention needs the keys' values only, one (B, H, T) vector, never a (Tq, Tk) tensor at long lengths.

A content bias that depends on the query alone far enough from it declares so (``has_far_bias``:
Shaw past its clip K, CoPE once its count of gated keys saturates) and says which keys are far
(``far_keys``) and what they add (``far_bias``); evaluation then builds its bias only near the
diagonal.

A bias that a kernel can compute per score from a few numbers (ALiBi's slope times the distance,
KERPLE's kernel, FIRE's MLP through a fine interpolation grid) also gives that form
(``score_formula``): FlexAttention computes it in place of reading a table.

Attention picks its kernel and its caching from the declaration alone (relpos_cli/attention.py):
a distance bias becomes an (H, T) table that a FlexAttention score_mod reads (no L x L tensor); an
index-pair bias is cached per length and evaluated one query block at a time at long lengths; a
content bias is recomputed on every call, one query block at a time. Nothing is inferred from the
numbers a formula returns, so a verdict cannot go stale.

``constrain_parameters()`` is called by the training loop after every optimizer step: schemes
whose parameters live in a constrained set (KERPLE's r > 0) project them there, as their
references do, rather than clamping inside the forward pass (which stops the gradient for good).
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import Tensor, nn

from relpos_cli.errors import RelposError


TOKEN_EMBEDDING_STD = 0.02  # the model's token embeddings (and other weights) start N(0, 0.02), as GPT-2


def check_above(key: str, value: Any, low: float, meaning: str = "") -> None:
    """pos.<key> must be a finite number above `low`: one line saying so otherwise (NaN and inf
    included, which a bare `value > low` lets through: inf, or NaN where it is written `not value <= low`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low < value < math.inf:
        raise RelposError(f"pos.{key}={value!r} must be a finite number above {low:g}{meaning}")


@dataclass(frozen=True)
class ModelShape:
    """What a scheme may need to know about the model it is built for."""

    d_model: int
    n_heads: int
    n_layers: int
    train_seq_len: int
    # the positions training reaches, [0, N): train.position_skip (PoSE) or train.randomized_positions;
    # None: train_seq_len. A scaling's factor auto scales to it, as PoSE's recipe scales to its target length.
    trained_positions: int | None = None

    @property
    def position_span(self) -> int:
        return self.trained_positions or self.train_seq_len

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class BiasInput(Enum):
    """What a scheme's additive logit bias is a function of; the value is what `relpos schemes` prints."""

    NONE = "-"  # no additive bias
    DISTANCE = "i - j"  # the causal distance only: shift invariant, one (H, T) table covers a length
    INDEX_PAIR = "(i, j)"  # both indices: cacheable per length, but no distance table
    CONTENT = "q, k, i, j"  # the queries and keys too: recomputed on every call
    TOKEN_DIFFERENCE = "D_i - D_j"  # per-token values from the layer's input: recomputed on every call, (B, H, T)

    @property
    def reads_input(self) -> bool:
        """Whether the bias changes with the tokens (never cached)."""
        return self in (BiasInput.CONTENT, BiasInput.TOKEN_DIFFERENCE)


BIAS_METHOD = {BiasInput.DISTANCE: "distance_bias", BiasInput.INDEX_PAIR: "pair_bias", BiasInput.CONTENT: "content_bias",
               BiasInput.TOKEN_DIFFERENCE: "token_values"}


class PositionScheme(nn.Module):
    """Base class: every hook is the identity / absent until a subclass overrides it."""

    name: str = ""
    paper: str = ""
    relative: bool = True  # logits depend on positions only through i - j (shift invariant)
    bias_input: BiasInput = BiasInput.NONE
    # options added after runs were saved, with the value that reproduces those runs: a saved run
    # config without the key gets it (checkpoint.load_config), so old runs evaluate as trained
    added_options: dict[str, Any] = {}
    # options that change only how positions are used, not the weights: a run fine-tuned from a
    # parent (init_from) may set them to other values than the parent's (relpos_cli/lineage.py)
    position_use_options: tuple[str, ...] = ()
    # whether attention divides each query's weights exp(logit) by their sum (softmax). A scheme whose
    # weights are at most a distribution by construction (stick-breaking) declares False: attention
    # then takes exp(logits + bias) as they are, which no softmax kernel (SDPA, flex) computes
    normalises: bool = True
    # for weights that are no softmax, the rule that makes them, so attention can run the fused kernel
    # it has for that rule (relpos_cli/kernels): "stick_breaking" is A_ij = beta_ij prod_{j<l<i} (1 - beta_il),
    # beta = sigmoid(q . k / sqrt(d)), with the query's own key or not (attends_to_itself)
    weight_rule: str | None = None
    # for a content bias, the rule that makes it, so attention can run the fused kernel it has for that
    # rule (relpos_cli/kernels) on the tensors kernel_inputs gives: "gate_count" is CoPE's q_i . e[p_ij] with
    # p_ij = min(sum_{t=j..i} sigmoid(q_i . k_t / sqrt(d)), P - 1) and e interpolated between integer positions;
    # "head_mlp" is DAPE's B_h + MLP([A; B])_h over all heads' logits A and a base bias B of the distance;
    # "clipped_distance" is Shaw's q_i . r[K - min(i - j, K)]
    content_rule: str | None = None
    # for a content bias, whether the bias of a pair (i, j) reads q_i, k_j (every head's) and the two
    # positions alone, not the keys between them (CoPE's gate counts do): it is then the same computed
    # on any subset of keys, at any positions, as an eval-time sink window's parts (extension.py) and
    # a sliding window's blocks (attention.check_sliding_window) ask
    content_bias_per_pair: bool = False
    # whether a query's own key is among the keys it weighs (softmax attention: always)
    attends_to_itself: bool = True
    # whether the logits depend on the position values, not only on their order (which the causal
    # mask already gives): train.randomized_positions changes nothing for a scheme that does not
    reads_positions: bool = True
    # which of the scheme's parameters take the optimizer's weight decay (fnmatch patterns over the
    # names of named_parameters()), following the scheme's reference implementation, named in
    # decay_reference: a rule by tensor rank decayed T5's and KERPLE's tables and r's, whose
    # references do not, and left FIRE's and the sinusoid's scalars alone (docs/configuration.md)
    decayed_parameters: tuple[str, ...] = ()
    decay_reference: str = "no learned parameters"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A declared bias must come with its method, and only with that one."""
        super().__init_subclass__(**kwargs)
        overridden = {m for m in BIAS_METHOD.values() if getattr(cls, m) is not getattr(PositionScheme, m)}
        wanted = BIAS_METHOD.get(cls.bias_input)
        if overridden != ({wanted} if wanted else set()):
            raise TypeError(f"{cls.__name__} declares bias_input={cls.bias_input.name} but overrides "
                            f"{sorted(overridden) or 'no bias method'}; it must override {wanted or 'none of them'}")

    def __init__(self, shape: ModelShape):
        super().__init__()
        self.shape = shape
        # inside forward_pass: its positions and what pass_value computed for it; None outside
        self._pass: tuple[Tensor, dict[tuple, Any]] | None = None
        # loaded parameters satisfy the constraints too (checkpoints of runs that clamped in the forward pass)
        self.register_load_state_dict_post_hook(lambda module, incompatible: module.constrain_parameters())

    # ---- hook 0: one forward pass --------------------------------------------------------------
    @contextlib.contextmanager
    def forward_pass(self, positions: Tensor) -> Iterator[None]:
        """Brackets one forward pass of the model over `positions` (T,), around every layer (not inside
        torch.compile): what the layers share is computed once in it (pass_value: the distance tables
        of pass_distance_table; FIRE's thresholds, read from the device once, and its training tables)
        and forgotten on exit, when an optimizer step may change it."""
        self._pass = (positions, {})
        try:
            yield
        finally:
            self._pass = None

    def pass_positions(self) -> Tensor | None:
        """The positions of the forward pass under way, None outside one."""
        return None if self._pass is None else self._pass[0]

    def pass_value(self, key: tuple, compute: Callable[[], Any]) -> Any:
        """compute(), once per forward pass for `key` (what it computes and from what: a layer, a
        length), kept until the pass ends; at every call outside a pass. A value that depends on
        positions is the pass's own positions' (pass_positions): a key can tell no other tensor apart."""
        if self._pass is None:
            return compute()
        values = self._pass[1]
        if key not in values:
            values[key] = compute()
        return values[key]

    # ---- hook 1: embeddings -------------------------------------------------------------------
    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        """x: (B, T, D) token embeddings, positions: (T,) increasing (0..T-1, or a sorted random
        sample under train.randomized_positions) -> (B, T, D)."""
        return x

    # ---- hook 2: q/k rotation -----------------------------------------------------------------
    def rotate(self, layer: int, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """q, k: (B, H, T, Dh), positions: (T,) -> rotated (q, k)."""
        return q, k

    def rotate_apart(self, layer: int, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        """Queries q (B, H, Tq, Dh) rotated at q_pos (Tq,) and keys k (B, H, Tk, Dh) at k_pos (Tk,),
        positions that may differ between the two and need not be integers: q . k then depends on
        q_pos - k_pos as rotate() makes it depend on i - j. A scheme whose rotation is relative in
        that sense implements it (``rotates_apart``); eval-time methods that give a (query, key)
        pair another relative position than i - j (Self-Extend, ReRoPE: relpos_cli/extension.py) need it."""
        raise NotImplementedError

    # ---- hook 3: additive logit bias, one method per declaration ------------------------------
    def distance_bias(self, layer: int, distance: Tensor) -> Tensor:
        """BiasInput.DISTANCE: distance (...) int64 tensor of i - j -> (H, ...). Elementwise in distance."""
        raise NotImplementedError

    def distance_table(self, layer: int, length: int, device: torch.device) -> Tensor:
        """BiasInput.DISTANCE: the (H, length) table of the bias of distances 0..length-1, what the fused
        kernel and flex read: distance_bias over arange(length). A scheme whose index arithmetic is
        costly keeps it per length (T5's buckets)."""
        return self.distance_bias(layer, torch.arange(length, device=device))

    def distance_table_layer(self, layer: int) -> int:
        """BiasInput.DISTANCE: the layer whose table layer `layer` reads. Layers with one answer share one
        table, which a forward pass computes once (pass_distance_table): a scheme whose table does not
        depend on the layer (no parameters, or one set that all layers share) answers 0 for every
        layer; the default is each layer's own."""
        return layer

    def pass_distance_table(self, layer: int, length: int, device: torch.device) -> Tensor:
        """distance_table(layer, length, device), what the fused kernels and flex read, computed once
        per forward pass for all the layers that share it (distance_table_layer): one table's few small
        kernels a training step instead of one per layer, and one backward through them, each a launch
        from the host, which a training step on a GPU waits on (docs/gpu.md). Outside a pass (inside
        torch.compile, whose graph fuses them) afresh at every call."""
        return self.pass_value(("distance table", self.distance_table_layer(layer), length, device),
                               lambda: self.distance_table(layer, length, device))

    def linear_distance_slopes(self, layer: int) -> Tensor:
        """BiasInput.DISTANCE, implemented only by a scheme whose bias is slope * distance at every
        distance, the slopes fixed (ALiBi's): those slopes (H,) float32, so a kernel computes the bias
        with one multiply per score instead of reading the table
        (relpos_cli/kernels/distance.linear_distance_attention)."""
        raise NotImplementedError

    def normalised_log_distance_grid(self, layer: int) -> tuple[Tensor, Tensor] | None:
        """BiasInput.INDEX_PAIR, implemented by a scheme whose bias at query position i and key
        position j is f_h(psi(i - j) / (psi(max(i, L)) + eps)), psi(x) = log(|c| x + 1), with f_h read
        off a grid (FIRE's score_formula), so that a kernel computes it per score where no table of
        distances serves (relpos_cli/kernels/fire.fire_attention: queries past L): (grid (H, G + 1)
        float32, f_h at G + 1 evenly spaced points of [0, 1], linearly interpolated between them;
        (|c|, L, eps) (3,) float32). None where the scheme gives none for this call (its parameters
        recording a gradient, as score_formula)."""
        raise NotImplementedError

    def distance_bias_flat_from(self) -> int | None:
        """BiasInput.DISTANCE: a distance n from which distance_bias stops changing (the bias of every
        d >= n is that of n), so a kernel reads a table of n + 1 entries and nothing for farther
        pairs (relpos_cli/kernels/distance.py); None (the default) where it changes with every distance."""
        return None

    def pair_bias(self, layer: int, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """BiasInput.INDEX_PAIR: q_pos (Tq, 1), k_pos (1, Tk) -> (H, Tq, Tk). Elementwise in the pair."""
        raise NotImplementedError

    def pair_bias_as_distances(self, layer: int, positions: Tensor) -> Tensor | None:
        """BiasInput.INDEX_PAIR: the bias among consecutive `positions` (T,) as a table over the
        distances 0..T-1, (H, T), where pair_bias(i, j) is a function of i - j alone for every query
        there (FIRE up to its threshold), so a kernel of distance tables can run it; None (the
        default) where it is not."""
        return None

    def content_bias(self, layer: int, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """BiasInput.CONTENT: a block of whole query rows, q (B, H, Tq, Dh) at q_pos (Tq,) against
        k (B, H, Tk, Dh) at k_pos (Tk,) -> broadcastable to (B, H, Tq, Tk). Called per query block
        at long lengths, so a row's bias may only depend on that row."""
        raise NotImplementedError

    def token_values(self, layer: int, x: Tensor) -> Tensor:
        """BiasInput.TOKEN_DIFFERENCE: x (B, T, D), the attention layer's input -> D (B, H, T); the
        bias of query i on key j is D_i - D_j. Each value may depend on its own and earlier tokens only."""
        raise NotImplementedError

    # BiasInput.CONTENT only: far enough from its query the bias depends on the query alone, so it
    # shifts all of that query's far logits alike and evaluation attends to far keys with no bias
    # tensor (attention.windowed_content_attention), through far_keys and far_bias; a far bias of
    # -inf (stick-breaking's spent stick) leaves the far keys out
    has_far_bias = False

    def far_keys(self, layer: int, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> int:
        """has_far_bias: n such that every key k_pos[:n] adds far_bias to every query of the block
        (0 if none does). q (B, H, Tq, Dh) at q_pos (Tq,): a block of queries; k (B, H, Tk, Dh) at
        k_pos (Tk,): the keys up to the block's last query, the queries being the last Tq of them."""
        raise NotImplementedError

    def far_bias(self, layer: int, q: Tensor, q_pos: Tensor) -> Tensor:
        """has_far_bias: what a far key adds to each query's logit, q (B, H, Tq, Dh) -> (B, H, Tq)."""
        raise NotImplementedError

    def kernel_inputs(self, layer: int, q: Tensor) -> tuple[Tensor, ...]:
        """content_rule: the tensors its fused kernel takes after q, k, v, for queries q (B, H, T, Dh)."""
        raise NotImplementedError

    def score_formula(self, layer: int) -> Callable[[Tensor, Tensor, Tensor], Tensor] | None:
        """The bias as arithmetic on one score's indices, for a kernel to compute where it would
        otherwise read a table (FlexAttention's score_mod): f(head, i, j), int tensors of one shape
        (query and key positions, j <= i where it counts) -> the bias, float32, that shape, from a
        few numbers the function captures (ALiBi's slopes). It must equal the declared bias method's
        value (or stay within the bound the scheme states and tests). Worth it where the arithmetic is
        cheaper than a table read: on an H100 KERPLE's log or power per score took 2-9x T5's lookups
        (docs/results/gpu.md), so KERPLE declares none. None
        (the default) when the scheme has no such form, or none for the current call: a per-head
        scalar that every score reads would get its gradient by atomics into H addresses (flex's
        captured-buffer gradient), so schemes whose parameters record a gradient return None and
        train through their table."""
        return None

    def score_bias(self, layer: int, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor | None = None,
                   layer_input: Tensor | None = None) -> Tensor:
        """The additive logits of queries q (B, H, Tq, Dh) at q_pos (Tq,) against keys k at k_pos (Tk,;
        default q_pos), whatever the declaration: broadcastable to (B, H, Tq, Tk). What every
        attention backend calls (on a whole length or a block of query rows), and inspect.
        layer_input (B, Tk, D): the attention layer's input at the keys, for a token-difference bias
        (the queries being the last Tq keys)."""
        k_pos = q_pos if k_pos is None else k_pos
        if self.bias_input is BiasInput.TOKEN_DIFFERENCE:
            if layer_input is None:
                raise TypeError(f"pos={self.name}'s bias reads the attention layer's input: pass layer_input")
            values = self.token_values(layer, layer_input)  # (B, H, Tk)
            return (values[..., -q.shape[-2]:, None] - values[..., None, :]).to(q.dtype)  # (B, H, Tq, Tk)
        if self.bias_input is BiasInput.DISTANCE:
            return self.distance_bias(layer, q_pos[:, None] - k_pos[None, :])
        if self.bias_input is BiasInput.INDEX_PAIR:
            return self.pair_bias(layer, q_pos[:, None], k_pos[None, :])
        if self.bias_input is BiasInput.CONTENT:
            return self.content_bias(layer, q, k, q_pos, k_pos)
        raise TypeError(f"pos={self.name} adds no score bias")

    # ---- training -----------------------------------------------------------------------------
    def constrain_parameters(self) -> None:
        """Called after every optimizer step (and may be called at init): project parameters back
        into their allowed set, in place. Unconstrained schemes do nothing."""

    def takes_weight_decay(self, name: str) -> bool:
        """Whether the parameter named `name` (as in named_parameters()) is in decayed_parameters."""
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.decayed_parameters)

    # ---- what attention and the CLI ask ---------------------------------------------------------
    @classmethod
    def overrides(cls, method: str) -> bool:
        """Whether this scheme implements the hook `method` (e.g. "rotate_apart") itself."""
        return getattr(cls, method) is not getattr(PositionScheme, method)

    @property
    def has_score_formula(self) -> bool:
        """Whether the scheme may give its bias as a per-score formula (score_formula)."""
        return self.overrides("score_formula")

    @property
    def uses_rotation(self) -> bool:
        return self.overrides("rotate")

    @property
    def rotates_apart(self) -> bool:
        return self.overrides("rotate_apart")

    @property
    def uses_score_bias(self) -> bool:
        return self.bias_input is not BiasInput.NONE

    @property
    def bias_per_pair(self) -> bool:
        """Whether the bias of a pair (i, j) is computed from that pair alone (its positions, or its own
        q and k: content_bias_per_pair), not from the keys between them: what a sink window's parts and
        a sliding window's blocks need."""
        return not self.bias_input.reads_input or self.content_bias_per_pair

    @property
    def uses_embedding(self) -> bool:
        return self.overrides("embed")

    @classmethod
    def hooks(cls) -> list[str]:
        found = [h for h in ("embed", "rotate") if cls.overrides(h)]
        if cls.bias_input is not BiasInput.NONE:
            found.append("score_bias")
        return found

    @classmethod
    def inherit_options(cls, pos_cfg: dict[str, Any], parent_pos_cfg: Mapping[str, Any], parent_train_len: int) -> dict[str, Any]:
        """A fine-tuned run's options, given its parent's: options whose meaning refers to the
        length the weights were first trained at are filled in here. Most schemes have none."""
        return pos_cfg

    def check_length(self, length: int) -> None:
        """Raise RelposError if this scheme cannot represent sequences of `length`."""


def records_gradient(*tensors: Tensor) -> bool:
    """Whether autograd is recording a graph through any of these tensors (training, not evaluation)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def per_head(values: Tensor, like: Tensor) -> Tensor:
    """(H,) per-head values shaped (H, 1, ..., 1) to broadcast against index tensors like `like`."""
    return values.view(-1, *([1] * like.dim()))
