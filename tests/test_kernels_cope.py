"""The fused CoPE kernel (relpos_cli/kernels/cope.py) against relpos's eager attention with the
scheme's content bias (what relpos's eager backend computes for pos=cope): values and the gradients
of q, k, v and the position embeddings (through per_position = q @ pos_emb.T), fp32, lengths that
are no multiple of the tile, several heads, grouped-query shapes, queries that are the last Tq of Tk
keys, tiles of different sizes, and max_positions small enough that the counts saturate (the clamp)
and large enough that they do not.

Without CUDA in Triton's interpreter, on tiny shapes (tests/triton_setup.py).
"""

import pytest
import torch

from triton_setup import (CUDA, DEVICE, NO_TRITON, check_low_precision, cuda_tiles, opposed_qkv, qkv,  # first: the
                          tiles_per_kernel, token_major)  # interpreter before triton is imported

pytest.importorskip("triton", reason=NO_TRITON)

from relpos_cli.attention import eager_attention  # noqa: E402
from relpos_cli.errors import RelposError  # noqa: E402
from relpos_cli.kernels import _row_table, cope  # noqa: E402
from relpos_cli.kernels.cope import cope_attention  # noqa: E402
from relpos_cli.positions import build_scheme  # noqa: E402
from relpos_cli.positions.base import ModelShape  # noqa: E402

pytestmark = pytest.mark.skipif(not CUDA and not cope.INTERPRETED,
                                reason="no CUDA and TRITON_INTERPRET was set to something else than 1 before the tests")


def shape_for(Dh):
    return ModelShape(d_model=4 * Dh, n_heads=4, n_layers=1, train_seq_len=32)


def inputs(B=2, H=4, Hk=2, Tq=37, Tk=37, Dh=16, dtype=torch.float32, seed=0, q_scale=1.5, projected=False):
    """q (B, H, Tq, Dh), k, v (B, Hk, Tk, Dh); q_scale spreads the logits (gates away from one half).
    projected: q, k, v as views of projections (triton_setup.qkv)."""
    g = torch.Generator().manual_seed(seed)
    return qkv(B, H, Hk, Tq, Tk, Dh, dtype, g, q_scale, projected=projected)


def cope_scheme(max_positions, Dh=16, seed=1):
    """The CoPE scheme with random position embeddings (they start at zero: the bias would be
    zero and every position test vacuous)."""
    scheme = build_scheme({"name": "cope", "max_positions": max_positions}, shape_for(Dh)).to(DEVICE)
    with torch.no_grad():
        scheme.pos_emb.copy_(torch.randn(scheme.pos_emb.shape, generator=torch.Generator().manual_seed(seed)))
    return scheme


def positions(q, k):
    k_pos = torch.arange(k.shape[-2], device=q.device)
    return k_pos[-q.shape[-2]:], k_pos


def repeated(q, k, v):
    """k and v repeated per query head, as grouped-query attention reads them."""
    group = q.shape[1] // k.shape[1]
    return k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)


def reference(scheme, q, k, v):
    """relpos's eager attention with CoPE.content_bias; queries the last Tq of the Tk positions."""
    k, v = repeated(q, k, v)
    q_pos, k_pos = positions(q, k)
    return eager_attention(q, k, v, scheme.content_bias(0, q, k, q_pos, k_pos))


def ours(scheme, q, k, v, **blocks):
    return cope_attention(q, k, v, *scheme.kernel_inputs(0, q), **blocks)


def reference_counts(scheme, q, k, v):
    """The scheme's unclamped gate counts sum_{t=j..i} g_it (B, H, Tq, Tk), and which (i, j) are visible."""
    k, _ = repeated(q, k, v)
    q_pos, k_pos = positions(q, k)
    counts = scheme.gates(q, k, q_pos, k_pos).flip(-1).cumsum(-1).flip(-1)
    return counts, k_pos[None, :] <= q_pos[:, None]


def check(scheme, mine, ref, q, k, v, rtol=1e-4):
    """-> our gradients. Values, then the gradients of q, k, v and pos_emb under one random upstream gradient, each
    within rtol of the reference's largest entry."""
    assert mine.shape == ref.shape and mine.dtype == ref.dtype
    assert torch.allclose(mine, ref, atol=rtol * ref.abs().max().item(), rtol=0), (mine - ref).abs().max()
    upstream = torch.randn_like(ref)
    wrt = [q, k, v, scheme.pos_emb]
    grads_mine = torch.autograd.grad((mine * upstream).sum(), wrt)
    grads_ref = torch.autograd.grad((ref * upstream).sum(), wrt)
    for name, a, b in zip(("q", "k", "v", "pos_emb"), grads_mine, grads_ref):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert b.abs().max() > 0, name  # a gradient that is there to compare
        assert torch.allclose(a, b, atol=rtol * b.abs().max().item(), rtol=0), (name, (a - b).abs().max())
    return grads_mine


