"""The schemes of 2024-2025 against their references: p-RoPE (Gemma's rope_proportion), NoPE with a
log-length temperature (Qwen's logn attention), FoX (flash-linear-attention's naive forgetting
attention), stick-breaking (flash-linear-attention's naive stick-breaking attention and the
definition as a product), each reimplemented here from the reference's text (the package needs
CUDA Triton to import). Registry-wide properties (causality, every backend against eager, gradients)
run for these schemes too, in test_schemes.py and test_attention.py."""

import math
import re

import pytest
import torch
import torch.nn.functional as F

from relpos_cli.errors import RelposError
from relpos_cli.positions import build_scheme
from relpos_cli.positions.base import ModelShape

SHAPE = ModelShape(d_model=128, n_heads=4, n_layers=2, train_seq_len=32)  # head_dim 32: 16 rotated pairs


# ---- p-RoPE --------------------------------------------------------------------------------------

def gemma_apply_rope(x: torch.Tensor, positions: torch.Tensor, base: float, proportion: float) -> torch.Tensor:
    """google-deepmind/gemma ``apply_rope`` (gemma/gm/math/_positional_embeddings.py) in torch:
    timescales base^(2k/d) for the first int(p * d // 2) pairs, infinity (no rotation) for the rest,
    half-split layout. x (B, H, T, Dh), positions (T,)."""
    head_dim = x.shape[-1]
    rope_angles = int(proportion * head_dim // 2)
    nope_angles = head_dim // 2 - rope_angles
    timescale = base ** (2.0 / head_dim * torch.arange(rope_angles, dtype=torch.float64))
    timescale = torch.cat([timescale, torch.full((nope_angles,), math.inf, dtype=torch.float64)])
    angle = positions.to(torch.float64)[:, None] / timescale[None, :]  # (T, Dh/2)
    sin, cos = angle.sin(), angle.cos()
    first, second = x.double().chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1).float()


@pytest.mark.parametrize("keep", [1.0, 0.75, 0.5, 0.25, 0.07])
def test_p_rope_matches_gemma_rope_proportion(keep):
    """Mutation checked: keeping the lowest frequencies (zeroing inv_freq[:-kept]) fails for keep < 1."""
    p_rope = build_scheme({"name": "p_rope", "keep": keep}, SHAPE)
    q, k = torch.randn(2, 2, SHAPE.n_heads, 40, SHAPE.head_dim).unbind(0)
    positions = torch.arange(40) + 5
    q_ours, k_ours = p_rope.rotate(0, q, k, positions)
    assert torch.allclose(q_ours, gemma_apply_rope(q, positions, 10000.0, keep), atol=1e-5)
    assert torch.allclose(k_ours, gemma_apply_rope(k, positions, 10000.0, keep), atol=1e-5)


def test_p_rope_at_one_is_rope_and_its_dropped_pairs_do_not_rotate():
    q, k = torch.randn(2, 1, SHAPE.n_heads, 20, SHAPE.head_dim).unbind(0)
    positions = torch.arange(20)
    full = build_scheme({"name": "p_rope", "keep": 1.0}, SHAPE).rotate(0, q, k, positions)
    rope = build_scheme({"name": "rope"}, SHAPE).rotate(0, q, k, positions)
    assert all(torch.equal(a, b) for a, b in zip(full, rope))
    half = build_scheme({"name": "p_rope", "keep": 0.5}, SHAPE)  # 16 pairs, 8 kept
    q_half, _ = half.rotate(0, q, k, positions)
    dropped = torch.cat([torch.arange(8, 16), torch.arange(24, 32)])  # pair k is dims k and k + 16
    assert torch.equal(q_half[..., dropped], q[..., dropped])
    assert not torch.allclose(q_half[..., 1:8], q[..., 1:8])


def test_p_rope_keeps_zero_frequencies_under_eval_scaling():
    p_rope = build_scheme({"name": "p_rope", "keep": 0.5}, SHAPE, {"type": "yarn", "factor": "auto"})
    inv_freq, _ = p_rope.frequencies_at(4 * SHAPE.train_seq_len)
    assert torch.all(inv_freq[8:] == 0) and torch.all(inv_freq[:8] > 0)


@pytest.mark.parametrize("keep", [0, -0.5, 1.5, "half", True, 0.01])
def test_p_rope_keep_out_of_range_is_a_clear_error(keep):
    with pytest.raises(RelposError, match=f"pos.keep={keep!r}" if not isinstance(keep, float) or keep != 0.01 else "keeps no frequency"):
        build_scheme({"name": "p_rope", "keep": keep}, SHAPE)


