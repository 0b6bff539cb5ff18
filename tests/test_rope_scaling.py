"""RoPE scaling at evaluation time and partial rotary, against `transformers` ROPE_INIT_FUNCTIONS,
GPT-NeoX partial rotation and x-transformers' NTK-aware base rescaling."""

import math

import pytest
import torch

from relpos_cli.errors import RelposError
from relpos_cli.positions import build_scheme
from relpos_cli.positions.base import ModelShape
from relpos_cli.positions.rope import rope_inv_freq

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

N_HEADS = 4
TRAIN_LEN = 128


def hf_rope(head_dim: int, params: dict, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """transformers' inv_freq and attention factor for a minimal Llama config."""
    config = LlamaConfig(hidden_size=head_dim * N_HEADS, num_attention_heads=N_HEADS,
                         max_position_embeddings=TRAIN_LEN, rope_parameters=dict(params))
    return ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu", seq_len=seq_len)


@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("base", [10000.0, 500000.0])
@pytest.mark.parametrize("factor", [1.0, 2.0, 4.0, 16.0])
@pytest.mark.parametrize("rope_type,seq_len", [("linear", None), ("dynamic", 100), ("dynamic", 1000), ("yarn", None)])
def test_inv_freq_matches_transformers(head_dim, base, factor, rope_type, seq_len):
    params = {"rope_type": rope_type, "rope_theta": base, "factor": factor,
              "original_max_position_embeddings": TRAIN_LEN}
    ref_freq, ref_scale = hf_rope(head_dim, params, seq_len)
    ours, scale = rope_inv_freq(head_dim, base, params, seq_len=seq_len)
    assert torch.allclose(ours, ref_freq, rtol=1e-5, atol=0)
    assert scale == pytest.approx(ref_scale, rel=1e-6)


@pytest.mark.parametrize("extra", [
    {"beta_fast": 16, "beta_slow": 2},
    {"attention_factor": 1.3},
    {"mscale": 0.707, "mscale_all_dim": 1.0},
    {"truncate": False},
])
def test_yarn_options_match_transformers(extra):
    params = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
              "original_max_position_embeddings": TRAIN_LEN, **extra}
    ref_freq, ref_scale = hf_rope(64, params)
    ours, scale = rope_inv_freq(64, 10000.0, params)
    assert torch.allclose(ours, ref_freq, rtol=1e-5, atol=0)
    assert scale == pytest.approx(ref_scale, rel=1e-6)


@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("factor", [2.0, 8.0])
def test_static_ntk_is_base_times_factor_power(head_dim, factor):
    from x_transformers.x_transformers import RotaryEmbedding

    ours, scale = rope_inv_freq(head_dim, 10000.0, {"rope_type": "ntk", "factor": factor})
    ref = RotaryEmbedding(head_dim, base=10000, base_rescale_factor=factor).inv_freq
    assert torch.allclose(ours, ref, rtol=1e-5) and scale == 1.0
    plain, _ = rope_inv_freq(head_dim, 10000.0)
    # NTK-aware: the fastest frequency is kept, the slowest one is interpolated by exactly `factor`
    assert ours[0] == plain[0]
    assert ours[-1] == pytest.approx(plain[-1].item() / factor, rel=1e-5)


def scheme(eval_scaling=None, **params):
    return build_scheme({"name": "rope", **params}, ModelShape(64 * N_HEADS, N_HEADS, 1, TRAIN_LEN), eval_scaling)


def rope_scaling(**settings):
    """eval.rope_scaling as the eval config's defaults give it, with `settings` over them."""
    return {"type": "none", "factor": "auto", "beta_fast": 32, "beta_slow": 1, "attention_factor": None, **settings}


