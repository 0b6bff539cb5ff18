"""model.attn_backend=fused runs the fused kernel the scheme's declaration calls for (FoX: a
token-difference bias under softmax; stick-breaking: its weight rule; CoPE and DAPE: their content rule), and the whole model gives the
eager model's logits and gradients. Under Triton's interpreter on CPU (tests/triton_setup.py),
compiled on CUDA."""

import pytest
import torch

from triton_setup import CUDA, DEVICE, NO_TRITON  # first: the interpreter before triton is imported

pytest.importorskip("triton", reason=NO_TRITON)

from relpos_cli import attention  # noqa: E402
from relpos_cli.errors import RelposError  # noqa: E402
from relpos_cli.kernels import available  # noqa: E402
from relpos_cli.model import build_model  # noqa: E402

pytestmark = pytest.mark.skipif(not available(CUDA), reason="TRITON_INTERPRET was set to something else than 1")


def model(pos: dict, backend: str):
    torch.manual_seed(0)
    cfg = {"model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "attn_backend": backend}, "train": {"seq_len": 37},
           "pos": pos}
    built = build_model(cfg, 50)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():  # CoPE's position embeddings start at zero: drawn, so its bias weighs (DAPE's MLP too)
        for p in built.scheme.parameters():
            p.copy_(torch.randn(p.shape, generator=generator))
        built.scheme.constrain_parameters()  # KERPLE's r's back above 0, as after every optimizer step
    return built.to(DEVICE)


@pytest.mark.parametrize("pos", [{"name": "fox"}, {"name": "stickbreaking"},
                                 {"name": "stickbreaking", "attend_current": True}, {"name": "cope", "max_positions": 8},
                                 {"name": "dape", "base": "kerple_log", "mlp_width": 5}])
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


def test_dape_over_an_index_pair_base_is_refused_when_the_model_is_built():
    with pytest.raises(RelposError, match="no fused kernel for pos=dape.*DAPE over a distance base"):
        model({"name": "dape", "base": "fire"}, "fused")


def test_a_scheme_without_a_fused_kernel_is_refused_when_the_model_is_built():
    with pytest.raises(RelposError, match="model.attn_backend=fused has no fused kernel for pos=alibi"):
        model({"name": "alibi"}, "fused")


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