# ---- NoPE with a temperature -------------------------------------------------------------------------

def qwen_logn(positions: torch.Tensor, seq_length: int) -> torch.Tensor:
    """Qwen's ``logn_tensor`` (modeling_qwen.py, use_logn_attn): entry i - 1 is log_L(i) past L, else 1;
    the query at 0-based position p is multiplied by entry p."""
    logn_list = [math.log(i, seq_length) if i > seq_length else 1 for i in range(1, int(positions.max()) + 2)]
    return torch.tensor(logn_list, dtype=torch.float32)[positions]


def test_nope_log_length_temperature_matches_qwen_logn():
    """Mutation checked: log(i) instead of log(i + 1) (one position off) fails."""
    scheme = build_scheme({"name": "nope_scaled"}, SHAPE)
    q, k = torch.randn(2, 2, SHAPE.n_heads, 300, SHAPE.head_dim).unbind(0)
    positions = torch.arange(300)
    q_ours, k_ours = scheme.rotate(0, q, k, positions)
    assert torch.equal(k_ours, k)
    assert torch.allclose(q_ours, q * qwen_logn(positions, SHAPE.train_seq_len)[:, None], atol=1e-6)
    assert torch.equal(q_ours[:, :, :SHAPE.train_seq_len], q[:, :, :SHAPE.train_seq_len])  # NoPE within the training length


def test_nope_scaled_trains_like_nope_within_the_training_length():
    from relpos_cli.model import Transformer

    tokens = torch.randint(0, 64, (2, SHAPE.train_seq_len))
    outputs = []
    for name in ("none", "nope_scaled"):
        torch.manual_seed(0)
        outputs.append(Transformer(64, SHAPE, {"name": name}, mlp_ratio=2)(tokens))
    assert torch.equal(outputs[0], outputs[1])


def test_nope_learned_temperature_multiplies_each_heads_logits():
    scheme = build_scheme({"name": "nope_scaled", "temperature": "learned"}, SHAPE)
    assert scheme.head_temperature.shape == (SHAPE.n_layers, SHAPE.n_heads)
    with torch.no_grad():
        scheme.head_temperature[1] = torch.tensor([0.5, 1.0, 2.0, 3.0])
    q, k = torch.randn(2, 1, SHAPE.n_heads, 10, SHAPE.head_dim).unbind(0)
    q1, k1 = scheme.rotate(1, q, k, torch.arange(10))
    expected = (q @ k.transpose(-1, -2)) * torch.tensor([0.5, 1.0, 2.0, 3.0])[:, None, None]
    assert torch.allclose(q1 @ k1.transpose(-1, -2), expected, atol=1e-5)
    assert not scheme.reads_positions and build_scheme({"name": "nope_scaled"}, SHAPE).reads_positions


@pytest.mark.parametrize("temperature", ["cubic", None, 2])
def test_nope_scaled_unknown_temperature_is_a_clear_error(temperature):
    with pytest.raises(RelposError, match="pos.temperature=.*; choose one of: log_length, learned"):
        build_scheme({"name": "nope_scaled", "temperature": temperature}, SHAPE)


# ---- FoX ----------------------------------------------------------------------------------------

def fla_naive_forgetting_attn(q, k, v, g):
    """flash-linear-attention fla/ops/forgetting_attn/naive.py ``naive_forgetting_attn`` (no window,
    no GQA), its computation in the same order: q, k, v (B, T, H, D), g (B, T, H) log forget gates."""
    T, D = q.shape[1], q.shape[-1]
    scale = D ** -0.5
    gc = g.float().cumsum(1)
    mask = torch.tril(torch.ones((T, T), dtype=torch.bool))
    ref = torch.einsum("bqhd,bkhd->bhqk", q.float() * scale, k.float())
    ref = ref + gc.permute(0, 2, 1)[..., :, None] - gc.permute(0, 2, 1)[..., None, :]
    ref = ref.masked_fill(~mask[None, None], -float("inf"))
    return torch.einsum("bhqk,bkhd->bqhd", F.softmax(ref, dim=-1), v.float())


def fox_model(backend: str):
    from relpos_cli.model import Transformer

    torch.manual_seed(0)
    model = Transformer(64, SHAPE, {"name": "fox"}, mlp_ratio=2, attn_backend=backend)
    for gate in model.scheme.gates:  # gates far from one half, different per token and head
        torch.nn.init.normal_(gate.weight, std=0.5)
        torch.nn.init.normal_(gate.bias, std=2.0)
    return model


