"""Training-free context extension at evaluation: which relative position each (query, key) pair
gets, or which keys a query sees, rather than the rotation frequencies (eval.rope_scaling).

Every method splits a query's keys by their distance d = i - j into near keys (d < W, the window,
the query itself included), which keep their positions, and far keys (d >= W), which take the
method's far positions, or only some of which are seen:

================ ======================================= ===========================================
method            far query position / far key position    reference (file the formula follows)
================ ======================================= ===========================================
Self-Extend       i // G + W - W / G  /  j // G            datamllab/LongLM self_extend_patch/Llama.py
ReRoPE, leaky     i S + W (1 - S)  /  j S                  bojone/rerope rerope_patch.py (S = 0),
                  (distance W + (d - W) S)                  leaky_rerope_patch.py (S = 1/k)
StreamingLLM      min(i, N + W - 1)  /  j, first N keys     mit-han-lab/streaming-llm pos_shift/modify_llama.py
LM-Infinite       min(D, L - 1)  /  0, first N keys         Glaciohound/LM-Infinite models/llama.py
================ ======================================= ===========================================

- Self-Extend: ``group_query_position = query_position // group_size_1 + _re_group_size_2 -
  _re_group_size_2 / group_size_1``: the code divides the window by G exactly (W / G), the paper
  writes the shift with W // G-style integer positions; they agree when G divides W. G = 1 gives
  every pair its own distance: plain attention.
- ReRoPE: the far query is rotated at W and the key not at all (``position_ids * 0 + window``);
  leaky ReRoPE rotates the far query at (i + W (k - 1)) / k and the key at j / k (a linear-scaled
  rotary embedding with factor k), so the distance grows by 1/k per token past W. Both patches also
  multiply queries by max(1, log(i + 1) / log(L_train)) (log-n scaling), which is no part of the
  position formula; relpos leaves queries unscaled.
- StreamingLLM rolls a KV cache of the first N tokens and the last W - 1 before the query and
  rotates keys and query at their positions *in the cache* (paper, section 3.2; the code's
  ``key_position_ids = arange(kv_seq_len)``): a key inside the window keeps its distance, a sink j
  sits at distance min(i, N + W - 1) - j. With eval.sinks.max_distance (LM-Infinite's lambda mask
  and distance limit) every sink outside the window is at distance D instead: the code rotates the
  query at ``min(limit_distance, kv_seq_len - 1)`` and leaves the key unrotated; the paper states
  the limit as min(d, L_pretrain). Schemes without relative positions (learned, sinusoidal, NoPE)
  get the mask only: their positions live in the embeddings, which cannot move per query.

Far positions reach the scheme through its hooks (``rotate_apart``, ``score_bias`` at those
positions); attention (relpos_cli/attention.extended_attention) runs the split without an (L x L)
tensor and never asks which method it runs.

A method, and eval.rope_scaling, are part of the model a run is evaluated as: ``eval_method``
turns the eval settings into an ``EvalMethod`` value, the model is built with it
(relpos_cli/model.build_model), and attention receives its extension as an argument. Every command
that takes eval settings (eval-length, eval-task, sample, load_run) builds the same model for the
same settings; inspect takes none and draws the model as trained.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import torch
from torch import Tensor

from relpos_cli.config import default_group
from relpos_cli.errors import RelposError
from relpos_cli.positions import REGISTRY
from relpos_cli.positions.base import BiasInput, PositionScheme
from relpos_cli.rope_options import LONGEST_FACTOR, check_scaling_takes_effect

METHOD_KEYS = ("self_extend", "rerope", "sinks")  # eval.<key>: at most one of them on
EVAL_METHOD_KEYS = ("rope_scaling", *METHOD_KEYS)  # every eval-time setting of how positions are used


@dataclass(frozen=True)
class Extension:
    """Near pairs (d < window) keep their positions; far pairs take far_positions, with every key
    or (sinks) only the first `sinks` of them."""

    key: ClassVar[str]  # the eval.<section> that sets it
    window: int
    sinks: int | None = None

    def far_positions(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions (T,) 0..T-1 -> (query positions (T,), key positions (T,)) of far pairs."""
        raise NotImplementedError


