"""model.attn_backend=fused under torch.compile (train.compile): every fused kernel is a torch.library
op inside the compiled graph (relpos_cli/kernels/_ops.py), so the model's loss compiles in one graph,
with no break, and gives the eager model's loss and every parameter's gradient. Under Triton's
interpreter on CPU, compiled by AOTAutograd without inductor's code generation (aot_eager: the ops'
fakes and their autograd rule are what is traced; tests/test_kernels_try_compile_interpreted.py
runs inductor once); on CUDA the same."""

import pytest
import torch

from triton_setup import DEVICE, NO_TRITON  # first: the interpreter before triton is imported

pytest.importorskip("triton", reason=NO_TRITON)

from relpos_cli import attention, kernels  # noqa: E402
from test_kernels_wiring import model  # noqa: E402

pytestmark = pytest.mark.skipif(not kernels.available(DEVICE == "cuda"), reason="TRITON_INTERPRET was set to something else than 1")

# FIRE's kernel serves a layer only while the last query is within its learned threshold, a read of the device:
# a graph break per layer under torch.compile, where auto does not pick it (attention.fused_is_faster)
SCHEMES = [{"name": "t5"}, {"name": "alibi"}, {"name": "fox"}, {"name": "stickbreaking"},
           {"name": "cope", "max_positions": 8}, {"name": "shaw", "max_distance": 4},
           {"name": "dape", "base": "kerple_log", "mlp_width": 5}]


@pytest.mark.parametrize("pos", SCHEMES, ids=lambda pos: pos["name"])
def test_the_compiled_loss_is_one_graph_with_the_eager_loss_and_gradients(pos, monkeypatch):
    kernels_run = []
    monkeypatch.setattr(attention, "fused_attention",
                        lambda *a, _f=attention.fused_attention: kernels_run.append(1) or _f(*a))
    tokens = torch.randint(0, 50, (2, 37), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    x, y = tokens[:, :-1], tokens[:, 1:]
    compiled, eager = model(pos, "fused"), model(pos, "fused")
    torch._dynamo.reset()
    explained = torch._dynamo.explain(compiled.loss)(x, y)
    assert [str(b.reason).splitlines()[0] for b in explained.break_reasons] == []
    torch._dynamo.reset()
    kernels_run.clear()
    got = torch.compile(compiled.loss, backend="aot_eager", fullgraph=True)(x, y)
    got.backward()
    assert kernels_run  # traced through fused_attention: the kernel, not a fallback
    want = eager.loss(x, y)
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)


def op_inputs(name: str, dtype: torch.dtype = torch.float32, key_heads: int = 2) -> tuple:
    """(op, its arguments) for kernel `name` at B=1, H=2, T=20, Dh=16 (queries on key_heads key heads)."""
    g = torch.Generator().manual_seed(0)

    def t(*shape, dt=torch.float32):
        return torch.randn(*shape, generator=g).to(DEVICE, dt).requires_grad_()

    B, H, T, Dh = 1, 2, 20, 16
    qkv = (t(B, H, T, Dh, dt=dtype), t(B, key_heads, T, Dh, dt=dtype), t(B, key_heads, T, Dh, dt=dtype))
    rest = {"distance_attention": lambda: (t(H, T),),
            "linear_distance_attention": lambda: (t(H, 1).detach(),),  # the public function's (H, 1) of fixed slopes
            "forgetting_attention": lambda: (t(B, H, T).detach().cumsum(-1).requires_grad_(),),
            "stickbreaking_attention": lambda: (False,),
            "cope_attention": lambda: (t(B, H, T, 8),),
            "shaw_attention": lambda: (t(B, H, T, 9),),
            "dape_attention": lambda: (t(H, T), t(5, 2 * H), t(5), t(H, 5), t(H))}[name]()
    return getattr(torch.ops.relpos, name).default, (*qkv, *rest, None, None, None)


KERNELS = ["distance_attention", "linear_distance_attention", "forgetting_attention", "stickbreaking_attention",
           "cope_attention", "shaw_attention", "dape_attention"]


@pytest.mark.parametrize("name, dtype, key_heads", [(n, torch.float32, 2) for n in KERNELS] + [
    ("distance_attention", torch.float32, 1),  # grouped-query attention
    ("stickbreaking_attention", torch.float16, 2)])  # its float32 copy of the output is a second output then
def test_each_kernel_op_passes_torch_library_opcheck(name, dtype, key_heads):
    """torch.library.opcheck: the op's schema, that its fake gives the real outputs' shapes, dtypes and
    strides, its autograd registration, and its trace by AOTAutograd with dynamic shapes."""
    getattr(kernels, name)  # its module registers the op when imported
    op, args = op_inputs(name, dtype, key_heads)
    results = torch.library.opcheck(op, args)
    assert set(results.values()) == {"SUCCESS"}, results


def test_whether_triton_is_installed_is_not_looked_up_per_call(monkeypatch):
    """Attention asks kernels.available on every fused call, inside torch.compile too, where torch 2.11's
    dynamo refuses to trace importlib's find_spec (a graph break per layer, seen on an H200): the answer
    is found once, on import."""
    import importlib.util

    def refused(*args, **kwargs):
        raise AssertionError("find_spec called per call")

    monkeypatch.setattr(importlib.util, "find_spec", refused)
    assert kernels.available(True) and kernels.available(DEVICE == "cuda")
