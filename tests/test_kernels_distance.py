"""The fused distance-table kernel (relpos_cli/kernels/distance.py) against relpos's eager attention
with the bias table[h, i - j] built here by indexing, and through real schemes (T5's buckets,
KERPLE-log) against eager attention with their score_bias: values and the gradients of q, k, v, the
table and the schemes' parameters, fp32, lengths that are no multiple of the tile, several heads,
grouped-query shapes, queries that are the last Tq of Tk keys, tables longer than Tk and tables
shorter (their last entry also every farther distance's: far key tiles read no table), tiles of
different sizes; brute-force expectations of which key a table picks; bad tables refused. The same
kernels with a slope per head (linear_distance_attention) against eager attention with slope * (i - j)
built here, through ALiBi's slopes, and a slope so steep each query sees only its own key.

Without CUDA in Triton's interpreter, on tiny shapes (tests/triton_setup.py).
"""

import pytest
import torch

from triton_setup import CUDA, DEVICE, NO_TRITON, qkv, tiles_per_kernel, token_major  # first: the interpreter before triton is imported

pytest.importorskip("triton", reason=NO_TRITON)

from relpos_cli.attention import eager_attention  # noqa: E402
from relpos_cli.errors import RelposError  # noqa: E402
from relpos_cli.kernels import distance  # noqa: E402
from relpos_cli.kernels.distance import distance_attention, linear_distance_attention  # noqa: E402
from relpos_cli.positions import build_scheme  # noqa: E402
from relpos_cli.positions.base import ModelShape  # noqa: E402

pytestmark = pytest.mark.skipif(not CUDA and not distance.INTERPRETED,
                                reason="no CUDA and TRITON_INTERPRET was set to something else than 1 before the tests")


def inputs(B=2, H=4, Hk=2, Tq=37, Tk=37, Dh=16, L=None, dtype=torch.float32, seed=0, projected=False):
    """q (B, H, Tq, Dh), k, v (B, Hk, Tk, Dh), table (H, L) float32 (L = Tk unless given), N(0, 1)
    entries: a bias as large as the scores, so the table moves the attention. projected: q, k, v as
    views of projections (triton_setup.qkv)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = qkv(B, H, Hk, Tq, Tk, Dh, dtype, g, projected=projected)
    table = torch.randn(H, L or Tk, generator=g)
    return [q, k, v, table.to(DEVICE).requires_grad_()]


def reference(q, k, v, table):
    """relpos's eager attention with bias table[h, min(i - j, L - 1)] (queries the last Tq of the
    keys; future keys clamped to distance 0, which the causal mask hides), k and v repeated per
    query head as grouped-query attention reads them."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    Tq, Tk = q.shape[-2], k.shape[-2]
    k_pos = torch.arange(Tk, device=q.device)
    bias = table[:, (k_pos[-Tq:, None] - k_pos[None, :]).clamp(min=0, max=table.shape[1] - 1)]  # (H, Tq, Tk)
    return eager_attention(q, k, v, bias.to(q.dtype))


def close(a, b, rel):
    """a within rel of b's largest magnitude: gradients of different sizes (a table entry sums a
    whole diagonal over the batch) get one relative tolerance."""
    return a.shape == b.shape and a.dtype == b.dtype and (a - b).abs().max() <= rel * max(1.0, b.abs().max())


def check(ours, ref, wrt, names, rel=1e-4):
    assert close(ours, ref, rel), (ours - ref).abs().max()
    upstream = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5)).to(ref.device)
    grads_ours = torch.autograd.grad((ours * upstream).sum(), wrt)
    grads_ref = torch.autograd.grad((ref * upstream).sum(), wrt)
    for name, a, b in zip(names, grads_ours, grads_ref):
        assert close(a, b, rel), (name, (a - b).abs().max(), b.abs().max())
    return grads_ours


