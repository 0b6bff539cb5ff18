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
RELATIVE_ROTARY_SCHEMES = [n for n in ROTARY_SCHEMES if REGISTRY[n].relative]


@pytest.mark.parametrize("name", BIAS_SCHEMES)
def test_bias_is_shift_invariant_exactly_when_declared_relative(name):
    """Checked both ways: a scheme declared relative keeps its bias under any shift of the positions;
    one declared absolute changes it under some shift (mutations checked: fire declared relative,
    kerple_log declared absolute, each fails here)."""
    scheme = build_scheme({"name": name}, SHAPE)
    torch.manual_seed(0)
    for p in scheme.parameters():
        torch.nn.init.normal_(p)
    scheme.constrain_parameters()  # as after an optimizer step
    pos = torch.arange(64)
    q, k = torch.randn(2, 1, SHAPE.n_heads, 64, SHAPE.head_dim).unbind(0)
    x = torch.randn(1, 64, SHAPE.d_model)  # the layer's input, for a token-difference bias
    base = scheme.score_bias(0, q, k, pos, layer_input=x)
    invariant = [torch.allclose(base, scheme.score_bias(0, q, k, pos + shift, layer_input=x), atol=1e-5)
                 for shift in (1, 17, 1000)]
    assert invariant == [scheme.relative] * 3, invariant


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


@pytest.mark.parametrize("name", scheme_names())
def test_model_output_is_shift_invariant_exactly_when_declared_relative(name):
    """The whole model (every hook: embeddings, rotations, biases) gives the same logits at any offset
    of its positions if and only if the scheme declares itself relative (the `shift inv.` column of
    `relpos schemes`). Mutations checked: rope declared absolute, learned declared relative, each fails."""
    tokens = torch.randint(0, 64, (1, 30), generator=torch.Generator().manual_seed(0))
    model = tiny_model(name)
    positions = torch.arange(30)
    with torch.no_grad():
        base, shifted = model(tokens, positions=positions), model(tokens, positions=positions + 123)
    assert torch.allclose(base, shifted, atol=1e-4) == model.scheme.relative


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


@pytest.mark.parametrize("name", [n for n in scheme_names()
                                  if build_scheme({"name": n}, SHAPE).bias_input is BiasInput.DISTANCE])
def test_a_distance_table_is_the_bias_of_each_distance(name):
    """distance_table(layer, L) is distance_bias over 0..L-1 for every layer, its gradient included, at
    one length, another and the first again (T5 keeps its buckets per length: a stale cache shows)."""
    scheme = build_scheme({"name": name}, SHAPE)
    for p in scheme.parameters():
        torch.nn.init.normal_(p, std=0.5)
    scheme.constrain_parameters()  # as after an optimizer step (KERPLE's are positive)
    for length in (7, 40, 7):
        for layer in range(SHAPE.n_layers):
            table = scheme.distance_table(layer, length, torch.device("cpu"))
            want = scheme.distance_bias(layer, torch.arange(length))
            torch.testing.assert_close(table, want, rtol=0, atol=0)
            if any(p.requires_grad for p in scheme.parameters()):
                grads = torch.autograd.grad(table.square().sum(), list(scheme.parameters()), allow_unused=True)
                wants = torch.autograd.grad(want.square().sum(), list(scheme.parameters()), allow_unused=True)
                for got, expected in zip(grads, wants):
                    assert (got is None) == (expected is None) and (got is None or torch.equal(got, expected))


def test_t5s_buckets_are_computed_once_per_length(monkeypatch):
    """The training step's table reads T5's buckets once per length, not once per layer and step."""
    from relpos_cli.positions import t5

    calls = []
    real = t5.relative_position_bucket
    monkeypatch.setattr(t5, "relative_position_bucket", lambda *a, **k: calls.append(1) or real(*a, **k))
    scheme = build_scheme({"name": "t5"}, SHAPE)
    for _ in range(3):
        for layer in range(SHAPE.n_layers):
            scheme.distance_table(layer, 129, torch.device("cpu"))
    assert len(calls) == 1
    scheme.distance_table(0, 64, torch.device("cpu"))
    with torch.inference_mode():  # inference tensors: not kept for a later training pass
        scheme.distance_table(0, 64, torch.device("cpu"))
    assert len(calls) == 3
    scheme.distance_table(0, 64, torch.device("cpu"))
    assert len(calls) == 3


DISTANCE_SCHEMES = [({"name": n}) for n in scheme_names() if REGISTRY[n].bias_input is BiasInput.DISTANCE]


def counted_tables(scheme) -> list:
    """Records each layer whose distance_table the scheme computes."""
    computed, real = [], scheme.distance_table
    scheme.distance_table = lambda layer, length, device: computed.append(layer) or real(layer, length, device)
    return computed


@pytest.mark.parametrize("pos", DISTANCE_SCHEMES + [{"name": "t5", "shared_layers": False},
                                                    {"name": "kerple_log", "shared_layers": False}])
def test_a_forward_pass_computes_a_shared_distance_table_once(pos):
    """Inside one forward pass every layer's table equals the one computed for that layer alone, and the
    layers that share their table (distance_table_layer: ALiBi's and Sandwich's fixed bias, T5's and
    KERPLE's one set of parameters) compute it once; with a set per layer, each its own. Mutations
    checked: T5 per layer declaring one shared table; the pass's key without the length."""
    shape = ModelShape(d_model=48, n_heads=3, n_layers=3, train_seq_len=32)
    scheme = build_scheme(pos, shape)
    for p in scheme.parameters():
        torch.nn.init.normal_(p, std=0.5)
    scheme.constrain_parameters()
    alone = {(layer, length): scheme.distance_table(layer, length, torch.device("cpu"))
             for layer in range(3) for length in (9, 20)}
    computed = counted_tables(scheme)
    with scheme.forward_pass(torch.arange(20)):
        for length in (9, 20):
            for layer in range(3):
                got = scheme.pass_distance_table(layer, length, torch.device("cpu"))
                torch.testing.assert_close(got, alone[layer, length], rtol=0, atol=0)
    shared = pos.get("shared_layers", True) and pos["name"] in ("t5", "kerple_log", "kerple_power", "alibi", "sandwich")
    assert computed == ([0, 0] if shared else [0, 1, 2, 0, 1, 2])


