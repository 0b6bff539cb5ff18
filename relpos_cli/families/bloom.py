"""BLOOM: ALiBi (pos=alibi; transformers adds slope x key position, equal under softmax to
relpos's -slope x (i - j)), a LayerNorm on the token embeddings, fused per-head q/k/v, biases
everywhere, tanh GELU, a tied head. Reference: transformers models/bloom/modeling_bloom.py.

Weight names: transformer.{word_embeddings, word_embeddings_layernorm}, transformer.h.N.{
input_layernorm, self_attention.query_key_value, self_attention.dense, post_attention_layernorm,
mlp.dense_h_to_4h, mlp.dense_4h_to_h}, transformer.ln_f."""

from __future__ import annotations

from typing import Any, Mapping

from torch import Tensor

from relpos_cli.families import register
from relpos_cli.families.base import Conversion, Family, Weights, interleaved_qkv, model_options, refuse_unless, require

BLOOM_CONTEXT = 2048  # BLOOM's configs do not state the trained context; the BLOOM paper's sequence length


@register("bloom")
class Bloom(Family):
    model_types = ("bloom",)
    prefix = "transformer."

    def convert_config(self, c: Mapping[str, Any]) -> Conversion:
        family = "bloom"
        d_model = c.get("hidden_size") or require(c, "n_embed", family)
        refuse_unless(not c.get("apply_residual_connection_post_layernorm", False), family,
                      "apply_residual_connection_post_layernorm=true")
        model = model_options(
            d_model=d_model, n_layers=c.get("n_layer") or require(c, "num_hidden_layers", family),
            n_heads=c.get("n_head") or require(c, "num_attention_heads", family),
            vocab_size=require(c, "vocab_size", family), mlp_hidden=4 * d_model, mlp="gelu_tanh", norm="layernorm",
            norm_eps=float(c.get("layer_norm_epsilon", 1e-5)), attn_bias=True, proj_bias=True, mlp_bias=True,
            embed_norm=True, tie_embeddings=bool(c.get("tie_word_embeddings", True)),
        )
        return Conversion(model, {"name": "alibi"}, int(c.get("seq_length") or BLOOM_CONTEXT))

    def convert_weights(self, w: Weights, c: Mapping[str, Any], model: Mapping[str, Any]) -> dict[str, Tensor]:
        state = {"tok_emb.weight": w.take("word_embeddings.weight")}
        for theirs, mine in (("word_embeddings_layernorm", "emb_norm"), ("ln_f", "norm")):
            state[f"{mine}.weight"], state[f"{mine}.bias"] = w.take(f"{theirs}.weight"), w.take(f"{theirs}.bias")
        for i in range(model["n_layers"]):
            layer, ours = f"h.{i}.", f"blocks.{i}."
            for theirs, mine in (("input_layernorm", "norm1"), ("post_attention_layernorm", "norm2"),
                                 ("self_attention.dense", "attn.proj"), ("mlp.dense_h_to_4h", "mlp.up"),
                                 ("mlp.dense_4h_to_h", "mlp.down")):
                state[f"{ours}{mine}.weight"] = w.take(f"{layer}{theirs}.weight")
                state[f"{ours}{mine}.bias"] = w.take(f"{layer}{theirs}.bias")
            qkv = layer + "self_attention.query_key_value."
            state[ours + "attn.qkv.weight"] = interleaved_qkv(w.take(qkv + "weight"), model["n_heads"])
            state[ours + "attn.qkv.bias"] = interleaved_qkv(w.take(qkv + "bias"), model["n_heads"])
        return state