@pytest.mark.parametrize("backend", ["eager", "sdpa", "chunked", "auto"])
def test_fox_attention_matches_fla_naive_forgetting_attn_with_gradients(backend, monkeypatch):
    """One layer's attention output and the gradients of q, k, v and the gate's weights, against the
    reference fed the reference's gates (the authors' logsigmoid(fgate_proj(x))).
    Mutation checked: D_j - D_i (the sign of the decay) fails; so does a cumsum shifted by one token."""
    from relpos_cli import attention

    monkeypatch.setattr(attention, "DISTANCE_BLOCK", 7)  # several query blocks at T = 40
    model = fox_model(backend)
    attn, scheme = model.blocks[1].attn, model.scheme
    x = torch.randn(2, 40, SHAPE.d_model, requires_grad=True)
    B, T, _ = x.shape
    q, k, v = attn.qkv(x).view(B, T, 3, SHAPE.n_heads, SHAPE.head_dim).permute(2, 0, 3, 1, 4)
    ours = attention.attend(backend, scheme, 1, q, k, v, torch.arange(T), attn.bias_cache, layer_input=x)  # (B, H, T, Dh)
    gate = scheme.gates[1]
    g = F.logsigmoid(gate(x).float())  # (B, T, H), as the authors' layer
    ref = fla_naive_forgetting_attn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), g).transpose(1, 2)
    assert torch.allclose(ours, ref, atol=1e-5)
    upstream = torch.randn_like(ref)
    grads_ours = torch.autograd.grad((ours * upstream).sum(), [x, gate.weight, gate.bias], retain_graph=True)
    grads_ref = torch.autograd.grad((ref * upstream).sum(), [x, gate.weight, gate.bias])
    for a, b in zip(grads_ours, grads_ref):
        assert torch.allclose(a, b, atol=1e-5)


def test_fox_long_evaluation_builds_no_query_by_key_bias(monkeypatch):
    """Without gradients on CPU, auto attends with the keys' values alone: no tensor of queries x keys
    is ever asked of the scheme (score_bias is not called), and the output is eager's."""
    from relpos_cli import attention

    monkeypatch.setattr(attention, "DISTANCE_BLOCK", 16)
    tokens = torch.randint(0, 64, (1, 100))
    with torch.no_grad():
        reference = fox_model("eager")(tokens)
        model = fox_model("auto")
        monkeypatch.setattr(type(model.scheme), "score_bias", lambda *a, **k: pytest.fail("dense bias built"))
        assert torch.allclose(model(tokens), reference, atol=1e-5)


def test_fox_trains_on_the_chunked_path_when_flex_is_asked():
    """Flex's backward cannot lower FoX's score_mod (two lookups into the gate values, torch 2.11 on
    CUDA), so with gradients model.attn_backend=flex runs FoX chunked: eager's gradients. Mutation
    checked: sending it to flex anyway fails here (no CPU backward for flex)."""
    tokens = torch.randint(0, 64, (2, 33))
    grads = {}
    for backend in ("eager", "flex"):
        model = fox_model(backend)
        model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
        grads[backend] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads["flex"].keys() == grads["eager"].keys()
    assert all(torch.allclose(grads["flex"][n], grads["eager"][n], atol=1e-5) for n in grads["eager"])


def test_fox_gates_start_as_the_reference_initialises_them():
    scheme = build_scheme({"name": "fox"}, SHAPE)
    assert len(scheme.gates) == SHAPE.n_layers and scheme.gates[0].weight.shape == (SHAPE.n_heads, SHAPE.d_model)
    assert torch.all(scheme.gates[0].bias == 0) and 0.015 < scheme.gates[0].weight.std() < 0.025


# ---- stick-breaking -----------------------------------------------------------------------------