def test_eval_auto_factor_is_length_over_train_length():
    plain = scheme().inv_freq.clone()
    linear = scheme(rope_scaling(type="linear"))
    assert torch.allclose(linear.frequencies_at(4 * TRAIN_LEN)[0], plain / 4)
    assert torch.allclose(linear.frequencies_at(TRAIN_LEN // 2)[0], plain)  # shorter than training: no scaling
    assert torch.allclose(scheme(rope_scaling(type="linear", factor=2)).frequencies_at(4 * TRAIN_LEN)[0], plain / 2)
    none = scheme(rope_scaling(type="none"))
    inv_freq, attention_scale = none.frequencies_at(4 * TRAIN_LEN)
    assert torch.allclose(inv_freq, plain) and attention_scale == 1.0


def test_eval_dynamic_follows_the_length():
    rope = scheme(rope_scaling(type="dynamic"))
    params = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 1.0}
    assert torch.allclose(rope.frequencies_at(8 * TRAIN_LEN)[0], hf_rope(64, params, seq_len=8 * TRAIN_LEN)[0], rtol=1e-5)
    static = scheme(rope_scaling(type="ntk"))  # factor=auto: the same alpha = 8
    assert torch.allclose(static.frequencies_at(8 * TRAIN_LEN)[0], rope.frequencies_at(8 * TRAIN_LEN)[0], rtol=1e-6)
    static = scheme(rope_scaling(type="ntk", factor=2)).frequencies_at(8 * TRAIN_LEN)[0]
    dynamic = scheme(rope_scaling(type="dynamic", factor=2)).frequencies_at(8 * TRAIN_LEN)[0]  # alpha = 2 * 8 - 1 = 15
    assert torch.allclose(dynamic, rope_inv_freq(64, 10000.0, {"rope_type": "ntk", "factor": 15})[0], rtol=1e-5)
    assert not torch.allclose(static, dynamic)


def test_the_rotation_follows_the_length_of_each_forward_pass():
    """Dynamic NTK (pos.scaling) scales by the number of positions rotated, as transformers'
    dynamic rope scales by the sequence it is called on: no call sets it beforehand."""
    rope = scheme(scaling={"type": "dynamic", "factor": 2.0})
    q, k = torch.randn(2, 1, N_HEADS, 4 * TRAIN_LEN, 64).unbind(0)
    want, _ = hf_rope(64, {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}, seq_len=4 * TRAIN_LEN)
    angles = torch.arange(4 * TRAIN_LEN).float()[:, None] * want[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    rotate_half = torch.cat((-q[..., 32:], q[..., :32]), dim=-1)
    q_want = q * emb.cos() + rotate_half * emb.sin()
    q_got, _ = rope.rotate(0, q, k, torch.arange(4 * TRAIN_LEN))
    assert torch.allclose(q_got, q_want, atol=1e-4)
    short, _ = rope.rotate(0, q[..., :TRAIN_LEN, :], k[..., :TRAIN_LEN, :], torch.arange(TRAIN_LEN))
    plain, _ = scheme().rotate(0, q[..., :TRAIN_LEN, :], k[..., :TRAIN_LEN, :], torch.arange(TRAIN_LEN))
    assert torch.equal(short, plain)  # within the original length dynamic NTK is no scaling


def test_yarn_attention_scale_multiplies_logits_and_stays_relative():
    rope = scheme(rope_scaling(type="yarn", factor=4))
    q, k = torch.randn(2, 1, N_HEADS, 40, 64).unbind(0)
    pos = torch.arange(40)
    expected = 0.1 * math.log(4) + 1
    assert rope.frequencies_at(40)[1] == pytest.approx(expected)
    qa, ka = rope.rotate(0, q, k, pos)
    qb, kb = rope.rotate(0, q, k, pos + 300)
    la, lb = qa @ ka.transpose(-1, -2), qb @ kb.transpose(-1, -2)
    causal = torch.ones(40, 40, dtype=torch.bool).tril()
    assert torch.allclose(la[..., causal], lb[..., causal], atol=1e-3)
    # at distance 0 rotation cancels: q . k times attention_scale^2
    diag = (q * k).sum(-1) * expected**2
    assert torch.allclose(la.diagonal(dim1=-2, dim2=-1), diag, atol=1e-4)


@pytest.mark.parametrize("bad,match", [
    ({"type": "longrope"}, "eval.rope_scaling.type='longrope'; choose one of: none, linear, ntk, dynamic, yarn"),
    ({"type": "linear", "factor": 0.5}, "eval.rope_scaling.factor=0.5 is below 1"),
    ({"type": "yarn", "factor": "big"}, "eval.rope_scaling.factor='big'"),
])
def test_bad_scaling_settings_are_clear_errors(bad, match):
    with pytest.raises(RelposError, match=match):
        scheme(rope_scaling(**bad))


@pytest.mark.parametrize("fraction", [0.25, 0.5, 1.0])
def test_partial_rotary_matches_gpt_neox(fraction):
    from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb

    rope = scheme(rotary_fraction=fraction)
    params = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 1.0, "partial_rotary_factor": fraction}
    ref_freq, _ = hf_rope(64, params)
    assert torch.allclose(rope.inv_freq, ref_freq, rtol=1e-6)
    q, k = torch.randn(2, 1, N_HEADS, 30, 64).unbind(0)
    pos = torch.arange(30)
    cos, sin = rope.cos_sin(pos)
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos[None], sin[None])
    q_ours, k_ours = rope.rotate(0, q, k, pos)
    assert torch.allclose(q_ours, q_ref, atol=1e-6) and torch.allclose(k_ours, k_ref, atol=1e-6)
    rot = int(64 * fraction)
    assert torch.equal(q_ours[..., rot:], q[..., rot:])  # the rest passes through


