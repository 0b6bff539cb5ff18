"""Properties every scheme must satisfy, checked through the registry (no scheme names hard-coded
except where a property belongs to one scheme)."""

import pytest
import torch

from relpos_cli.errors import RelposError
from relpos_cli.model import Transformer
from relpos_cli.positions import REGISTRY, build_scheme, scheme_names
from relpos_cli.positions.base import BiasInput, ModelShape

SHAPE = ModelShape(d_model=48, n_heads=3, n_layers=2, train_seq_len=32)


def tiny_model(name: str, backend: str = "sdpa", **params) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(64, SHAPE, {"name": name, **params}, mlp_ratio=2, attn_backend=backend)
    for p in model.scheme.parameters():  # make learned position parameters non-trivial
        torch.nn.init.normal_(p, std=0.5)
    model.scheme.constrain_parameters()  # as after an optimizer step
    return model.eval()


def test_core_schemes_registered():
    assert {"none", "learned", "sinusoidal", "rope", "alibi", "t5"} <= set(scheme_names())


@pytest.mark.parametrize("name", scheme_names())
def test_no_attention_to_the_future(name):
    model = tiny_model(name)
    tokens = torch.randint(0, 64, (2, 40))
    changed = tokens.clone()
    changed[:, 25:] = torch.randint(0, 64, (2, 15))
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert torch.allclose(a[:, :25], b[:, :25], atol=1e-5)
    assert not torch.allclose(a[:, 25:], b[:, 25:], atol=1e-3)


@pytest.mark.parametrize("name", scheme_names())
def test_sdpa_matches_eager_reference(name):
    tokens = torch.randint(0, 64, (2, 40))
    with torch.no_grad():
        fast, ref = tiny_model(name, "sdpa")(tokens), tiny_model(name, "eager")(tokens)
    assert torch.allclose(fast, ref, atol=1e-5)


BIAS_SCHEMES = [n for n in scheme_names() if build_scheme({"name": n}, SHAPE).uses_score_bias]
ROTARY_SCHEMES = [n for n in scheme_names() if build_scheme({"name": n}, SHAPE).uses_rotation]
RELATIVE_BIAS_SCHEMES = [n for n in BIAS_SCHEMES if REGISTRY[n].relative]
RELATIVE_ROTARY_SCHEMES = [n for n in ROTARY_SCHEMES if REGISTRY[n].relative]


@pytest.mark.parametrize("name", RELATIVE_BIAS_SCHEMES)
@pytest.mark.parametrize("shift", [1, 17, 1000])
def test_bias_is_shift_invariant(name, shift):
    scheme = build_scheme({"name": name}, SHAPE)
    for p in scheme.parameters():
        torch.nn.init.normal_(p)
    scheme.constrain_parameters()  # as after an optimizer step
    pos = torch.arange(64)
    q, k = torch.randn(2, 1, SHAPE.n_heads, 64, SHAPE.head_dim).unbind(0)
    x = torch.randn(1, 64, SHAPE.d_model)  # the layer's input, for a token-difference bias
    base = scheme.score_bias(0, q, k, pos, layer_input=x)
    shifted = scheme.score_bias(0, q, k, pos + shift, layer_input=x)
    assert torch.allclose(base, shifted, atol=1e-5)


@pytest.mark.parametrize("name", RELATIVE_ROTARY_SCHEMES)
@pytest.mark.parametrize("shift", [1, 17, 1000])
def test_rotated_logits_depend_only_on_distance(name, shift):
    scheme = build_scheme({"name": name}, SHAPE)
    q, k = torch.randn(2, 1, SHAPE.n_heads, 64, SHAPE.head_dim).unbind(0)
    pos = torch.arange(64)
    qa, ka = scheme.rotate(0, q, k, pos)
    qb, kb = scheme.rotate(0, q, k, pos + shift)
    causal = torch.ones(64, 64, dtype=torch.bool).tril()
    la, lb = (qa @ ka.transpose(-1, -2))[..., causal], (qb @ kb.transpose(-1, -2))[..., causal]
    assert torch.allclose(la, lb, atol=1e-3 * la.abs().max().item())


def test_whole_model_output_is_shift_invariant_for_relative_schemes():
    """A model whose only position signal is relative gives the same logits at any offset."""
    tokens = torch.randint(0, 64, (1, 30))
    for name in set(BIAS_SCHEMES + ROTARY_SCHEMES):
        model = tiny_model(name)
        if not model.scheme.relative:
            continue
        positions = torch.arange(30)
        x = model.tok_emb(tokens)
        outs = []
        for offset in (0, 123):
            h = x
            for block in model.blocks:
                h = block(h, positions + offset, model.scheme, "sdpa")
            outs.append(h)
        assert torch.allclose(outs[0], outs[1], atol=1e-4), name


def test_alibi_bias_values():
    scheme = build_scheme({"name": "alibi"}, ModelShape(48, 6, 1, 16))
    pos = torch.arange(5)
    bias = scheme.score_bias(0, None, None, pos)
    slopes = scheme.slopes
    assert bias.shape == (6, 5, 5)
    assert torch.allclose(bias[:, 4, 1], -3 * slopes)
    assert torch.allclose(bias[:, 2, 2], torch.zeros(6))


def test_t5_tables_shared_or_per_layer():
    shared = build_scheme({"name": "t5", "shared_layers": True}, SHAPE)
    per_layer = build_scheme({"name": "t5", "shared_layers": False}, SHAPE)
    assert shared.tables.shape == (1, 32, SHAPE.n_heads)
    assert per_layer.tables.shape == (SHAPE.n_layers, 32, SHAPE.n_heads)
    torch.nn.init.normal_(per_layer.tables)
    pos = torch.arange(10)
    assert not torch.allclose(per_layer.score_bias(0, None, None, pos), per_layer.score_bias(1, None, None, pos))


def test_learned_positions_refuse_lengths_past_the_table():
    model = tiny_model("learned", max_positions=48)
    model(torch.zeros(1, 48, dtype=torch.long))
    with pytest.raises(RelposError, match="48 positions; length 49"):
        model(torch.zeros(1, 49, dtype=torch.long))


def test_unknown_scheme_and_option_are_clear_errors():
    with pytest.raises(RelposError, match="unknown position scheme 'bogus'; choose one of: .*alibi"):
        build_scheme({"name": "bogus"}, SHAPE)
    with pytest.raises(RelposError, match="pos=alibi has no option slope"):
        build_scheme({"name": "alibi", "slope": 1}, SHAPE)


def test_declarations_are_consistent():
    """A distance bias is shift invariant by construction; a scheme that declares one method of the
    bias interface and overrides another is refused when its class is defined."""
    for name, cls in REGISTRY.items():
        if cls.bias_input is BiasInput.DISTANCE:
            assert cls.relative, name
    with pytest.raises(TypeError, match="declares bias_input=DISTANCE but overrides \\['pair_bias'\\]"):
        type("Wrong", (REGISTRY["none"],), {"bias_input": BiasInput.DISTANCE, "pair_bias": lambda self, l, q, k: q})
    with pytest.raises(TypeError, match="must override content_bias"):
        type("Missing", (REGISTRY["none"],), {"bias_input": BiasInput.CONTENT})


def test_hooks_are_declared_by_overriding():
    assert REGISTRY["alibi"].hooks() == ["score_bias"]
    assert REGISTRY["rope"].hooks() == ["rotate"]
    assert REGISTRY["learned"].hooks() == ["embed"]
    assert REGISTRY["none"].hooks() == []
