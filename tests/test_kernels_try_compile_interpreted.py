"""model.attn_backend=fused with train.compile under Triton's interpreter: dynamo traced into the
interpreter's numpy code and the first step died with a traceback (InterpreterError ... KeyError
torch.uint64); the kernel is now a torch.library op that dynamo never traces into
(relpos_cli/kernels/_ops.py), so the call compiles in one graph, through inductor, with the eager numbers.

Without CUDA only: on CUDA the kernels compile (tests/triton_setup.py)."""

import pytest
import torch

from triton_setup import CUDA, NO_TRITON  # first: the interpreter before triton is imported

pytest.importorskip("triton", reason=NO_TRITON)

from relpos_cli import attention, kernels  # noqa: E402
from relpos_cli.positions import build_scheme  # noqa: E402
from relpos_cli.positions.base import ModelShape  # noqa: E402

pytestmark = pytest.mark.skipif(CUDA or not kernels.available(False), reason="Triton's interpreter on CPU only")


def test_a_compiled_call_of_the_fused_kernel_gives_the_eager_values_and_gradients():
    """T5's table (its bucket embedding drawn at random) under torch.compile, against eager attention
    in float64 with the scheme's bias: values and the gradients of q, k, v and the table."""
    torch._dynamo.reset()
    T = 20
    scheme = build_scheme({"name": "t5"}, ModelShape(32, 2, 1, T))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in scheme.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    q, k, v = (torch.randn(1, 2, T, 16, generator=g).requires_grad_() for _ in range(3))
    positions = torch.arange(T)

    def fused(q, k, v):
        return attention.attend("fused", scheme, 0, q, k, v, positions, attention.BiasCache(), consecutive=True)

    got = torch.compile(fused, fullgraph=True)(q, k, v)
    leaves = [q, k, v, *scheme.parameters()]
    grads = torch.autograd.grad(got.sum(), leaves)
    scheme64 = build_scheme({"name": "t5"}, ModelShape(32, 2, 1, T)).double()
    scheme64.load_state_dict(scheme.state_dict())
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v)] + list(scheme64.parameters())
    want = attention.eager_attention(*leaves64[:3], scheme64.score_bias(0, *leaves64[:2], positions))
    grads64 = torch.autograd.grad(want.sum(), leaves64)
    assert (got.double() - want).abs().max() < 1e-5
    for a, b in zip(grads, grads64):
        assert (a.double() - b).abs().max() < 1e-5 * max(1.0, b.abs().max().item())