@dataclass(frozen=True)
class SelfExtend(Extension):
    key: ClassVar[str] = "eval.self_extend"
    group: int = 1

    def far_positions(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        grouped = torch.div(positions, self.group, rounding_mode="floor").double()
        return grouped + (self.window - self.window / self.group), grouped


@dataclass(frozen=True)
class ReRoPE(Extension):
    key: ClassVar[str] = "eval.rerope"
    slope: float = 0.0

    def far_positions(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        scaled = positions.double() * self.slope
        return scaled + self.window * (1 - self.slope), scaled


@dataclass(frozen=True)
class SinkWindow(Extension):
    key: ClassVar[str] = "eval.sinks"
    max_distance: int | None = None

    def far_positions(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        if self.max_distance is None:  # StreamingLLM: the query's position in a cache of sinks + window
            return positions.clamp(max=int(positions[0]) + (self.sinks or 0) + self.window - 1), positions
        limit = min(self.max_distance, positions.shape[0] - 1)  # LM-Infinite: every far sink at distance D
        return torch.full_like(positions, limit), torch.zeros_like(positions)


@dataclass(frozen=True)
class EvalMethod:
    """How a trained model uses positions at evaluation, as a value the model is built with:
    `rope_scaling` (eval.rope_scaling when it names a type) goes to the RoPE schemes' constructor,
    `extension` (eval.self_extend / rerope / sinks) to attention as an argument. EvalMethod() is
    the model as trained; training never builds another."""

    rope_scaling: Mapping[str, Any] | None = None
    extension: Extension | None = None


def _section(eval_cfg: Mapping[str, Any], key: str) -> dict[str, Any]:
    section = eval_cfg.get(key) or {}
    return {k: section.get(k) for k in section}


def requested(eval_cfg: Mapping[str, Any]) -> list[str]:
    """The methods whose keys are set, as `eval.<key>` names."""
    on = {"self_extend": "group", "rerope": "window", "sinks": "window"}
    return [f"eval.{key}" for key in METHOD_KEYS if _section(eval_cfg, key).get(on[key]) is not None]


def build_extension(eval_cfg: Mapping[str, Any]) -> Extension | None:
    """The method eval_cfg asks for (None when its keys are null); ranges are checked by the schema."""
    se, rr, sinks = (_section(eval_cfg, key) for key in METHOD_KEYS)
    if se.get("group") is not None:
        return SelfExtend(window=int(se["window"]), group=int(se["group"]))
    if rr.get("window") is not None:
        return ReRoPE(window=int(rr["window"]), slope=float(rr.get("slope") or 0.0))
    if sinks.get("window") is not None:
        return SinkWindow(window=int(sinks["window"]), sinks=int(sinks.get("count") or 0),
                          max_distance=None if sinks.get("max_distance") is None else int(sinks["max_distance"]))
    return None


def resolve_longest_factor(eval_cfg: Any, longest: int, train_len: int) -> None:
    """eval.rope_scaling.factor=longest -> the number max(1, longest / train_len), in place: one
    factor at every eval length, chosen as pos.scaling's auto is at training (target length / the
    length trained at). The variant then names that number. longest: the longest length scored."""
    scaling = eval_cfg.get("rope_scaling") or {}
    if scaling.get("type", "none") != "none" and scaling.get("factor") == LONGEST_FACTOR:
        if scaling["type"] == "dynamic":  # its base follows each length: there is no one model to fix
            raise RelposError("eval.rope_scaling.factor=longest is one scaled model at every length; type=dynamic rescales its "
                              "base at each length itself (its auto factor is 1, as at training): give factor=auto or a number")
        eval_cfg.rope_scaling.factor = max(1.0, longest / train_len)


def eval_method(eval_cfg: Mapping[str, Any] | None) -> EvalMethod:
    """The EvalMethod the eval settings ask for (EvalMethod() for none); RelposError (one line) for
    settings that cannot go together. What applies to which scheme: check_method, when the model is
    built. eval.rope_scaling.factor=longest must be resolved first (resolve_longest_factor)."""
    if eval_cfg is None:
        return EvalMethod()
    scaling = dict(_section(eval_cfg, "rope_scaling"))
    check_scaling_takes_effect(scaling, default_group("eval").rope_scaling, "eval.rope_scaling")
    methods = requested(eval_cfg)
    if len(methods) > 1:
        raise RelposError(f"{' and '.join(methods)} are separate methods; set the keys of one of them")
    if methods and scaling.get("type", "none") != "none":
        raise RelposError(f"{methods[0]} runs on the model's own rotation; none of its references applies it on top of "
                          f"eval.rope_scaling.type={scaling['type']} (set one or the other)")
    return EvalMethod(rope_scaling=scaling if scaling.get("type", "none") != "none" else None,
                      extension=build_extension(eval_cfg))


def _rotating_schemes() -> str:
    return ", ".join(n for n, cls in sorted(REGISTRY.items()) if cls.overrides("rotate_apart"))


def check_method(method: EvalMethod, scheme: PositionScheme, sliding_window: int | None = None) -> None:
    """RelposError (one line) if the method's extension does not apply to this scheme or model;
    called when the model is built, before any scoring, so nothing is written.
    sliding_window: the model's (model.sliding_window), under which no method's reference runs."""
    ext = method.extension
    if ext is None:
        return
    if sliding_window is not None:
        raise RelposError(f"{ext.key} extends full causal attention; this model attends within a sliding window of "
                          f"{sliding_window} tokens (model.sliding_window), which no reference combines it with")
    if not scheme.normalises or scheme.bias_input is BiasInput.TOKEN_DIFFERENCE:
        why = ("replaces softmax's normalisation, which the merge of score sets assumes" if not scheme.normalises
               else "adds a bias of the layer's input (cumulative forget gates), which this path does not read")
        raise RelposError(f"{ext.key} is not implemented for pos={scheme.name}: it {why}")
    if isinstance(ext, (SelfExtend, ReRoPE)) and not scheme.rotates_apart:
        raise RelposError(f"{ext.key} gives (query, key) pairs other rotation distances, so it applies to schemes that "
                          f"rotate q and k ({_rotating_schemes()}); pos={scheme.name} does not")
    if isinstance(ext, SinkWindow):
        if not scheme.bias_per_pair:  # a token-difference bias was refused above
            raise RelposError(f"{ext.key} gives each (query, key) pair its bias at the pair's cache positions; pos={scheme.name}'s "
                              f"depends on the keys between them as well, which a sink window drops")
        if scheme.uses_rotation and not scheme.rotates_apart:
            raise RelposError(f"{ext.key} moves sink keys' positions; pos={scheme.name} transforms q and k at one set of "
                              f"positions (its rotate hook) and cannot give the keys other ones")
        if ext.max_distance is not None and not (scheme.relative and scheme.reads_positions):
            raise RelposError(f"{ext.key}.max_distance caps the distance i - j a relative scheme sees; pos={scheme.name}'s "
                              f"logits are no function of i - j alone (use {ext.key}.window and {ext.key}.count without it)")
        if ext.max_distance is not None and not ext.sinks:  # else the plain window under LM-Infinite's name
            raise RelposError(f"{ext.key}.max_distance={ext.max_distance} is where LM-Infinite puts the sinks outside the "
                              f"window, and {ext.key}.count=0 keeps none; give {ext.key}.count >= 1, or leave max_distance out")
    spans = {f"{ext.key}.window": (ext.window, ext.window)}
    if isinstance(ext, SinkWindow) and ext.max_distance is not None:
        spans[f"{ext.key}.max_distance"] = (ext.max_distance, ext.max_distance + 1)  # distance D needs positions 0..D
    for key, (value, span) in spans.items():
        try:
            scheme.check_length(span)
        except RelposError as e:
            raise RelposError(f"{key}={value} is past what pos={scheme.name} can represent ({e})") from None
