"""The fused Shaw kernel (relpos_cli/kernels/shaw.py) against relpos's eager attention with the
scheme's content bias (what relpos's eager backend computes for pos=shaw): values and the gradients
of q, k, v and the table (through per_distance = q @ table.T / sqrt(Dh)), fp32, lengths that are no
multiple of the tile, several heads, grouped-query shapes, queries that are the last Tq of Tk keys,
tiles of different sizes, and max_distance small enough that most keys are far (they all read the
table's column 0, some whole key tiles of them) and larger than the sequence (no key is far).

Without CUDA in Triton's interpreter, on tiny shapes (tests/triton_setup.py).
"""

import math

import pytest
import torch

from triton_setup import CUDA, DEVICE, NO_TRITON, cuda_tiles, qkv, tiles_per_kernel, token_major  # first: the interpreter before triton is imported

pytest.importorskip("triton", reason=NO_TRITON)

from relpos_cli.attention import eager_attention  # noqa: E402
from relpos_cli.errors import RelposError  # noqa: E402
from relpos_cli.kernels import _row_table, shaw  # noqa: E402
from relpos_cli.kernels.shaw import shaw_attention  # noqa: E402
from relpos_cli.positions import build_scheme  # noqa: E402
from relpos_cli.positions.base import ModelShape  # noqa: E402

pytestmark = pytest.mark.skipif(not CUDA and not shaw.INTERPRETED,
                                reason="no CUDA and TRITON_INTERPRET was set to something else than 1 before the tests")


def shape_for(Dh):
    return ModelShape(d_model=4 * Dh, n_heads=4, n_layers=1, train_seq_len=32)


def inputs(B=2, H=4, Hk=2, Tq=37, Tk=37, Dh=16, dtype=torch.float32, seed=0, q_scale=1.5, projected=False):
    """q (B, H, Tq, Dh), k, v (B, Hk, Tk, Dh); q_scale spreads the logits. projected: q, k, v as views
    of projections (triton_setup.qkv)."""
    g = torch.Generator().manual_seed(seed)
    return qkv(B, H, Hk, Tq, Tk, Dh, dtype, g, q_scale, projected=projected)


def shaw_scheme(max_distance, Dh=16, seed=1):
    """The Shaw scheme with its table drawn N(0, 1) (it starts at 0.02 scale, where the bias would
    barely weigh against q . k and a wrong column could pass)."""
    scheme = build_scheme({"name": "shaw", "max_distance": max_distance}, shape_for(Dh)).to(DEVICE)
    with torch.no_grad():
        scheme.table.copy_(torch.randn(scheme.table.shape, generator=torch.Generator().manual_seed(seed)))
    return scheme


def positions(q, k):
    k_pos = torch.arange(k.shape[-2], device=q.device)
    return k_pos[-q.shape[-2]:], k_pos


def repeated(q, k, v):
    """k and v repeated per query head, as grouped-query attention reads them."""
    group = q.shape[1] // k.shape[1]
    return k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)


def reference(scheme, q, k, v):
    """relpos's eager attention with Shaw.content_bias; queries the last Tq of the Tk positions."""
    k, v = repeated(q, k, v)
    q_pos, k_pos = positions(q, k)
    return eager_attention(q, k, v, scheme.content_bias(0, q, k, q_pos, k_pos))


def per_distance(scheme, q):
    return q @ scheme.table[0].to(q.dtype).T / math.sqrt(q.shape[-1])


def ours(scheme, q, k, v, **blocks):
    return shaw_attention(q, k, v, per_distance(scheme, q), **blocks)


