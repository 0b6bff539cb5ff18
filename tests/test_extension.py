"""Training-free context extension at evaluation (relpos_cli/extension.py, attention.extended_attention).

The reference is a per-pair computation written from the reference implementations' text, apart
from the fast path: for every (query i, key j <= i) the position each method assigns to the query
and to the key (or that the key is dropped), the rotation that implies for RoPE (a complex rotation
of q and k written here, half-split layout as transformers' Llama), the bias at that distance for a
bias scheme, then one softmax per query row:

- Self-Extend: datamllab/LongLM self_extend_patch/Llama.py (neighbour mask i - j < group_size_2,
  group positions query // g1 + g2 - g2 / g1 and key // g1);
- ReRoPE / leaky ReRoPE: bojone/rerope rerope_patch.py (|i - j| < window, else query at `window`,
  key unrotated) and leaky_rerope_patch.py (query at (i + window (k - 1)) / k, key at j / k);
- StreamingLLM: mit-han-lab/streaming-llm pos_shift/modify_llama.py with kv_cache.py's
  start + recent cache (positions in the cache);
- LM-Infinite: Glaciohound/LM-Infinite models/llama.py + lambda_attention.py (sinks outside the
  local branch: query rotated at min(limit_distance, kv_len - 1), key unrotated).
"""

from __future__ import annotations

import math

import pytest
import torch

from relpos_cli import attention
from relpos_cli.errors import RelposError
from relpos_cli.extension import build_extension, check_method, eval_method
from relpos_cli.model import Transformer
from relpos_cli.positions import build_scheme
from relpos_cli.positions.base import ModelShape

SHAPE = ModelShape(d_model=32, n_heads=2, n_layers=1, train_seq_len=16)
NULL = {"rope_scaling": {"type": "none"}, "self_extend": {"group": None, "window": None},
        "rerope": {"window": None, "slope": None}, "sinks": {"count": None, "window": None, "max_distance": None}}


def eval_cfg(**sections) -> dict:
    return {**NULL, **{k: {**NULL[k], **v} for k, v in sections.items()}}


def extension_for(scheme, **sections):
    """The extension eval settings ask for, checked against the scheme as building a model checks it."""
    method = eval_method(eval_cfg(**sections))
    check_method(method, scheme)
    return method.extension


# ---- the per-pair reference ------------------------------------------------------------------------
def assigned_positions(method: dict, i: int, j: int, length: int) -> tuple[float, float] | None:
    """(query position, key position) the method gives the pair (i, j), or None when the key is dropped."""
    d = i - j
    if "group" in method:  # Self-Extend
        G, W = method["group"], method["window"]
        return (i, j) if d < W else (i // G + W - W / G, j // G)
    if "slope" in method:  # ReRoPE (slope 0) / leaky ReRoPE (slope 1/k)
        W, S = method["window"], method["slope"]
        if d < W:
            return i, j
        if S == 0:
            return W, 0  # rerope_patch.py: query at `window`, key as it is
        k = 1 / S
        return (i + W * (k - 1)) / k, j / k  # leaky_rerope_patch.py: rotary_emb2 = linear scaling by k
    N, W, D = method["sinks"], method["size"], method.get("max_distance")
    if d < W:
        return i, j
    if j >= N:
        return None
    if D is None:  # StreamingLLM: cache = N sinks + the W - 1 keys before the query, positions in the cache
        cache_query = min(i, N + W - 1)
        return cache_query, j
    return min(D, length - 1), 0  # LM-Infinite: effective_limit_distance, key unrotated


def rope_logit(q: torch.Tensor, k: torch.Tensor, q_pos: float, k_pos: float, base: float = 10000.0) -> torch.Tensor:
    """q . k after rotating q at q_pos and k at k_pos: dimension m pairs with m + d/2 (rotate_half)."""
    half = q.shape[-1] // 2
    theta = base ** (-torch.arange(half, dtype=torch.float64) * 2 / q.shape[-1])
    qc = torch.complex(q[..., :half], q[..., half:]) * torch.polar(torch.ones_like(theta), theta * q_pos)
    kc = torch.complex(k[..., :half], k[..., half:]) * torch.polar(torch.ones_like(theta), theta * k_pos)
    return (qc * kc.conj()).real.sum(-1)


def reference_attention(method: dict, q, k, v, logit) -> torch.Tensor:
    """q, k, v (H, T, Dh) float64; logit(h, i, j, q_pos, k_pos) -> the pair's logit before scaling
    by 1/sqrt(Dh) is applied inside. One softmax per query row."""
    H, T, Dh = q.shape
    out = torch.zeros_like(q)
    for h in range(H):
        for i in range(T):
            keys, logits = [], []
            for j in range(i + 1):
                pos = assigned_positions(method, i, j, T)
                if pos is None:
                    continue
                keys.append(j)
                logits.append(logit(h, i, j, *pos))
            p = torch.softmax(torch.stack(logits) / math.sqrt(Dh), dim=0)
            out[h, i] = (p[:, None] * v[h, keys]).sum(0)
    return out


METHODS = {
    "self_extend": ({"self_extend": {"group": 3, "window": 5}}, {"group": 3, "window": 5}),
    "self_extend_uneven": ({"self_extend": {"group": 4, "window": 6}}, {"group": 4, "window": 6}),
    "rerope": ({"rerope": {"window": 4}}, {"window": 4, "slope": 0}),
    "leaky_rerope": ({"rerope": {"window": 4, "slope": 0.25}}, {"window": 4, "slope": 0.25}),
    "streaming": ({"sinks": {"count": 2, "window": 6}}, {"sinks": 2, "size": 6}),
    "lm_infinite": ({"sinks": {"count": 3, "window": 5, "max_distance": 9}}, {"sinks": 3, "size": 5, "max_distance": 9}),
    "lm_infinite_past_length": ({"sinks": {"count": 3, "window": 5, "max_distance": 99}},
                                {"sinks": 3, "size": 5, "max_distance": 99}),
}


def qkv(T: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, SHAPE.n_heads, T, SHAPE.head_dim, generator=g, dtype=torch.float64) for _ in range(3)]


