"""bfloat16 under Triton's interpreter: its tl.dot multiplies bfloat16's raw bit patterns (triton 3.9,
triton-lang/triton#11584), so every fused kernel's output was garbage there, and
eval.precision=bf16 on CPU with model.attn_backend=fused wrote wrong perplexities. The kernels now
refuse bf16 there in one line, and model.attn_backend=fused runs such a call as auto would.

Without CUDA only: on CUDA the kernels compile and bf16 is theirs (tests/triton_setup.py)."""

import pytest
import torch

from triton_setup import CUDA, NO_TRITON  # first: the interpreter before triton is imported

pytest.importorskip("triton", reason=NO_TRITON)

from relpos_cli import attention, kernels  # noqa: E402
from relpos_cli.errors import RelposError  # noqa: E402
from relpos_cli.positions import build_scheme  # noqa: E402
from relpos_cli.positions.base import ModelShape  # noqa: E402

pytestmark = pytest.mark.skipif(CUDA or not kernels.available(False), reason="Triton's interpreter on CPU only")

B, H, T, DH = 2, 2, 32, 16


def qkv(dtype):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, T, DH, generator=g).to(dtype) for _ in range(3)]


@pytest.mark.parametrize("name,extra", [
    ("distance_attention", lambda q: (torch.zeros(H, T),)),
    ("linear_distance_attention", lambda q: (torch.zeros(H),)),
    ("forgetting_attention", lambda q: (torch.zeros(B, H, T),)),
    ("stickbreaking_attention", lambda q: ()),
    ("cope_attention", lambda q: (torch.zeros(B, H, T, 4),)),
    ("shaw_attention", lambda q: (torch.zeros(B, H, T, 5),)),
    ("dape_attention", lambda q: (torch.zeros(H, T), torch.zeros(3, 2 * H), torch.zeros(3), torch.zeros(H, 3),
                                  torch.zeros(H))),
])
def test_each_kernel_refuses_bfloat16_in_one_line(name, extra):
    q, k, v = qkv(torch.bfloat16)
    with pytest.raises(RelposError, match="TRITON_INTERPRET=1") as caught:
        getattr(kernels, name)(q, k, v, *extra(q))
    assert "\n" not in str(caught.value)


def test_the_fused_backend_runs_bfloat16_as_auto_would():
    """ALiBi's attention in bf16 through model.attn_backend=fused, against float64 eager attention
    with the bias -slope_h (i - j) built here: within bf16's rounding (it was ~8e8 off)."""
    scheme = build_scheme({"name": "alibi"}, ModelShape(H * DH, H, 1, T))
    q, k, v = qkv(torch.float32)
    positions = torch.arange(T)
    slopes = torch.tensor([2.0 ** -4, 2.0 ** -8], dtype=torch.float64)  # ALiBi's for 2 heads: 2^(-8 h / H)
    distance = (positions[:, None] - positions[None, :]).double()
    want = attention.eager_attention(q.double(), k.double(), v.double(), -slopes[:, None, None] * distance)
    with torch.no_grad():
        got = attention.attend("fused", scheme, 0, *(t.bfloat16() for t in (q, k, v)), positions, attention.BiasCache())
    assert got.dtype == torch.bfloat16
    assert (got.double() - want).abs().max() < 3e-2


def test_float16_still_runs_the_kernel(monkeypatch):
    """Only bf16 is left out: fp16 tiles the interpreter computes (within fp16's rounding of the
    float64 reference)."""
    calls = []
    monkeypatch.setattr(kernels, "linear_distance_attention",
                        lambda *a, _f=kernels.linear_distance_attention: calls.append(1) or _f(*a))
    scheme = build_scheme({"name": "alibi"}, ModelShape(H * DH, H, 1, T))
    q, k, v = qkv(torch.float32)
    positions = torch.arange(T)
    slopes = torch.tensor([2.0 ** -4, 2.0 ** -8], dtype=torch.float64)
    distance = (positions[:, None] - positions[None, :]).double()
    want = attention.eager_attention(q.double(), k.double(), v.double(), -slopes[:, None, None] * distance)
    with torch.no_grad():
        got = attention.attend("fused", scheme, 0, *(t.half() for t in (q, k, v)), positions, attention.BiasCache())
    assert calls and got.dtype == torch.float16
    assert (got.double() - want).abs().max() < 5e-3