def check(scheme, mine, ref, q, k, v, rtol=1e-4):
    """-> our gradients. Values, then the gradients of q, k, v and the table under one random upstream gradient, each
    within rtol of the reference's largest entry; the table's gradient column by column (each
    within rtol of its own column's largest entry), so that a wrong small column cannot hide
    behind a large one. Columns after 0..K (keys after the query) get exactly no gradient."""
    assert mine.shape == ref.shape and mine.dtype == ref.dtype
    assert torch.allclose(mine, ref, atol=rtol * ref.abs().max().item(), rtol=0), (mine - ref).abs().max()
    upstream = torch.randn_like(ref)
    wrt = [q, k, v, scheme.table]
    grads_mine = torch.autograd.grad((mine * upstream).sum(), wrt)
    grads_ref = torch.autograd.grad((ref * upstream).sum(), wrt)
    for name, a, b in zip(("q", "k", "v", "table"), grads_mine, grads_ref):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert b.abs().max() > 0, name  # a gradient that is there to compare
        assert torch.allclose(a, b, atol=rtol * b.abs().max().item(), rtol=0), (name, (a - b).abs().max())
    K = scheme.max_distance
    a, b = grads_mine[3][0], grads_ref[3][0]  # (2K + 1, Dh)
    for column in range(K + 1):
        scale = b[column].abs().max().item()
        assert torch.allclose(a[column], b[column], atol=rtol * scale, rtol=0), (column, (a - b)[column].abs().max())
    assert (b[K + 1:] == 0).all() and (a[K + 1:] == 0).all()
    return grads_mine


@pytest.mark.parametrize("max_distance", [2, 64])
@pytest.mark.parametrize("shape", [
    dict(Tq=37, Tk=37, H=4, Hk=4),  # multi-head, T no multiple of 16
    dict(Tq=37, Tk=37, H=4, Hk=2),  # grouped-query attention
    dict(Tq=21, Tk=40, H=3, Hk=1),  # queries are the last 21 of 40 positions, one key head
])
def test_values_and_gradients_match_eager_attention(shape, max_distance):
    """max_distance 2: most keys are far (column 0, whole far key tiles in the last query tiles);
    64: none is at these lengths."""
    q, k, v = inputs(**shape)
    scheme = shaw_scheme(max_distance)
    check(scheme, ours(scheme, q, k, v), reference(scheme, q, k, v), q, k, v)


@pytest.mark.parametrize("shape", [dict(H=4, Hk=4), dict(H=4, Hk=2), dict(Tq=21, Tk=40, H=3, Hk=1)])
def test_views_of_projections_read_in_place(shape):
    """q, k, v as the model's attention hands them over, views of its projections (triton_setup.qkv):
    the values and gradients of contiguous ones, the output and q, k, v's gradients laid out
    (B, T, H, Dh). Mutations checked, each failing here: the forward storing the output with q's
    strides; the backward reading dO with q's strides; dq stored at contiguous offsets."""
    q, k, v = inputs(**shape, projected=True)
    scheme = shaw_scheme(4)
    mine = ours(scheme, q, k, v)
    grads = check(scheme, mine, reference(scheme, q, k, v), q, k, v)
    assert token_major(mine, *grads[:3])


@pytest.mark.parametrize("blocks", [(16, 32), (32, 16)])
def test_tiles_of_queries_and_keys_of_different_sizes(blocks):
    """Tq 40 of Tk 70: with max_distance 3 both tilings have query tiles with whole key tiles far,
    key tiles half far, and tiles straddling the diagonal."""
    q, k, v = inputs(B=1, Tq=40, Tk=70, H=2, Hk=1)
    scheme = shaw_scheme(3)
    mine = ours(scheme, q, k, v, block_m=blocks[0], block_n=blocks[1])
    check(scheme, mine, reference(scheme, q, k, v), q, k, v)


def test_a_backward_tiled_unlike_the_forward(monkeypatch):
    """On CUDA each kernel launches at tiles of its own: the forward through the host code Shaw shares
    with CoPE (kernels/_row_table.py), the backward's query-tile and key-tile programs (shaw.BACKWARD_Q_TILES,
    BACKWARD_KV_TILES) through shaw.py's, the key-tile program walking query tiles other than the forward's."""
    tiles = [(shaw.FORWARD_TILES, (32, 16)), (shaw.BACKWARD_Q_TILES, (16, 32)), (shaw.BACKWARD_KV_TILES, (32, 16))]
    for module in (_row_table, shaw):
        tiles_per_kernel(monkeypatch, module, tiles)
    q, k, v = inputs(B=1, Tq=40, Tk=70, H=2, Hk=1)
    scheme = shaw_scheme(3)
    check(scheme, ours(scheme, q, k, v), reference(scheme, q, k, v), q, k, v)