def test_dape_s_pass_is_its_base_s():
    """DAPE reads its base's table in every layer's kernel inputs: one computation a pass for T5's
    shared table."""
    scheme = build_scheme({"name": "dape", "base": "t5"}, ModelShape(d_model=48, n_heads=3, n_layers=3, train_seq_len=32))
    computed = counted_tables(scheme.base)
    q = torch.zeros(1, 3, 20, 16)
    with scheme.forward_pass(torch.arange(20)):
        tables = [scheme.kernel_inputs(layer, q)[0] for layer in range(3)]
    assert computed == [0] and all(t is tables[0] for t in tables)


def test_a_new_pass_computes_the_table_afresh():
    """An optimizer step between passes changes the table: the next pass computes it again, and outside
    a pass every call does."""
    scheme = build_scheme({"name": "kerple_log"}, SHAPE)
    computed = counted_tables(scheme)
    with scheme.forward_pass(torch.arange(16)):
        before = scheme.pass_distance_table(0, 16, torch.device("cpu"))
    with torch.no_grad():
        scheme.r1.mul_(2)
    with scheme.forward_pass(torch.arange(16)):
        after = scheme.pass_distance_table(1, 16, torch.device("cpu"))
    torch.testing.assert_close(after, 2 * before)
    scheme.pass_distance_table(0, 16, torch.device("cpu"))
    scheme.pass_distance_table(0, 16, torch.device("cpu"))
    assert computed == [0, 1, 0, 0]


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


# what each scheme's reference implementation decays, written from the references (not from the
# declarations): parameter names as in named_parameters() of the scheme at SHAPE
REFERENCE_DECAY = {
    "learned": {"table.weight"},  # nanoGPT: the position embedding is a >= 2-D parameter, decayed
    "t5": set(),  # transformers' Trainer leaves out names holding "bias" (checked below on HF T5)
    "kerple_log": set(), "kerple_power": set(),  # KERPLE's kerple_configs/train.yml: weight-decay 0.0
    "fire": {f"layers.{i}.mlp.{j}.weight" for i in range(SHAPE.n_layers) for j in (0, 2)},  # MLP weights only
    "shaw": {"table"},  # Tensor2Tensor decays every variable but biases
    "cope": {"pos_emb"},
    "sinusoidal": set(),
    "fox": {f"gates.{i}.weight" for i in range(SHAPE.n_layers)},  # the gate's projection, not its bias
    "dape": {f"mlps.{i}.{j}.weight" for i in range(SHAPE.n_layers) for j in (0, 2)},  # over alibi: the MLP's weights
}


def test_dape_decays_its_base_parameters_as_the_base_declares():
    """DAPE keeps its base's declaration: over FIRE the base's MLP weights decay beside DAPE's own MLP
    weights, over KERPLE r1/r2 stay out. Mutation checked: DAPE declaring only its own MLP weights
    fails the FIRE case."""
    from relpos_cli.train import param_groups

    own = {f"mlps.{i}.{j}.weight" for i in range(SHAPE.n_layers) for j in (0, 2)}
    fire = {f"base.{n}" for n in REFERENCE_DECAY["fire"]}
    for base, expected in (("fire", own | fire), ("kerple_log", own)):
        model = tiny_model("dape", base=base)
        decayed = set(map(id, param_groups(model, 0.1)[0]["params"]))
        assert {n for n, p in model.scheme.named_parameters() if id(p) in decayed} == expected, base


@pytest.mark.parametrize("name", scheme_names())
def test_weight_decay_follows_each_schemes_declaration_not_tensor_rank(name):
    """The optimizer's decayed group holds the model's weight matrices and embeddings (not its norms)
    and exactly the scheme parameters its reference decays. Mutation checked: the old rule by tensor
    rank (p.dim() >= 2) fails for t5, kerple_log, kerple_power."""
    from relpos_cli.train import param_groups

    model = tiny_model(name)
    decayed, not_decayed = (set(map(id, g["params"])) for g in param_groups(model, 0.1))
    scheme_params = dict(model.scheme.named_parameters())
    assert {n for n, p in scheme_params.items() if id(p) in decayed} == REFERENCE_DECAY.get(name, set())
    for n, p in model.named_parameters():
        if not n.startswith("scheme."):
            assert (id(p) in decayed) == (p.dim() >= 2) and (id(p) in not_decayed) == (p.dim() < 2), n
    assert REGISTRY[name].decay_reference  # docs/configuration.md quotes it


def test_t5s_reference_trainer_does_not_decay_its_relative_attention_bias():
    """transformers' Trainer, on a small T5 of its own: the relative position table is left out of
    weight decay (names holding 'bias'), while the attention weights take it, as relpos's t5 declares."""
    from transformers import T5Config, T5ForConditionalGeneration, Trainer

    hf = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4))
    decayed = Trainer.get_decay_parameter_names(None, hf)
    tables = [n for n, _ in hf.named_parameters() if "relative_attention_bias" in n]
    assert tables and not set(tables) & set(decayed)
    assert any(n.endswith("SelfAttention.q.weight") for n in decayed)
    assert REGISTRY["t5"].decayed_parameters == ()
