"""What a pretrained family provides, and the helpers the families share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import Tensor

from relpos_cli.errors import RelposError
from relpos_cli.settings import model_option_defaults


@dataclass
class Conversion:
    """A checkpoint in relpos's terms: run config sections and the state dict of relpos's model."""

    model: dict[str, Any]  # model.* keys (relpos_cli/settings.py ModelSettings)
    pos: dict[str, Any]  # the position scheme and its options (conf/pos/<name>.yaml)
    train_len: int  # the context the model was trained at: train.seq_len of the run
    notes: list[str] = field(default_factory=list)  # what the conversion leaves out, said at import


class Weights:
    """A checkpoint's tensors by name, with the family's prefix (``model.``, ``transformer.``) taken
    off where present. take(name) hands one out; leftover() names those no one took."""

    IGNORED = ("rotary_emb.inv_freq", "attn.bias", "attn.masked_bias", "attention.bias", "attention.masked_bias")

    def __init__(self, tensors: Mapping[str, Tensor], prefix: str, family: str):
        self.family = family
        self.tensors = {(k[len(prefix):] if k.startswith(prefix) else k): v for k, v in tensors.items()}
        self.taken: set[str] = set()

    def take(self, name: str) -> Tensor:
        if name not in self.tensors:
            raise RelposError(f"the {self.family} checkpoint has no weight {name!r}: a weight file is missing or "
                              f"truncated, or this is no {self.family} checkpoint")
        self.taken.add(name)
        return self.tensors[name].to(torch.float32)

    def get(self, name: str) -> Tensor | None:
        return self.take(name) if name in self.tensors else None

    def leftover(self) -> list[str]:
        return sorted(k for k in self.tensors if k not in self.taken and not k.endswith(self.IGNORED))


class Family:
    """One pretrained family: HF config -> relpos options; HF weight names -> relpos's."""

    name = ""
    model_types: tuple[str, ...] = ()
    prefix = ""  # the base model's prefix in the causal-LM checkpoint's weight names
    heads: tuple[str, ...] = ("lm_head.weight",)  # the output head's names, outside the prefix (first found)

    def convert_config(self, c: Mapping[str, Any]) -> Conversion:
        raise NotImplementedError

    def convert_weights(self, w: Weights, c: Mapping[str, Any], model: Mapping[str, Any]) -> dict[str, Tensor]:
        """relpos's state dict from the checkpoint's tensors (`model`: convert_config's model keys)."""
        raise NotImplementedError

    def convert(self, tensors: Mapping[str, Tensor], c: Mapping[str, Any]) -> tuple[Conversion, dict[str, Tensor]]:
        conversion = self.convert_config(c)
        w = Weights(tensors, self.prefix, self.name)
        state = self.convert_weights(w, c, conversion.model)
        head = next((h for h in self.heads if h in w.tensors), self.heads[0])
        if conversion.model["tie_embeddings"]:
            stored = w.get(head)  # a checkpoint may store the tied head as well: the same tensor
            if stored is not None and not torch.equal(stored, state["tok_emb.weight"]):
                # a head of its own: transformers (modeling_utils.tie_weights) and llama.cpp read it untied
                conversion.model["tie_embeddings"] = False
                conversion.notes.append(f"the config ties the output head to the embedding, but the checkpoint's "
                                        f"{head} differs from it: imported untied, as transformers reads it")
        state["lm_head.weight"] = state["tok_emb.weight"] if conversion.model["tie_embeddings"] else w.take(head)
        extra = w.leftover()
        if extra:
            raise RelposError(f"the {self.name} checkpoint holds weights relpos does not map ({', '.join(extra[:3])}"
                              f"{', ...' if len(extra) > 3 else ''}): an option of this architecture it does not support")
        return conversion, state


def require(c: Mapping[str, Any], key: str, family: str) -> Any:
    if c.get(key) is None:
        raise RelposError(f"the {family} config has no {key!r}")
    return c[key]


def refuse_unless(condition: bool, family: str, what: str) -> None:
    if not condition:
        raise RelposError(f"{family} checkpoint with {what}: relpos does not import this variant")


def model_options(**options: Any) -> dict[str, Any]:
    """model.* for a family: relpos's defaults for whatever the family does not set."""
    return {"mlp_ratio": 4, "dropout": 0.0, "attn_backend": "auto", **model_option_defaults(), **options}