@pytest.mark.parametrize("block", [512, 7])
@pytest.mark.parametrize("name", list(METHODS))
def test_rope_methods_match_the_per_pair_reference(name, block, monkeypatch):
    """Mutations seen failing: Self-Extend's query shift W - W // G (self_extend_uneven), the near test
    d <= W, the far band ending one key early (e - W - 1), the sinks' cache position N + W, the CPU
    kernel's log-sum-exp of 0 kept for a query whose far keys are all masked."""
    monkeypatch.setattr(attention, "DISTANCE_BLOCK", block)
    cfg, method = METHODS[name]
    rope = build_scheme({"name": "rope"}, SHAPE).double()
    extension = extension_for(rope, **cfg)
    T = 23
    q, k, v = qkv(T)
    got = attention.attend("auto", rope, 0, q, k, v, torch.arange(T), attention.BiasCache(), extension=extension)
    want = reference_attention(method, q[0], k[0], v[0], lambda h, i, j, qp, kp: rope_logit(q[0, h, i], k[0, h, j], qp, kp))
    torch.testing.assert_close(got[0], want, rtol=1e-6, atol=1e-6)  # positions go through float32 (W - W / G)


@pytest.mark.parametrize("block", [512, 4])
@pytest.mark.parametrize("pos, name", [("alibi", "streaming"), ("alibi", "lm_infinite"), ("t5", "streaming"),
                                       ("t5", "lm_infinite"), ("kerple_log", "lm_infinite_past_length"),
                                       ("fire", "streaming")])
def test_sink_windows_on_bias_schemes_match_the_per_pair_reference(pos, name, block, monkeypatch):
    """A bias scheme's far sinks take the bias at their assigned positions (StreamingLLM: in the
    cache; LM-Infinite: distance D). Mutation seen failing: the far part's bias at the true positions."""
    monkeypatch.setattr(attention, "DISTANCE_BLOCK", block)
    cfg, method = METHODS[name]
    dtype = torch.float32 if pos == "fire" else torch.float64  # FIRE's MLP runs in float32
    scheme = build_scheme({"name": pos}, SHAPE).to(dtype)
    extension = extension_for(scheme, **cfg)
    T = 19
    q, k, v = qkv(T, seed=1)

    def logit(h, i, j, qp, kp):
        bias = scheme.score_bias(0, q, k, torch.tensor([int(qp)]), torch.tensor([int(kp)])).double()
        return q[0, h, i] @ k[0, h, j] + bias.reshape(-1, 1)[h, 0] * math.sqrt(SHAPE.head_dim)

    with torch.no_grad():
        got = attention.attend("auto", scheme, 0, q.to(dtype), k.to(dtype), v.to(dtype), torch.arange(T), attention.BiasCache(),
                               extension=extension)
        want = reference_attention(method, q[0], k[0], v[0], logit)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-9
    torch.testing.assert_close(got[0].double(), want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("block", [512, 4])
@pytest.mark.parametrize("pos, name", [("shaw", "streaming"), ("shaw", "lm_infinite"), ("dape", "streaming"),
                                       ("dape", "lm_infinite_past_length")])
def test_sink_windows_on_per_pair_content_biases_match_the_per_pair_reference(pos, name, block, monkeypatch):
    """Shaw's q_i . r[clip(j - i)] and DAPE's MLP over one pair's logits and base biases read the pair
    alone, so a sink takes them at its assigned positions, computed here one pair at a time from q_i and
    k_j (every head's, for DAPE). Shaw's clip K = 2 sits inside the windows, so a sink's clipped distance
    is r[-K] at its true and its cache positions alike, and the test also takes K = 16. Mutation seen
    failing: the far part's bias at the true positions (DAPE, and Shaw with K = 16)."""
    monkeypatch.setattr(attention, "DISTANCE_BLOCK", block)
    cfg, method = METHODS[name]
    for options in ([{}] if pos == "dape" else [{"max_distance": 2}, {"max_distance": 16}]):
        scheme = build_scheme({"name": pos, **options}, SHAPE).double()
        with torch.no_grad():
            for parameter in scheme.parameters():  # away from the init, which may leave a term at zero
                parameter.copy_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64))
        extension = extension_for(scheme, **cfg)
        T = 19
        q, k, v = qkv(T, seed=2)

        def logit(h, i, j, qp, kp):
            bias = scheme.score_bias(0, q[:, :, i:i + 1], k[:, :, j:j + 1], torch.tensor([int(qp)]), torch.tensor([int(kp)]))
            return q[0, h, i] @ k[0, h, j] + bias[0, h, 0, 0] * math.sqrt(SHAPE.head_dim)

        with torch.no_grad():
            got = attention.attend("auto", scheme, 0, q, k, v, torch.arange(T), attention.BiasCache(), extension=extension)
            want = reference_attention(method, q[0], k[0], v[0], logit)
        torch.testing.assert_close(got[0], want, rtol=1e-9, atol=1e-9)


