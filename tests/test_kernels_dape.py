"""The fused DAPE kernel (relpos_cli/kernels/dape.py) against relpos's eager attention with
DAPE.content_bias (ALiBi and KERPLE-log bases, randomised MLPs and base parameters), and against
DAPE's formula written out here pair by pair in float64: fp32, lengths that are no multiple of the
tile, several heads (a count that is no power of two too), an MLP width that is no power of two,
tiles of different sizes, grouped-query shapes, queries that are the last Tq of Tk keys; values and
the gradients of q, k, v, the base (its table, or the base scheme's parameters through it) and the
MLP's weights; bad inputs refused.

Without CUDA in Triton's interpreter, on tiny shapes (tests/triton_setup.py).
"""

import math

import pytest
import torch

from triton_setup import CUDA, DEVICE, NO_TRITON, check, check_low_precision, qkv, token_major  # first: the interpreter before triton is imported

pytest.importorskip("triton", reason=NO_TRITON)

from relpos_cli.attention import eager_attention  # noqa: E402
from relpos_cli.errors import RelposError  # noqa: E402
from relpos_cli.kernels import dape  # noqa: E402
from relpos_cli.kernels.dape import dape_attention  # noqa: E402
from relpos_cli.positions import build_scheme  # noqa: E402
from relpos_cli.positions.base import ModelShape  # noqa: E402

pytestmark = pytest.mark.skipif(not CUDA and not dape.INTERPRETED,
                                reason="no CUDA and TRITON_INTERPRET was set to something else than 1 before the tests")


def scheme_of(base, H, width, seed=0):
    """relpos's DAPE scheme, one layer, with its MLP and its base's parameters drawn at random (at
    init the MLP's output is small and KERPLE's parameters sit in a narrow range)."""
    scheme = build_scheme({"name": "dape", "base": base, "mlp_width": width},
                          ModelShape(d_model=16 * H, n_heads=H, n_layers=1, train_seq_len=32)).to(DEVICE)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in scheme.mlps.parameters():
            p.copy_(0.7 * torch.randn(p.shape, generator=g))
        for p in scheme.base.parameters():  # KERPLE's r1, r2 > 0; ALiBi has none
            p.copy_(0.2 + 1.8 * torch.rand(p.shape, generator=g))
    return scheme


def inputs(B=2, H=4, Hk=None, Tq=37, Tk=37, Dh=16, dtype=torch.float32, seed=1, projected=False):
    """q (B, H, Tq, Dh), k, v (B, Hk, Tk, Dh), requiring grad; projected: as views of projections
    (triton_setup.qkv)."""
    g = torch.Generator().manual_seed(seed)
    Hk = Hk or H
    return qkv(B, H, Hk, Tq, Tk, Dh, dtype, g, projected=projected)


def kernel_args(scheme, length):
    """What a caller hands the kernel: the base's table of distances 0..length-1 and the MLP's weights."""
    first, _, last = scheme.mlps[0]
    base = scheme.base.distance_bias(0, torch.arange(length, device=DEVICE))
    return base, first.weight, first.bias, last.weight, last.bias


