"""The fused stick-breaking kernel (relpos_cli/kernels/stickbreaking.py) against relpos's eager
attention with the scheme's content bias and no softmax (what relpos's eager backend computes for
pos=stickbreaking), and against the definition as a product written out here: values and the
gradients of q, k, v, fp32, lengths that are no multiple of the tile, several heads, grouped-query
shapes, queries that are the last Tq of Tk keys, both pos.attend_current.

Without CUDA in Triton's interpreter, on tiny shapes (tests/triton_setup.py).
"""

import math

import pytest
import torch

from triton_setup import (CUDA, NO_TRITON, check, cuda_tiles, opposed_qkv, qkv, tiles_per_kernel,  # first: the
                          token_major)  # interpreter before triton is imported

pytest.importorskip("triton", reason=NO_TRITON)

from relpos_cli.attention import eager_attention  # noqa: E402
from relpos_cli.errors import RelposError  # noqa: E402
from relpos_cli.kernels import stickbreaking  # noqa: E402
from relpos_cli.kernels.stickbreaking import stickbreaking_attention  # noqa: E402
from relpos_cli.positions import build_scheme  # noqa: E402
from relpos_cli.positions.base import ModelShape  # noqa: E402

pytestmark = pytest.mark.skipif(not CUDA and not stickbreaking.INTERPRETED,
                                reason="no CUDA and TRITON_INTERPRET was set to something else than 1 before the tests")
SHAPE = ModelShape(d_model=64, n_heads=4, n_layers=1, train_seq_len=32)


def inputs(B=2, H=4, Hk=2, Tq=37, Tk=37, Dh=16, dtype=torch.float32, seed=0, q_scale=1.5, projected=False):
    """q (B, H, Tq, Dh), k, v (B, Hk, Tk, Dh); q_scale spreads the logits (sticks spent sooner).
    projected: q, k, v as views of projections (triton_setup.qkv)."""
    g = torch.Generator().manual_seed(seed)
    return qkv(B, H, Hk, Tq, Tk, Dh, dtype, g, q_scale, projected=projected)


def reference(q, k, v, attend_current):
    """relpos's eager attention, no softmax, with StickBreaking.content_bias; k and v repeated per
    query head as grouped-query attention reads them; queries the last Tq of the Tk positions."""
    scheme = build_scheme({"name": "stickbreaking", "attend_current": attend_current}, SHAPE)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    k_pos = torch.arange(k.shape[-2], device=q.device)
    q_pos = k_pos[-q.shape[-2]:]
    return eager_attention(q, k, v, scheme.content_bias(0, q, k, q_pos, k_pos), normalise=False)


def product_definition(q, k, v, attend_current):
    """A_ij = sigmoid(z_ij) * prod_{j < l visible} (1 - sigmoid(z_il)), one key at a time in float64
    (Tan et al. 2025, eq. 1), out_i = sum_j A_ij v_j. q (B, H, T, Dh), k, v with H heads."""
    q, k, v = q.double(), k.double(), v.double()
    T = q.shape[-2]
    beta = torch.sigmoid(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]))  # (B, H, T, T)
    out = torch.zeros_like(q)
    for i in range(T):
        left = torch.ones_like(beta[..., 0, 0])  # the stick query i still holds, (B, H)
        for j in range(i if attend_current else i - 1, -1, -1):  # nearest key first
            out[..., i, :] += (beta[..., i, j] * left)[..., None] * v[..., j, :]
            left = left * (1 - beta[..., i, j])
    return out


@pytest.mark.parametrize("attend_current", [False, True])
@pytest.mark.parametrize("shape", [
    dict(Tq=37, Tk=37, H=4, Hk=4),  # multi-head, T no multiple of 16
    dict(Tq=37, Tk=37, H=4, Hk=2),  # grouped-query attention
    dict(Tq=21, Tk=50, H=3, Hk=1),  # queries are the last 21 of 50 positions, one key head
])
def test_values_and_gradients_match_eager_attention(shape, attend_current):
    """Mutations checked: the tiles walked farthest first (the stick carried the wrong way) fails;
    the in-tile suffix sum without reverse (a prefix sum) fails; visible `<` and `<=` swapped fails;
    sum_{m <= j} g taken as sum_{m < j} (without the `- g`) fails (dq, dk); dk without its scale
    fails; the backward's g from A unrounded passes in fp32, as it should (the rounding is bf16's)."""
    q, k, v = inputs(**shape)
    check(stickbreaking_attention(q, k, v, attend_current), reference(q, k, v, attend_current), [q, k, v], atol=2e-5)


