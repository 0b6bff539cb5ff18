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
  sits at distance min(i, N + W - 1) - j. With eval.window.max_distance (LM-Infinite's lambda mask
  and distance limit) every sink outside the window is at distance D instead: the code rotates the
  query at ``min(limit_distance, kv_seq_len - 1)`` and leaves the key unrotated; the paper states
  the limit as min(d, L_pretrain). Schemes without relative positions (learned, sinusoidal, NoPE)
  get the mask only: their positions live in the embeddings, which cannot move per query.

Far positions reach the scheme through its hooks (``rotate_apart``, ``score_bias`` at those
positions); attention (relpos_cli/attention.extended_attention) runs the split without an (L x L)
tensor and never asks which method it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import Tensor

from relpos_cli.errors import RelposError
from relpos_cli.positions import REGISTRY, accepts_rope_scaling, rope_scaling_error
from relpos_cli.positions.base import BiasInput, PositionScheme

METHOD_KEYS = ("self_extend", "rerope", "window")  # eval.<key>: at most one of them on
EVAL_METHOD_KEYS = ("rope_scaling", *METHOD_KEYS)  # every eval-time setting of how positions are used


@dataclass(frozen=True)
class Extension:
    """Near pairs (d < window) keep their positions; far pairs take far_positions, with every key
    or (far_keys) only the first far_keys of them."""

    window: int
    far_keys: int | None = None

    def far_positions(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions (T,) 0..T-1 -> (query positions (T,), key positions (T,)) of far pairs."""
        raise NotImplementedError


@dataclass(frozen=True)
class SelfExtend(Extension):
    group: int = 1

    def far_positions(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        grouped = torch.div(positions, self.group, rounding_mode="floor").double()
        return grouped + (self.window - self.window / self.group), grouped


@dataclass(frozen=True)
class ReRoPE(Extension):
    slope: float = 0.0

    def far_positions(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        scaled = positions.double() * self.slope
        return scaled + self.window * (1 - self.slope), scaled


@dataclass(frozen=True)
class SinkWindow(Extension):
    max_distance: int | None = None

    def far_positions(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        if self.max_distance is None:  # StreamingLLM: the query's position in a cache of far_keys + window
            return positions.clamp(max=int(positions[0]) + (self.far_keys or 0) + self.window - 1), positions
        limit = min(self.max_distance, positions.shape[0] - 1)  # LM-Infinite: every far sink at distance D
        return torch.full_like(positions, limit), torch.zeros_like(positions)


def _section(eval_cfg: Mapping[str, Any], key: str) -> dict[str, Any]:
    section = eval_cfg.get(key) or {}
    return {k: section.get(k) for k in section}


def requested(eval_cfg: Mapping[str, Any]) -> list[str]:
    """The methods whose keys are set, as `eval.<key>` names."""
    on = {"self_extend": "group", "rerope": "window", "window": "size"}
    return [f"eval.{key}" for key in METHOD_KEYS if _section(eval_cfg, key).get(on[key]) is not None]


def build_extension(eval_cfg: Mapping[str, Any]) -> Extension | None:
    """The method eval_cfg asks for (None when its keys are null); ranges are checked by the schema."""
    se, rr, win = (_section(eval_cfg, key) for key in METHOD_KEYS)
    if se.get("group") is not None:
        return SelfExtend(window=int(se["window"]), group=int(se["group"]))
    if rr.get("window") is not None:
        return ReRoPE(window=int(rr["window"]), slope=float(rr.get("slope") or 0.0))
    if win.get("size") is not None:
        return SinkWindow(window=int(win["size"]), far_keys=int(win.get("sinks") or 0),
                          max_distance=None if win.get("max_distance") is None else int(win["max_distance"]))
    return None


def _rotating_schemes() -> str:
    return ", ".join(n for n, cls in sorted(REGISTRY.items()) if cls._overrides("rotate_apart"))


def check_extension(eval_cfg: Mapping[str, Any], scheme: PositionScheme) -> None:
    """RelposError (one line) if the requested method does not apply to this scheme or to the other
    eval settings; called before any scoring, so nothing is written."""
    scaling = (eval_cfg.get("rope_scaling") or {}).get("type", "none")
    if scaling != "none" and not accepts_rope_scaling(type(scheme)):
        raise RelposError(f"{rope_scaling_error('eval.rope_scaling', scheme.name)}, so the results would be the default ones")
    methods = requested(eval_cfg)
    if not methods:
        return
    if len(methods) > 1:
        raise RelposError(f"{' and '.join(methods)} are separate methods; set the keys of one of them")
    method = methods[0]
    if scaling != "none":
        raise RelposError(f"{method} runs on the model's own rotation; none of its references applies it on top of "
                          f"eval.rope_scaling.type={scaling} (set one or the other)")
    ext = build_extension(eval_cfg)
    if not scheme.normalises or scheme.bias_input is BiasInput.TOKEN_DIFFERENCE:
        why = ("replaces softmax's normalisation, which the merge of score sets assumes" if not scheme.normalises
               else "adds a bias of the layer's input (cumulative forget gates), which this path does not read")
        raise RelposError(f"{method} is not implemented for pos={scheme.name}: it {why}")
    if isinstance(ext, (SelfExtend, ReRoPE)) and not scheme.rotates_apart:
        raise RelposError(f"{method} gives (query, key) pairs other rotation distances, so it applies to schemes that "
                          f"rotate q and k ({_rotating_schemes()}); pos={scheme.name} does not")
    if isinstance(ext, SinkWindow):
        if scheme.bias_input is BiasInput.CONTENT:
            raise RelposError(f"eval.window needs a bias that is a function of positions; pos={scheme.name}'s depends "
                              f"on the content of every key between a pair, which the window drops")
        if scheme.uses_rotation and not scheme.rotates_apart:
            raise RelposError(f"eval.window moves sink keys' positions; pos={scheme.name} cannot rotate q and k apart")
        if ext.max_distance is not None and not (scheme.relative and scheme.reads_positions):
            raise RelposError(f"eval.window.max_distance caps the distance i - j a relative scheme sees; pos={scheme.name}'s "
                              f"logits are no function of i - j alone (use eval.window.size and sinks without it)")
    where = {"self_extend": "window", "rerope": "window", "window": "size"}[method.removeprefix("eval.")]
    spans = {f"{method}.{where}": ext.window}
    if isinstance(ext, SinkWindow) and ext.max_distance is not None:
        spans[f"{method}.max_distance"] = ext.max_distance + 1  # distance D needs positions 0..D
    for key, span in spans.items():
        try:
            scheme.check_length(span)
        except RelposError as e:
            value = ext.window if key.endswith(where) else ext.max_distance
            raise RelposError(f"{key}={value} is past what pos={scheme.name} can represent ({e})") from None


def configure_extension(scheme: PositionScheme, eval_cfg: Mapping[str, Any], sliding_window: int | None = None) -> None:
    """Set (or clear) the eval-time method attention runs for this scheme; training never calls it.
    sliding_window: the model's (model.sliding_window), under which no method's reference runs."""
    check_extension(eval_cfg, scheme)
    methods = requested(eval_cfg)
    if methods and sliding_window is not None:
        raise RelposError(f"{methods[0]} extends full causal attention; this model attends within a sliding window of "
                          f"{sliding_window} tokens (model.sliding_window), which no reference combines it with")
    scheme.eval_extension = build_extension(eval_cfg)