def test_a_sink_window_on_an_absolute_scheme_is_the_mask_alone():
    scheme = build_scheme({"name": "learned"}, SHAPE).double()
    extension = extension_for(scheme, sinks={"count": 2, "window": 4})
    T = 12
    q, k, v = qkv(T, seed=2)
    got = attention.attend("auto", scheme, 0, q, k, v, torch.arange(T), attention.BiasCache(), extension=extension)
    want = reference_attention({"sinks": 2, "size": 4}, q[0], k[0], v[0], lambda h, i, j, qp, kp: q[0, h, i] @ k[0, h, j])
    torch.testing.assert_close(got[0], want, rtol=1e-9, atol=1e-9)


def test_xpos_rotated_apart_depends_on_the_position_difference():
    xpos = build_scheme({"name": "xpos"}, SHAPE).double()
    q, k, _ = qkv(6, seed=3)
    a = torch.tensor([0.0, 3.5, 7.0, 9.0, 20.0, 41.0], dtype=torch.float64)
    b = torch.tensor([1.0, 2.0, 2.5, 8.0, 11.0, 40.0], dtype=torch.float64)
    qa, kb = xpos.rotate_apart(0, q, k, a, b)
    qs, ks = xpos.rotate_apart(0, q, k, a + 100, b + 100)
    torch.testing.assert_close(qa @ kb.transpose(-2, -1), qs @ ks.transpose(-2, -1), rtol=1e-9, atol=1e-9)
    # at equal positions, rotate_apart is rotate
    pos = torch.arange(6)
    q1, k1 = xpos.rotate(0, q, k, pos)
    q2, k2 = xpos.rotate_apart(0, q, k, pos, pos)
    torch.testing.assert_close(q1 @ k1.transpose(-2, -1), q2 @ k2.transpose(-2, -1), rtol=1e-9, atol=1e-9)


# ---- reductions to plain attention, and the default path ---------------------------------------
def tiny_model(pos: str, **sections) -> Transformer:
    """The same weights (seed 0) whatever the eval-time method the model is built with."""
    torch.manual_seed(0)
    return Transformer(64, SHAPE, {"name": pos}, method=eval_method(eval_cfg(**sections))).double().eval()


@pytest.mark.parametrize("pos, cfg", [
    ("rope", {"self_extend": {"group": 1, "window": 3}}),  # G = 1: every pair at its own distance
    ("rope", {"self_extend": {"group": 4, "window": 40}}),  # window covers the length
    ("rope", {"rerope": {"window": 40, "slope": 0.5}}),
    ("xpos", {"rerope": {"window": 40}}),
    ("rope", {"sinks": {"count": 4, "window": 40}}),
    ("alibi", {"sinks": {"count": 1, "window": 40, "max_distance": 3}}),
    ("learned", {"sinks": {"count": 1, "window": 40}}),
])
def test_each_method_reduces_to_plain_attention_when_its_window_covers_the_length(pos, cfg):
    tokens = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = tiny_model(pos)(tokens)
        model = tiny_model(pos, **cfg)
        assert model.method.extension is not None
        extended = model(tokens)
    torch.testing.assert_close(extended, plain, rtol=1e-9, atol=1e-9)


