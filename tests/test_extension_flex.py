"""extended_attention's FlexAttention path (attention.extension_runs_flex, _flex_near_and_far): two
flex passes, near pairs in a band of the block grid and far pairs at the extension's far positions,
merged by their log-sum-exps.

Production runs it on CUDA only. Here it runs on CPU, where torch 2.13's compiled flex returns no
log-sum-exp: flex runs as torch's reference implementation (the HOP's dense math, eager), which
reads each BlockMask's mask_mod but not its block grid, so the grid is checked on its own against
the pairs it stands for. The reference is written here from the formulas in relpos_cli/extension.py
(each pair's query and key positions, a complex rotation of q and k, explicit (T x T) logits, one
softmax per row), apart from the code under test; the CPU block path (the flash kernel) is the second
reference, in float32.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex

from relpos_cli import attention
from relpos_cli.extension import EvalMethod, Extension, ReRoPE, SelfExtend, SinkWindow, check_method
from relpos_cli.model import BlockOptions, Transformer
from relpos_cli.positions import build_scheme
from relpos_cli.positions.base import ModelShape

CPU = torch.device("cpu")
B, H, DH = 2, 3, 16
SHAPE = ModelShape(d_model=H * DH, n_heads=H, n_layers=1, train_seq_len=64)

EXTENSIONS = {
    "self_extend_g2": SelfExtend(window=16, group=2),
    "self_extend_g4": SelfExtend(window=64, group=4),
    "self_extend_uneven": SelfExtend(window=18, group=4),  # W not a multiple of G: W / G = 4.5
    "rerope": ReRoPE(window=16),
    "leaky_rerope": ReRoPE(window=64, slope=1 / 8),
    "streaming": SinkWindow(window=16, sinks=4),
    "lm_infinite": SinkWindow(window=16, sinks=4, max_distance=40),
    "lm_infinite_past_length": SinkWindow(window=64, sinks=4, max_distance=999),
    "window_past_length": SelfExtend(window=512, group=4),  # every pair near: one pass
}


@pytest.fixture
def flex_on_cpu(monkeypatch):
    """Flex chosen on CPU, run eagerly (torch's reference implementation); counts the flex passes."""
    monkeypatch.setattr(torch_flex, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)  # no dynamo: the HOP's math
    monkeypatch.setattr(attention, "_compiled_flex", lambda: torch_flex.flex_attention)
    monkeypatch.setattr(attention, "FLEX_EXTENSION_DEVICES", ("cpu",))
    passes = []
    run_flex = attention._run_flex

    def counted(*args, **kwargs):
        passes.append(1)
        return run_flex(*args, **kwargs)

    monkeypatch.setattr(attention, "_run_flex", counted)
    return passes


def qkv(T: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, DH, generator=g, dtype=torch.float64).to(dtype) for _ in range(3)]


def scheme_for(name: str, ext: Extension, dtype: torch.dtype):
    scheme = build_scheme({"name": name}, SHAPE).to(dtype)
    check_method(EvalMethod(extension=ext), scheme)
    return scheme


def extended(ext: Extension, scheme, q, k, v) -> torch.Tensor:
    with torch.no_grad():
        return attention.extended_attention(ext, scheme, 0, q, k, v, torch.arange(q.shape[-2]))


