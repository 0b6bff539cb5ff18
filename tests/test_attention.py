"""Every attention backend computes the same function as the eager reference, for every registered
scheme; caching never serves a stale bias; no backend changes a training loss."""


import pytest
import torch

from relpos_cli import attention
from relpos_cli.errors import RelposError
from relpos_cli.model import Transformer
from relpos_cli.positions import REGISTRY, scheme_names
from relpos_cli.positions.base import BiasInput, ModelShape, PositionScheme

SHAPE = ModelShape(d_model=32, n_heads=2, n_layers=2, train_seq_len=32)
VOCAB = 64


def model_for(scheme, backend: str = "eager") -> Transformer:
    torch.manual_seed(0)
    pos_cfg = {"name": scheme} if isinstance(scheme, str) else {"name": "none"}
    model = Transformer(VOCAB, SHAPE, pos_cfg, mlp_ratio=2, attn_backend=backend)
    if not isinstance(scheme, str):  # an unregistered test scheme instance
        model.scheme = scheme
    for p in model.scheme.parameters():  # non-trivial learned position parameters
        torch.nn.init.normal_(p, std=0.5)
    model.scheme.constrain_parameters()  # as after an optimizer step
    return model


class ToyShaw(PositionScheme):
    """Content bias q_i . a_clip(j - i) (not registered)."""

    bias_input = BiasInput.CONTENT

    def __init__(self, shape: ModelShape, clip: int = 5):
        super().__init__(shape)
        self.clip = clip
        self.rel = torch.nn.Parameter(torch.randn(2 * clip + 1, shape.head_dim))

    def content_bias(self, layer, q, k, q_pos, k_pos):
        column = (k_pos[None, :] - q_pos[:, None]).clamp(-self.clip, self.clip) + self.clip
        per_distance = q @ self.rel.T  # (B, H, Tq, 2 clip + 1)
        return per_distance.gather(-1, column.expand(*per_distance.shape[:2], *column.shape))  # (B, H, Tq, Tk)


class ToyProgressive(PositionScheme):
    """Index-pair bias that is not translation invariant (distance / query position, like FIRE):
    no distance table, so flex runs it in query chunks (not registered)."""

    bias_input = BiasInput.INDEX_PAIR

    def __init__(self, shape: ModelShape):
        super().__init__(shape)
        self.scale = torch.nn.Parameter(torch.randn(shape.n_heads))

    def pair_bias(self, layer, q_pos, k_pos):
        return -self.scale[:, None, None] * (q_pos - k_pos).abs() / (q_pos + 1)


TOYS = {"toy_shaw": ToyShaw, "toy_progressive": ToyProgressive}
SCHEMES = [*scheme_names(), *TOYS]


def scheme_arg(name):
    return TOYS[name](SHAPE) if name in TOYS else name


@pytest.mark.parametrize("name", SCHEMES)
def test_backends_agree_with_eager(name, monkeypatch):
    monkeypatch.setattr(attention, "DENSE_BYTES", 4 * 2 * SHAPE.n_heads * 48 * 10)  # auto runs query blocks
    monkeypatch.setattr(attention, "BLOCK_BYTES", 4 * 2 * SHAPE.n_heads * 48 * 10)  # of 10 queries
    monkeypatch.setattr(attention, "DISTANCE_BLOCK", 10)  # a distance table read in 5 blocks
    tokens = torch.randint(0, VOCAB, (2, 48))
    model = model_for(scheme_arg(name)).eval()
    outputs = {}
    with torch.no_grad():
        for backend in ("eager", "sdpa", "chunked", "flex", "auto"):
            model.attn_backend = backend
            outputs[backend] = model(tokens)
            outputs[backend + " (cached)"] = model(tokens)  # second call: bias served from cache
    for backend, out in outputs.items():
        assert torch.allclose(out, outputs["eager"], atol=1e-5), backend


