"""Rotary position embedding (Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary
Position Embedding"), with partial rotation and RoPE scaling at training (pos.scaling) and
evaluation time (eval.rope_scaling).

Reference implementation: ``transformers`` LlamaRotaryEmbedding / ``apply_rotary_pos_emb``
(half-split layout: dimension i pairs with i + d/2), GPT-NeoX partial rotary (the first
``rotary_fraction`` of each head is rotated, the rest passes through). q_m . k_n then depends on
m - n only.

Scaling follows ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS``:
linear (position interpolation, Chen et al. 2023), dynamic NTK (emozilla), YaRN (Peng et al. 2023);
static NTK-aware (bloc97) is base * factor^(d/(d-2)) as in x-transformers' ``base_rescale_factor``;
llama3 (Llama 3.1: slow dimensions interpolated, fast ones kept, smoothed between
``low_freq_factor`` and ``high_freq_factor``), as transformers' ``_compute_llama3_parameters``.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Mapping

import torch
from torch import Tensor

from relpos_cli import kernels
from relpos_cli.errors import RelposError
from relpos_cli.positions import register
from relpos_cli.positions.base import ModelShape, PositionScheme, check_above
from relpos_cli.rope_options import AUTO_FACTOR, LONGEST_FACTOR, SCALING_TYPES, check_rope_scaling, scaling_option

FLOAT32_EXACT = 2**24  # the largest position float32 rotation angles are computed from exactly


def _yarn_inv_freq(dim: int, base: float, scaling: Mapping[str, Any]) -> tuple[Tensor, float]:
    """YaRN: interpolate the slow dimensions, keep the fast ones, ramp in between; temperature
    sqrt(1/t) = 0.1 ln(factor) + 1 returned as the cos/sin scale (as in transformers)."""
    factor = float(scaling["factor"])
    original = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling_option(scaling, "beta_fast"), scaling_option(scaling, "beta_slow")

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_scale = scaling.get("attention_factor")
    if attention_scale is None:
        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            attention_scale = mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
        else:
            attention_scale = mscale(factor)

    def correction_dim(rotations: float) -> float:
        """Dimension whose wavelength makes `rotations` turns over the original context."""
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid 0/0 in the ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # (dim/2,)
    freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    keep = 1 - ramp  # 1 = extrapolate (fast dims), 0 = interpolate (slow dims)
    inv_freq = (1.0 / (factor * freqs)) * (1 - keep) + (1.0 / freqs) * keep
    return inv_freq, float(attention_scale)


def _llama3_inv_freq(dim: int, base: float, scaling: Mapping[str, Any]) -> Tensor:
    """Llama 3.1: wavelengths past original / low_freq_factor divided by factor, those below
    original / high_freq_factor kept, a linear blend in between."""
    inv_freq, _ = rope_inv_freq(dim, base)
    factor, original = float(scaling["factor"]), scaling["original_max_position_embeddings"]
    low, high = float(scaling_option(scaling, "low_freq_factor")), float(scaling_option(scaling, "high_freq_factor"))
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(medium, blended, scaled)


def rope_inv_freq(
    head_dim: int, base: float = 10000.0, scaling: Mapping[str, Any] | None = None, seq_len: int | None = None
) -> tuple[Tensor, float]:
    """Rotation frequencies for `head_dim` rotated dimensions -> (inv_freq (head_dim/2,), attention_scale).

    `scaling` is a dict in transformers' ``rope_parameters`` form: ``rope_type`` (none | linear |
    ntk | dynamic | yarn), ``factor``, ``original_max_position_embeddings`` (dynamic, yarn),
    ``beta_fast``, ``beta_slow``, ``attention_factor``, ``mscale``, ``mscale_all_dim``, ``truncate``
    (yarn). `seq_len` is the current length (dynamic only). attention_scale multiplies cos and sin.
    """
    dim = head_dim
    rope_type = (scaling or {}).get("rope_type", "none")
    if rope_type in ("none", "default"):
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    factor = float(scaling["factor"])
    if rope_type in ("ntk", "dynamic") and dim < 4:  # d / (d - 2) below: one pair's frequency, base^0 = 1, has no base to scale
        raise RelposError(f"RoPE scaling type={rope_type} multiplies the base by factor^(d/(d-2)) for d rotated dimensions, "
                          f"so it needs d >= 4; this model rotates {dim} (head_dim x pos.rotary_fraction)")
    if rope_type == "linear":
        inv_freq, _ = rope_inv_freq(dim, base)
        return inv_freq / factor, 1.0
    if rope_type == "ntk":
        return rope_inv_freq(dim, base * factor ** (dim / (dim - 2)))[0], 1.0
    if rope_type == "dynamic":
        original = scaling["original_max_position_embeddings"]
        seq_len = max(seq_len or original, original)
        alpha = factor * seq_len / original - (factor - 1)
        return rope_inv_freq(dim, base * alpha ** (dim / (dim - 2)))[0], 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(dim, base, scaling)
    if rope_type == "llama3":
        return _llama3_inv_freq(dim, base, scaling), 1.0
    raise RelposError(f"eval.rope_scaling.type={rope_type!r}; choose one of: {', '.join(SCALING_TYPES)}")


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


# why the rotation kernel could not run in this process (its first launch failed: a machine whose
# triton cannot build its launcher, an unsupported GPU), after which every call takes the eager ops
_rotary_failure: list[str] = []


def rotary_runs_fused(x: Tensor, cos: Tensor, sin: Tensor) -> bool:
    """Whether apply_rotary runs relpos_cli/kernels/rotary.py: on CUDA, for a (B, H, T, Dh) x in 32 or
    16 bits and (T, Dr) cos and sin without gradients, outside torch.compile (whose graph fuses the
    eager ops itself), where triton is installed (not its interpreter with bf16, which the kernel
    functions refuse) and the kernel has not failed in this process."""
    return (x.is_cuda and x.dim() == 4 and cos.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and not (cos.requires_grad or sin.requires_grad) and not torch.compiler.is_compiling()
            and kernels.available(True) and not (kernels.interpreting() and x.dtype == torch.bfloat16)
            and not _rotary_failure)


def _fused_or_none(rotate: Callable[[], Any]) -> Any:
    """rotate() (a call of the rotation kernel), or None once the kernel has failed in this process,
    from its first failure on (said once: the rotation is the same, only slower, by the ops)."""
    try:
        return rotate()
    except RelposError:
        raise
    except Exception as e:  # noqa: BLE001 -- triton's compile or launch: fall back rather than stop a run
        _rotary_failure.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        warnings.warn(f"RoPE's rotation kernel failed ({_rotary_failure[0]}); rotating with PyTorch ops "
                      f"from here on", RuntimeWarning, stacklevel=3)
        return None


def apply_rotary_pair(q: Tensor, k: Tensor, q_cos: Tensor, q_sin: Tensor, k_cos: Tensor,
                      k_sin: Tensor) -> tuple[Tensor, Tensor]:
    """(apply_rotary(q, q_cos, q_sin), apply_rotary(k, k_cos, k_sin)): on CUDA both in one launch of the
    kernel where both would take it and they share a length, head size, dtype and table shape (a layer's
    q and k: half the launches from the host a step); else each by apply_rotary."""
    if (rotary_runs_fused(q, q_cos, q_sin) and rotary_runs_fused(k, k_cos, k_sin) and q.shape[0] == k.shape[0]
            and q.shape[2:] == k.shape[2:] and q.dtype == k.dtype and q_cos.shape == k_cos.shape):
        rotated = _fused_or_none(lambda: kernels.rotary_embedding_pair(q, k, q_cos, q_sin, k_cos, k_sin))
        if rotated is not None:
            return rotated
    return apply_rotary(q, q_cos, q_sin), apply_rotary(k, k_cos, k_sin)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: (B, H, T, Dh), cos/sin: (T, Dr) with Dr <= Dh; dimensions past Dr pass through. One fused
    kernel on CUDA (rotary_runs_fused), the ops below elsewhere, and from the kernel's first failure on
    (_fused_or_none)."""
    if rotary_runs_fused(x, cos, sin):
        rotated = _fused_or_none(lambda: kernels.rotary_embedding(x, cos, sin))
        if rotated is not None:
            return rotated
    rot_dim = cos.shape[-1]
    if rot_dim == x.shape[-1]:  # every dimension rotated: no copy to join an empty rest to
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