@pytest.mark.parametrize("fraction", [0.0, 0.01, 1.5])
def test_bad_rotary_fraction_is_a_clear_error(fraction):
    with pytest.raises(RelposError, match="pos.rotary_fraction"):
        scheme(rotary_fraction=fraction)


# ---- pos.scaling: the same frequencies while training ----------------------------------------------
def tiny_model(**pos):
    from relpos_cli.model import build_model

    torch.manual_seed(0)
    cfg = {"model": {"d_model": 64, "n_layers": 1, "n_heads": 2}, "train": {"seq_len": TRAIN_LEN}, "pos": {"name": "rope", **pos}}
    return build_model(cfg, vocab_size=50).eval()


@pytest.mark.parametrize("name", ["rope", "xpos"])
@pytest.mark.parametrize("rope_type", ["linear", "ntk", "dynamic", "yarn"])
def test_training_scaling_with_factor_1_is_no_scaling(name, rope_type):
    tokens = torch.randint(0, 50, (2, TRAIN_LEN))
    plain = tiny_model(name=name)
    scaled = tiny_model(name=name, scaling={"type": rope_type, "factor": 1.0})
    scaled.load_state_dict(plain.state_dict())
    with torch.no_grad():
        want, got = plain(tokens), scaled(tokens)
    if rope_type in ("linear", "ntk", "dynamic"):
        assert torch.equal(want, got)
    assert torch.allclose(want, got, atol=1e-5)