def test_the_tiles_cuda_launches(monkeypatch):
    """Each kernel at its narrow tiles on CUDA (bf16, head size up to 64), here in float32: the forward's
    128 x 64 and the backward's two programs' 64 x 64, with max_distance 16 (the default) over 300
    tokens, so that whole query tiles are far from a key tile and whole key tiles from a query tile."""
    cuda_tiles(monkeypatch, (_row_table, shaw), shaw.FORWARD_TILES, shaw.BACKWARD_Q_TILES, shaw.BACKWARD_KV_TILES)
    q, k, v = inputs(B=1, Tq=300, Tk=300, H=2, Hk=1)
    scheme = shaw_scheme(16)
    check(scheme, ours(scheme, q, k, v), reference(scheme, q, k, v), q, k, v)


def test_single_near_distance():
    """max_distance 1 (P = 3, the least): only the diagonal key is near, every other reads column 0."""
    q, k, v = inputs(B=1, H=2, Hk=1, Tq=20, Tk=20)
    scheme = shaw_scheme(1)
    check(scheme, ours(scheme, q, k, v), reference(scheme, q, k, v), q, k, v)


def test_the_cases_reach_far_and_near_keys():
    """The gradient cases are not vacuous: with max_distance 2 most visible pairs are 2 or more
    apart (column 0) and every row past the first two has near keys too; with 64 none is far; and
    the reference table gradient is far from zero in column 0 and in the nearer columns."""
    q, k, v = inputs()
    q_pos, k_pos = positions(q, k)
    distance = q_pos[:, None] - k_pos[None, :]
    visible = distance >= 0
    far = visible & (distance >= 2)
    assert 0.8 < far.sum() / visible.sum() < 0.95
    assert ((visible & ~far).sum(-1) == 2)[2:].all()
    assert distance.max() < 64
    scheme = shaw_scheme(2)
    ref = reference(scheme, q, k, v)
    (grad,) = torch.autograd.grad((ref * torch.randn_like(ref)).sum(), [scheme.table])
    norms = grad[0].norm(dim=-1)  # per column, 0..2K
    assert (norms[:3] > 0.05 * norms.max()).all() and (norms[3:] == 0).all()


def test_bad_inputs_are_one_line():
    q, k, v = inputs(Tq=20, Tk=20)
    pd = per_distance(shaw_scheme(2), q)  # P = 5
    for call, match in [
        (lambda: shaw_attention(q, k[..., :8], v[..., :8], pd), "share B and Dh"),
        (lambda: shaw_attention(q, k, v, pd[:, :2]), "per_distance must be"),
        (lambda: shaw_attention(q, k, v, pd[..., :4]), "per_distance must be"),  # P even
        (lambda: shaw_attention(q, k, v, pd[..., :1]), "per_distance must be"),  # P < 3
        (lambda: shaw_attention(q, k, v, pd.double()), "per_distance must be"),
        (lambda: shaw_attention(q.double(), k, v, pd), "one dtype"),
        (lambda: shaw_attention(q, k, v, torch.empty(pd.shape, device="meta")), "one device"),
    ]:
        with pytest.raises(RelposError, match=match) as raised:
            call()
        assert "\n" not in str(raised.value)


@pytest.mark.skipif(not CUDA, reason="needs CUDA: compiled kernels at training lengths")
@pytest.mark.parametrize("max_distance", [16, 200])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-3), (torch.bfloat16, 3e-2)])
def test_cuda_long_sequences(dtype, atol, max_distance):
    """T = 1100 (no multiple of any tile), default tiles (whole far key tiles at both distances),
    against eager attention in float32 on the same inputs; bf16 within bf16's rounding."""
    q, k, v = inputs(B=2, H=4, Hk=2, Tq=1100, Tk=1100, Dh=64, dtype=dtype, q_scale=1.0)
    scheme = shaw_scheme(max_distance, Dh=64)
    mine = ours(scheme, q, k, v)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = reference(scheme, q32, k32, v32)
    assert mine.dtype == dtype and torch.allclose(mine.float(), ref, atol=atol, rtol=0)
    upstream = torch.randn_like(ref)
    grads_mine = torch.autograd.grad((mine.float() * upstream).sum(), [q, k, v, scheme.table])
    grads_ref = torch.autograd.grad((ref * upstream).sum(), [q32, k32, v32, scheme.table])
    for a, b in zip(grads_mine, grads_ref):
        scale = b.abs().max().item()
        assert torch.allclose(a.float(), b, atol=atol * max(1.0, scale), rtol=0)
