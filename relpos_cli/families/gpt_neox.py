"""GPT-NeoX / Pythia: LayerNorm with biases, parallel residual (x + attn(ln1 x) + mlp(ln2 x)),
partial rotary (the first rotary_pct of each head), fused per-head q/k/v, biases everywhere,
an untied head. Reference: transformers models/gpt_neox/modeling_gpt_neox.py.

Weight names: gpt_neox.embed_in, gpt_neox.layers.N.{input_layernorm, post_attention_layernorm,
attention.query_key_value, attention.dense, mlp.dense_h_to_4h, mlp.dense_4h_to_h},
gpt_neox.final_layer_norm, embed_out."""

from __future__ import annotations

from typing import Any, Mapping

from torch import Tensor

from relpos_cli.families import register
from relpos_cli.families.base import (Conversion, Family, Weights, activation, interleaved_qkv, model_options, require,
                                      rope_position)


@register("gpt_neox")
class GPTNeoX(Family):
    model_types = ("gpt_neox",)
    prefix = "gpt_neox."
    heads = ("embed_out.weight", "lm_head.weight")  # checkpoints / transformers 5's module name

    def convert_config(self, c: Mapping[str, Any]) -> Conversion:
        family = "gpt_neox"
        d_model = require(c, "hidden_size", family)
        bias = bool(c.get("attention_bias", True))
        model = model_options(
            d_model=d_model, n_layers=require(c, "num_hidden_layers", family),
            n_heads=require(c, "num_attention_heads", family), vocab_size=require(c, "vocab_size", family),
            mlp_hidden=require(c, "intermediate_size", family), mlp=activation(c, "hidden_act", family),
            norm="layernorm", norm_eps=float(c.get("layer_norm_eps", 1e-5)), attn_bias=bias, proj_bias=bias,
            mlp_bias=True, parallel_residual=bool(c.get("use_parallel_residual", True)),
            tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        )
        pos, train_len = rope_position(c, family, require(c, "max_position_embeddings", family))
        return Conversion(model, pos, train_len)

    def convert_weights(self, w: Weights, c: Mapping[str, Any], model: Mapping[str, Any]) -> dict[str, Tensor]:
        state = {"tok_emb.weight": w.take("embed_in.weight"), "norm.weight": w.take("final_layer_norm.weight"),
                 "norm.bias": w.take("final_layer_norm.bias")}
        for i in range(model["n_layers"]):
            layer, ours = f"layers.{i}.", f"blocks.{i}."
            for theirs, mine in (("input_layernorm", "norm1"), ("post_attention_layernorm", "norm2"),
                                 ("attention.dense", "attn.proj"), ("mlp.dense_h_to_4h", "mlp.up"),
                                 ("mlp.dense_4h_to_h", "mlp.down")):
                for kind in ("weight", "bias"):
                    if kind == "bias" and mine == "attn.proj" and not model["proj_bias"]:
                        continue
                    state[f"{ours}{mine}.{kind}"] = w.take(f"{layer}{theirs}.{kind}")
            qkv = layer + "attention.query_key_value."
            state[ours + "attn.qkv.weight"] = interleaved_qkv(w.take(qkv + "weight"), model["n_heads"])
            if model["attn_bias"]:
                state[ours + "attn.qkv.bias"] = interleaved_qkv(w.take(qkv + "bias"), model["n_heads"])
        return state
