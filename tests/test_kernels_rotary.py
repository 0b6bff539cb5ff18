"""The fused rotary kernel (relpos_cli/kernels/rotary.py) against the rotation written out here in
float64 (transformers' rotate_half pairing: out = x * cos + rotate_half(x) * sin on the first Dr
dimensions, the rest passed through): values and x's gradient, whole and partial rotations, halves
and rests that are no power of two, lengths no multiple of the kernel's rows, strided inputs; q and k
rotated in one launch by their own tables; bad inputs refused in one line; and RoPE, xPos and p-RoPE
models whose rotations take the kernel, against the same models on the eager ops.

Without CUDA in Triton's interpreter, on tiny shapes (tests/triton_setup.py).
"""

import pytest
import torch

from triton_setup import CUDA, DEVICE, NO_TRITON  # first: the interpreter before triton is imported

pytest.importorskip("triton", reason=NO_TRITON)

from relpos_cli.errors import RelposError  # noqa: E402
from relpos_cli.kernels import rotary as rotary_module  # noqa: E402
from relpos_cli.kernels.rotary import rotary_embedding, rotary_embedding_pair  # noqa: E402
from relpos_cli.model import build_model  # noqa: E402
from relpos_cli.positions import rope  # noqa: E402

pytestmark = pytest.mark.skipif(not CUDA and not rotary_module.INTERPRETED,
                                reason="no CUDA and TRITON_INTERPRET was set to something else than 1 before the tests")


def reference(x, cos, sin):
    """The rotation in float64, by its definition."""
    x, cos, sin = x.double(), cos.double(), sin.double()
    half, dr = cos.shape[1] // 2, cos.shape[1]
    x1, x2, rest = x[..., :half], x[..., half:dr], x[..., dr:]
    return torch.cat([x1 * cos[:, :half] - x2 * sin[:, :half], x2 * cos[:, half:] + x1 * sin[:, half:], rest], dim=-1)


def tables(T, dr, generator):
    """cos, sin of RoPE-like angles (T, Dr), each half its own draw so a pairing mix-up shows."""
    angles = torch.rand(T, dr, generator=generator) * 6.0
    return angles.cos().to(DEVICE), angles.sin().to(DEVICE)


@pytest.mark.parametrize("B, H, T, Dh, Dr", [
    (2, 3, 37, 16, 16),  # whole rotation, T no multiple of the kernel's 16 rows
    (1, 2, 20, 24, 16),  # partial: 8 dimensions pass through
    (2, 1, 9, 20, 12),  # half 6 and rest 8: neither a power of two... half masked
    (1, 2, 33, 22, 12),  # ...and a rest of 10
])
def test_values_and_gradient_match_the_rotation_written_out(B, H, T, Dh, Dr):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, H, T, Dh, generator=g).to(DEVICE).requires_grad_()
    cos, sin = tables(T, Dr, g)
    out = rotary_embedding(x, cos, sin)
    ref = reference(x, cos, sin)
    assert out.shape == x.shape and out.dtype == x.dtype and out.transpose(1, 2).is_contiguous()  # token-major
    assert torch.allclose(out.double(), ref, atol=1e-6, rtol=0)
    upstream = torch.randn(B, H, T, Dh, generator=g).to(DEVICE)
    (grad,) = torch.autograd.grad((out * upstream).sum(), [x])
    (expected,) = torch.autograd.grad((ref * upstream.double()).sum(), [x])
    assert grad.dtype == x.dtype and torch.allclose(grad, expected, atol=1e-6, rtol=0)
    assert grad.transpose(1, 2).is_contiguous()  # as the projection's gradient is laid out: no copy to reach it


