"""Pretrained families against transformers' own forward: a tiny random model built with
transformers, converted by its family module (relpos_cli/families/), must give the same logits
in relpos's Transformer (fp32, 1e-4).

Every weight (biases and norms included) is drawn at random with a large spread, so a weight
mapped to the wrong place, a missing bias or a wrong activation moves the logits by far more than
the tolerance. Mutations checked to fail these tests: the GPT-NeoX / BLOOM q/k/v de-interleave
left out (interleaved_qkv returning its input): gpt_neox and bloom fail; llama3's smoothing
blend dropped (rope.py: `medium` all false): llama3 fails; Qwen2 q/k/v biases left out
(attn_bias=qwen2 -> bias): qwen2 fails; repeat_interleave replaced by repeat in model.py's
grouped-query expansion: the GQA cases fail; the GPT-2 Conv1D transpose left out: gpt2 fails.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from relpos_cli.errors import RelposError  # noqa: E402
from relpos_cli.extension import eval_method  # noqa: E402
from relpos_cli.families import family_for  # noqa: E402
from relpos_cli.model import build_model  # noqa: E402

transformers.logging.set_verbosity_error()
VOCAB = 300
LLAMA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)


def random_hf_model(config_cls, model_cls, **kwargs):
    torch.manual_seed(0)
    model = model_cls(config_cls(**kwargs)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln" in name:  # norm gains near 1: activations stay in range
                p.copy_(1 + 0.3 * torch.randn_like(p) if name.endswith("weight") else 0.3 * torch.randn_like(p))
            else:
                p.normal_(0, 0.15)
    return model


def converted(hf_model, eval_cfg=None):
    """relpos's model from a transformers model's config and weights, through its family module,
    built with the eval-time method eval_cfg asks for (relpos_cli/extension.eval_method)."""
    config = hf_model.config.to_dict()
    conversion, state = family_for(config).convert(hf_model.state_dict(), config)
    run = {"model": conversion.model, "pos": conversion.pos, "train": {"seq_len": conversion.train_len}}
    ours = build_model(run, conversion.model["vocab_size"], eval_method(eval_cfg))
    ours.load_state_dict(state, strict=True)
    return ours.eval(), conversion


def assert_same_logits(hf_model, length: int = 48, **eval_cfg):
    ours, conversion = converted(hf_model, eval_cfg or None)
    tokens = torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = hf_model(tokens).logits
        logits = ours(tokens)
    assert reference.std() > 0.5  # the weights' spread reaches the logits: a wrong mapping cannot hide
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
    return conversion


T = transformers


@pytest.mark.parametrize("kwargs", [
    dict(LLAMA),  # grouped-query attention: 2 key/value heads for 4 query heads
    dict(LLAMA, num_key_value_heads=4, tie_word_embeddings=True),
    dict(LLAMA, num_key_value_heads=1, attention_bias=True, mlp_bias=True),
    dict(LLAMA, rope_theta=100000.0, rms_norm_eps=1e-5),
], ids=["gqa", "tied", "mqa-biases", "theta"])
def test_llama(kwargs):
    conversion = assert_same_logits(random_hf_model(T.LlamaConfig, T.LlamaForCausalLM, **kwargs))
    assert conversion.model["n_kv_heads"] == kwargs["num_key_value_heads"]


@pytest.mark.parametrize("scaling,train_len", [
    ({"rope_type": "linear", "factor": 4.0}, 128),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}, 32),
    ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64, "beta_fast": 16, "beta_slow": 2}, 64),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 32}, 32),
], ids=["linear", "yarn", "yarn-betas", "llama3"])
def test_llama_rope_scaling(scaling, train_len):
    """The config's rope_scaling becomes pos.scaling, and train.seq_len its original length."""
    hf = random_hf_model(T.LlamaConfig, T.LlamaForCausalLM, rope_scaling=scaling, rope_theta=500.0, **LLAMA)
    conversion = assert_same_logits(hf, length=96)
    assert conversion.pos["scaling"]["type"] == scaling["rope_type"]
    assert conversion.train_len == train_len


