"""model.attn_backend=fused runs the fused kernel the scheme's declaration calls for (a bias of the
distance, or FIRE's up to its threshold; FoX: a token-difference bias under softmax; stick-breaking:
its weight rule; Shaw, CoPE and DAPE: their content rule), and the whole model gives the eager
model's logits and gradients; a call the kernel cannot serve runs as auto would. Under Triton's
interpreter on CPU (tests/triton_setup.py), compiled on CUDA."""

import sys
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from triton_setup import CUDA, DEVICE, NO_TRITON  # first: the interpreter before triton is imported

pytest.importorskip("triton", reason=NO_TRITON)

from relpos_cli import attention, kernels  # noqa: E402
from relpos_cli.errors import RelposError  # noqa: E402
from relpos_cli.kernels import available  # noqa: E402
from relpos_cli.model import build_model  # noqa: E402
from relpos_cli.positions import build_scheme, scheme_names  # noqa: E402
from relpos_cli.positions.base import BiasInput, ModelShape, PositionScheme  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

pytestmark = pytest.mark.skipif(not available(CUDA), reason="TRITON_INTERPRET was set to something else than 1")


def model(pos: dict, backend: str):
    torch.manual_seed(0)
    cfg = {"model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "attn_backend": backend}, "train": {"seq_len": 37},
           "pos": pos}
    built = build_model(cfg, 50)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():  # CoPE's position embeddings start at zero: drawn, so its bias weighs (DAPE's MLP too)
        for name, p in built.scheme.named_parameters():
            # FIRE's threshold stays at the training length, so the kernel serves calls up to it
            p.copy_(torch.ones(()) if name.endswith("threshold_multiplier") else torch.randn(p.shape, generator=generator))
        built.scheme.constrain_parameters()  # KERPLE's r's back above 0, as after every optimizer step
    return built.to(DEVICE)


@pytest.mark.parametrize("pos", [{"name": "fox"}, {"name": "stickbreaking"},
                                 {"name": "stickbreaking", "attend_current": True}, {"name": "cope", "max_positions": 8},
                                 {"name": "dape", "base": "kerple_log", "mlp_width": 5}, {"name": "alibi"}, {"name": "t5"},
                                 {"name": "t5", "num_buckets": 8, "max_distance": 12},
                                 {"name": "t5", "boundaries": [0, 1, 3, 9]},
                                 {"name": "kerple_power"}, {"name": "sandwich"}, {"name": "fire"},
                                 {"name": "shaw", "max_distance": 4}])