@pytest.mark.parametrize("H, Hk, Dh, Dr", [(3, 3, 16, 16), (4, 2, 24, 16), (3, 1, 22, 12)])
def test_q_and_k_rotate_in_one_launch_each_by_its_own_tables(H, Hk, Dh, Dr):
    """rotary_embedding_pair: q and k (other head counts: grouped-query attention), each by its own cos and
    sin (xPos scales them apart), as two rotations written out; both gradients; one launch each way.
    Mutations checked, each failing here: k read with q's tables; k's programs counted from q's heads."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, H, 37, Dh, generator=g).to(DEVICE).requires_grad_()
    k = torch.randn(2, Hk, 37, Dh, generator=g).to(DEVICE).requires_grad_()
    (q_cos, q_sin), (k_cos, k_sin) = tables(37, Dr, g), tables(37, Dr, g)
    launches = []
    real = rotary_module._rotary
    rotary_module._rotary = type("Counted", (), {"__getitem__": lambda self, grid: launches.append(grid) or real[grid]})()
    try:
        q_out, k_out = rotary_embedding_pair(q, k, q_cos, q_sin, k_cos, k_sin)
        upstream_q = torch.randn(q_out.shape, generator=g).to(DEVICE)
        upstream_k = torch.randn(k_out.shape, generator=g).to(DEVICE)
        grads = torch.autograd.grad((q_out * upstream_q).sum() + (k_out * upstream_k).sum(), [q, k])
    finally:
        rotary_module._rotary = real
    assert len(launches) == 2
    q_ref, k_ref = reference(q, q_cos, q_sin), reference(k, k_cos, k_sin)
    assert torch.allclose(q_out.double(), q_ref, atol=1e-6, rtol=0) and torch.allclose(k_out.double(), k_ref, atol=1e-6, rtol=0)
    expected = torch.autograd.grad((q_ref * upstream_q.double()).sum() + (k_ref * upstream_k.double()).sum(), [q, k])
    for got, want in zip(grads, expected):
        assert torch.allclose(got, want, atol=1e-6, rtol=0)
    # a loss that reads q's rotation alone: k's gradient is zero
    q_out, k_out = rotary_embedding_pair(q, k, q_cos, q_sin, k_cos, k_sin)
    dq, dk = torch.autograd.grad((q_out * upstream_q).sum(), [q, k])
    assert torch.allclose(dq, grads[0], atol=1e-6, rtol=0) and not dk.any()


def test_a_pair_of_other_lengths_is_one_line():
    g = torch.Generator().manual_seed(8)
    q, k = torch.randn(1, 2, 12, 16, generator=g).to(DEVICE), torch.randn(1, 2, 10, 16, generator=g).to(DEVICE)
    with pytest.raises(RelposError, match="rotary_embedding_pair takes q and k of one batch, length") as caught:
        rotary_embedding_pair(q, k, *tables(12, 16, g), *tables(10, 16, g))
    assert "\n" not in str(caught.value)


def test_strided_inputs_read_as_they_lie():
    """q as the model makes it: a (B, T, H, Dh) projection transposed to (B, H, T, Dh), no copy; and an
    x whose last dimension is strided (copied first)."""
    g = torch.Generator().manual_seed(1)
    cos, sin = tables(21, 16, g)
    projected = torch.randn(2, 21, 3, 16, generator=g).to(DEVICE).transpose(1, 2)
    assert not projected.is_contiguous()
    assert torch.allclose(rotary_embedding(projected, cos, sin).double(), reference(projected, cos, sin), atol=1e-6, rtol=0)
    every_other = torch.randn(2, 3, 21, 32, generator=g).to(DEVICE)[..., ::2]
    assert torch.allclose(rotary_embedding(every_other, cos, sin).double(), reference(every_other, cos, sin), atol=1e-6, rtol=0)


def test_float16_rounds_once():
    """16-bit x: computed in float32 and rounded once, so within half a float16 ulp of the exact rotation
    (the eager ops round three times)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 2, 40, 16, generator=g).to(DEVICE, torch.float16)
    cos, sin = (t.half() for t in tables(40, 16, g))
    out = rotary_embedding(x, cos, sin)
    exact = reference(x, cos, sin)
    assert out.dtype == torch.float16
    assert ((out.double() - exact).abs() <= exact.abs() * 2.0**-11 + 2.0**-24).all()


@pytest.mark.parametrize("what, args", [
    ("odd Dr", lambda x, c, s: (x, c[:, :15], s[:, :15])),
    ("Dr past Dh", lambda x, c, s: (x[..., :8], c, s)),
    ("T mismatch", lambda x, c, s: (x, c[:10], s[:10])),
    ("3-D x", lambda x, c, s: (x[0], c, s)),
    ("cos and sin differ", lambda x, c, s: (x, c, s[:, :8])),
])
def test_bad_inputs_are_one_line(what, args):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 2, 12, 16, generator=g).to(DEVICE)
    cos, sin = tables(12, 16, g)
    with pytest.raises(RelposError, match="rotary_embedding takes x") as caught:
        rotary_embedding(*args(x, cos, sin))
    assert "\n" not in str(caught.value), what
    with pytest.raises(RelposError, match="no gradient"):
        rotary_embedding(x, cos.clone().requires_grad_(), sin)


