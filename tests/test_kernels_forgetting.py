"""The fused FoX kernel (relpos_cli/kernels/forgetting.py) against relpos's eager attention with FoX's
bias D_i - D_j: values and the gradients of q, k, v and D, fp32, lengths that are no multiple of the
tile, several heads, grouped-query shapes, queries that are the last Tq of Tk keys.

Without CUDA in Triton's interpreter, on tiny shapes (tests/triton_setup.py).
"""


import pytest
import torch

from triton_setup import CUDA, DEVICE, NO_TRITON, check, qkv, tiles_per_kernel, token_major  # first: the interpreter before triton is imported

pytest.importorskip("triton", reason=NO_TRITON)

from relpos_cli.attention import eager_attention  # noqa: E402
from relpos_cli.errors import RelposError  # noqa: E402
from relpos_cli.kernels import forgetting  # noqa: E402
from relpos_cli.kernels.forgetting import forgetting_attention  # noqa: E402
from relpos_cli.positions import build_scheme  # noqa: E402
from relpos_cli.positions.base import ModelShape  # noqa: E402

pytestmark = pytest.mark.skipif(not CUDA and not forgetting.INTERPRETED,
                                reason="no CUDA and TRITON_INTERPRET was set to something else than 1 before the tests")


def inputs(B=2, H=4, Hk=2, Tq=37, Tk=37, Dh=16, dtype=torch.float32, seed=0, gate_scale=1.0, projected=False):
    """q (B, H, Tq, Dh), k, v (B, Hk, Tk, Dh), D (B, H, Tk) float64 as fox.token_values gives it.
    projected: q, k, v as views of projections (triton_setup.qkv)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = qkv(B, H, Hk, Tq, Tk, Dh, dtype, g, projected=projected)
    log_f = torch.nn.functional.logsigmoid(gate_scale * torch.randn(B, H, Tk, generator=g) + 1.0)
    D = log_f.double().cumsum(-1)
    return [q, k, v, D.to(DEVICE).requires_grad_()]


def reference(q, k, v, D):
    """relpos's eager attention with the bias D_i - D_j (queries the last Tq of the keys), k and v
    repeated per query head as grouped-query attention reads them."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    bias = (D[..., -q.shape[-2]:, None] - D[..., None, :]).to(q.dtype)  # (B, H, Tq, Tk)
    return eager_attention(q, k, v, bias)


@pytest.mark.parametrize("shape", [
    dict(Tq=37, Tk=37, H=4, Hk=4),  # multi-head, T no multiple of 16
    dict(Tq=37, Tk=37, H=4, Hk=2),  # grouped-query attention
    dict(Tq=33, Tk=33, H=3, Hk=1),  # one key head for three query heads; one query past two tiles
    dict(Tq=21, Tk=50, H=2, Hk=2),  # queries are the last 21 of 50 positions
])
def test_values_and_gradients_match_eager_attention(shape):
    """Mutations checked: D_j - D_i (the decay's sign) fails; the keys' dD without its minus fails
    (dD); dropping the queries' share of dD passes, as it should (it sums to 0 up to rounding);
    the causal mask `<=` as `<` fails; the backward's first query tile one tile later fails (dk);
    dk of a group's first query head only (no sum over the group) fails the GQA case."""
    q, k, v, D = inputs(**shape)
    check(forgetting_attention(q, k, v, D), reference(q, k, v, D), [q, k, v, D], atol=2e-5)


@pytest.mark.parametrize("shape", [dict(H=4, Hk=4), dict(H=4, Hk=2), dict(Tq=21, Tk=50, H=2, Hk=2)])
def test_views_of_projections_read_in_place(shape):
    """q, k, v as the model's attention hands them over, views of its projections (triton_setup.qkv):
    the values and gradients of contiguous ones, the output and q, k, v's gradients laid out
    (B, T, H, Dh). Mutations checked, each failing here: either backward kernel reading dO with q's
    strides; dq stored at contiguous (B, H, T, Dh) offsets into its token-major tensor."""
    q, k, v, D = inputs(**shape, projected=True)
    ours = forgetting_attention(q, k, v, D)
    grads = check(ours, reference(q, k, v, D), [q, k, v, D], atol=2e-5)
    assert token_major(ours, *grads[:3])


@pytest.mark.parametrize("blocks", [(16, 32), (32, 16)])
def test_tiles_of_queries_and_keys_of_different_sizes(blocks):
    """Key tiles that straddle the diagonal of two query tiles and the reverse."""
    q, k, v, D = inputs(Tq=45, Tk=70, H=2, Hk=1)
    ours = forgetting_attention(q, k, v, D, block_m=blocks[0], block_n=blocks[1])
    check(ours, reference(q, k, v, D), [q, k, v, D], atol=2e-5)


def test_a_backward_tiled_unlike_the_forward(monkeypatch):
    """On CUDA the backward kernels launch at tiles of their own (forgetting.BACKWARD_TILES)."""
    tiles_per_kernel(monkeypatch, forgetting, [(forgetting.FORWARD_TILES, (32, 16)), (forgetting.BACKWARD_TILES, (16, 32))])
    q, k, v, D = inputs(Tq=45, Tk=70, H=2, Hk=1)
    check(forgetting_attention(q, k, v, D), reference(q, k, v, D), [q, k, v, D], atol=2e-5)