def fla_naive_stickbreaking_attn(q, k, v, attend_current=False):
    """flash-linear-attention fla/ops/stickbreaking_attn/naive.py ``naive_stickbreaking_attn`` (no
    GQA), its computation in the same order: q, k, v (B, T, H, D) -> o (B, T, H, D), rem (B, T, H)."""
    T, K = q.shape[1], q.shape[-1]
    scale = K ** -0.5
    compute_dtype = torch.double if torch.double in (q.dtype, k.dtype, v.dtype) else torch.float
    q, k, v = q.to(compute_dtype), k.to(compute_dtype), v.to(compute_dtype)
    z = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    i = torch.arange(T)
    mask = i[None, :] <= i[:, None] if attend_current else i[None, :] < i[:, None]
    log_om_beta = F.logsigmoid(-z).masked_fill(~mask, 0.0)
    log_att = F.logsigmoid(z) + log_om_beta.flip(-1).cumsum(-1).flip(-1) - log_om_beta
    att = log_att.masked_fill(~mask, float("-inf")).exp()
    o = torch.einsum("bhqk,bkhd->bqhd", att, v)
    rem = log_om_beta.sum(-1).exp().permute(0, 2, 1)
    return o, rem


def stick_model(backend: str, **options):
    from relpos_cli.model import Transformer

    torch.manual_seed(0)
    return Transformer(64, SHAPE, {"name": "stickbreaking", **options}, mlp_ratio=2, attn_backend=backend)


@pytest.mark.parametrize("attend_current", [False, True])
@pytest.mark.parametrize("backend", ["eager", "sdpa", "chunked", "auto"])
def test_stickbreaking_matches_fla_naive_with_gradients(backend, attend_current, monkeypatch):
    """Mutations checked: softmax instead of exp (normalising) fails; so does the suffix sum
    starting one key nearer (taken.cumsum without flips: a prefix sum)."""
    from relpos_cli import attention

    monkeypatch.setattr(attention, "BLOCK_BYTES", 4 * 2 * SHAPE.n_heads * 40 * 9)  # chunked: blocks of 9 queries
    model = stick_model(backend, attend_current=attend_current)
    attn, scheme = model.blocks[0].attn, model.scheme
    x = torch.randn(2, 40, SHAPE.d_model)
    B, T, _ = x.shape
    q, k, v = (t.detach().requires_grad_() for t in
               attn.qkv(x).view(B, T, 3, SHAPE.n_heads, SHAPE.head_dim).permute(2, 0, 3, 1, 4))
    ours = attention.attend(backend, scheme, 0, q, k, v, torch.arange(T), attn.bias_cache)  # (B, H, T, Dh)
    ref, _ = fla_naive_stickbreaking_attn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attend_current)
    ref = ref.transpose(1, 2)
    assert torch.allclose(ours, ref, atol=1e-5)
    if not attend_current:
        assert torch.all(ours[:, :, 0] == 0)  # the first query sees no key
    upstream = torch.randn_like(ref)
    grads_ours = torch.autograd.grad((ours * upstream).sum(), [q, k, v])
    grads_ref = torch.autograd.grad((ref * upstream).sum(), [q, k, v])
    for a, b in zip(grads_ours, grads_ref):
        assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("share, cut", [("large", True), ("tiny", False), ("slow", False)])
def test_stickbreaking_leaves_out_only_keys_of_zero_weight(share, cut, monkeypatch):
    """Without gradients on CPU, auto attends only to keys behind which the stick is spent: the same
    output as eager. Large shares (q . k >> 0) spend it within a few keys (far keys found, left out);
    tiny ones (q . k << 0) never do; slow ones (softplus(z) ~ 0.04 a key) spend about 10 over 256
    keys, 28 over 700. Mutation checked: a threshold of 10 instead of SPENT = 110 fails on "slow"
    (keys of weight ~e^-10 dropped)."""
    from relpos_cli import attention

    monkeypatch.setattr(attention, "DISTANCE_BLOCK", 32)
    model = stick_model("eager")
    attn, scheme = model.blocks[0].attn, model.scheme
    q, k, v = (torch.randn(1, SHAPE.n_heads, 700, SHAPE.head_dim) for _ in range(3))
    if share == "slow":  # z = -0.5625 sqrt(32) = -3.18 for every pair, give or take 1%
        q, k = 0.75 + 0.01 * q, -0.75 + 0.01 * k
    else:
        q, k = q.abs() * 4, (1.0 if share == "large" else -1.0) * k.abs() * 4
    found = []
    far_keys = scheme.far_keys
    monkeypatch.setattr(scheme, "far_keys", lambda *a: found.append(far_keys(*a)) or found[-1])
    with torch.no_grad():
        want = attention.attend("eager", scheme, 0, q, k, v, torch.arange(700), attn.bias_cache)
        got = attention.attend("auto", scheme, 0, q, k, v, torch.arange(700), attn.bias_cache)
    assert torch.allclose(got, want, atol=1e-6)
    assert (max(found) > 0) == cut