@pytest.mark.parametrize("attend_current", [False, True])
def test_the_product_definition_written_out(attend_current):
    q, k, v = inputs(B=1, H=2, Hk=2, Tq=20, Tk=20)
    with torch.no_grad():
        ours = stickbreaking_attention(q, k, v, attend_current)
        assert torch.allclose(ours.double(), product_definition(q, k, v, attend_current), atol=1e-5, rtol=0)
        if not attend_current:
            assert torch.all(ours[:, :, 0] == 0)  # the first query sees no key


@pytest.mark.parametrize("shape", [dict(H=4, Hk=4), dict(H=4, Hk=2), dict(Tq=21, Tk=50, H=3, Hk=1)])
def test_views_of_projections_read_in_place(shape):
    """q, k, v as the model's attention hands them over, views of its projections (triton_setup.qkv):
    the values and gradients of contiguous ones, the output and q, k, v's gradients laid out
    (B, T, H, Dh). Mutations checked, each failing here: the forward storing the output with q's
    strides; the backward reading dO with q's strides; dq stored at contiguous offsets."""
    q, k, v = inputs(**shape, projected=True)
    ours = stickbreaking_attention(q, k, v, False)
    grads = check(ours, reference(q, k, v, False), [q, k, v], atol=2e-5)
    assert token_major(ours, *grads)


@pytest.mark.parametrize("blocks", [(16, 32), (32, 16)])
def test_tiles_of_queries_and_keys_of_different_sizes(blocks):
    q, k, v = inputs(Tq=45, Tk=70, H=2, Hk=1)
    ours = stickbreaking_attention(q, k, v, False, block_m=blocks[0], block_n=blocks[1])
    check(ours, reference(q, k, v, False), [q, k, v], atol=2e-5)


def test_a_backward_tiled_unlike_the_forward(monkeypatch):
    """On CUDA each kernel launches at tiles of its own: the backward's query-tile program
    (stickbreaking.BACKWARD_Q_TILES) walks the key tiles again from the nearest, carrying the stick on
    its own tiling, and its key-tile program (BACKWARD_KV_TILES) walks query tiles other than both;
    the two share the key tiles' size, the query-tile program's (16 here) giving way."""
    tiles_per_kernel(monkeypatch, stickbreaking, [(stickbreaking.FORWARD_TILES, (32, 16)),
                                                  (stickbreaking.BACKWARD_Q_TILES, (16, 16)),
                                                  (stickbreaking.BACKWARD_KV_TILES, (32, 32))])
    q, k, v = inputs(Tq=45, Tk=70, H=2, Hk=1)
    check(stickbreaking_attention(q, k, v), reference(q, k, v, False), [q, k, v], atol=2e-5)


def test_the_tiles_cuda_launches(monkeypatch):
    """Each kernel at its narrow tiles on CUDA (bf16, head size up to 64), here in float32: the forward's
    128 x 64, the backward's two programs' 128 x 32 and 64 x 32, over several tiles of each."""
    cuda_tiles(monkeypatch, (stickbreaking,), stickbreaking.FORWARD_TILES, stickbreaking.BACKWARD_Q_TILES,
               stickbreaking.BACKWARD_KV_TILES)
    q, k, v = inputs(B=1, Tq=150, Tk=170, H=2, Hk=1)
    check(stickbreaking_attention(q, k, v), reference(q, k, v, False), [q, k, v], atol=2e-5)


def test_spent_sticks_give_far_keys_nothing():
    """Logits of ~+-20: a few keys take a query's whole stick, far keys weigh e^-100 and less, and
    their gradients stay finite and match."""
    q, k, v = inputs(Tq=40, Tk=40, H=2, Hk=2, q_scale=6.0)
    check(stickbreaking_attention(q, k, v), reference(q, k, v, False), [q, k, v], atol=5e-5)