@pytest.mark.slow  # a flex compile per scheme and length: ~13 s each, about 4 min for the set on 2 cores
@pytest.mark.parametrize("name", [n for n in SCHEMES if n in TOYS or REGISTRY[n].bias_input is not BiasInput.NONE
                                  or REGISTRY[n].overrides("rotate")])
def test_flex_after_a_short_call_matches_eager_at_a_longer_length(name):
    """A call at a length at or below FIRE's threshold (train_seq_len 32) used to make flex remember
    the bias as translation invariant and build every query's bias from the last query's row."""
    model = model_for(scheme_arg(name)).eval()
    short, long = torch.randint(0, VOCAB, (2, 24)), torch.randint(0, VOCAB, (2, 80))
    with torch.no_grad():
        model.attn_backend = "flex"
        model(short)
        flex = model(long)
        model.attn_backend = "eager"
        assert torch.allclose(flex, model(long), atol=1e-5)


@pytest.mark.parametrize("name", SCHEMES)
def test_gradients_match_eager(name, monkeypatch):
    """Training backends on CPU (sdpa, chunked) give the eager gradients, learned biases included."""
    monkeypatch.setattr(attention, "DISTANCE_BLOCK", 7)
    tokens = torch.randint(0, VOCAB, (2, 32))
    grads = {}
    for backend in ("eager", "sdpa", "chunked", "auto"):
        model = model_for(scheme_arg(name), backend)
        model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
        grads[backend] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for backend, g in grads.items():
        assert g.keys() == grads["eager"].keys()
        for n in g:
            assert torch.allclose(g[n], grads["eager"][n], atol=1e-5), (backend, n)


@pytest.mark.parametrize("name", [n for n in scheme_names() if REGISTRY[n].bias_input in (BiasInput.DISTANCE, BiasInput.INDEX_PAIR)])
def test_cached_bias_follows_parameter_updates(name):
    model = model_for(name, "sdpa").eval()
    reference = model_for(name, "eager").eval()
    tokens = torch.randint(0, VOCAB, (2, 40))
    with torch.no_grad():
        model(tokens)  # fills the cache
        for p, q in zip([*model.scheme.parameters(), *model.scheme.buffers()],
                        [*reference.scheme.parameters(), *reference.scheme.buffers()]):
            if p.is_floating_point():
                p.mul_(1.5).add_(0.25)
                q.mul_(1.5).add_(0.25)
        assert torch.allclose(model(tokens), reference(tokens), atol=1e-5)


@pytest.mark.parametrize("name", scheme_names())
def test_seeded_training_losses_identical_across_cpu_backends(name):
    """20 AdamW steps: the loss curve does not depend on the backend."""
    data = torch.randint(0, VOCAB, (20, 4, 33), generator=torch.Generator().manual_seed(1))
    curves = {}
    for backend in ("eager", "sdpa", "auto"):
        model = model_for(name, backend)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for batch in data:
            loss = model.loss(batch[:, :-1], batch[:, 1:])
            opt.zero_grad()
            loss.backward()
            opt.step()
            model.scheme.constrain_parameters()  # as the training loop does
            losses.append(loss.item())
        curves[backend] = torch.tensor(losses)
    for backend, curve in curves.items():
        assert torch.allclose(curve, curves["eager"], atol=1e-5), backend


def test_flex_refuses_to_train_on_cpu():
    model = model_for("alibi", "flex")
    tokens = torch.randint(0, VOCAB, (2, 16))
    with pytest.raises(RelposError, match="cannot train on CPU"):
        model.loss(tokens[:, :-1], tokens[:, 1:])


def test_unknown_backend_is_a_user_error():
    with pytest.raises(RelposError, match="attn_backend"):
        Transformer(VOCAB, SHAPE, {"name": "none"}, attn_backend="fast")