def test_stickbreaking_weights_are_the_product_definition():
    """A_ij = beta_ij prod_{j<l<i} (1 - beta_il), looped in float64, against the weights our bias gives."""
    scheme = build_scheme({"name": "stickbreaking"}, SHAPE)
    q, k = torch.randn(2, 1, SHAPE.n_heads, 12, SHAPE.head_dim, dtype=torch.float64).unbind(0)
    positions = torch.arange(12)
    z = q @ k.transpose(-1, -2) / math.sqrt(SHAPE.head_dim)
    weights = (z + scheme.score_bias(0, q, k, positions)).exp()  # (1, H, 12, 12)
    beta = torch.sigmoid(z)
    for i in range(12):
        for j in range(12):
            expected = beta[..., i, j] * torch.prod(1 - beta[..., i, j + 1:i], dim=-1) if j < i else torch.zeros_like(z[..., 0, 0])
            assert torch.allclose(weights[..., i, j], expected, atol=1e-12), (i, j)
    assert torch.all(weights.sum(-1) <= 1 + 1e-12)


def test_stickbreaking_bad_option_is_a_clear_error():
    with pytest.raises(RelposError, match="pos.attend_current='yes' must be true or false"):
        build_scheme({"name": "stickbreaking", "attend_current": "yes"}, SHAPE)


# ---- through the CLI: train, evaluate at 16x, resume bitwise -----------------------------------------

NEW_SCHEMES = [["pos=p_rope"], ["pos=nope_scaled"], ["pos=nope_scaled", "pos.temperature=learned"], ["pos=fox"],
               ["pos=stickbreaking"], ["pos=dape"], ["pos=dape", "pos.base=kerple_log"]]


@pytest.mark.parametrize("pos", NEW_SCHEMES, ids=lambda p: ",".join(p))
def test_new_scheme_trains_evaluates_at_16x_and_resumes_bitwise(pos, tmp_path, in_temp_cwd):
    """A run resumed from its step-2 checkpoint ends with the uninterrupted run's losses and weights."""
    import csv
    import shutil

    from conftest import TINY, final_weights, metrics, run_in_process
    from relpos_cli.results import report_path

    run = tmp_path / "run"
    code, _, err = run_in_process("train", *TINY, *pos, "train.ckpt_every=2", "device=cpu", f"hydra.run.dir={run}")
    assert code == 0, err
    code, _, err = run_in_process("eval-length", str(run), "eval.lengths=[32,512]", "eval.tokens=1024")
    assert code == 0, err
    rows = list(csv.DictReader(report_path(run, "eval_length", "default", ".csv").open()))
    assert [int(r["length"]) for r in rows] == [32, 512] and all(math.isfinite(float(r["ppl"])) for r in rows)

    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    (resumed / "checkpoint.pt").unlink()  # as if stopped after step 2's checkpoint
    code, _, err = run_in_process("train", f"resume={resumed}")
    assert code == 0, err
    assert [(m["loss"], m.get("val_loss")) for m in metrics(resumed)] == [(m["loss"], m.get("val_loss")) for m in metrics(run)]
    want, got = final_weights(run), final_weights(resumed)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


# ---- DAPE ---------------------------------------------------------------------------------------

def dape_alibi_reference(x, slopes, mlp2):
    """chuanyang-Zheng/DAPE ``AliBi_DAPE.forward`` on scores x (B, H, T, T), its computation in order."""
    T = x.shape[-1]
    a = -torch.tril(torch.arange(T).view(T, 1).repeat(1, T) + torch.arange(0, -T, -1))
    a = a.to(x.dtype) * slopes.view(slopes.shape[0], 1, 1)
    x_a_bias = torch.cat((x, torch.tile(a, (x.shape[0], 1, 1, 1))), dim=1)
    x_a_bias = torch.permute(x_a_bias, (0, 2, 3, 1))
    x_a_bias = mlp2(x_a_bias)
    x_a_bias = torch.permute(x_a_bias, (0, 3, 1, 2))
    return x + a + x_a_bias