@pytest.mark.parametrize("shape", [
    dict(Tq=37, Tk=37, H=4, Hk=4),  # multi-head, T no multiple of 16
    dict(Tq=37, Tk=37, H=4, Hk=2),  # grouped-query attention
    dict(Tq=33, Tk=33, H=3, Hk=1),  # one key head for three query heads; one query past two tiles
    dict(Tq=21, Tk=50, H=2, Hk=2),  # queries are the last 21 of 50 positions
    dict(Tq=37, Tk=37, H=2, Hk=1, L=52),  # a table longer than Tk: distances past 36 get no gradient
    dict(Tq=70, Tk=70, H=2, Hk=1, L=3),  # a short table: far tiles in every walk at 16 x 16, one pair short of far on their edges
    dict(Tq=45, Tk=70, H=3, Hk=3, L=20),  # a short table, queries the last of the keys
    dict(Tq=37, Tk=37, H=2, Hk=2, L=1),  # one entry: every pair far, a constant bias
    dict(Tq=20, Tk=50, H=2, Hk=1),  # offset 30: a key tile ends one key past a query tile's first query
    dict(Tq=20, Tk=50, H=2, Hk=1, L=7),  # the same, far tiles too
])
def test_values_and_gradients_match_eager_attention(shape):
    """Mutations checked, each failing here: the diagonal sums added one distance off; the skew's
    roll one row off; one wrap fewer; the tile's base distance one off; each wrap's sum taking the
    next wrap's entries; the table read one entry off in the forward only, the dk/dv backward only,
    the dq backward only; the causal mask `>=` as `>`; the table's gradient added at the key head's
    row and dk of a group's first query head only (both fail the GQA cases). Dropping the test for
    rows without a pair of a wrap passes, as it should (those sums are 0)."""
    q, k, v, table = inputs(**shape)
    check(distance_attention(q, k, v, table), reference(q, k, v, table), [q, k, v, table], "qkv table")


def test_a_bias_past_exp_s_range_leaves_no_nan_from_padded_queries():
    """Biases of 100 and more, finite logits whose exp overflows float32 unless the log-sum-exp is
    subtracted first: the padded rows of the last query tile (37 is no multiple of the tile) hold no
    log-sum-exp, so the backward must mask them rather than exponentiate their logits; with a short
    table, in the far tiles too. Mutations checked: walking the last, partial query tile of the dk/dv
    backward without its mask puts nan in dk and dv; the dq kernel's far tiles' or near tiles' dS summed
    for the table without masking the padded rows puts nan in the table's gradient."""
    for L in (None, 5):
        q, k, v, table = inputs(Tq=37, Tk=37, H=2, Hk=1, L=L)
        with torch.no_grad():
            table += 100.0
        check(distance_attention(q, k, v, table), reference(q, k, v, table), [q, k, v, table], "qkv table")


@pytest.mark.parametrize("shape", [dict(H=4, Hk=4), dict(H=4, Hk=2), dict(Tq=21, Tk=50, H=2, Hk=2)])
def test_views_of_projections_read_in_place(shape):
    """q, k, v as the model's attention hands them over, views of its projections with rows longer
    than a head's (triton_setup.qkv): read through their strides, with the values and gradients of
    contiguous ones; the output and q, k, v's gradients laid out (B, T, H, Dh), what the model reads
    them as. Mutations checked, each failing here: the key-tile backward reading dO with q's strides;
    dq, and dk and dv, stored at contiguous (B, H, T, Dh) offsets into their token-major tensors."""
    q, k, v, table = inputs(**shape, projected=True)
    assert not q.is_contiguous() and q.stride(2) != shape["H"] * q.shape[-1]
    ours = distance_attention(q, k, v, table)
    grads = check(ours, reference(q, k, v, table), [q, k, v, table], "qkv table")
    assert token_major(ours, *grads[:3])


@pytest.mark.parametrize("blocks", [(16, 32), (32, 16)])
def test_tiles_of_queries_and_keys_of_different_sizes(blocks):
    """Key tiles that straddle the diagonal of two query tiles and the reverse: the diagonal
    reduction's roll wraps 3 times at 16 x 32, twice at 32 x 16. Mutation checked: counting the
    wraps in key tiles, (M + N - 2) // N + 1, fails 16 x 32 (2 wraps, a diagonal left out) and
    passes 32 x 16, rightly (3 wraps, the last empty)."""
    for L in (75, 9):  # a table longer than Tk, and one that ends early (far tiles)
        q, k, v, table = inputs(Tq=45, Tk=70, H=2, Hk=1, L=L)
        ours = distance_attention(q, k, v, table, block_m=blocks[0], block_n=blocks[1])
        check(ours, reference(q, k, v, table), [q, k, v, table], "qkv table")