def test_the_model_s_own_gates_through_the_scheme_s_score_bias():
    """D from ForgettingGate.token_values, gradients reaching the gate's weights, against eager
    attention with the scheme's score_bias (what relpos's eager backend adds). A gate's gradient
    sums dD over every later token (the cumulative sum's backward) and then over the batch: float32
    rounding of 80 tokens' dD, so its tolerance scales with its size (error 2.8e-5 at 1.6 seen)."""
    shape = ModelShape(d_model=32, n_heads=2, n_layers=1, train_seq_len=40)
    torch.manual_seed(1)
    scheme = build_scheme({"name": "fox"}, shape).to(DEVICE)
    for gate in scheme.gates:  # gates far from one half, different per token and head
        torch.nn.init.normal_(gate.weight, std=0.5)
        torch.nn.init.normal_(gate.bias, std=2.0)
    x = torch.randn(2, 40, 32, device=DEVICE)
    q, k, v = (torch.randn(2, 2, 40, 16, device=DEVICE, requires_grad=True) for _ in range(3))
    ours = forgetting_attention(q, k, v, scheme.token_values(0, x))
    pos = torch.arange(40, device=DEVICE)
    ref = eager_attention(q, k, v, scheme.score_bias(0, q, k, pos, layer_input=x))
    assert torch.allclose(ours, ref, atol=2e-5, rtol=0)
    upstream = torch.randn_like(ref)
    wrt = [q, k, v, scheme.gates[0].weight, scheme.gates[0].bias]
    grads_ours = torch.autograd.grad((ours * upstream).sum(), wrt)
    grads_ref = torch.autograd.grad((ref * upstream).sum(), wrt)
    for name, a, b in zip(["q", "k", "v", "gate weight", "gate bias"], grads_ours, grads_ref):
        atol = 2e-5 if name in "qkv" else 5e-5 * max(1.0, b.abs().max().item())
        assert torch.allclose(a, b, atol=atol, rtol=0), (name, (a - b).abs().max())


def test_far_along_a_long_sequence_d_keeps_float32_precision():
    """D shifted by -1e5 (a cumulative sum of log gates tens of thousands of tokens long) gives
    the same attention: the kernel subtracts in D's float64 before float32. Mutation checked:
    converting the keys' D to float32 before the subtraction fails (errors of ~1e-2 in the logits;
    the queries' D alone passes, rightly: an error per query shifts its whole row, which softmax ignores)."""
    q, k, v, D = inputs(Tq=40, Tk=40, H=2, Hk=2)
    with torch.no_grad():
        shifted = D - 1e5
        ours = forgetting_attention(q, k, v, shifted)
        assert torch.allclose(ours, reference(q, k, v, D), atol=2e-5, rtol=0)


def test_strong_forgetting_attends_to_the_last_token():
    """Gates near 0 (log f = -50): every query sees its own key only (a brute-force expectation)."""
    q, k, v, _ = inputs(Tq=20, Tk=20, H=2, Hk=2)
    D = torch.full((2, 2, 20), -50.0, dtype=torch.float64, device=DEVICE).cumsum(-1)
    with torch.no_grad():
        assert torch.allclose(forgetting_attention(q, k, v, D), v, atol=1e-6, rtol=0)


def test_bad_shapes_are_one_line():
    q, k, v, D = inputs(Tq=20, Tk=20)
    with pytest.raises(RelposError, match="log_forget_cumsum must be"):
        forgetting_attention(q, k, v, D[..., 1:])
    with pytest.raises(RelposError, match="number of heads dividing"):
        forgetting_attention(q, torch.cat([k, k[:, :1]], 1), torch.cat([v, v[:, :1]], 1), D)


@pytest.mark.skipif(not CUDA, reason="needs CUDA: compiled kernels at training lengths")
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-3), (torch.bfloat16, 3e-2)])
def test_cuda_long_sequences(dtype, atol):
    """T = 1100 (no multiple of any tile), default tiles, against eager attention in float32 on the
    same inputs; bf16 within bf16's rounding."""
    q, k, v, D = inputs(B=2, H=4, Hk=2, Tq=1100, Tk=1100, Dh=64, dtype=dtype, gate_scale=3.0)
    ours = forgetting_attention(q, k, v, D)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    D32 = D.detach().clone().requires_grad_()
    ref = reference(q32, k32, v32, D32)
    assert ours.dtype == dtype and torch.allclose(ours.float(), ref, atol=atol, rtol=0)
    upstream = torch.randn_like(ref)
    grads_ours = torch.autograd.grad((ours.float() * upstream).sum(), [q, k, v, D])
    grads_ref = torch.autograd.grad((ref * upstream).sum(), [q32, k32, v32, D32])
    for a, b in zip(grads_ours, grads_ref):
        scale = b.abs().max().item()
        assert torch.allclose(a.to(b.dtype), b, atol=atol * max(1.0, scale), rtol=0)