@pytest.mark.parametrize("length", [24, 48], ids=["below-max", "above-max"])
@pytest.mark.parametrize("original", [None, 16], ids=["plain", "with-original"])
def test_llama_dynamic_ntk(original, length):
    """transformers' dynamic NTK scales from max_position_embeddings (32 here), once a forward
    passes it, whatever the config's original_max_position_embeddings (16) says: relpos scaled from
    16, 2.1 apart at 24 tokens."""
    scaling = {"rope_type": "dynamic", "factor": 2.0, **({"original_max_position_embeddings": original} if original else {})}
    hf = random_hf_model(T.LlamaConfig, T.LlamaForCausalLM, rope_scaling=scaling,
                         **{**LLAMA, "max_position_embeddings": 32})
    conversion = assert_same_logits(hf, length=length)
    assert conversion.train_len == 32 and conversion.pos["scaling"]["type"] == "dynamic"


def test_llama_rope_scaling_changes_the_logits():
    """The scaled cases above test something: the same weights without the scaling give other logits."""
    hf = random_hf_model(T.LlamaConfig, T.LlamaForCausalLM, rope_theta=500.0, **LLAMA,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    ours, conversion = converted(hf)
    plain = build_model({"model": conversion.model, "pos": {**conversion.pos, "scaling": None},
                         "train": {"seq_len": 128}}, VOCAB)
    plain.load_state_dict(ours.state_dict())
    tokens = torch.randint(0, VOCAB, (1, 96))
    with torch.no_grad():
        assert (plain.eval()(tokens) - ours(tokens)).abs().max() > 1e-2


def test_qwen2_biases():
    conversion = assert_same_logits(random_hf_model(T.Qwen2Config, T.Qwen2ForCausalLM, **LLAMA))
    assert conversion.model["attn_bias"] and not conversion.model["proj_bias"]


def test_mistral():
    assert_same_logits(random_hf_model(T.MistralConfig, T.MistralForCausalLM, **LLAMA, sliding_window=None))


def test_mistral_sliding_window():
    """A window of 16 at 48 tokens: transformers' sliding mask on every layer (masking_utils)."""
    hf = random_hf_model(T.MistralConfig, T.MistralForCausalLM, **LLAMA, sliding_window=16)
    conversion = assert_same_logits(hf)
    assert conversion.model["sliding_window"] == 16 and conversion.model["sliding_layers"] is None
    ours, _ = converted(hf)
    for block in ours.blocks:
        block.attn.window = None
    tokens = torch.randint(0, VOCAB, (1, 48))
    with torch.no_grad():  # the window matters at this length: attending to every key gives other logits
        assert (ours(tokens) - hf(tokens).logits).abs().max() > 1e-2


def test_qwen2_sliding_window_on_its_later_layers():
    hf = random_hf_model(T.Qwen2Config, T.Qwen2ForCausalLM, **LLAMA, use_sliding_window=True, sliding_window=16,
                         max_window_layers=1)
    conversion = assert_same_logits(hf)
    assert conversion.model["sliding_window"] == 16 and conversion.model["sliding_layers"] == [1]
    off = random_hf_model(T.Qwen2Config, T.Qwen2ForCausalLM, **LLAMA, sliding_window=16)  # use_sliding_window false
    assert family_for(off.config.to_dict()).convert_config(off.config.to_dict()).model["sliding_window"] is None


@pytest.mark.parametrize("kwargs", [
    dict(rotary_pct=0.25),
    dict(rotary_pct=0.5, use_parallel_residual=False, hidden_act="gelu_new", tie_word_embeddings=True),
    dict(rotary_pct=1.0, attention_bias=False),
], ids=["pythia", "sequential-residual", "no-attention-bias"])
def test_gpt_neox(kwargs):
    hf = random_hf_model(T.GPTNeoXConfig, T.GPTNeoXForCausalLM, vocab_size=VOCAB, hidden_size=64,
                         intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         max_position_embeddings=128, **kwargs)
    conversion = assert_same_logits(hf)
    assert conversion.pos["rotary_fraction"] == kwargs["rotary_pct"]


def test_gpt2():
    hf = random_hf_model(T.GPT2Config, T.GPT2LMHeadModel, vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                         n_positions=128)
    conversion = assert_same_logits(hf)
    assert conversion.pos == {"name": "learned", "max_positions": 128}


def test_bloom():
    hf = random_hf_model(T.BloomConfig, T.BloomForCausalLM, vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4)
    conversion = assert_same_logits(hf)
    assert conversion.pos == {"name": "alibi"}


def test_bloom_non_power_of_two_heads():
    """ALiBi slopes for 6 heads follow BLOOM's recipe (closest power of two, then every other slope)."""
    hf = random_hf_model(T.BloomConfig, T.BloomForCausalLM, vocab_size=VOCAB, hidden_size=96, n_layer=1, n_head=6)
    assert_same_logits(hf)


def test_unsupported_architecture_names_the_families():
    with pytest.raises(RelposError, match=r"architecture 'falcon' is not supported; relpos imports these families: "
                                          r"bloom \(bloom\), gpt2 \(gpt2\), gpt_neox \(gpt_neox\), llama"):
        family_for({"model_type": "falcon"})


def test_a_missing_weight_is_named():
    hf = random_hf_model(T.LlamaConfig, T.LlamaForCausalLM, **LLAMA)
    state = dict(hf.state_dict())
    del state["model.layers.1.mlp.up_proj.weight"]
    config = hf.config.to_dict()
    with pytest.raises(RelposError, match="has no weight 'layers.1.mlp.up_proj.weight'"):
        family_for(config).convert(state, config)


def test_an_unmapped_weight_is_refused():
    hf = random_hf_model(T.LlamaConfig, T.LlamaForCausalLM, **LLAMA)
    state = {**hf.state_dict(), "model.layers.0.self_attn.q_norm.weight": torch.ones(16)}
    config = hf.config.to_dict()
    with pytest.raises(RelposError, match="holds weights relpos does not map"):
        family_for(config).convert(state, config)


@pytest.mark.parametrize("act", ["swish", "silu"])
def test_llama_takes_every_name_transformers_gives_silu(act):
    """transformers' ACT2FN maps "swish" to SiLU as it maps "silu": both are Llama's SwiGLU gate."""
    assert_same_logits(random_hf_model(T.LlamaConfig, T.LlamaForCausalLM, **LLAMA, hidden_act=act))


@pytest.mark.parametrize("act", ["gelu_python", "gelu_accurate", "gelu_python_tanh", "gelu_fast"])
def test_gpt_neox_takes_transformers_gelu_aliases(act):
    hf = random_hf_model(T.GPTNeoXConfig, T.GPTNeoXForCausalLM, vocab_size=VOCAB, hidden_size=64,
                         intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         max_position_embeddings=128, rotary_pct=0.25, hidden_act=act)
    assert_same_logits(hf)


@pytest.mark.parametrize("model_type,key,act,named", [
    ("llama", "hidden_act", "gelu", "relpos imports silu, swish$"),
    ("gpt_neox", "hidden_act", "swish", "relpos imports gelu, gelu_python, gelu_new"),
    ("gpt2", "activation_function", "relu", "relpos imports gelu, gelu_python, gelu_new"),
])
def test_an_activation_the_mlp_cannot_compute_is_refused(model_type, key, act, named):
    config = {"llama": T.LlamaConfig(**LLAMA), "gpt_neox": T.GPTNeoXConfig(), "gpt2": T.GPT2Config()}[model_type]
    c = {**config.to_dict(), key: act}
    with pytest.raises(RelposError, match=f"{model_type} checkpoint with {key}='{act}': {named}"):
        family_for(c).convert_config(c)


def test_qwen2_sliding_layers_follow_layer_types():
    """transformers fills layer_types in; relpos reads them, not max_window_layers (configs may name both)."""
    c = {**T.Qwen2Config(**LLAMA, use_sliding_window=True, sliding_window=16).to_dict(),
         "layer_types": ["sliding_attention", "full_attention"], "max_window_layers": 1}
    assert family_for(c).convert_config(c).model["sliding_layers"] == [0]
