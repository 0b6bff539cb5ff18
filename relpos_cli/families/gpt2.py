"""GPT-2: learned absolute positions (pos=learned, max_positions = n_positions), LayerNorm with
biases, Conv1D weights (stored as (in, out): transposed here), biases everywhere, a tied head.
Reference: transformers models/gpt2/modeling_gpt2.py.

Weight names: transformer.{wte, wpe}, transformer.h.N.{ln_1, attn.c_attn, attn.c_proj, ln_2,
mlp.c_fc, mlp.c_proj}, transformer.ln_f."""

from __future__ import annotations

from typing import Any, Mapping

from torch import Tensor

from relpos_cli.families import register
from relpos_cli.families.base import Conversion, Family, Weights, activation, model_options, refuse_unless, require


@register("gpt2")
class GPT2(Family):
    model_types = ("gpt2",)
    prefix = "transformer."

    def convert_config(self, c: Mapping[str, Any]) -> Conversion:
        family = "gpt2"
        d_model = require(c, "n_embd", family)
        refuse_unless(c.get("scale_attn_weights", True), family, "scale_attn_weights=false")
        refuse_unless(not c.get("scale_attn_by_inverse_layer_idx", False), family, "scale_attn_by_inverse_layer_idx=true")
        model = model_options(
            d_model=d_model, n_layers=require(c, "n_layer", family), n_heads=require(c, "n_head", family),
            vocab_size=require(c, "vocab_size", family), mlp_hidden=c.get("n_inner") or 4 * d_model,
            mlp=activation(c, "activation_function", family), norm="layernorm",
            norm_eps=float(c.get("layer_norm_epsilon", 1e-5)), attn_bias=True, proj_bias=True, mlp_bias=True,
            tie_embeddings=bool(c.get("tie_word_embeddings", True)),
        )
        n_positions = require(c, "n_positions", family)
        return Conversion(model, {"name": "learned", "max_positions": int(n_positions)}, int(n_positions))

    def convert_weights(self, w: Weights, c: Mapping[str, Any], model: Mapping[str, Any]) -> dict[str, Tensor]:
        state = {"tok_emb.weight": w.take("wte.weight"), "scheme.table.weight": w.take("wpe.weight"),
                 "norm.weight": w.take("ln_f.weight"), "norm.bias": w.take("ln_f.bias")}
        for i in range(model["n_layers"]):
            layer, ours = f"h.{i}.", f"blocks.{i}."
            for theirs, mine in (("ln_1", "norm1"), ("ln_2", "norm2")):
                state[f"{ours}{mine}.weight"] = w.take(f"{layer}{theirs}.weight")
                state[f"{ours}{mine}.bias"] = w.take(f"{layer}{theirs}.bias")
            for theirs, mine in (("attn.c_attn", "attn.qkv"), ("attn.c_proj", "attn.proj"), ("mlp.c_fc", "mlp.up"),
                                 ("mlp.c_proj", "mlp.down")):
                state[f"{ours}{mine}.weight"] = w.take(f"{layer}{theirs}.weight").t().contiguous()  # Conv1D: (in, out)
                state[f"{ours}{mine}.bias"] = w.take(f"{layer}{theirs}.bias")
        return state