def test_a_run_trained_with_a_scaling_is_evaluated_with_it_unless_eval_names_one():
    rope = scheme(scaling={"type": "linear", "factor": 4.0})
    plain = scheme().inv_freq
    assert torch.equal(rope.inv_freq, plain / 4)  # training
    for length in (TRAIN_LEN // 2, TRAIN_LEN, 16 * TRAIN_LEN):
        inv_freq, attention_scale = scheme(rope_scaling(), scaling={"type": "linear", "factor": 4.0}).frequencies_at(length)
        assert torch.equal(inv_freq, plain / 4) and attention_scale == 1.0
    # eval.rope_scaling replaces it, from the plain frequencies
    yarn_eval = scheme(rope_scaling(type="yarn"), scaling={"type": "linear", "factor": 4.0})
    want = rope_inv_freq(64, 10000.0, {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": TRAIN_LEN})
    inv_freq, attention_scale = yarn_eval.frequencies_at(8 * TRAIN_LEN)
    assert torch.equal(inv_freq, want[0]) and attention_scale == want[1]
    yarn = scheme(scaling={"type": "yarn", "factor": "auto", "original_length": TRAIN_LEN // 4})
    params = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": TRAIN_LEN // 4}
    assert torch.equal(yarn.inv_freq, rope_inv_freq(64, 10000.0, params)[0])  # auto = train.seq_len / original_length


@pytest.mark.parametrize("span_key", ["position_skip", "randomized_positions"])
def test_factor_auto_scales_to_the_positions_trained_over(span_key):
    """PoSE's recipe (Zhu et al. 2024, section 3): positions skip up to the target length N while the
    window stays L, and the interpolation scales by N / L. factor auto was train.seq_len / original =
    1 there: refused as scaling nothing, or with init_from a factor of the child's window, not of N."""
    from relpos_cli.model import build_model

    cfg = {"model": {"d_model": 64, "n_layers": 1, "n_heads": 2}, "pos": {"name": "rope", "scaling": {"type": "yarn"}},
           "train": {"seq_len": TRAIN_LEN, span_key: 8 * TRAIN_LEN}}
    rope = build_model(cfg, vocab_size=50).scheme
    want, scale = hf_rope(32, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                               "original_max_position_embeddings": TRAIN_LEN})
    assert torch.allclose(rope.inv_freq, want, rtol=1e-6) and rope.attention_scale == pytest.approx(scale)
    with pytest.raises(RelposError, match="factor auto = the positions trained over / original_length = 1024 / 1024 = 1"):
        build_model({**cfg, "pos": {"name": "rope", "scaling": {"type": "linear", "original_length": 8 * TRAIN_LEN}}}, 50)


def test_a_fine_tuned_run_scales_from_its_parents_training_length():
    from relpos_cli.positions.rope import NO_SCALING, RoPE

    child = {"name": "rope", "scaling": {**NO_SCALING, "type": "yarn"}}
    assert RoPE.inherit_options(child, {"name": "rope"}, 32)["scaling"]["original_length"] == 32
    grandparent_scaled = {"name": "rope", "scaling": {**NO_SCALING, "type": "linear", "original_length": 16}}
    assert RoPE.inherit_options(child, grandparent_scaled, 32)["scaling"]["original_length"] == 16
    assert RoPE.inherit_options({"name": "rope", "scaling": NO_SCALING}, {"name": "rope"}, 32)["scaling"] == NO_SCALING


@pytest.mark.parametrize("pos", ["alibi", "learned", "none", "nope_scaled"])
def test_a_scaling_on_a_scheme_that_does_not_rotate_is_an_error(pos):
    with pytest.raises(RelposError, match=f"pos.scaling applies to schemes that rotate q and k .*; pos={pos} does not"):
        build_scheme({"name": pos, "scaling": {"type": "linear"}}, ModelShape(64, 2, 1, TRAIN_LEN))


def test_eval_factor_auto_is_named_per_length_and_longest_is_one_fixed_factor(tmp_path, monkeypatch):
    """eval.rope_scaling.factor=auto scales each length by L / L_train: its files are named
    auto_per_length, its rows carry the factor each length ran with, and its table says so.
    factor=longest is one factor, the longest eval length / L_train, at every length: the same model
    in every row, equal to auto at the longest length and to factor=4 everywhere. Mutations checked,
    each fails: dropping the auto_per_length name from the variant; resolving longest per length."""
    import csv

    from conftest import TINY, run_in_process

    monkeypatch.chdir(tmp_path)
    run = tmp_path / "rope"
    assert run_in_process("train", *TINY, "pos=rope", "train.steps=2", f"hydra.run.dir={run}")[0] == 0
    evaluation = ["eval.lengths=[32,128]", "eval.tokens=256", "eval.rope_scaling.type=linear"]

    def rows(variant: str) -> list[dict]:
        return list(csv.DictReader((run / f"eval_length.{variant}.csv").open()))

    code, out, err = run_in_process("eval-length", str(run), *evaluation)
    assert code == 0, err
    auto = rows("rope_scaling.factor=auto_per_length,rope_scaling.type=linear")
    assert [(r["length"], float(r["rope_factor"])) for r in auto] == [("32", 1.0), ("128", 4.0)]
    assert "L / L_train per length, so each row is a differently scaled model" in " ".join(out.split())
    code, out, err = run_in_process("eval-length", str(run), *evaluation, "eval.rope_scaling.factor=longest")
    assert code == 0, err
    longest = rows("rope_scaling.factor=4,rope_scaling.type=linear")
    assert [float(r["rope_factor"]) for r in longest] == [4.0, 4.0]
    assert "one fixed factor at every length" in " ".join(out.split())
    assert run_in_process("eval-length", str(run), *evaluation, "eval.rope_scaling.factor=4")[0] == 0
    assert [r["loss"] for r in rows("rope_scaling.factor=4,rope_scaling.type=linear")] == [r["loss"] for r in longest]
    assert longest[1]["loss"] == auto[1]["loss"] and longest[0]["loss"] != auto[0]["loss"]
    for bad in ("longer", "0.5"):
        code, _, err = run_in_process("eval-length", str(run), *evaluation, f"eval.rope_scaling.factor={bad}")
        assert code == 2 and "give a number >= 1, auto or longest" in err and len(err.strip().splitlines()) == 1


# ---- the rotation's cos and sin, computed once for every layer -------------------------------------------

def fresh_rotation(scheme, q, k, positions):
    """RoPE's rotation from its formula, nothing kept: cos and sin of positions x frequencies; for xPos
    times zeta_i^((n - centre) / scale_base) on q and divided by it on k, centre (max + 1) // 2 (x-transformers)."""
    from relpos_cli.positions.rope import apply_rotary

    inv_freq, scale = scheme.frequencies_at(positions.shape[0])
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos() * scale, emb.sin() * scale
    if scheme.name != "xpos":
        return apply_rotary(q, cos.to(q.dtype), sin.to(q.dtype)), apply_rotary(k, cos.to(k.dtype), sin.to(k.dtype))
    dim = cos.shape[-1]
    zeta = (torch.arange(0, dim, 2, dtype=torch.float32) + 0.4 * dim) / (1.4 * dim)
    power = (positions - (positions.max() + 1) // 2).to(torch.float32)[:, None] / scheme.scale_base
    decay = torch.cat((zeta ** power, zeta ** power), dim=-1)
    return (apply_rotary(q, (cos * decay).to(q.dtype), (sin * decay).to(q.dtype)),
            apply_rotary(k, (cos / decay).to(k.dtype), (sin / decay).to(k.dtype)))


@pytest.mark.parametrize("pos", [{"name": "rope"}, {"name": "p_rope"}, {"name": "xpos"},
                                 {"name": "rope", "scaling": {"type": "yarn", "factor": 4.0}}])
def test_the_rotation_is_computed_once_and_redone_whenever_its_inputs_change(pos, monkeypatch):
    scheme = build_scheme(pos, ModelShape(d_model=32, n_heads=2, n_layers=3, train_seq_len=16))
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 2, 16, 16, generator=g), torch.randn(2, 2, 16, 16, generator=g)
    computed = []
    cos_sin = scheme.cos_sin
    monkeypatch.setattr(scheme, "cos_sin", lambda *a, **kw: computed.append(1) or cos_sin(*a, **kw))

    def check(q, k, positions):
        for layer in range(3):
            for got, want in zip(scheme.rotate(layer, q, k, positions), fresh_rotation(scheme, q, k, positions)):
                assert torch.equal(got, want)

    positions = torch.arange(16)
    check(q, k, positions)
    check(q, k, positions)
    assert len(computed) == 1  # one positions tensor, six rotations
    skipped = torch.arange(16) * 3  # another tensor of the same length (PoSE's skipped positions)
    check(q, k, skipped)
    positions.mul_(2)  # edited in place after it was read
    check(q, k, positions)
    check(q.to(torch.bfloat16), k.to(torch.bfloat16), positions)  # another dtype
    scheme.inv_freq.mul_(0.5)  # frequencies changed in place (a state loaded into the buffer)
    check(q, k, positions)
    assert len(computed) == 5


@pytest.mark.parametrize("pos", ["rope", "p_rope", "xpos", "fire", "alibi", "t5", "kerple_log"])
def test_a_model_runs_under_inference_mode(pos):
    # inference tensors have no version counter: the rotation's cache and the bias cache must not ask theirs
    from relpos_cli.model import BlockOptions, Transformer

    model = Transformer(64, ModelShape(d_model=32, n_heads=2, n_layers=2, train_seq_len=16), {"name": pos},
                        block=BlockOptions(mlp_hidden=32)).eval()
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():  # first: the model's positions tensor is made (and kept) under it
        got = model(tokens)
        again = model(tokens)
    with torch.no_grad():
        want = model(tokens)
    assert torch.equal(got, want) and torch.equal(again, want)