def reference(scheme, q, k, v):
    """relpos's eager attention with DAPE.content_bias; k, v repeated per query head as grouped-query
    attention reads them; queries the last Tq of the Tk positions."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    k_pos = torch.arange(k.shape[-2], device=q.device)
    q_pos = k_pos[-q.shape[-2]:]
    return eager_attention(q, k, v, scheme.content_bias(0, q, k, q_pos, k_pos))


def formula(q, k, v, base, w1, b1, w2, b2):
    """DAPE written out one (i, j) pair at a time in float64: A_h = q_h,i . k_h,j / sqrt(Dh), B_h =
    base[h, i - j], logits_h = A_h + B_h + (w2 leaky_relu(w1 [A; B] + b1) + b2)_h, softmax over
    j <= i per head. q, k, v (B, H, T, Dh)."""
    q, k, v, base, w1, b1, w2, b2 = (t.cpu().double() for t in (q, k, v, base, w1, b1, w2, b2))
    B, H, T, Dh = q.shape
    out = torch.zeros_like(q)
    for i in range(T):
        logits = torch.zeros(B, H, i + 1, dtype=torch.float64)
        for j in range(i + 1):
            a = (q[:, :, i] * k[:, :, j]).sum(-1) / math.sqrt(Dh)  # (B, H)
            bias = base[:, i - j].expand(B, H)
            pre = torch.cat([a, bias], dim=1) @ w1.T + b1  # (B, width)
            hidden = torch.where(pre >= 0, pre, 0.01 * pre)
            logits[:, :, j] = a + bias + hidden @ w2.T + b2
        weights = torch.softmax(logits, dim=-1)  # (B, H, i + 1)
        out[:, :, i] = torch.einsum("bhj,bhjd->bhd", weights, v[:, :, :i + 1])
    return out


@pytest.mark.parametrize("base,H,width", [("alibi", 4, 5), ("alibi", 2, 8), ("kerple_log", 4, 8), ("kerple_log", 2, 5),
                                         ("kerple_log", 3, 33)])
def test_matches_eager_attention_with_dape_content_bias(base, H, width):
    """T = 37, no multiple of the 16-query tile; gradients of q, k, v, the MLP's weights and
    KERPLE's r1, r2 (through the base table). Mutations checked (each fails this test and the
    others but the one on Tq < Tk): the leaky slope dropped (a ReLU); b1 dropped; the base half of
    W1 read at W1[w, :H]; W2 read transposed; the base bias left out of the logits; the 1/sqrt(Dh)
    dropped; key j = i hidden; the online softmax's rescaling dropped; key heads h % group; the
    log-sum-exp stored without log l; in the backward: the slope dropped, dk unscaled, dA or dB
    without the MLP's share (dB: the KERPLE cases and the formula), dW1[:, H:] from A or stored at
    [:, :H], dW2 from the pre-activation, db1 zero, dS without dO . O. dk, dv added at the query
    head and d base one distance off write out of bounds (the run crashes). The query offset Tk -
    Tq taken as 0 fails the grouped-query test below."""
    scheme = scheme_of(base, H, width)
    q, k, v = inputs(H=H)
    ours = dape_attention(q, k, v, *kernel_args(scheme, 37))
    ref = reference(scheme, q, k, v)
    with torch.no_grad():  # the MLP moves the result well beyond the tolerance: the check reads it
        pos = torch.arange(37, device=DEVICE)
        base_only = eager_attention(q, k, v, scheme.base.distance_bias(0, pos[:, None] - pos))
    assert (ref - base_only).abs().max() > 0.1
    check(ours, ref, [q, k, v, *scheme.parameters()], atol=1e-4)


def test_the_formula_written_out():
    """Three heads (padded to four inside the kernel), width 5, a base table of arbitrary values
    longer than T (its gradient past T - 1 is zero): no relpos scheme involved; values and the
    gradients of all eight inputs against autograd of the float64 formula."""
    g = torch.Generator().manual_seed(3)
    H, width, T = 3, 5, 20
    q, k, v = inputs(B=2, H=H, Tq=T, Tk=T)
    base = torch.randn(H, T + 7, generator=g)
    w1, b1 = 0.7 * torch.randn(width, 2 * H, generator=g), 0.7 * torch.randn(width, generator=g)
    w2, b2 = 0.7 * torch.randn(H, width, generator=g), 0.7 * torch.randn(H, generator=g)
    mlp = [t.to(DEVICE).requires_grad_() for t in (base, w1, b1, w2, b2)]
    ours = dape_attention(q, k, v, *mlp)
    ref = formula(q, k, v, *mlp)
    # the kernel leaves b2 out (the softmax cancels a per-head constant): the definition agrees
    with torch.no_grad():
        assert torch.allclose(ref, formula(q, k, v, *mlp[:-1], 5 * mlp[-1] + 3), atol=1e-12, rtol=0)
    check(ours.cpu().double(), ref, [q, k, v, *mlp], atol=1e-4)


@pytest.mark.parametrize("blocks", [(16, 32), (32, 16)])
def test_tiles_of_queries_and_keys_of_different_sizes(blocks):
    scheme = scheme_of("kerple_log", 2, 5, seed=4)
    q, k, v = inputs(H=2, Tq=40, Tk=40)
    ours = dape_attention(q, k, v, *kernel_args(scheme, 40), block_m=blocks[0], block_n=blocks[1])
    check(ours, reference(scheme, q, k, v), [q, k, v, *scheme.parameters()], atol=1e-4)


def test_grouped_query_heads_and_queries_that_are_the_last_of_the_keys():
    """21 queries, the last of 40 keys, 4 query heads reading 2 key heads; the base table runs past
    Tk (the kernel indexes it by distance, not by its length)."""
    scheme = scheme_of("alibi", 4, 5, seed=5)
    q, k, v = inputs(H=4, Hk=2, Tq=21, Tk=40)
    ours = dape_attention(q, k, v, *kernel_args(scheme, 45))
    check(ours, reference(scheme, q, k, v), [q, k, v, *scheme.parameters()], atol=1e-4)


@pytest.mark.parametrize("shape", [dict(H=4, Hk=4, Tq=37, Tk=37), dict(H=4, Hk=2, Tq=21, Tk=40)])
def test_views_of_projections_read_in_place(shape):
    """q, k, v as the model's attention hands them over, views of its projections (triton_setup.qkv):
    the values and gradients of contiguous ones, the output and q, k, v's gradients laid out
    (B, T, H, Dh). Mutations checked, each failing here: the forward storing the output with q's
    strides; the backward reading dO with q's strides; dq stored at q's strides; dk added at k's."""
    scheme = scheme_of("alibi", 4, 5, seed=5)
    q, k, v = inputs(**shape, projected=True)
    ours = dape_attention(q, k, v, *kernel_args(scheme, 45))
    grads = check(ours, reference(scheme, q, k, v), [q, k, v, *scheme.parameters()], atol=1e-4)
    assert token_major(ours, *grads[:3])