def test_backward_tiles_that_differ_from_the_forward_s(monkeypatch):
    """On CUDA the three kernels launch at tiles of their own (distance.FORWARD_TILES, ...): the
    backward recomputes the probabilities from the forward's log-sum-exp on a tiling of its own.
    Mutations checked, each failing here: either backward kernel's grid counting its tiles along the
    other side (too few programs to cover the keys, the queries)."""
    tiles_per_kernel(monkeypatch, distance, [(distance.FORWARD_TILES, (16, 16)), (distance.BACKWARD_KV_TILES, (32, 16)),
                                             (distance.BACKWARD_Q_TILES, (16, 32))])
    for L in (75, 9):
        q, k, v, table = inputs(Tq=45, Tk=70, H=2, Hk=1, L=L)
        check(distance_attention(q, k, v, table), reference(q, k, v, table), [q, k, v, table], "qkv table")


def test_a_table_that_ends_early_is_the_whole_table_with_its_last_entry_repeated():
    """table[:, :L] against the (H, Tk) table whose entries L - 1.. all equal table[:, L - 1]: the
    same output, and the short table's last entry gets the gradient of all the farther ones, the
    sum of the long table's gradients there (brute force on the kernel's own long-table path)."""
    q, k, v, table = inputs(Tq=70, Tk=70, H=2, Hk=2, L=70, seed=4)
    short = table.detach()[:, :12].clone().requires_grad_()
    long = torch.cat([short.detach(), short.detach()[:, -1:].expand(2, 58)], 1).requires_grad_()
    upstream = torch.randn(2, 2, 70, 16, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    out_short, out_long = distance_attention(q, k, v, short), distance_attention(q, k, v, long)
    assert torch.allclose(out_short, out_long, atol=1e-5, rtol=0)
    (g_short,) = torch.autograd.grad((out_short * upstream).sum(), [short])
    (g_long,) = torch.autograd.grad((out_long * upstream).sum(), [long])
    assert torch.allclose(g_short[:, :11], g_long[:, :11], atol=1e-4, rtol=0)
    assert torch.allclose(g_short[:, 11], g_long[:, 11:].sum(1), atol=1e-4, rtol=0)


def test_a_fixed_table_gets_no_gradient_and_q_k_v_theirs():
    """ALiBi's and Sandwich's tables have no parameters behind them: the backward skips the table's
    diagonal sums and atomics (TABLE_GRAD), and q, k, v's gradients are the reference's. Mutation
    checked: the flag inverted fails every test here of a table with a gradient."""
    q, k, v, table = inputs(Tq=45, Tk=70, H=2, Hk=1, L=75)
    fixed = table.detach()
    ours = distance_attention(q, k, v, fixed)
    check(ours, reference(q, k, v, fixed), [q, k, v], "qkv")
    assert ours.grad_fn is not None and not fixed.requires_grad


def test_the_table_s_gradient_reaches_every_distance_and_no_further():
    """Every distance 0..Tk-1 occurs (distance d in Tk - d pairs per batch element), so each gets a
    nonzero gradient; distances past Tk - 1 occur nowhere and get exactly 0. Against the reference's
    gradient too, so a kernel that added the sums to the wrong distances fails here as well."""
    q, k, v, table = inputs(Tq=37, Tk=37, H=2, Hk=2, L=48)
    upstream = torch.randn(2, 2, 37, 16, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    (grad,) = torch.autograd.grad((distance_attention(q, k, v, table) * upstream).sum(), [table])
    (expected,) = torch.autograd.grad((reference(q, k, v, table) * upstream).sum(), [table])
    assert (grad[:, :37].abs() > 1e-6).all(), grad
    assert (grad[:, 37:] == 0).all()
    assert close(grad, expected, 1e-4)


@pytest.mark.parametrize("picked", [0, 1, 5])
def test_a_table_that_picks_one_distance_attends_to_that_key(picked):
    """table[h, picked] = 0, every other distance -1e4: query i >= picked sees key i - picked only
    (queries before it have no key that far back, and are left out): a brute-force expectation
    that catches a forward reading the table one entry off."""
    q, k, v, _ = inputs(Tq=40, Tk=40, H=2, Hk=2)
    table = torch.full((2, 40), -1e4, device=DEVICE)
    table[:, picked] = 0.0
    with torch.no_grad():
        out = distance_attention(q, k, v, table)
    assert torch.allclose(out[:, :, picked:], v[:, :, :40 - picked], atol=1e-6, rtol=0)


def scheme_inputs(name, H=2, T=40, seed=1):
    """relpos's scheme `name` for head dim 16, its parameters drawn at random (T5 starts N(0, 1);
    KERPLE's r1, r2 in [0.05, 2], kept positive by constrain_parameters), and q, k, v (2, H, T, 16)."""
    scheme = build_scheme({"name": name}, ModelShape(d_model=16 * H, n_heads=H, n_layers=1, train_seq_len=T)).to(DEVICE)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in scheme.parameters():
            drawn = torch.randn(p.shape, generator=g) if name == "t5" else 0.05 + 1.95 * torch.rand(p.shape, generator=g)
            p.copy_(drawn)
    scheme.constrain_parameters()
    q, k, v = (torch.randn(2, H, T, 16, generator=g).to(DEVICE).requires_grad_() for _ in range(3))
    return scheme, q, k, v


@pytest.mark.parametrize("name", ["t5", "kerple_log"])
def test_a_scheme_s_table_through_its_distance_bias(name):
    """The table from the scheme's distance_bias, gradients reaching its parameters (T5's bucket
    embedding: distances from 16 on share log-spaced buckets, so a bucket sums several diagonals;
    KERPLE's r1, r2), against eager attention with the scheme's score_bias (what relpos's eager
    backend adds)."""
    scheme, q, k, v = scheme_inputs(name)
    pos = torch.arange(40, device=DEVICE)
    ours = distance_attention(q, k, v, scheme.distance_bias(0, pos))
    ref = eager_attention(q, k, v, scheme.score_bias(0, q, k, pos))
    params = dict(scheme.named_parameters())
    grads = check(ours, ref, [q, k, v, *params.values()], ["q", "k", "v", *params])
    assert all((g.abs() > 1e-6).float().mean() > 0.5 for g in grads[3:])  # the parameters' gradients are not vacuous


def test_bad_tables_are_one_line():
    q, k, v, table = inputs(Tq=20, Tk=20, H=4, Hk=2)
    bad = {"wrong heads": table[:3], "empty": table[:, :0], "float64": table.double(),
           "bfloat16": table.bfloat16(), "3-D": table[None], "1-D": table[0]}
    for what, wrong in bad.items():
        with pytest.raises(RelposError, match=r"table must be \(H, L\)") as caught:
            distance_attention(q, k, v, wrong)
        assert "\n" not in str(caught.value), what
    with pytest.raises(RelposError, match="number of heads dividing"):
        distance_attention(q, torch.cat([k, k[:, :1]], 1), torch.cat([v, v[:, :1]], 1), table)


def linear_reference(q, k, v, slopes):
    """relpos's eager attention with bias slopes[h] * (i - j), brute force (queries the last Tq of the
    keys; future keys at distance 0, hidden by the causal mask)."""
    Tq, Tk = q.shape[-2], k.shape[-2]
    k_pos = torch.arange(Tk, device=q.device)
    distance = (k_pos[-Tq:, None] - k_pos[None, :]).clamp(min=0).to(torch.float32)
    table = slopes[:, None] * torch.arange(Tk, device=q.device, dtype=torch.float32)  # (H, Tk): the bias by distance
    assert torch.equal(table[:, distance.long()], slopes[:, None, None] * distance)
    return reference(q, k, v, table)


@pytest.mark.parametrize("shape", [
    dict(Tq=37, Tk=37, H=4, Hk=4),
    dict(Tq=37, Tk=37, H=4, Hk=2),  # grouped-query attention
    dict(Tq=33, Tk=33, H=3, Hk=1),
    dict(Tq=21, Tk=50, H=2, Hk=2),  # queries are the last 21 of 50 positions
    dict(Tq=20, Tk=50, H=2, Hk=1),
])
def test_slopes_match_eager_attention_with_the_bias_written_out(shape):
    """Slopes of either sign, large enough to move the attention (a key 10 back shifts its logit by up
    to 7). Mutations checked, each failing here: the distance's sign flipped in the forward only, in the
    dq backward only, in the dk/dv backward only; each head reading head 0's slope."""
    q, k, v, _ = inputs(**shape)
    slopes = (torch.rand(shape["H"], generator=torch.Generator().manual_seed(7)) * 1.4 - 0.7).to(DEVICE)
    check(linear_distance_attention(q, k, v, slopes), linear_reference(q, k, v, slopes), [q, k, v], "qkv")


def test_alibi_s_slopes_give_its_table_s_attention():
    """ALiBi's linear_distance_slopes through the kernel, against eager attention with ALiBi's own
    score_bias, and against distance_attention over ALiBi's distance table."""
    scheme = build_scheme({"name": "alibi"}, ModelShape(d_model=64, n_heads=4, n_layers=1, train_seq_len=40)).to(DEVICE)
    q, k, v, _ = inputs(Tq=40, Tk=40, H=4, Hk=4, seed=2)
    pos = torch.arange(40, device=DEVICE)
    ours = linear_distance_attention(q, k, v, scheme.linear_distance_slopes(0))
    check(ours, eager_attention(q, k, v, scheme.score_bias(0, q, k, pos)), [q, k, v], "qkv")
    assert close(ours, distance_attention(q, k, v, scheme.distance_table(0, 40, DEVICE)), 1e-6)


def test_a_slope_that_steep_attends_each_query_to_its_own_key():
    """slope -1e3: the key one back is e^-1000 less likely than the query's own, so out_i = v_i
    (a brute-force expectation; grouped-query: the key head's v)."""
    q, k, v, _ = inputs(Tq=40, Tk=40, H=4, Hk=2)
    with torch.no_grad():
        out = linear_distance_attention(q, k, v, torch.full((4,), -1e3, device=DEVICE))
    assert torch.allclose(out, v.repeat_interleave(2, 1), atol=1e-6, rtol=0)


def test_bad_slopes_are_one_line():
    q, k, v, _ = inputs(Tq=20, Tk=20, H=4, Hk=2)
    slopes = torch.full((4,), -0.5, device=DEVICE)
    bad = {"(H, 1)": (slopes[:, None], "slopes must be"), "wrong heads": (slopes[:3], "slopes must be"),
           "float64": (slopes.double(), "slopes must be"), "a gradient": (slopes.clone().requires_grad_(), "fixed slopes")}
    for what, (wrong, message) in bad.items():
        with pytest.raises(RelposError, match=message) as caught:
            linear_distance_attention(q, k, v, wrong)
        assert "\n" not in str(caught.value), what


@pytest.mark.skipif(not CUDA, reason="needs CUDA: compiled kernels at training lengths")
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-3), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("L", [None, 129, "slopes"])
def test_cuda_long_sequences(dtype, atol, L):
    """T = 1100 (no multiple of any tile), default tiles, against eager attention in float32 on the
    same inputs; bf16 within bf16's rounding; a whole table, one that ends at T5's default
    max_distance (far tiles), and ALiBi's slopes for 4 heads (linear_distance_attention). The table's
    gradient sums up to 2 x 1100 pairs per entry (the short table's last, most of them) through float32
    atomics: tolerance relative to its largest entry."""
    q, k, v, table = inputs(B=2, H=4, Hk=2, Tq=1100, Tk=1100, Dh=64, L=None if L == "slopes" else L, dtype=dtype)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    if L == "slopes":
        slopes = -torch.tensor([2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8], device=DEVICE)
        ours, ref = linear_distance_attention(q, k, v, slopes), linear_reference(q32, k32, v32, slopes)
        wrt, wrt32 = [q, k, v], [q32, k32, v32]
    else:
        table32 = table.detach().clone().requires_grad_()
        ours, ref = distance_attention(q, k, v, table), reference(q32, k32, v32, table32)
        wrt, wrt32 = [q, k, v, table], [q32, k32, v32, table32]
    assert ours.dtype == dtype and torch.allclose(ours.float(), ref, atol=atol, rtol=0)
    upstream = torch.randn_like(ref)
    grads_ours = torch.autograd.grad((ours.float() * upstream).sum(), wrt)
    grads_ref = torch.autograd.grad((ref * upstream).sum(), wrt32)
    for name, a, b in zip(["q", "k", "v", "table"], grads_ours, grads_ref):
        scale = b.abs().max().item()
        error = (a.float() - b).abs().max().item()
        assert error <= atol * max(1.0, scale), (name, error, scale)