# transformers' activation names (activations.py ACT2CLS) -> the function relpos computes; several
# names are one function: gelu_python is erf GELU, and gelu_new / gelu_fast / gelu_accurate /
# gelu_pytorch_tanh / gelu_python_tanh are all the tanh approximation, swish is SiLU
HF_ACTIVATIONS = {"gelu": "gelu", "gelu_python": "gelu", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh",
                  "gelu_accurate": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_python_tanh": "gelu_tanh",
                  "silu": "silu", "swish": "silu"}


def activation(c: Mapping[str, Any], key: str, family: str, allowed: tuple[str, ...] = ("gelu", "gelu_tanh"),
               default: str | None = None) -> str:
    """The function the config's `key` names, one of `allowed` (relpos's names), or a one-line error
    listing the transformers names that give one of them.

    Args:
        c: the Hugging Face config.
        key: the config key naming the activation (hidden_act, activation_function).
        family: the family's name, for the message.
        allowed: the functions the family's MLP can compute (gelu, gelu_tanh; silu for a SwiGLU gate).
        default: what a config without `key` uses (transformers' default for the family).
    """
    act = c.get(key, default)
    if HF_ACTIVATIONS.get(act) not in allowed:
        names = [name for name, fn in HF_ACTIVATIONS.items() if fn in allowed]
        raise RelposError(f"{family} checkpoint with {key}={act!r}: relpos imports {', '.join(names)}")
    return HF_ACTIVATIONS[act]


def rope_position(c: Mapping[str, Any], family: str, max_len: int) -> tuple[dict[str, Any], int]:
    """pos=rope from transformers' rope_parameters (theta, partial_rotary_factor, scaling), and the
    trained context: the scaling's original length where it names one (not for dynamic NTK), else
    `max_len`."""
    params = dict(c.get("rope_parameters") or {})
    legacy = dict(c.get("rope_scaling") or {})  # configs written before transformers 5
    params = {**legacy, **params} if params.get("rope_type", "default") == "default" else params
    rope_type = params.get("rope_type") or params.get("type") or "default"
    base = params.get("rope_theta") or c.get("rope_theta") or c.get("rotary_emb_base") or 10000.0
    # the first that is set: a factor of 0 (no rotated dimensions) is a setting, not "unset"
    fraction = next(f for f in (params.get("partial_rotary_factor"), c.get("partial_rotary_factor"),
                                c.get("rotary_pct"), 1.0) if f is not None)
    refuse_unless(fraction > 0, family, f"partial_rotary_factor={fraction} (no rotated dimensions)")
    pos = {"name": "rope", "base": float(base), "rotary_fraction": float(fraction)}
    if rope_type == "default":
        return pos, int(max_len)
    if rope_type not in ("linear", "dynamic", "yarn", "llama3"):
        raise RelposError(f"{family} checkpoint with rope scaling {rope_type!r}: relpos imports linear, dynamic, "
                          f"yarn and llama3")
    # transformers' dynamic NTK scales from max_position_embeddings, past it, whatever the config's
    # original_max_position_embeddings says (modeling_rope_utils._compute_dynamic_ntk_parameters)
    original = max_len if rope_type == "dynamic" else params.get("original_max_position_embeddings")
    factor = params.get("factor")
    if factor is None and original:  # transformers' yarn default
        factor = max_len / original
    # YaRN's betas, whole numbers as pos.scaling takes them (a config's or a GGUF file's 32.0 is 32)
    betas = {name: params.get(name) or default for name, default in (("beta_fast", 32), ("beta_slow", 1))}
    betas = {name: int(value) if float(value).is_integer() else value for name, value in betas.items()}
    scaling = {"type": rope_type, "factor": float(factor), "original_length": int(original) if original else None, **betas,
               "attention_factor": params.get("attention_factor"),
               "low_freq_factor": params.get("low_freq_factor"), "high_freq_factor": params.get("high_freq_factor")}
    if rope_type == "yarn" and (params.get("mscale") or params.get("truncate") is False):
        raise RelposError(f"{family} checkpoint with yarn mscale or truncate=false: relpos does not import this variant")
    return {**pos, "scaling": scaling}, int(original or max_len)


def head_dim_of(c: Mapping[str, Any], d_model: int, n_heads: int, family: str) -> None:
    head_dim = c.get("head_dim")
    if head_dim is not None and head_dim != d_model // n_heads:
        raise RelposError(f"{family} checkpoint with head_dim={head_dim} != hidden_size / heads = {d_model // n_heads}: "
                          f"relpos does not import this variant")


def interleaved_qkv(t: Tensor, n_heads: int) -> Tensor:
    """A fused (H x [q, k, v] x Dh, ...) projection (GPT-NeoX, BLOOM) in relpos's order ([q | k | v], heads inside)."""
    return t.reshape(n_heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)