def scaling_params(rope_scaling: Mapping[str, Any], length: int, train_len: int,
                   key: str = "eval.rope_scaling") -> dict[str, Any] | None:
    """eval.rope_scaling or pos.scaling (type, factor|auto, beta_fast, beta_slow, attention_factor)
    -> rope_parameters, with `train_len` as the original length the frequencies are scaled from.

    factor=auto is length / train length (at least 1), except for dynamic NTK where it is 1:
    dynamic already grows with the current length, base * (length / train length)^(d/(d-2)), which
    is then what ntk with factor=auto gives too (every evaluation window has a single length).
    `key` names the settings in error messages."""
    rope_type = str(rope_scaling.get("type", "none"))
    if rope_type not in SCALING_TYPES:
        raise RelposError(f"{key}.type={rope_type!r}; choose one of: {', '.join(SCALING_TYPES)}")
    check_rope_scaling(rope_scaling, key)
    if rope_type == "none":
        return None
    factor = rope_scaling.get("factor", AUTO_FACTOR)
    if factor == AUTO_FACTOR:
        factor = 1.0 if rope_type == "dynamic" else max(1.0, length / train_len)
    factor = float(factor)  # checked by check_rope_scaling above; longest is resolved by evaluate.py
    return {
        "rope_type": rope_type,
        "factor": factor,
        "original_max_position_embeddings": train_len,
        "beta_fast": rope_scaling.get("beta_fast"),
        "beta_slow": rope_scaling.get("beta_slow"),
        "attention_factor": rope_scaling.get("attention_factor"),
        "low_freq_factor": rope_scaling.get("low_freq_factor"),  # llama3
        "high_freq_factor": rope_scaling.get("high_freq_factor"),
    }