def test_auto_evaluates_without_compiling_or_dense_biases_on_cpu():
    """No-grad on CPU: a distance table is read in place at every length, as is a content bias with a
    far bias (built near the diagonal only) and a token-difference bias (one row of key values per
    block); other biases go chunked once their dense logits would be large; nothing picks flex (a
    compile per length)."""
    long, short = torch.zeros(4, 2, 2048, 16), torch.zeros(2, 2, 64, 16)  # dense logits 128 MiB, 64 KiB
    for name in scheme_names():
        scheme = REGISTRY[name](SHAPE)
        with torch.no_grad():
            picked = {attention.resolve_backend("auto", scheme, q) for q in (long, short)}
        if scheme.bias_input in (BiasInput.DISTANCE, BiasInput.TOKEN_DIFFERENCE) or scheme.has_far_bias:
            assert picked == {"chunked"}, name
        elif scheme.uses_score_bias:
            assert picked == {"chunked", "sdpa"}, name
        else:
            assert picked == {"sdpa"}, name  # fused causal kernel, no mask tensor


def test_distance_table_attention_matches_brute_force():
    """Hankel-view blocks of various sizes (ragged last block included) against explicit logits."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 4, 37, 8) for _ in range(3))
    table = torch.randn(4, 37)  # (H, distances 0..36)
    i, j = torch.arange(37)[:, None], torch.arange(37)[None, :]
    bias = table[:, (i - j).clamp(min=0)].masked_fill(j > i, float("-inf"))  # (H, T, T)
    expected = torch.softmax(q @ k.transpose(-2, -1) / 8**0.5 + bias, dim=-1) @ v
    for block in (1, 5, 36, 37, 512):
        assert torch.allclose(attention.distance_table_attention(q, k, v, table, block), expected, atol=1e-5), block


@pytest.mark.parametrize("batched_bias", [False, True])
def test_query_blocks_match_brute_force(batched_bias):
    """Blocks of queries, each attending to the keys before it (bias read as a view) and to its own
    keys (causal) and merging the two by log-sum-exp without gradients, against explicit logits;
    with gradients, in one masked call."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 4, 37, 8) for _ in range(3))
    bias = torch.randn(3, 4, 37, 37) if batched_bias else torch.randn(4, 37, 37)
    causal = bias.masked_fill(torch.ones(37, 37, dtype=torch.bool).triu(1), float("-inf"))
    expected = torch.softmax(q @ k.transpose(-2, -1) / 8**0.5 + causal, dim=-1) @ v
    for block in (1, 5, 36, 37):
        with torch.no_grad():
            got = attention.chunked_attention(q, k, v, lambda s, e: bias[..., s:e, :e], block)
        assert torch.allclose(got, expected, atol=1e-5), block
    q.requires_grad_(True)
    assert torch.allclose(attention.chunked_attention(q, k, v, lambda s, e: bias[..., s:e, :e], 5), expected, atol=1e-5)


@pytest.mark.parametrize("max_distance", [1, 3, 36, 40])
def test_shaw_far_keys_without_a_bias_tensor_match_brute_force(max_distance, monkeypatch):
    """Shaw evaluated on CPU: keys at its clip distance or further are attended with no bias and
    merged by log-sum-exp (the (block x L) path is never taken), against logits built pair by pair."""
    torch.manual_seed(0)
    scheme = REGISTRY["shaw"](SHAPE, max_distance=max_distance)
    torch.nn.init.normal_(scheme.table, std=0.5)
    q, k, v = (torch.randn(3, SHAPE.n_heads, 37, SHAPE.head_dim) for _ in range(3))
    bias = torch.full((3, SHAPE.n_heads, 37, 37), float("-inf"))
    for i in range(37):
        for j in range(i + 1):
            r = scheme.table[1, max(j - i, -max_distance) + max_distance]  # layer 1's table
            bias[:, :, i, j] = q[:, :, i] @ r / SHAPE.head_dim**0.5
    expected = torch.softmax(q @ k.transpose(-2, -1) / SHAPE.head_dim**0.5 + bias, dim=-1) @ v
    monkeypatch.setattr(attention, "chunked_attention", None)  # the (block x L) path would fail
    for block in (1, 5, 36, 64):
        monkeypatch.setattr(attention, "DISTANCE_BLOCK", block)
        with torch.no_grad():
            got = attention.attend("chunked", scheme, 1, q, k, v, torch.arange(37), attention.BiasCache())
        assert torch.allclose(got, expected, atol=1e-5), block