def dape_kerple_reference(x, bias_p, bias_a, mlp2):
    """chuanyang-Zheng/DAPE ``ParallelKerpleLog_DAPE.forward`` (bias_p, bias_a (H, 1, 1), clamped)."""
    T = x.shape[-1]
    diff = torch.tril(torch.arange(T).view(T, 1).repeat(1, T) + torch.arange(0, -T, -1)).to(x.dtype)
    bias = -bias_p.clamp(min=1e-2) * torch.log(1 + bias_a.clamp(min=1e-2) * diff)
    x_a_bias = torch.cat((x, torch.tile(bias, (x.shape[0], 1, 1, 1))), dim=1)
    x_a_bias = torch.permute(x_a_bias, (0, 2, 3, 1))
    x_a_bias = mlp2(x_a_bias)
    x_a_bias = torch.permute(x_a_bias, (0, 3, 1, 2))
    return x + bias + x_a_bias


@pytest.mark.parametrize("base", ["alibi", "kerple_log"])
@pytest.mark.parametrize("backend", ["eager", "sdpa", "chunked", "auto"])
def test_dape_attention_matches_the_authors_module_with_gradients(base, backend, monkeypatch):
    """The authors' module on the scaled scores, causal softmax, against our attention, outputs and
    gradients of q, k, v, the MLP and the base's parameters. Mutations checked: the first layer's
    weights for logits and base swapped fails; so does dropping the base bias from the sum, and
    rows groups overlapping by one (range step rows - 1)."""
    from relpos_cli import attention
    from relpos_cli.model import Transformer

    from relpos_cli.positions import dape

    monkeypatch.setattr(attention, "BLOCK_BYTES", 4 * 2 * SHAPE.n_heads * 40 * 9)  # chunked: blocks of 9 queries
    monkeypatch.setattr(dape, "HIDDEN_BYTES", 4 * 2 * 32 * 40 * 4)  # the MLP over 4 query rows at a time
    torch.manual_seed(0)
    model = Transformer(64, SHAPE, {"name": "dape", "base": base, "base_options": {"shared_layers": False}}
                        if base == "kerple_log" else {"name": "dape", "base": base}, mlp_ratio=2, attn_backend=backend)
    scheme, attn = model.scheme, model.blocks[1].attn
    x = torch.randn(2, 40, SHAPE.d_model)
    B, T, _ = x.shape
    q, k, v = (t.detach().requires_grad_() for t in
               attn.qkv(x).view(B, T, 3, SHAPE.n_heads, SHAPE.head_dim).permute(2, 0, 3, 1, 4))
    ours = attention.attend(backend, scheme, 1, q, k, v, torch.arange(T), attn.bias_cache)
    scores = q @ k.transpose(-1, -2) / math.sqrt(SHAPE.head_dim)
    if base == "alibi":
        logits = dape_alibi_reference(scores, scheme.base.slopes, scheme.mlps[1])
    else:
        logits = dape_kerple_reference(scores, scheme.base.r1[1][:, None, None], scheme.base.r2[1][:, None, None], scheme.mlps[1])
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    ref = logits.masked_fill(~causal, float("-inf")).softmax(-1) @ v
    assert torch.allclose(ours, ref, atol=1e-5)
    params = [q, k, v, *scheme.mlps[1].parameters(), *scheme.base.parameters()]
    upstream = torch.randn_like(ref)
    grads_ours = torch.autograd.grad((ours * upstream).sum(), params, retain_graph=True, allow_unused=True)
    grads_ref = torch.autograd.grad((ref * upstream).sum(), params, allow_unused=True)
    for a, b in zip(grads_ours, grads_ref):
        assert (a is None) == (b is None) and (a is None or torch.allclose(a, b, atol=1e-5))


@pytest.mark.parametrize("options, message", [
    ({"base": "rope"}, "pos.base='rope' cannot be DAPE's base (it adds no bias)"),
    ({"base": "stickbreaking"}, "pos.base='stickbreaking' cannot be DAPE's base (it replaces softmax's normalisation"),
    ({"base": "cope"}, "pos.base='cope' cannot be DAPE's base (its bias reads the content)"),
    ({"base": "dape"}, "pos.base='dape' cannot be DAPE's base (its bias reads the content)"),
    ({"base": "nope"}, "pos.base='nope' cannot be DAPE's base (not a scheme); choose a bias of positions: alibi, fire"),
    ({"mlp_width": 0}, "pos.mlp_width=0 must be a positive integer"),
    ({"base": "kerple_log", "base_options": {"slopes": 2}}, "pos=kerple_log has no option slopes"),
])
def test_dape_bad_options_are_clear_errors(options, message):
    with pytest.raises(RelposError, match=re.escape(message)):
        build_scheme({"name": "dape", **options}, SHAPE)