# ---- the reference ---------------------------------------------------------------------------------
def pair_positions(ext: Extension, T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(query position, key position, seen) of every pair (i, j), each (T, T): near pairs
    0 <= i - j < W at (i, j), far pairs i - j >= W at the method's far positions (extension.py's
    table), sinks only the first N keys."""
    i = torch.arange(T, dtype=torch.float64)[:, None]
    j = torch.arange(T, dtype=torch.float64)[None, :]
    W = ext.window
    near, far = (i - j >= 0) & (i - j < W), i - j >= W
    if isinstance(ext, SelfExtend):
        G = ext.group
        far_q, far_k = torch.floor(i / G) + W - W / G, torch.floor(j / G)
    elif isinstance(ext, ReRoPE):
        S = ext.slope
        far_q, far_k = i * S + W * (1 - S), j * S
    else:
        N, D = ext.sinks, ext.max_distance
        far = far & (j < N)
        if D is None:  # StreamingLLM: the query's position in a cache of N sinks + W
            far_q, far_k = torch.clamp(i, max=N + W - 1), j
        else:  # LM-Infinite: every far sink at distance D (at most T - 1)
            far_q, far_k = torch.full_like(i, min(D, T - 1)), torch.zeros_like(j)
    return torch.where(near, i, far_q), torch.where(near, j, far_k), near | far


def reference_attention(ext: Extension, q, k, v, inv_freq: torch.Tensor | None) -> torch.Tensor:
    """q, k, v (B, H, T, Dh) -> attention with each pair's logit at its assigned positions, float64:
    RoPE's half-split rotation as a complex phase of the pair's position difference at frequencies
    inv_freq (Dh/2,), or (None) no rotation."""
    T, Dh = q.shape[-2:]
    q, k, v = q.double(), k.double(), v.double()
    q_pos, k_pos, seen = pair_positions(ext, T)
    if inv_freq is None:
        logits = q @ k.transpose(-2, -1)
    else:
        half = Dh // 2
        qc = torch.complex(q[..., :half], q[..., half:])  # (B, H, T, Dh/2)
        kc = torch.complex(k[..., :half], k[..., half:])
        angle = (q_pos - k_pos)[..., None] * inv_freq.double()  # (T, T, Dh/2)
        phase = torch.polar(torch.ones_like(angle), angle)
        logits = (qc[..., :, None, :] * kc.conj()[..., None, :, :] * phase).real.sum(-1)  # (B, H, T, T)
    logits = (logits / math.sqrt(Dh)).masked_fill(~seen, float("-inf"))
    return torch.softmax(logits, dim=-1) @ v


# ---- tests ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("q_len, k_len, near, far, offset", [
    (300, 300, 0, None, None),  # causal, as flex_attention uses it
    (300, 300, 0, 16, None), (70, 70, 0, 64, None), (200, 200, 0, 128, None), (50, 50, 0, 64, None),  # bands
    (300 - 64, 300, 64, None, 64), (70 - 16, 70, 16, None, 16), (200 - 128, 200, 128, None, 128),  # far pairs
    (300 - 16, 4, 16, None, 16), (300, 4, 0, None, 0),  # far sinks
    (100, 300, 0, 40, None),  # queries the last 100 of 300 positions
])
def test_block_masks_are_the_pairs_in_the_band(q_len, k_len, near, far, offset):
    """Built from the block grid: a kv block is listed for a q block iff one of its pairs is in the
    band, and as full (no mask_mod) iff all of them are and it is a whole block. Mutations seen
    failing: full blocks without the `far` bound, ragged blocks counted full, seen blocks and the
    mask_mod without it."""
    mask = attention.causal_block_mask(q_len, k_len, CPU, near=near, far=far, offset=offset)
    first = k_len - q_len if offset is None else offset
    distance = torch.arange(q_len)[:, None] + first - torch.arange(k_len)[None, :]
    pairs = (distance >= near) & (distance < (far if far is not None else k_len + q_len + first))
    qb, kb = -(-q_len // 128), -(-k_len // 128)
    padded = torch.zeros(qb * 128, kb * 128, dtype=torch.int64)
    padded[:q_len, :k_len] = pairs
    valid = torch.zeros_like(padded)
    valid[:q_len, :k_len] = 1
    in_band = padded.view(qb, 128, kb, 128).sum((1, 3))
    whole = valid.view(qb, 128, kb, 128).sum((1, 3)) == 128 * 128
    assert torch.equal(mask.to_dense()[0, 0].bool(), in_band > 0)
    full = torch.zeros(qb, kb, dtype=torch.bool)
    for row, (count, order) in enumerate(zip(mask.full_kv_num_blocks[0, 0], mask.full_kv_indices[0, 0])):
        full[row, order[:count].long()] = True
    assert torch.equal(full, whole & (in_band == 128 * 128))
    # the mask_mod, which runs on partial blocks, is the band itself
    got = mask.mask_mod(0, 0, torch.arange(q_len)[:, None], torch.arange(k_len)[None, :])
    assert torch.equal(got, pairs)


def test_flex_log_sum_exp_is_the_natural_one(flex_on_cpu):
    """flex's kernel works in base 2; what _run_flex returns is torch.logsumexp's (natural log).
    Mutation seen failing: _run_flex's log-sum-exp divided by ln 2."""
    q, k, v = qkv(200, torch.float32)
    mask = attention.causal_block_mask(200 - 16, 200, CPU, near=16, offset=16)
    y, lse = attention._run_flex(q[:, :, 16:], k, v, None, mask, lse=True)
    distance = torch.arange(16, 200)[:, None] - torch.arange(200)[None, :]
    logits = (q[:, :, 16:] @ k.transpose(-2, -1) / math.sqrt(DH)).masked_fill(distance < 16, float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(logits, dim=-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, torch.softmax(logits, dim=-1) @ v, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T", [70, 200, 300])
@pytest.mark.parametrize("name", list(EXTENSIONS))
def test_flex_path_matches_the_per_pair_reference(name, T, flex_on_cpu):
    """RoPE, float64. Lengths below one flex block (70), ragged (200, 300), within the window
    (window_past_length; 70 under W = 64 barely past it). Mutations seen failing: the near band one
    pair too wide, the far pairs from W - 1, the far pass at offset 0, its queries at the near
    positions, the near output returned without the merge."""
    ext = EXTENSIONS[name]
    rope = scheme_for("rope", ext, torch.float64)
    q, k, v = qkv(T, torch.float64, seed=T)
    got = extended(ext, rope, q, k, v)
    assert len(flex_on_cpu) == (2 if T > ext.window else 1)  # the flex path ran: near (and far) pass
    torch.testing.assert_close(got, reference_attention(ext, q, k, v, rope.inv_freq), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("sinks, passes", [(4, 2), (0, 1)])
def test_flex_path_on_a_scheme_without_positions_is_the_sink_window(sinks, passes, flex_on_cpu):
    """NoPE (no rotation, no bias): the sinks' mask alone, keys beyond the sinks dropped; no sinks,
    no far pass (the plain sliding window)."""
    ext = SinkWindow(window=16, sinks=sinks)
    nope = scheme_for("none", ext, torch.float64)
    q, k, v = qkv(200, torch.float64, seed=1)
    got = extended(ext, nope, q, k, v)
    assert len(flex_on_cpu) == passes
    torch.testing.assert_close(got, reference_attention(ext, q, k, v, None), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("pos, name", [("rope", "self_extend_uneven"), ("rope", "leaky_rerope"), ("rope", "lm_infinite"),
                                       ("xpos", "rerope"), ("xpos", "streaming"), ("p_rope", "self_extend_g4")])
def test_flex_path_matches_the_block_path_in_float32(pos, name, flex_on_cpu, monkeypatch):
    """The same call on both paths (the block path: the CPU flash kernel), float32 at 1e-5."""
    ext = EXTENSIONS[name]
    scheme = scheme_for(pos, ext, torch.float32)
    q, k, v = qkv(300, torch.float32, seed=2)
    got = extended(ext, scheme, q, k, v)
    assert len(flex_on_cpu) == 2
    monkeypatch.setattr(attention, "FLEX_EXTENSION_DEVICES", ())
    want = extended(ext, scheme, q, k, v)
    assert len(flex_on_cpu) == 2  # the block path ran
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_flex_runs_exactly_where_the_dispatcher_says(monkeypatch):
    """Decided by the device and the scheme's declarations, never its name: a score bias (the sink
    windows of bias schemes) and a recorded gradient keep the block path, as every device outside
    FLEX_EXTENSION_DEVICES does (CPU by default). Mutations seen failing: leaving out any one of
    the three conditions."""
    ext = EXTENSIONS["streaming"]
    q, k, v = qkv(8, torch.float32)
    rope, nope, alibi = (scheme_for(name, ext, torch.float32) for name in ("rope", "none", "alibi"))
    assert attention.FLEX_EXTENSION_DEVICES == ("cuda",)
    assert not attention.extension_runs_flex(rope, q, k, v)
    monkeypatch.setattr(attention, "FLEX_EXTENSION_DEVICES", ("cpu",))
    assert attention.extension_runs_flex(rope, q, k, v) and attention.extension_runs_flex(nope, q, k, v)
    assert not attention.extension_runs_flex(alibi, q, k, v)
    q.requires_grad_()
    assert not attention.extension_runs_flex(rope, q, k, v)
    with torch.no_grad():
        assert attention.extension_runs_flex(rope, q, k, v)
        small = [t[..., :8] for t in (q, k, v)]  # a head size inductor's flex does not compile for
        assert not attention.extension_runs_flex(scheme_for("rope", ext, torch.float32), *small)


@pytest.mark.parametrize("cuda", [False, True])
def test_extended_attention_takes_the_dispatchers_choice(cuda, flex_on_cpu, monkeypatch):
    """On a device the dispatcher picks (CUDA, patched to this CPU) extended_attention runs the flex
    passes; elsewhere the block path, whose flash kernel this checks ran."""
    monkeypatch.setattr(attention, "FLEX_EXTENSION_DEVICES", ("cpu",) if cuda else ("cuda",))
    flash, kernel = [], attention._FLASH_CPU
    monkeypatch.setattr(attention, "_FLASH_CPU", lambda *a, **kw: flash.append(1) or kernel(*a, **kw))
    ext = EXTENSIONS["rerope"]
    q, k, v = qkv(70, torch.float32)
    extended(ext, scheme_for("rope", ext, torch.float32), q, k, v)
    assert (len(flex_on_cpu), bool(flash)) == ((2, False) if cuda else (0, True))


def test_a_model_with_grouped_query_heads_gives_the_same_logits_on_both_paths(flex_on_cpu, monkeypatch):
    """End to end through the model: key/value heads repeated for their query heads (3 query heads
    per key/value head), q, k, v as strided views of the fused projection."""
    ext = SelfExtend(window=16, group=4)
    torch.manual_seed(0)
    model = Transformer(64, SHAPE, {"name": "rope"}, block=BlockOptions(mlp_hidden=64, n_kv_heads=1),
                        method=EvalMethod(extension=ext)).eval()
    tokens = torch.randint(0, 64, (B, 70), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = model(tokens)
        assert len(flex_on_cpu) == 2
        monkeypatch.setattr(attention, "FLEX_EXTENSION_DEVICES", ())
        want = model(tokens)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: flex compiled for the GPU")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-3), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("name", ["self_extend_uneven", "leaky_rerope", "streaming", "lm_infinite"])
def test_compiled_flex_on_cuda_matches_the_per_pair_reference(name, dtype, tol):
    """The production path as it runs on a GPU: flex compiled, its log-sum-exp from the kernel (torch's
    aux output), at a length past two of its 128-token blocks and not a multiple of them; float32 with
    TF32 allowed by the kernel's dots, bf16 as eval.precision=auto runs it."""
    ext = EXTENSIONS[name]
    scheme = scheme_for("rope", ext, torch.float32).cuda()
    q, k, v = (t.cuda().to(dtype) for t in qkv(300, torch.float32, seed=3))
    with torch.no_grad():
        assert attention.extension_runs_flex(scheme, q, k, v)
        got = attention.extended_attention(ext, scheme, 0, q, k, v, torch.arange(300, device="cuda"))
    want = reference_attention(ext, q.float().cpu(), k.float().cpu(), v.float().cpu(), scheme.inv_freq.cpu())
    torch.testing.assert_close(got.float().cpu(), want.float(), rtol=tol, atol=tol)