@pytest.mark.parametrize("attend_current", [False, True])
def test_sticks_that_last_reach_the_far_keys(attend_current):
    """Logits near -3 (q and k along opposite directions): each key takes 5% of what is left, so 100 keys
    back a query still holds e^-5 of its stick and the far keys weigh ~3e-4, well above the tolerance,
    where logits of +-1.5 leave them e^-40. No walk stops (nothing reaches a spent stick of 110), and
    the key-tile program walks its chunks of 4 query tiles (interpreter tiles of 16: 64 queries)
    whole. Mutation checked, failing here: each chunk's last query tile left out."""
    q, k, v = opposed_qkv(T=100, Dh=16, logit=-3.0, seed=4)
    reference_out = reference(q, k, v, attend_current)
    assert reference_out[0, :, -1].abs().max() > 0.1  # the last query still weighs its keys
    check(stickbreaking_attention(q, k, v, attend_current), reference_out, [q, k, v], atol=2e-5)


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # the rows before 48, which do read the NaN keys
@pytest.mark.parametrize("attend_current", [False, True])
def test_keys_past_every_spent_stick_are_not_read(attend_current, monkeypatch):
    """Every logit ~20: each query's stick is gone (e^-110 and less left) after 6 keys, so a query tile's
    walk stops at its first check (every STOP_CHECK_TILES = 4 key tiles) after its rows have 6 behind them,
    and the farther key tiles add exactly nothing. Keys 0-31 (the first two tiles of 16) hold NaN: the
    queries from 80 on (their tiles stop after four key tiles, keys 32 and up) get the output and dq of
    the same inputs with those keys zeroed, finite; a kernel that read the keys would give NaN there
    (0 * NaN). Then all values and gradients without the NaN against eager attention. Mutations checked,
    each failing here: the walks stopping at no spent stick (forward; the query-tile program, whose dq
    then reads them); the query-tile program storing no spent stick, or no sum of g, for the tiles it
    skips."""
    g = torch.Generator().manual_seed(3)
    Dh, T, clean = 16, 150, 80
    q = (math.sqrt(20 / math.sqrt(Dh)) + 0.05 * torch.randn(1, 2, T, Dh, generator=g)).requires_grad_()
    k = torch.full((1, 2, T, Dh), math.sqrt(20 / math.sqrt(Dh)))
    v = torch.randn(1, 2, T, Dh, generator=g)
    far = torch.arange(T) < 32
    k_nan, v_nan = k.masked_fill(far[:, None], float("nan")), v.masked_fill(far[:, None], float("nan"))
    k_zero, v_zero = k.masked_fill(far[:, None], 0.0), v.masked_fill(far[:, None], 0.0)
    upstream = torch.randn(1, 2, T, Dh, generator=g)
    outs, dqs = [], []
    for keys, values in ((k_nan, v_nan), (k_zero, v_zero)):
        out = stickbreaking_attention(q, keys, values, attend_current, block_m=16, block_n=16)
        outs.append(out[:, :, clean:])
        dqs.append(torch.autograd.grad((out * upstream).sum(), q)[0][:, :, clean:])
    assert torch.isfinite(outs[0]).all() and torch.isfinite(dqs[0]).all()
    assert torch.equal(outs[0], outs[1]) and torch.equal(dqs[0], dqs[1])
    # and every value and gradient where no key is NaN, dq within 8e-5 (3.2e-5 and 5.2e-5 off here, for
    # attend_current false and true; 6.0e-5 and 1.0e-4 when the walks went on past the spent sticks, adding
    # sigmoid(z) times the rounding of sum_{m <= j} g, whose true value is 0). The key-tile program on query
    # tiles of 32, 4 a check: at key tile 1 rows 0-127 are one chunk, rows 16-47 not spent there, rows
    # 80-127 stored where their query-tile programs stopped
    tiles_per_kernel(monkeypatch, stickbreaking, [(stickbreaking.FORWARD_TILES, (16, 16)),
                                                  (stickbreaking.BACKWARD_Q_TILES, (16, 16)),
                                                  (stickbreaking.BACKWARD_KV_TILES, (32, 16))])
    k_zero, v_zero = k_zero.requires_grad_(), v_zero.requires_grad_()
    check(stickbreaking_attention(q, k_zero, v_zero, attend_current),
          reference(q, k_zero, v_zero, attend_current), [q, k_zero, v_zero], atol=8e-5)


def test_bad_inputs_are_one_line():
    q, k, v = inputs(Tq=20, Tk=20)
    with pytest.raises(RelposError, match="must share one dtype"):
        stickbreaking_attention(q.double(), k.double(), v.double())
    with pytest.raises(RelposError, match="attend_current"):
        stickbreaking_attention(q, k, v, attend_current=1)


@pytest.mark.skipif(not CUDA, reason="needs CUDA: compiled kernels at training lengths")
@pytest.mark.parametrize("attend_current", [False, True])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-3), (torch.bfloat16, 3e-2)])
def test_cuda_long_sequences(dtype, atol, attend_current):
    """T = 1100 (no multiple of any tile), default tiles, against eager attention in float32 on the
    same inputs; bf16 within bf16's rounding."""
    q, k, v = inputs(B=2, H=4, Hk=2, Tq=1100, Tk=1100, Dh=64, dtype=dtype, q_scale=1.0)
    ours = stickbreaking_attention(q, k, v, attend_current)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = reference(q32, k32, v32, attend_current)
    assert ours.dtype == dtype and torch.allclose(ours.float(), ref, atol=atol, rtol=0)
    upstream = torch.randn_like(ref)
    grads_ours = torch.autograd.grad((ours.float() * upstream).sum(), [q, k, v])
    grads_ref = torch.autograd.grad((ref * upstream).sum(), [q32, k32, v32])
    for a, b in zip(grads_ours, grads_ref):
        scale = b.abs().max().item()
        assert torch.allclose(a.float(), b, atol=atol * max(1.0, scale), rtol=0)