def test_a_method_changes_the_logits_once_keys_fall_outside_its_window():
    """The reductions above are not vacuous: the same model with a short window differs."""
    tokens = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = tiny_model("rope")(tokens)
        model = tiny_model("rope", self_extend={"group": 4, "window": 8})
        assert not torch.allclose(model(tokens)[:, 8:], plain[:, 8:])
        torch.testing.assert_close(model(tokens)[:, :8], plain[:, :8], rtol=1e-9, atol=1e-9)


def test_null_keys_leave_the_default_path_bit_identical():
    tokens = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = tiny_model("rope").float()(tokens)
        model = tiny_model("rope", **NULL).float()
        assert model.method.extension is None and model.method.rope_scaling is None
        assert torch.equal(model(tokens), before)


# ---- bad settings -------------------------------------------------------------------------------
@pytest.mark.parametrize("pos, cfg, match", [
    ("alibi", {"rerope": {"window": 8}}, r"eval.rerope .* rotate q and k \(p_rope, rope, xpos\); pos=alibi does not"),
    ("learned", {"self_extend": {"group": 2, "window": 8}}, r"eval.self_extend .*pos=learned does not"),
    ("rope", {"self_extend": {"group": 2, "window": 8}, "rerope": {"window": 4}},
     "eval.self_extend and eval.rerope are separate methods"),
    ("rope", {"rerope": {"window": 4}, "rope_scaling": {"type": "yarn"}}, "on top of eval.rope_scaling.type=yarn"),
    ("rope", {"sinks": {"window": 4}, "rope_scaling": {"type": "linear"}}, "on top of eval.rope_scaling.type=linear"),
    ("learned", {"sinks": {"window": 4, "max_distance": 8}}, "pos=learned's logits are no function of i - j alone"),
    ("none", {"sinks": {"window": 4, "max_distance": 8}}, "pos=none's logits are no function of i - j alone"),
    ("fire", {"sinks": {"window": 4, "max_distance": 8}}, "pos=fire's logits are no function of i - j alone"),
    # no sink outside the window to put at max_distance: the plain window, named as LM-Infinite
    ("alibi", {"sinks": {"window": 4, "max_distance": 8}}, "eval.sinks.count=0 keeps none"),
    ("alibi", {"sinks": {"count": 0, "window": 4, "max_distance": 8}}, "eval.sinks.count=0 keeps none"),
    ("cope", {"sinks": {"window": 4}}, "pos=cope's depends on the keys between them as well"),
    ("fox", {"sinks": {"window": 4}}, "not implemented for pos=fox: it adds a bias of the layer's input"),
    ("stickbreaking", {"sinks": {"window": 4}}, "not implemented for pos=stickbreaking: it replaces softmax's"),
    ("rope", {"rerope": {"window": 2**24 + 1}}, r"eval.rerope.window=16777217 is past what pos=rope can represent"),
    ("learned", {"sinks": {"window": 10**6}}, r"eval.sinks.window=1000000 is past what pos=learned can represent"),
])
def test_methods_refuse_schemes_and_combinations_they_do_not_apply_to(pos, cfg, match):
    with pytest.raises(RelposError, match=match):
        Transformer(64, SHAPE, {"name": pos}, method=eval_method(eval_cfg(**cfg)))


def test_build_reads_null_slope_and_sinks_as_zero():
    assert build_extension(eval_cfg(rerope={"window": 4})).slope == 0.0
    assert build_extension(eval_cfg(sinks={"window": 4})).sinks == 0
    assert build_extension(eval_cfg()) is None


def test_the_explicit_path_used_on_cuda_or_with_gradients_matches_the_reference():
    """Off the CPU flash kernel (CUDA, or a recorded gradient) each part's log-sum-exp comes from
    explicit (block x keys) logits; a query with no key in a part must weigh nothing there.
    Mutation seen failing: the softmax of such a row (all -inf: NaN) left unzeroed."""
    cfg, method = METHODS["streaming"]
    rope = build_scheme({"name": "rope"}, SHAPE).double()
    extension = extension_for(rope, **cfg)
    T = 17
    q, k, v = qkv(T, seed=4)
    got = attention.attend("auto", rope, 0, q.requires_grad_(), k, v, torch.arange(T), attention.BiasCache(),
                           extension=extension)
    want = reference_attention(method, q[0].detach(), k[0], v[0],
                               lambda h, i, j, qp, kp: rope_logit(q[0, h, i].detach(), k[0, h, j], qp, kp))
    torch.testing.assert_close(got[0].detach(), want, rtol=1e-6, atol=1e-6)