# pos.scaling as runs saved before it existed were trained: no scaling
NO_SCALING = {"type": "none", "factor": AUTO_FACTOR, "original_length": None, "beta_fast": 32, "beta_slow": 1,
              "attention_factor": None, "low_freq_factor": None, "high_freq_factor": None}


@register("rope")
class RoPE(PositionScheme):
    """`scaling` (pos.scaling) rescales the frequencies while training, with the same function as
    eval.rope_scaling, from `original_length` (default train.seq_len; for a fine-tuned run its
    parent's training length). `eval_scaling` (eval.rope_scaling, given when a trained model is
    built for evaluation: relpos_cli/extension.EvalMethod) replaces it, applied to the unscaled
    frequencies. Scalings that depend on the length (dynamic NTK, factor=auto) follow the length of
    each forward pass, the number of positions rotated, as transformers' dynamic rope does: the same
    model in every command (eval-length, eval-task, sample, load_run)."""

    paper = "Su et al. 2021 (RoFormer)"
    added_options = {"scaling": NO_SCALING}
    position_use_options = ("scaling",)

    def __init__(self, shape: ModelShape, base: float = 10000.0, rotary_fraction: float = 1.0,
                 scaling: Mapping[str, Any] | None = None, *, eval_scaling: Mapping[str, Any] | None = None):
        super().__init__(shape)
        check_above("base", base, 1, ": theta_i = base^(-2i/d) must fall with i")
        self.base = float(base)
        fraction_ok = isinstance(rotary_fraction, (int, float)) and 0 < rotary_fraction <= 1  # NaN fails too
        self.rotary_dim = int(shape.head_dim * rotary_fraction) if fraction_ok else 0
        if not fraction_ok or self.rotary_dim < 2 or self.rotary_dim % 2:
            raise RelposError(
                f"pos.rotary_fraction={rotary_fraction} gives {self.rotary_dim} rotated dimensions of "
                f"head_dim={shape.head_dim}; it must be in (0, 1] and give an even number >= 2"
            )
        scaling = {**NO_SCALING, **(scaling or {})}
        original = shape.train_seq_len if scaling["original_length"] is None else scaling["original_length"]
        if not (isinstance(original, int) and not isinstance(original, bool) and original > 0):
            raise RelposError(f"pos.scaling.original_length={original!r}; give a positive integer or null")
        # the factor is resolved at the positions trained over (train.seq_len; PoSE's N): the run keeps it at every
        # evaluation length
        self.trained_scaling = scaling_params(scaling, shape.position_span, original, key="pos.scaling")
        if (self.trained_scaling and scaling["factor"] == AUTO_FACTOR and self.trained_scaling["rope_type"] != "dynamic"
                and self.trained_scaling["factor"] == 1):
            # linear, ntk and yarn at factor 1 are the unscaled frequencies: a run that says it scales and does not
            span = "train.seq_len" if shape.trained_positions is None else "the positions trained over"
            raise RelposError(f"pos.scaling.type={scaling['type']} with factor auto = {span} / original_length = "
                              f"{shape.position_span} / {original} = 1 scales nothing: set pos.scaling.original_length "
                              f"below {span} (the length scaled from) or pos.scaling.factor above 1")
        requested = dict(eval_scaling or {})
        if requested.get("factor") == LONGEST_FACTOR:
            raise RelposError("eval.rope_scaling.factor=longest is resolved from the eval lengths before the model is "
                              "built (relpos_cli/extension.resolve_longest_factor)")
        scaling_params(requested, shape.train_seq_len, shape.train_seq_len)  # its options checked now, not at the first forward
        self.eval_scaling = requested if requested.get("type", "none") != "none" else None
        self.length_dependent = (self.eval_scaling is not None and self.eval_scaling.get("factor", AUTO_FACTOR) == AUTO_FACTOR) or \
            (self.scaling_at(shape.train_seq_len) or {}).get("rope_type") == "dynamic"
        inv_freq, self.attention_scale = self.frequencies(self.scaling_at(shape.train_seq_len), shape.train_seq_len)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._by_length: tuple[int, Tensor, float] | None = None  # the frequencies of the last length rotated at
        self._rotation: tuple[Tensor, tuple, tuple[Tensor, ...]] | None = None  # rotation()'s last tables

    def scaling_at(self, length: int) -> dict[str, Any] | None:
        """The rope_parameters in force at `length`: eval.rope_scaling when given, else pos.scaling."""
        if self.eval_scaling is not None:
            return scaling_params(self.eval_scaling, length, self.shape.train_seq_len)
        return self.trained_scaling

    def frequencies(self, scaling: Mapping[str, Any] | None, length: int) -> tuple[Tensor, float]:
        """(inv_freq (Dr/2,), attention_scale) under `scaling` (rope_parameters or None) at `length`."""
        return rope_inv_freq(self.rotary_dim, self.base, scaling, seq_len=length)

    def frequencies_at(self, length: int) -> tuple[Tensor, float]:
        """(inv_freq (Dr/2,), attention_scale) for a forward pass over `length` positions."""
        if not self.length_dependent:
            return self.inv_freq, self.attention_scale
        cached = self._by_length
        if (cached is None or cached[0] != length or cached[1].device != self.inv_freq.device
                or cached[1].dtype != self.inv_freq.dtype):  # the buffer moved (model.to(...)): so do these
            inv_freq, scale = self.frequencies(self.scaling_at(length), length)
            cached = self._by_length = (length, inv_freq.to(self.inv_freq), scale)
        return cached[1], cached[2]

    @classmethod
    def inherit_options(cls, pos_cfg: dict[str, Any], parent_pos_cfg: Mapping[str, Any], parent_train_len: int) -> dict[str, Any]:
        """A fine-tuned run scales from the length its weights were first trained at: the parent's
        own original length if the parent was scaled, else the parent's training length."""
        scaling = dict(pos_cfg.get("scaling") or {})
        if scaling.get("type", "none") != "none" and scaling.get("original_length") is None:
            parent = {**NO_SCALING, **(parent_pos_cfg.get("scaling") or {})}
            scaled = parent["type"] != "none" and parent["original_length"] is not None
            scaling["original_length"] = parent["original_length"] if scaled else parent_train_len
            pos_cfg = {**pos_cfg, "scaling": scaling}
        return pos_cfg

    def cos_sin(self, positions: Tensor, length: int | None = None) -> tuple[Tensor, Tensor]:
        """cos and sin (T, Dr) at positions (T,), with the frequencies of a forward pass over
        `length` positions (default T)."""
        inv_freq, attention_scale = self.frequencies_at(positions.shape[0] if length is None else length)
        freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # (T, Dr/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, Dr)
        if attention_scale == 1.0:  # every scaling but YaRN's: two kernels fewer, the same numbers
            return emb.cos(), emb.sin()
        return emb.cos() * attention_scale, emb.sin() * attention_scale

    def rotate(self, layer: int, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        q_cos, q_sin, k_cos, k_sin = self.rotation(positions, q.dtype)
        return apply_rotary_pair(q, k, q_cos, q_sin, k_cos, k_sin)

    def rotation_tables(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The cos and sin (T, Dr) that rotate q, then those that rotate k, at `positions` in `dtype`,
        computed afresh: RoPE's are one pair."""
        cos, sin = self.cos_sin(positions)
        cos, sin = cos.to(dtype), sin.to(dtype)
        return cos, sin, cos, sin

    def rotation(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """rotation_tables(positions, dtype), computed once for every layer and step while the positions
        tensor (the model keeps one per length) and the frequencies stay the same: the bench model's
        12 layers each computed it afresh, ~9 small kernels a layer, and a RoPE training step on an
        H100 is bound by kernel launches (0.79x NoPE's tokens/s at 9beafdd, ALiBi on flex's formula 0.91x)."""
        # compiled, the graph computes it once and fuses it: no state to keep; inference tensors (made
        # under torch.inference_mode) have no version counter to tell an edit by
        if torch.compiler.is_compiling() or positions.is_inference() or self.inv_freq.is_inference():
            return self.rotation_tables(positions, dtype)
        stamp = (positions._version, dtype, id(self.inv_freq), self.inv_freq._version)
        cached = self._rotation
        if cached is None or cached[0] is not positions or cached[1] != stamp:
            # holds positions: its id stays its own
            cached = self._rotation = (positions, stamp, self.rotation_tables(positions, dtype))
        return cached[2]

    def rotate_apart(self, layer: int, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        length = q_pos.shape[0]  # the queries are the whole sequence (PositionScheme.rotate_apart)
        q_cos, q_sin = self.cos_sin(q_pos, length)
        k_cos, k_sin = self.cos_sin(k_pos, length)
        return apply_rotary_pair(q, k, q_cos.to(q.dtype), q_sin.to(q.dtype), k_cos.to(k.dtype), k_sin.to(k.dtype))

    def check_length(self, length: int) -> None:
        """Positions are rotated in float32, which holds integers exactly only up to 2^24."""
        if length > FLOAT32_EXACT:
            raise RelposError(f"pos={self.name} rotates positions in float32, exact up to {FLOAT32_EXACT}; "
                              f"{length} positions are past that")
