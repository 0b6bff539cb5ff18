"""Llama and its kin (Mistral, Qwen2, SmolLM): RMSNorm, SwiGLU MLP, grouped-query attention,
RoPE with its theta and scaling (linear, dynamic, yarn, llama3), tied or untied head; Qwen2 has
biases on q, k and v. Reference: transformers models/llama/modeling_llama.py (and qwen2, mistral).

Weight names: model.embed_tokens, model.layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj,
post_attention_layernorm, mlp.{gate,up,down}_proj}, model.norm, lm_head."""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import Tensor

from relpos_cli.families import register
from relpos_cli.families.base import (Conversion, Family, Weights, activation, head_dim_of, model_options, require,
                                      rope_position)


def sliding_options(c: Mapping[str, Any], family: str, n_layers: int) -> dict[str, Any]:
    """model.sliding_window / sliding_layers as transformers applies them: Mistral, every layer when
    sliding_window is set (modeling_mistral.py); Qwen2, when use_sliding_window, the layers its
    layer_types call "sliding_attention" (transformers' config fills layer_types in: by default
    the layers from max_window_layers on, configuration_qwen2.py); Llama, none."""
    window = c.get("sliding_window")
    if family == "llama" or not window or (family == "qwen2" and not c.get("use_sliding_window", False)):
        return {}
    if family == "mistral":
        return {"sliding_window": int(window)}
    layers = [i for i, kind in enumerate(require(c, "layer_types", family)) if kind == "sliding_attention"]
    if not layers:
        return {}
    return {"sliding_window": int(window), "sliding_layers": None if len(layers) == n_layers else layers}


@register("llama")
class Llama(Family):
    model_types = ("llama", "mistral", "qwen2")
    prefix = "model."

    def convert_config(self, c: Mapping[str, Any]) -> Conversion:
        family = c["model_type"]
        d_model = require(c, "hidden_size", family)
        n_heads = require(c, "num_attention_heads", family)
        head_dim_of(c, d_model, n_heads, family)
        activation(c, "hidden_act", family, allowed=("silu",), default="silu")  # the SwiGLU gate's
        qwen2 = family == "qwen2"
        # Llama's bias options: Mistral's and Qwen2's modules fix their biases whatever the config names
        llama = family == "llama"
        bias = llama and bool(c.get("attention_bias", False))
        model = model_options(
            d_model=d_model, n_layers=require(c, "num_hidden_layers", family), n_heads=n_heads,
            n_kv_heads=c.get("num_key_value_heads") or n_heads, vocab_size=require(c, "vocab_size", family),
            mlp_hidden=require(c, "intermediate_size", family), mlp="swiglu", norm="rmsnorm",
            norm_eps=float(c.get("rms_norm_eps", 1e-6)), attn_bias=qwen2 or bias, proj_bias=bias,
            mlp_bias=llama and bool(c.get("mlp_bias", False)), tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        )
        model.update(sliding_options(c, family, model["n_layers"]))
        max_len = require(c, "max_position_embeddings", family)
        pos, train_len = rope_position(c, family, max_len)
        return Conversion(model, pos, train_len)

    def convert_weights(self, w: Weights, c: Mapping[str, Any], model: Mapping[str, Any]) -> dict[str, Tensor]:
        state = {"tok_emb.weight": w.take("embed_tokens.weight"), "norm.weight": w.take("norm.weight")}
        for i in range(model["n_layers"]):
            layer, ours = f"layers.{i}.", f"blocks.{i}."
            state[ours + "norm1.weight"] = w.take(layer + "input_layernorm.weight")
            state[ours + "norm2.weight"] = w.take(layer + "post_attention_layernorm.weight")
            attn = layer + "self_attn."
            state[ours + "attn.qkv.weight"] = torch.cat([w.take(attn + f"{p}_proj.weight") for p in "qkv"])
            if model["attn_bias"]:
                state[ours + "attn.qkv.bias"] = torch.cat([w.take(attn + f"{p}_proj.bias") for p in "qkv"])
            state[ours + "attn.proj.weight"] = w.take(attn + "o_proj.weight")
            if model["proj_bias"]:
                state[ours + "attn.proj.bias"] = w.take(attn + "o_proj.bias")
            for theirs, mine in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
                state[ours + f"mlp.{mine}.weight"] = w.take(layer + f"mlp.{theirs}.weight")
                if model["mlp_bias"]:
                    state[ours + f"mlp.{mine}.bias"] = w.take(layer + f"mlp.{theirs}.bias")
        return state