def test_the_fused_backend_gives_the_eager_models_logits_and_gradients(pos, monkeypatch):
    used = []
    monkeypatch.setattr(attention, "fused_attention", lambda *a, _f=attention.fused_attention: used.append(1) or _f(*a))
    tokens = torch.randint(0, 50, (2, 37), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    fused, eager = model(pos, "fused"), model(pos, "eager")
    assert torch.equal(fused.lm_head.weight, eager.lm_head.weight)  # the same weights, drawn from one seed
    fused_loss = fused.loss(tokens[:, :-1], tokens[:, 1:])
    eager_loss = eager.loss(tokens[:, :-1], tokens[:, 1:])
    fused_loss.backward()
    eager_loss.backward()
    assert used  # the kernel ran, not a fallback
    torch.testing.assert_close(fused_loss, eager_loss, rtol=1e-5, atol=1e-5)
    for (name, got), want in zip(fused.named_parameters(), eager.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5, msg=name)


class ActivationCopies(TorchDispatchMode):
    """Counts the copies (clone, copy_, casts) of tensors with `numel` elements that torch runs, outside
    Triton's interpreter (which copies every tensor a kernel reads into numpy and back)."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.copies = numel, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name.split("::")[-1]
        if name in ("clone", "copy_", "_to_copy") and isinstance(out, torch.Tensor) and out.numel() == self.numel:
            frame = sys._getframe(1)
            while frame is not None and "/triton/" not in frame.f_code.co_filename:
                frame = frame.f_back
            if frame is None:
                self.copies[name] += 1
        return out


@pytest.mark.parametrize("pos,copies", [({"name": "t5"}, 0), ({"name": "fox"}, 0), ({"name": "stickbreaking"}, 0),
                                        ({"name": "shaw", "max_distance": 4}, 1), ({"name": "cope", "max_positions": 8}, 1),
                                        ({"name": "dape", "base": "kerple_log", "mlp_width": 5}, 2)])
def test_a_training_step_copies_no_head_tensor_but_the_atomics_gradients(pos, copies):
    """The kernels read q, k, v where the model's qkv projection leaves them and write the output and
    q, k, v's gradients laid out as the model reads them (relpos_cli/kernels/_launch.kernel_layout,
    token_major): no copy of a (B, H, T, Dh) tensor in a training step, where each layer made 8 (q, k,
    v, the output, dO, dq, dk, dv) and cast 3 in bf16. The kernels that add dk and dv with float32
    atomics (DAPE's) copy those two buffers into their dtype and layout, 2 a layer; Shaw's and CoPE's
    logits of q against their tables (kernel_inputs, q @ table.T) copy q first, 1 a layer. Mutations checked, each
    failing here: kernel_layout copying every input; softmax_outputs' output contiguous (B, H, T, Dh);
    the distance kernel's dq contiguous in float32 and cast."""
    torch.manual_seed(0)
    fused = model(pos, "fused")
    tokens = torch.randint(0, 50, (2, 37), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    fused.loss(tokens[:, :-1], tokens[:, 1:]).backward()  # the first step: any one-time set-up
    counter = ActivationCopies(numel=2 * 36 * 32)  # B x T x d_model: one (B, H, T, Dh) tensor of the model
    with counter:
        fused.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    assert sum(counter.copies.values()) == copies * len(fused.blocks), counter.copies


def test_a_distance_table_made_under_bf16_autocast_reaches_the_kernel_in_float32(monkeypatch):
    """FIRE's MLP gives its table in bf16 under bf16 autocast, as relpos trains on CUDA; the kernel
    takes a float32 table (an H100 refused the bf16 one). q, k, v in float32 here: Triton's interpreter
    runs no bf16 kernel (its bf16 results are garbage on CPU), so the bf16 kernels are tested on CUDA."""
    scheme = build_scheme({"name": "fire"}, ModelShape(32, 2, 1, 37)).to(DEVICE)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 37, 16, generator=g).to(DEVICE).requires_grad_() for _ in range(3))
    positions = torch.arange(37, device=DEVICE)
    tables = []
    monkeypatch.setattr(kernels, "distance_attention",
                        lambda q, k, v, table, _f=kernels.distance_attention: tables.append(table) or _f(q, k, v, table))
    with torch.autocast("cuda" if CUDA else "cpu", dtype=torch.bfloat16):
        made = scheme.pair_bias_as_distances(0, positions)
        got = attention.fused_attention(scheme, 0, q, k, v, positions, None, True)
    assert made.dtype == torch.bfloat16  # what autocast makes of it
    [table] = tables
    assert table.dtype == torch.float32 and torch.equal(table, made.float())
    distance = (positions[:, None] - positions[None, :]).clamp(min=0)  # above the diagonal: masked by eager
    torch.testing.assert_close(got, attention.eager_attention(q, k, v, table[:, distance]), rtol=1e-4, atol=1e-4)


def test_dape_over_an_index_pair_base_is_refused_when_the_model_is_built():
    with pytest.raises(RelposError, match="no fused kernel for pos=dape.*DAPE over a distance base"):
        model({"name": "dape", "base": "fire"}, "fused")


def test_every_registered_scheme_with_a_bias_has_a_fused_kernel():
    shape = ModelShape(32, 2, 1, 37)
    schemes = [build_scheme({"name": n}, shape) for n in scheme_names()]
    assert [s.name for s in schemes if s.uses_score_bias and attention.fused_kernel(s) is None] == []