@pytest.mark.parametrize("max_positions", [4, 64])
@pytest.mark.parametrize("shape", [
    dict(Tq=37, Tk=37, H=4, Hk=4),  # multi-head, T no multiple of 16
    dict(Tq=37, Tk=37, H=4, Hk=2),  # grouped-query attention
    dict(Tq=21, Tk=40, H=3, Hk=1),  # queries are the last 21 of 40 positions, one key head
    dict(Tq=100, Tk=100, H=2, Hk=1),  # the key-tile program's chunks of 4 query tiles, each query tile seen
])
def test_values_and_gradients_match_eager_attention(shape, max_positions):
    """max_positions 4: most counts saturate (the clamp, Z[i, P - 1]); 64: none do at these lengths."""
    q, k, v = inputs(**shape)
    scheme = cope_scheme(max_positions)
    check(scheme, ours(scheme, q, k, v), reference(scheme, q, k, v), q, k, v)


@pytest.mark.parametrize("shape", [dict(H=4, Hk=4), dict(H=4, Hk=2), dict(Tq=21, Tk=40, H=3, Hk=1)])
def test_views_of_projections_read_in_place(shape):
    """q, k, v as the model's attention hands them over, views of its projections (triton_setup.qkv):
    the values and gradients of contiguous ones, the output and q, k, v's gradients laid out
    (B, T, H, Dh). Mutations checked, each failing here: the forward storing the output with q's
    strides; the backward reading dO with q's strides; dq stored at contiguous offsets."""
    q, k, v = inputs(**shape, projected=True)
    scheme = cope_scheme(4)
    mine = ours(scheme, q, k, v)
    grads = check(scheme, mine, reference(scheme, q, k, v), q, k, v)
    assert token_major(mine, *grads[:3])


@pytest.mark.parametrize("blocks", [(16, 32), (32, 16)])
def test_tiles_of_queries_and_keys_of_different_sizes(blocks):
    q, k, v = inputs(B=1, Tq=30, Tk=40, H=2, Hk=1)
    scheme = cope_scheme(8)
    mine = ours(scheme, q, k, v, block_m=blocks[0], block_n=blocks[1])
    check(scheme, mine, reference(scheme, q, k, v), q, k, v)


@pytest.mark.parametrize("forward,rows,keys,Tq,Tk,max_positions", [
    ((32, 16), (16, 16), (32, 32), 30, 40, 8),
    ((16, 16), (16, 16), (32, 16), 100, 100, 4),
])
def test_a_backward_tiled_unlike_the_forward(monkeypatch, forward, rows, keys, Tq, Tk, max_positions):
    """On CUDA each kernel launches at tiles of its own: the forward through the host code CoPE
    shares with Shaw (kernels/_row_table.py); the backward's query-tile program (cope.BACKWARD_Q_TILES)
    walks the key tiles again from the nearest, carrying the gate counts on its own tiling, and its
    key-tile program (BACKWARD_KV_TILES) walks query tiles other than both; the two share the key
    tiles' size, the query-tile program's giving way (first case).

    Second case, max_positions 4 over 100 keys: a query tile's counts all reach 3 within its two nearest
    key tiles of 16, so the forward and the query-tile program walk the farther tiles as saturated (z +
    Z[i, 3], no gates), the latter storing each row's count and sum of d count as they stand there. The
    key-tile program, on query tiles of 32, meets rows 32-47, not all saturated at key tile 1, beside
    rows 48-63 stored that way, and takes the full arithmetic for both. Mutations checked, each failing
    there: the stored count, or sum of d count, of a saturated tile left 0."""
    tiles = [(cope.FORWARD_TILES, forward), (cope.BACKWARD_Q_TILES, rows), (cope.BACKWARD_KV_TILES, keys)]
    for module in (_row_table, cope):
        tiles_per_kernel(monkeypatch, module, tiles)
    q, k, v = inputs(B=1, Tq=Tq, Tk=Tk, H=2, Hk=1)
    scheme = cope_scheme(max_positions)
    check(scheme, ours(scheme, q, k, v), reference(scheme, q, k, v), q, k, v)