def test_bad_inputs_are_one_line():
    H, width, T = 2, 5, 20
    scheme = scheme_of("alibi", H, width)
    q, k, v = inputs(H=H, Tq=T, Tk=T)
    with torch.no_grad():
        base, w1, b1, w2, b2 = kernel_args(scheme, T)
        bad = [
            ("q, k, v must be", lambda: dape_attention(q[0], k, v, base, w1, b1, w2, b2)),
            ("must share one dtype", lambda: dape_attention(q.double(), k.double(), v.double(), base, w1, b1, w2, b2)),
            ("L >= Tk", lambda: dape_attention(q, k, v, base[:, :T - 1], w1, b1, w2, b2)),
            ("base must be", lambda: dape_attention(q, k, v, base[:1], w1, b1, w2, b2)),
            ("MLP for 2 heads", lambda: dape_attention(q, k, v, base, w1[:, :3], b1, w2, b2)),
            ("MLP for 2 heads", lambda: dape_attention(q, k, v, base, w1, b1[:4], w2, b2)),
            ("MLP for 2 heads", lambda: dape_attention(q, k, v, base, w1, b1, w2.T, b2)),
            ("MLP for 2 heads", lambda: dape_attention(q, k, v, base, w1, b1, w2, b2[:1])),
            ("block_m=24", lambda: dape_attention(q, k, v, base, w1, b1, w2, b2, block_m=24)),
            ("block_n=8", lambda: dape_attention(q, k, v, base, w1, b1, w2, b2, block_n=8)),
        ]
        for match, call in bad:
            with pytest.raises(RelposError, match=match) as caught:
                call()
            assert "\n" not in str(caught.value)


class ClaimsCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: what the guard before the launch reads."""

    @property
    def is_cuda(self):
        return True


def test_a_call_whose_tiles_would_not_fit_a_gpu_is_refused_before_the_launch():
    """DAPE's float32 backward at 12 heads of 64 needs more shared memory than a GPU has
    (tests/test_kernels_compile.py; an H100 failed it at the launch), and so does its float32 forward
    at head size 128 (kernels.DAPE_FOOTPRINT): asked for on CUDA they are refused in one line. Without
    gradients the first runs, on the same tensors: the guard reads grad mode where the call is made
    (autograd runs forward with gradients off, and needs_input_grad ignores no_grad)."""
    wide = scheme_of("kerple_log", 12, 3)
    q12, k12, v12 = inputs(B=1, H=12, Tq=20, Tk=20, Dh=64)
    with pytest.raises(RelposError, match="backward for 12 heads of 64 in float32 needs more shared memory") as caught:
        dape_attention(q12.detach().as_subclass(ClaimsCuda).requires_grad_(), k12, v12, *kernel_args(wide, 20))
    assert "\n" not in str(caught.value)
    with pytest.raises(RelposError, match="forward for 12 heads of 128 in float32"), torch.no_grad():
        q, k, v = inputs(B=1, H=12, Tq=20, Tk=20, Dh=128)
        dape_attention(q.as_subclass(ClaimsCuda), k, v, *kernel_args(wide, 20))
    with torch.no_grad():
        ours = dape_attention(q12.detach().as_subclass(ClaimsCuda).requires_grad_(), k12, v12, *kernel_args(wide, 20))
        assert torch.allclose(ours, reference(wide, q12, k12, v12), atol=1e-5)


@pytest.mark.skipif(not CUDA, reason="needs CUDA: compiled kernels at training lengths")
def test_cuda_long_sequences_in_float32_without_gradients():
    """T = 1100 (no multiple of any tile), 12 heads, Dh = 64, width 32, default tiles, against eager
    attention on the same inputs within 2e-3. The float32 backward needs more shared memory than a GPU
    has (tests/test_kernels_compile.py): asked for, it is refused in one line, not at the launch."""
    scheme = scheme_of("kerple_log", 12, 32)
    q, k, v = inputs(B=2, H=12, Tq=1100, Tk=1100, Dh=64, dtype=torch.float32)
    with torch.no_grad():
        ours = dape_attention(q, k, v, *kernel_args(scheme, 1100))
        ref = reference(scheme, q, k, v)
    assert torch.allclose(ours, ref, atol=2e-3, rtol=0)
    with pytest.raises(RelposError, match="backward for 12 heads of 64 in float32") as caught:
        dape_attention(q, k, v, *kernel_args(scheme, 1100))
    assert "\n" not in str(caught.value)


@pytest.mark.skipif(not CUDA, reason="needs CUDA: compiled kernels at training lengths")
def test_cuda_long_sequences_in_bf16():
    """As above in bf16, gradients included: within twice eager attention's own error under bf16
    autocast (check_low_precision). An H100 put the gradients of the base's parameters (KERPLE's,
    per head) 1-8% off the float32 reference, past a flat 3e-2 of their largest entry."""
    scheme = scheme_of("kerple_log", 12, 32)
    params = list(scheme.parameters())
    q, k, v = inputs(B=2, H=12, Tq=1100, Tk=1100, Dh=64, dtype=torch.bfloat16)
    ours = dape_attention(q, k, v, *kernel_args(scheme, 1100))
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = reference(scheme, q32, k32, v32)
    q16, k16, v16 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        eager = reference(scheme, q16, k16, v16)
    check_low_precision(ours, eager, ref, ([q, k, v, *params], [q16, k16, v16, *params], [q32, k32, v32, *params]))