def test_auto_on_cuda_picks_the_kernels_where_an_h100_measured_them_faster(monkeypatch):
    """docs/results/gpu.md (H100, bf16 autocast): training, every kernel but ALiBi's (flex computes
    its formula as fast); without gradients past SDPA's dense lengths, the schemes flex cannot serve
    and, in 16 bits, the distance tables but ALiBi's formula (docs/results/gpu-t5.md) and FoX's token
    differences (an H200 at 0b1c743).
    Asked with stand-ins for CUDA tensors (resolve_backend reads device, shape, dtype, requires_grad)."""
    shape = ModelShape(32, 2, 1, 37)

    def picks(requires_grad, T, dtype=torch.bfloat16, head_dim=16):
        q = SimpleNamespace(is_cuda=True, shape=(4, 2, T, head_dim), requires_grad=requires_grad, dtype=dtype,
                            element_size=lambda: torch.empty((), dtype=dtype).element_size())
        return {n for n in scheme_names() if attention.resolve_backend("auto", build_scheme({"name": n}, shape), q) == "fused"}

    assert picks(True, 1024) == {"t5", "kerple_log", "kerple_power", "sandwich", "fire", "fox", "stickbreaking", "cope",
                                 "dape", "shaw"}
    assert picks(False, 2048) == {"t5", "kerple_log", "kerple_power", "sandwich", "fox", "stickbreaking", "cope", "dape",
                                  "shaw"}
    assert picks(False, 2048, torch.float16) == picks(False, 2048)
    assert picks(False, 2048, torch.float32) == {"stickbreaking", "cope", "dape", "shaw"}
    assert picks(False, 256) == set()  # SDPA with the dense bias
    assert "dape" not in picks(True, 1024, torch.float32, head_dim=512)  # its backward would not fit a GPU (kernels.serves)
    with torch.no_grad():
        assert picks(True, 2048) == picks(False, 2048)  # no gradient recorded: evaluation
    eager = picks(True, 1024), picks(False, 2048)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    # train.compile: the same kernels, as ops (kernels/_ops.py), but FIRE's, whose table needs a read of the device
    assert (picks(True, 1024), picks(False, 2048)) == (eager[0] - {"fire"}, eager[1])


def test_a_bias_without_a_fused_kernel_is_refused():
    class PairBias(PositionScheme):  # an index-pair bias that declares no table of distances
        name = "pair_bias"
        bias_input = BiasInput.INDEX_PAIR

        def pair_bias(self, layer, q_pos, k_pos):
            return (q_pos - k_pos).float()[None] / (q_pos + 1)

    with pytest.raises(RelposError, match="model.attn_backend=fused has no fused kernel for pos=pair_bias"):
        attention.check_backend("fused", scheme=PairBias(ModelShape(32, 2, 1, 37)))


def test_fire_past_its_threshold_runs_its_own_kernel_without_gradients(monkeypatch):
    """FIRE's rows past its threshold L (37 here) have a normaliser of their own: no table of
    distances. Up to L the distance kernel runs; past it, without gradients, fire_attention computes
    the bias per score off FIRE's grid, within the grid's error of the eager model's logits; training
    past L runs as auto would (no kernel)."""
    calls = Counter()
    for name in ("distance_attention", "fire_attention"):
        monkeypatch.setattr(kernels, name, lambda *a, _n=name, _f=getattr(kernels, name): calls.update([_n]) or _f(*a))
    fused, eager = model({"name": "fire"}, "fused"), model({"name": "fire"}, "eager")
    for length, kernel in ((30, "distance_attention"), (60, "fire_attention")):
        calls.clear()
        tokens = torch.randint(0, 50, (2, length), generator=torch.Generator().manual_seed(3)).to(DEVICE)
        with torch.no_grad():
            torch.testing.assert_close(fused(tokens), eager(tokens), rtol=1e-4, atol=1e-4)
        assert calls == Counter({kernel: 2}), length  # two layers
    calls.clear()
    tokens = torch.randint(0, 50, (2, 61), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    fused_loss, eager_loss = (m.loss(tokens[:, :-1], tokens[:, 1:]) for m in (fused, eager))
    fused_loss.backward()
    eager_loss.backward()
    torch.testing.assert_close(fused_loss, eager_loss, rtol=1e-5, atol=1e-5)
    assert calls == Counter()


def test_positions_that_are_not_consecutive_run_as_auto_would():
    """The kernels read distances off indices: randomized positions (sorted, with gaps) give the
    eager bias at those positions through auto's path."""
    scheme = build_scheme({"name": "t5"}, ModelShape(32, 2, 1, 37)).to(DEVICE)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 20, 16, generator=g).to(DEVICE) for _ in range(3))
    positions = torch.randperm(100, generator=g)[:20].sort().values.to(DEVICE)
    with torch.no_grad():
        want = attention.eager_attention(q, k, v, scheme.score_bias(0, q, k, positions))
        got = attention.attend("fused", scheme, 0, q, k, v, positions, attention.BiasCache())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(CUDA, reason="on CUDA the fused kernels run")