def test_the_tiles_cuda_launches(monkeypatch):
    """Each kernel at its narrow tiles on CUDA (bf16, head size up to 64), here in float32: the forward's
    64 x 32, the backward's two programs at theirs, over several tiles of each (Tq 150 of Tk 170)."""
    cuda_tiles(monkeypatch, (_row_table, cope), cope.FORWARD_TILES, cope.BACKWARD_Q_TILES, cope.BACKWARD_KV_TILES)
    q, k, v = inputs(B=1, Tq=150, Tk=170, H=2, Hk=1)
    scheme = cope_scheme(8)
    check(scheme, ours(scheme, q, k, v), reference(scheme, q, k, v), q, k, v)


def test_gates_that_count_slowly():
    """Logits near -3 (q and k along opposite directions), gates of ~0.05: a count reaches max_positions - 1
    = 3 about 64 keys back, so the walks' checks (every 4 key tiles of 16) meet counts on both sides of it,
    some just below. Mutations checked, each failing here: the walks' stop (forward, the backward's
    query-tile program) and the key-tile program's saturated chunks taken at P - 2."""
    q, k, v = opposed_qkv(T=150, Dh=16, logit=-3.0, seed=6)
    scheme = cope_scheme(4)
    check(scheme, ours(scheme, q, k, v), reference(scheme, q, k, v), q, k, v)


def test_the_cases_reach_both_sides_of_the_clamp():
    """The gradient cases are not vacuous: with max_positions 4 each long row has saturated keys
    (the clamp passes nothing, they read Z[i, 3]) and unsaturated ones, with 64 no count reaches 63;
    the gates are spread, not all one half."""
    q, k, v = inputs()
    with torch.no_grad():
        counts, visible = reference_counts(cope_scheme(4), q, k, v)
        saturated = (counts > 3) & visible
        assert saturated[..., -1, :].any(-1).all() and (~saturated & visible)[..., -1, :].any(-1).all()
        assert 0.1 < saturated.sum() / visible.expand_as(saturated).sum() < 0.9
        assert counts[visible.expand_as(counts)].max() < 63
        gates = counts - torch.nn.functional.pad(counts[..., 1:], (0, 1))
        assert gates[visible.expand_as(gates)].std() > 0.2


def test_bad_inputs_are_one_line():
    q, k, v = inputs(Tq=20, Tk=20)
    per_position = q @ cope_scheme(4).pos_emb[0].T
    with pytest.raises(RelposError, match="share B and Dh"):
        cope_attention(q, k[..., :8], v[..., :8], per_position)
    with pytest.raises(RelposError, match="per_position must be"):
        cope_attention(q, k, v, per_position[:, :2])
    with pytest.raises(RelposError, match="per_position must be"):
        cope_attention(q, k, v, per_position[..., :1])
    with pytest.raises(RelposError, match="per_position must be"):
        cope_attention(q, k, v, per_position.double())


@pytest.mark.skipif(not CUDA, reason="needs CUDA: compiled kernels at training lengths")
@pytest.mark.parametrize("max_positions", [16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_long_sequences(dtype, max_positions):
    """T = 1100 (no multiple of any tile), default tiles, against eager attention in float32 on the
    same inputs: within 2e-3 in float32; in bf16 within twice eager attention's own error under bf16
    autocast (check_low_precision). An H100 put bf16 CoPE over 0.03 off when its per-position bias
    was rounded to bf16; kernel_inputs now gives it in float32."""
    q, k, v = inputs(B=2, H=4, Hk=2, Tq=1100, Tk=1100, Dh=64, dtype=dtype, q_scale=1.0)
    scheme = cope_scheme(max_positions, Dh=64)
    mine = ours(scheme, q, k, v)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = reference(scheme, q32, k32, v32)
    if dtype == torch.float32:
        assert torch.allclose(mine, ref, atol=2e-3, rtol=0)
        upstream = torch.randn_like(ref)
        grads_mine = torch.autograd.grad((mine * upstream).sum(), [q, k, v, scheme.pos_emb])
        grads_ref = torch.autograd.grad((ref * upstream).sum(), [q32, k32, v32, scheme.pos_emb])
        for a, b in zip(grads_mine, grads_ref):
            assert torch.allclose(a, b, atol=2e-3 * max(1.0, b.abs().max().item()), rtol=0)
        return
    q16, k16, v16 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with torch.autocast("cuda", dtype=dtype):
        eager = reference(scheme, q16, k16, v16)
    check_low_precision(mine, eager, ref, ([q, k, v, scheme.pos_emb], [q16, k16, v16, scheme.pos_emb],
                                           [q32, k32, v32, scheme.pos_emb]))
