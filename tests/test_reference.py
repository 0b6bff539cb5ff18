"""The checkable pure functions against the `transformers` reference implementations."""

import pytest
import torch

from relpos_cli.positions.alibi import alibi_slopes
from relpos_cli.positions.rope import rope_inv_freq
from relpos_cli.positions.t5 import relative_position_bucket

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (16, 64), (64, 256), (8, 20)])
def test_t5_buckets_match_transformers(bidirectional, num_buckets, max_distance):
    from transformers.models.t5.modeling_t5 import T5Attention

    rel = torch.arange(-600, 600)[None, :] - torch.arange(0, 3)[:, None]
    ours = relative_position_bucket(rel, bidirectional, num_buckets, max_distance)
    ref = T5Attention._relative_position_bucket(rel, bidirectional, num_buckets, max_distance)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("n_heads", [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 20, 32, 48])
def test_alibi_slopes_match_bloom(n_heads):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    mask = torch.ones(1, 2)
    ref = build_alibi_tensor(mask, n_heads, torch.float32)  # (H, 1, T) = slope_h * position
    assert torch.allclose(alibi_slopes(n_heads), ref[:, 0, 1], rtol=0, atol=1e-7)


@pytest.mark.parametrize("head_dim", [16, 32, 64, 128])
@pytest.mark.parametrize("base", [10000.0, 500000.0, 100.0])
def test_rope_inv_freq_and_rotation_match_llama(head_dim, base):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    n_heads = 4
    config = LlamaConfig(hidden_size=head_dim * n_heads, num_attention_heads=n_heads, rope_theta=base)
    rotary = LlamaRotaryEmbedding(config)
    assert torch.allclose(rope_inv_freq(head_dim, base)[0], rotary.inv_freq, rtol=1e-6, atol=0)

    T = 50
    q, k = torch.randn(2, 1, n_heads, T, head_dim).unbind(0)
    positions = torch.arange(T)
    cos, sin = rotary(q, positions[None])
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)
    from relpos_cli.positions import build_scheme
    from relpos_cli.positions.base import ModelShape

    scheme = build_scheme({"name": "rope", "base": base}, ModelShape(head_dim * n_heads, n_heads, 1, T))
    q_ours, k_ours = scheme.rotate(0, q, k, positions)
    assert torch.allclose(q_ours, q_ref, atol=1e-5) and torch.allclose(k_ours, k_ref, atol=1e-5)


def test_t5_hf_parameterization_matches_transformers():
    """pos.parameterization=hf: transformers' T5 bias values (compute_bias, decoder buckets) and
    its initialisation N(0, d_model^-0.5) (T5PreTrainedModel._init_weights)."""
    from transformers import T5Config
    from transformers.models.t5.modeling_t5 import T5Attention, T5PreTrainedModel

    config = T5Config(d_model=32, num_heads=4, d_kv=8, relative_attention_num_buckets=32,
                      relative_attention_max_distance=128, is_decoder=True)
    ref_attn = T5Attention(config, has_relative_attention_bias=True)
    T5PreTrainedModel(config)._init_weights(ref_attn)
    from relpos_cli.positions import build_scheme
    from relpos_cli.positions.base import ModelShape

    torch.manual_seed(0)
    scheme = build_scheme({"name": "t5", "parameterization": "hf"}, ModelShape(32, 4, 2, 64))
    ref_std = ref_attn.relative_attention_bias.weight.std().item()
    assert scheme.tables.std().item() == pytest.approx(32**-0.5, rel=0.3) and ref_std == pytest.approx(32**-0.5, rel=0.3)
    with torch.no_grad():
        scheme.tables[0].copy_(ref_attn.relative_attention_bias.weight)
    T = 300
    ref = ref_attn.compute_bias(T, T)[0]  # (H, T, T); decoder => unidirectional buckets
    assert torch.allclose(scheme.score_bias(0, None, None, torch.arange(T)), ref)


def test_t5_xtransformers_parameterization_matches_x_transformers():
    """pos.parameterization=xtransformers: RelativePositionBias(scale=sqrt(dim_head), causal=True),
    nn.Embedding's N(0, 1) init, added to q.k / sqrt(dim_head) as relpos's attention does."""
    from x_transformers.x_transformers import RelativePositionBias

    from relpos_cli.positions import build_scheme
    from relpos_cli.positions.base import ModelShape

    shape = ModelShape(48, 4, 2, 64)  # head_dim 12
    ref = RelativePositionBias(scale=shape.head_dim**0.5, causal=True, num_buckets=32, max_distance=128, heads=4)
    torch.manual_seed(0)
    scheme = build_scheme({"name": "t5", "parameterization": "xtransformers"}, shape)
    assert scheme.tables.std().item() == pytest.approx(1.0, rel=0.3)
    with torch.no_grad():
        scheme.tables[0].copy_(ref.relative_attention_bias.weight)
    T = 300
    assert torch.allclose(scheme.score_bias(0, None, None, torch.arange(T)), ref(T, T), atol=1e-5)


def test_t5_zero_parameterization_starts_position_blind():
    from relpos_cli.positions import build_scheme
    from relpos_cli.positions.base import ModelShape

    scheme = build_scheme({"name": "t5", "parameterization": "zero"}, ModelShape(32, 4, 2, 64))
    assert torch.count_nonzero(scheme.score_bias(0, None, None, torch.arange(40))) == 0