def test_fused_on_cpu_without_the_interpreter_is_refused_before_training(tmp_path):
    """Checked where the device is known, before the run writes more than its failure (it used to
    start training and fail at the first forward pass)."""
    from conftest import TINY, run_cli

    run = tmp_path / "run"
    proc = run_cli("train", *TINY, "pos=fox", "model.attn_backend=fused", "device=cpu", f"hydra.run.dir={run}",
                   check=False, env={"TRITON_INTERPRET": "0"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "model.attn_backend=fused runs Triton kernels on CUDA" in proc.stderr
    assert not (run / "config.yaml").exists() and not (run / "checkpoint.pt").exists()


@pytest.mark.skipif(CUDA, reason="on CUDA the fused kernels run")
def test_a_run_trained_fused_evaluates_where_the_kernels_cannot_run(tmp_path):
    """Trained with the fused kernels (here under the interpreter), evaluated on a CPU without it:
    the same model through auto, with a note, not a refusal."""
    from conftest import TINY, run_cli

    run = tmp_path / "run"
    run_cli("train", *TINY, "pos=shaw", "model.attn_backend=fused", "device=cpu", f"hydra.run.dir={run}",
            env={"TRITON_INTERPRET": "1"})
    proc = run_cli("eval-length", str(run), "eval.lengths=[32]", "eval.tokens=64", env={"TRITON_INTERPRET": "0"})
    assert "trained with model.attn_backend=fused" in proc.stderr + proc.stdout
    assert (run / "eval_length.json").exists()


def test_dape_runs_as_auto_would_where_its_tiles_would_not_fit_a_gpu():
    """DAPE's program holds every head's tiles, past an H100's shared memory in the backward in
    float32, at head size 128 or at 32 heads (kernels.DAPE_FOOTPRINT, checked against compiled
    kernels by tests/test_kernels_compile.py): such a call is not the kernel's; 16 heads of 64 in 16-bit
    are, and without gradients twice as much; every call under the interpreter (a CPU tensor), and
    every other kernel's."""
    def cuda(dtype, heads=12, head_dim=64):  # what serves reads of a CUDA tensor
        return SimpleNamespace(dtype=dtype, is_cuda=True, shape=(1, heads, 8, head_dim),
                               element_size=lambda: torch.empty((), dtype=dtype).element_size())

    assert not kernels.serves("dape_attention", cuda(torch.float32), needs_grad=True)
    assert kernels.serves("dape_attention", cuda(torch.float32), needs_grad=False)
    assert kernels.serves("dape_attention", cuda(torch.bfloat16), needs_grad=True)
    assert kernels.serves("dape_attention", cuda(torch.float16, heads=16), needs_grad=True)
    assert not kernels.serves("dape_attention", cuda(torch.bfloat16, heads=17), needs_grad=True)  # padded to 32
    assert kernels.serves("dape_attention", cuda(torch.bfloat16, heads=17), needs_grad=False)
    assert not kernels.serves("dape_attention", cuda(torch.bfloat16, head_dim=80), needs_grad=True)  # padded to 128
    assert kernels.serves("dape_attention", cuda(torch.bfloat16, head_dim=128), needs_grad=False)
    assert not kernels.serves("dape_attention", cuda(torch.float32, head_dim=128), needs_grad=False)
    assert kernels.serves("shaw_attention", cuda(torch.float32, heads=64, head_dim=256), needs_grad=True)
    assert kernels.serves("dape_attention", torch.zeros(1, 64, 8, 128, dtype=torch.float32), needs_grad=True)


def test_a_call_the_kernel_does_not_serve_runs_as_auto_would(monkeypatch):
    monkeypatch.setattr(kernels, "serves", lambda name, q, needs_grad: False)
    monkeypatch.setattr(kernels, "dape_attention", lambda *a: pytest.fail("the kernel ran"))
    fused, eager = model({"name": "dape"}, "fused"), model({"name": "dape"}, "eager")
    tokens = torch.randint(0, 50, (2, 37), generator=torch.Generator().manual_seed(6)).to(DEVICE)
    torch.testing.assert_close(fused.loss(tokens[:, :-1], tokens[:, 1:]), eager.loss(tokens[:, :-1], tokens[:, 1:]),
                               rtol=1e-5, atol=1e-5)