@pytest.mark.parametrize("gates", ["about a half", "near zero"])
def test_cope_far_keys_without_a_bias_tensor_match_whole_rows(gates, monkeypatch):
    """CoPE evaluated on CPU: keys whose gates up to the query already sum to max_positions - 1 are
    attended with no bias and merged by log-sum-exp, against the bias built over whole rows
    (content_bias, itself checked against x-transformers). Gates of about a half saturate within a
    few keys; gates near zero never do, so every block takes whole rows, split to fit NEAR_BYTES."""
    torch.manual_seed(0)
    scheme = REGISTRY["cope"](SHAPE, max_positions=4)
    torch.nn.init.normal_(scheme.pos_emb)
    q, k, v = (torch.randn(3, SHAPE.n_heads, 61, SHAPE.head_dim) for _ in range(3))
    if gates == "near zero":
        q, k = q.abs() + 1, -k.abs() - 1  # q . k / sqrt(d) <= -4
    causal = torch.ones(61, 61, dtype=torch.bool).triu(1)
    bias = scheme.score_bias(1, q, k, torch.arange(61)).masked_fill(causal, float("-inf"))
    expected = torch.softmax(q @ k.transpose(-2, -1) / SHAPE.head_dim**0.5 + bias, dim=-1) @ v
    found = []
    far_keys = scheme.far_keys
    monkeypatch.setattr(scheme, "far_keys", lambda *args: found.append(far_keys(*args)) or found[-1])
    monkeypatch.setattr(attention, "chunked_attention", None)  # the (block x L) path would fail
    monkeypatch.setattr(attention, "NEAR_BYTES", 4 * 3 * SHAPE.n_heads * 16 * 61)  # 16 queries' whole rows
    blocks = (1, 5, 32, 64)
    for block in blocks:
        monkeypatch.setattr(attention, "DISTANCE_BLOCK", block)
        with torch.no_grad():
            got = attention.attend("chunked", scheme, 1, q, k, v, torch.arange(61), attention.BiasCache())
        assert torch.allclose(got, expected, atol=1e-5), block
    if gates == "about a half":
        assert max(found) > 8  # the far path ran
    else:
        assert max(found) == 0 and len(found) > sum(-(-61 // b) for b in blocks)  # whole rows, blocks split


@pytest.mark.parametrize("q_len,k_len", [(48, 48), (300, 300), (129, 129), (100, 300)])
def test_block_mask_matches_flex_create_block_mask(q_len, k_len):
    """Built from the block grid (no q x k tensor), yet the same mask as torch's reference builder."""
    from torch.nn.attention.flex_attention import create_block_mask

    offset = k_len - q_len
    ours = attention.causal_block_mask(q_len, k_len, torch.device("cpu"))
    ref = create_block_mask(lambda b, h, q, k: q + offset >= k, None, None, q_len, k_len, device="cpu")
    assert torch.equal(ours.to_dense(), ref.to_dense())
    assert torch.equal(ours.full_kv_num_blocks, ref.full_kv_num_blocks)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention backward needs CUDA in torch 2.13")
@pytest.mark.parametrize("name", SCHEMES)
def test_flex_training_on_cuda_matches_eager(name):
    """Flex gives the eager gradients, and a gradient for every parameter eager gives one to: a
    position parameter flex leaves without a gradient fails here (mutation checked on an H100 for
    t5 and kerple_log: distance_score_mod reading table.detach() fails both on the names; unmutated
    both pass)."""
    tokens = torch.randint(0, VOCAB, (2, 128), device="cuda")
    grads = {}
    for backend in ("eager", "flex"):
        model = model_for(scheme_arg(name), backend).cuda()
        model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
        grads[backend] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads["flex"].keys() == grads["eager"].keys()
    for n, g in grads["eager"].items():
        assert torch.allclose(grads["flex"][n], g, atol=1e-4), n


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention backward needs CUDA in torch 2.13")
def test_flex_trains_in_bf16_at_head_size_64_on_cuda():
    """With torch's default tiles this kernel asked for 240 KiB of shared memory on an H100 (227 KiB)
    and failed to compile; flex_kernel_options returning None brings that back (seen on an H100)."""
    from relpos_cli.model import Transformer
    from relpos_cli.positions.base import ModelShape

    model = Transformer(512, ModelShape(768, 12, 1, 1024), {"name": "alibi"}, mlp_ratio=4, attn_backend="flex").cuda()
    tokens = torch.randint(0, 512, (2, 1025), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model.loss(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_compile_cache_lives_under_relpos_cache_unless_the_user_chose_one(monkeypatch, tmp_path):
    from relpos_cli.compile_cache import use_relpos_compile_cache

    monkeypatch.setenv("RELPOS_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert use_relpos_compile_cache() == tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert use_relpos_compile_cache() == tmp_path / "mine"


@pytest.mark.slow
@pytest.mark.parametrize("pos", ["alibi"])  # a cached bias mask (t5, whose mask carries a gradient, failed the same way)
def test_train_compile_gives_the_eager_losses_in_a_fresh_and_a_cached_process(pos, tmp_path, monkeypatch):
    """`relpos train train.compile=true`: the same losses as eager, in a process that compiles into an
    empty $RELPOS_CACHE/inductor and in the next one, which loads from it (torch 2.13's AOTAutograd
    cache once handed that one a backward with corrupted shapes, or segfaulted saving it)."""
    from conftest import TINY, metrics, run_cli

    # an in-process CLI test earlier in the session may have set it in this process, and run_cli passes it on
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    env = {"RELPOS_CACHE": str(tmp_path / "cache")}
    losses = {}
    for name, compiled in [("eager", "false"), ("fresh", "true"), ("cached", "true")]:
        run = tmp_path / name
        run_cli("train", *TINY, f"pos={pos}", "train.log_every=1", f"train.compile={compiled}", f"hydra.run.dir={run}",
                env=env)
        losses[name] = [m["loss"] for m in metrics(run) if "loss" in m]
        if name == "fresh":
            assert any((tmp_path / "cache" / "inductor").iterdir())  # the kernels went to relpos's cache
    assert len(losses["eager"]) == 4
    assert losses["fresh"] == pytest.approx(losses["eager"], rel=1e-4)
    assert losses["cached"] == pytest.approx(losses["eager"], rel=1e-4)


def windowed_brute_force(q, k, v, bias, window):
    """Per (query, key) pair: logit q.k / sqrt(Dh) + bias, kept when 0 <= i - j < window, one
    softmax per query row (transformers masking_utils: causal and kv_idx > q_idx - window)."""
    T, Dh = q.shape[-2], q.shape[-1]
    out = torch.zeros_like(q)
    for i in range(T):
        keys = [j for j in range(T) if 0 <= i - j < window]
        logits = (q[:, :, i, None] @ k[:, :, keys].transpose(-2, -1))[:, :, 0] / Dh**0.5  # (B, H, keys)
        if bias is not None:
            logits = logits + bias[..., i, keys]
        out[:, :, i] = (logits.softmax(-1)[..., None] * v[:, :, keys]).sum(-2)
    return out


@pytest.mark.parametrize("name", ["rope", "alibi", "t5", "fire", "shaw", "dape"])
@pytest.mark.parametrize("window,block_bytes", [(5, None), (16, 4 * 2 * 3 * 24), (40, None)])
def test_sliding_window_matches_brute_force_with_gradients(name, window, block_bytes, monkeypatch):
    """Values and gradients (q, k, v and the scheme's parameters) of the model's sliding window,
    with query blocks smaller than the window (block_bytes) and a window past the length (40). Shaw's
    and DAPE's content biases read one pair alone, so a model may take them in a window too."""
    if block_bytes:
        monkeypatch.setattr(attention, "BLOCK_BYTES", block_bytes)
    T = 37
    scheme = model_for(name).scheme
    attention.check_sliding_window(scheme, window)  # what building the model asks first
    positions = torch.arange(T)
    q, k, v = (torch.randn(2, SHAPE.n_heads, T, SHAPE.head_dim, requires_grad=True) for _ in range(3))

    def grads(fn):
        for t in (q, k, v, *scheme.parameters()):
            t.grad = None
        out = fn()
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return out.detach(), [torch.zeros_like(t) if t.grad is None else t.grad.clone() for t in (q, k, v, *scheme.parameters())]

    def fast():
        qr, kr = scheme.rotate(0, q, k, positions) if scheme.uses_rotation else (q, k)
        return attention.attend("auto", scheme, 0, qr, kr, v, positions, attention.BiasCache(), window=window)

    def slow():
        qr, kr = scheme.rotate(0, q, k, positions) if scheme.uses_rotation else (q, k)
        bias = scheme.score_bias(0, qr, kr, positions, positions) if scheme.uses_score_bias else None
        return windowed_brute_force(qr, kr, v, bias, window)

    fast, slow = grads(fast), grads(slow)
    torch.testing.assert_close(fast[0], slow[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(fast[1], slow[1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["cope", "fox", "stickbreaking"])
def test_sliding_window_refuses_content_biases_and_other_normalisations(name):
    with pytest.raises(RelposError, match=f"model.sliding_window .* pos={name}"):
        attention.check_sliding_window(model_for(name).scheme, 8)
    attention.check_sliding_window(model_for(name).scheme, None)


# ---- FoX's token-difference bias keeps its precision where the weights are ---------------------------

@pytest.mark.parametrize("gate_bias", [0.433, -1.0])  # log forget gates ~ -0.5 and -1.3 per token
def test_fox_in_bf16_is_as_close_to_fp32_on_every_backend_as_eager(gate_bias):
    """Chunked attention measured each block's bias from its first query, D_start - D_j: hundreds
    deep in a 512-query block, where bf16 steps by 2 to 4, so the near keys' logits were off by up
    to a whole unit (30x eager bf16's error at log f = -1.3). Two blocks (600 tokens) are scored."""
    model = model_for("fox")
    with torch.no_grad():
        for gates in model.scheme.gates:
            gates.bias.fill_(gate_bias)
    tokens = torch.randint(0, VOCAB, (1, 600), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model(tokens)  # eager, fp32

        def error(backend):
            model.attn_backend = backend
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return (model(tokens).float() - reference).abs().max().item()

        eager = error("eager")
        for backend in ("chunked", "auto"):
            assert error(backend) <= 2 * eager, backend


@pytest.mark.parametrize("depth", [0.0, -5000.0, -20000.0])
def test_fox_on_flex_keeps_float64_differences_of_deep_cumulative_gates(depth):
    """D_t sums log forget gates (float64 in fox.py): thousands deep into a long window, where float32
    rounds D to ~1e-3. Flex rounded D to float32 before the difference (error 1.3e-3 at D ~ -20000,
    130x its error at 0); a constant added to D changes no true bias D_i - D_j."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 128, 16) for _ in range(3))
    log_forget = torch.nn.functional.logsigmoid(torch.randn(1, 2, 128) * 0.5 - 1.0).double()
    values = depth + log_forget.cumsum(-1)  # (B, H, T)
    truth = attention.eager_attention(q.double(), k.double(), v.double(), values[..., :, None] - values[..., None, :])
    with torch.no_grad():
        for backend in ("flex", "chunked"):
            got = attention.token_difference_attention(backend, values, q, k, v)
            assert (got.double() - truth).abs().max().item() < 5e-5, backend