@pytest.mark.parametrize("pos", [{"name": "rope"}, {"name": "xpos"}, {"name": "p_rope"},
                                 {"name": "rope", "rotary_fraction": 0.5}])
def test_a_model_on_the_kernel_gives_the_eager_models_loss_and_gradients(pos, monkeypatch):
    """apply_rotary takes the kernel where rotary_runs_fused says (on CUDA; here forced, under the
    interpreter): the same loss and parameter gradients as the eager ops, and it did run."""
    def model():
        torch.manual_seed(0)
        cfg = {"model": {"d_model": 32, "n_layers": 2, "n_heads": 2}, "train": {"seq_len": 37}, "pos": pos}
        return build_model(cfg, 50).to(DEVICE)

    tokens = torch.randint(0, 50, (2, 37), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    monkeypatch.setattr(rope, "rotary_runs_fused", lambda x, cos, sin: False)
    eager = model()
    eager_loss = eager.loss(tokens[:, :-1], tokens[:, 1:])
    eager_loss.backward()
    calls = []
    monkeypatch.setattr(rope, "rotary_runs_fused", lambda x, cos, sin: calls.append(1) or True)
    fused = model()
    fused_loss = fused.loss(tokens[:, :-1], tokens[:, 1:])
    fused_loss.backward()
    assert calls
    torch.testing.assert_close(fused_loss, eager_loss, rtol=1e-5, atol=1e-5)
    for (name, got), want in zip(fused.named_parameters(), eager.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.skipif(not CUDA, reason="needs CUDA: where apply_rotary picks the kernel by itself")
def test_on_cuda_apply_rotary_runs_the_kernel_in_bf16():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 12, 1100, 64, generator=g).to(DEVICE, torch.bfloat16)
    cos, sin = (t.bfloat16() for t in tables(1100, 64, g))
    assert rope.rotary_runs_fused(x, cos, sin)
    exact = reference(x, cos, sin)
    for out in (rope.apply_rotary(x, cos, sin), *rope.apply_rotary_pair(x, x, cos, sin, cos, sin)):
        assert ((out.double() - exact).abs() <= exact.abs() * 2.0**-8 + 1e-30).all()


def test_a_kernel_that_fails_leaves_the_rotation_to_the_eager_ops_and_says_so_once(monkeypatch):
    """A triton that cannot build or launch the kernel (no C compiler, an unsupported GPU) must not stop
    a RoPE run: apply_rotary warns once and rotates with PyTorch ops from then on."""
    monkeypatch.setattr(rope, "_rotary_failure", [])
    monkeypatch.setattr(rope, "rotary_runs_fused", lambda x, cos, sin: not rope._rotary_failure)
    tries = []

    def broken(x, cos, sin):
        tries.append(1)
        raise RuntimeError("failed to build the launcher: no C compiler")

    monkeypatch.setattr(rope.kernels, "rotary_embedding", broken, raising=False)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 2, 12, 16, generator=g)
    angles = torch.rand(12, 16, generator=g)
    with pytest.warns(RuntimeWarning, match="rotation kernel failed .RuntimeError: failed to build the launcher"):
        first = rope.apply_rotary(x, angles.cos(), angles.sin())
    second = rope.apply_rotary(x, angles.cos(), angles.sin())
    assert tries == [1]
    for out in (first, second):
        assert torch.allclose(out.double(), reference(x, angles.cos(), angles.sin()), atol=1e-6, rtol=0)
    # the pair's kernel too: its first failure warns, and the rotation goes on by the ops
    monkeypatch.setattr(rope, "_rotary_failure", [])
    monkeypatch.setattr(rope.kernels, "rotary_embedding_pair", lambda *args: broken(*args[:3]), raising=False)
    with pytest.warns(RuntimeWarning, match="rotation kernel failed"):
        pair = rope.apply_rotary_pair(x, x, angles.cos(), angles.sin(), angles.cos(), angles.sin())
    assert tries == [1, 1]
    for out in pair:
        assert torch.allclose(out.double(), reference(x, angles.cos(), angles.sin()), atol=1e-6, rtol=0)
