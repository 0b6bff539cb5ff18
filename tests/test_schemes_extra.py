"""The schemes beyond the core: oracles where a reference implementation exists (x-transformers
xPos and CoPE, KERPLE written from the authors' code, Sandwich written from the paper's equation,
the naive L x L x d form for Shaw), properties otherwise.
Registry-wide properties (causality, sdpa == eager, shift invariance) live in test_schemes.py."""

import csv
import math

import pytest
import torch

from conftest import TINY, run_cli, run_in_process
from relpos_cli.errors import RelposError
from relpos_cli.positions import REGISTRY, build_scheme
from relpos_cli.positions.base import BiasInput, ModelShape
from relpos_cli.results import report_path, variant_tag

SHAPE = ModelShape(d_model=64, n_heads=4, n_layers=2, train_seq_len=32)
NEW_SCHEMES = ["shaw", "kerple_log", "kerple_power", "fire", "sandwich", "xpos", "cope"]


def pairs(n: int, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(n) + offset
    return pos[:, None], pos[None, :]


# ---- T5 explicit boundaries ---------------------------------------------------------------------

def test_t5_boundaries_map_the_seeds_example():
    t5 = build_scheme({"name": "t5", "boundaries": [0, 1, 2, 5, 17]}, SHAPE)
    assert t5.tables.shape == (1, 5, SHAPE.n_heads)
    distance = torch.arange(0, 40)
    buckets = t5.buckets(distance, torch.zeros_like(distance))  # query at distance d after key 0
    expected = [0, 1] + [2] * 3 + [3] * 12 + [4] * 23  # 0 | 1 | 2-4 | 5-16 | >=17
    assert buckets.tolist() == expected


def test_t5_boundaries_direction_aware():
    t5 = build_scheme({"name": "t5", "boundaries": [0, 1, 2, 5, 17], "bidirectional": True}, SHAPE)
    assert t5.tables.shape == (1, 10, SHAPE.n_heads)
    q, k = torch.tensor([10, 10, 10, 10]), torch.tensor([7, 13, 10, 40])
    assert t5.buckets(q, k).tolist() == [2, 5 + 2, 0, 5 + 4]  # past keys 0..4, future keys 5..9


@pytest.mark.parametrize("bad", [[1, 2, 5], [0, 2, 2], [0, 5, 3], []])
def test_t5_bad_boundaries_are_clear_errors(bad):
    with pytest.raises(RelposError, match="pos.boundaries=.* must start at 0 and increase strictly"):
        build_scheme({"name": "t5", "boundaries": bad}, SHAPE)


# ---- KERPLE and FIRE ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["kerple_log", "kerple_power"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kerple_bias_non_increasing_with_distance_at_init(name, seed):
    torch.manual_seed(seed)
    scheme = build_scheme({"name": name}, SHAPE)
    for layer in range(SHAPE.n_layers):
        row = scheme.distance_bias(layer, torch.arange(501))  # (H, 501): distance 0..500
        assert torch.all(row[:, 1:] - row[:, :-1] <= 0) and torch.all(row[:, 0] == 0)
        assert torch.all(row[:, -1] < 0)


def test_kerple_constraints_hold_for_any_raw_parameters():
    power = build_scheme({"name": "kerple_power"}, SHAPE)
    with torch.no_grad():
        power.r1.fill_(-3.0)
        power.r2.fill_(7.0)
    power.constrain_parameters()
    assert torch.all(power.r1 == 1e-2) and torch.all(power.r2 == 2) and power.r1.shape == (1, SHAPE.n_heads)
    q, k = pairs(6)
    assert torch.allclose(power.score_bias(0, None, None, torch.arange(6))[0], -1e-2 * (q - k).abs().float() ** 2)


class ReferenceKerple(torch.nn.Module):
    """ParallelKerpleLog / ParallelKerplePower (github.com/chijames/KERPLE, mpu/layers.py) without
    model parallelism: (H, 1, 1) parameters clamped in place on .data before each use, added to the
    [b, h, sq, sk] scores over the tril'd distance matrix."""

    def __init__(self, kind: str, heads: int):
        super().__init__()
        self.kind, self.eps = kind, 1e-2
        self.bias_p = torch.nn.Parameter(torch.rand(heads)[:, None, None] * 2)
        self.bias_a = torch.nn.Parameter(torch.rand(heads)[:, None, None])

    def forward(self, x):
        n = x.shape[-1]
        diff = torch.tril(torch.arange(n).view(n, 1).repeat(1, n) + torch.arange(0, -n, -1)).to(x.dtype)
        if self.kind == "log":
            self.bias_p.data = self.bias_p.data.clamp(min=self.eps)
            self.bias_a.data = self.bias_a.data.clamp(min=self.eps)
            return x - self.bias_p * torch.log(1 + self.bias_a * diff)
        self.bias_p.data = self.bias_p.data.clamp(min=self.eps, max=2)
        self.bias_a.data = self.bias_a.data.clamp(min=self.eps)
        return x - diff.pow(self.bias_p) * self.bias_a


@pytest.mark.parametrize("kind", ["log", "power"])
def test_kerple_trains_like_the_reference(kind):
    """Same start, same AdamW steps on the same loss: the reference projects its stored parameters
    (so one pushed below the bound keeps its gradient); relpos projects after each step. One set
    of parameters is shared by all layers, as the reference hands one module to every layer."""
    torch.manual_seed(0)
    ours = build_scheme({"name": f"kerple_{kind}"}, SHAPE)
    ref = ReferenceKerple(kind, SHAPE.n_heads)
    with torch.no_grad():  # log: bias_p = r1 (scale), bias_a = r2; power: bias_a = r1 (scale), bias_p = r2 (exponent)
        start_scale = torch.tensor([0.3, 1.7, 0.02, 0.9])
        start_other = torch.tensor([0.015, 0.5, 0.8, 0.011]) if kind == "log" else torch.tensor([0.05, 1.9, 1.2, 0.5])
        ours.r1.copy_(start_scale[None]), ours.r2.copy_(start_other[None])
        (ref.bias_p if kind == "log" else ref.bias_a).copy_(start_scale[:, None, None])
        (ref.bias_a if kind == "log" else ref.bias_p).copy_(start_other[:, None, None])
    opt_ours, opt_ref = torch.optim.AdamW(ours.parameters(), lr=0.05), torch.optim.AdamW(ref.parameters(), lr=0.05)
    T = 20
    target = torch.randn(SHAPE.n_heads, T, T)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for _ in range(30):  # a loss whose minimum pulls some parameters below the bound
        loss_ours = sum(((ours.score_bias(layer, None, None, torch.arange(T)) - target)[:, causal] ** 2).mean()
                        for layer in range(SHAPE.n_layers))
        loss_ref = SHAPE.n_layers * ((ref(torch.zeros(1, SHAPE.n_heads, T, T))[0] - target)[:, causal] ** 2).mean()
        for opt, loss in ((opt_ours, loss_ours), (opt_ref, loss_ref)):
            opt.zero_grad()
            loss.backward()
            opt.step()
        ours.constrain_parameters()
        assert torch.allclose(loss_ours, loss_ref, atol=1e-5)
    ref(torch.zeros(1, SHAPE.n_heads, T, T))  # the reference projects at its next use
    scale, other = (ref.bias_p, ref.bias_a) if kind == "log" else (ref.bias_a, ref.bias_p)
    assert torch.allclose(ours.r1[0], scale.flatten(), atol=1e-5) and torch.allclose(ours.r2[0], other.flatten(), atol=1e-5)
    assert (ours.r1 == 1e-2).any() or (ours.r2 == 1e-2).any()  # the bound was reached and left intact


def test_kerple_per_layer_option():
    per_layer = build_scheme({"name": "kerple_log", "shared_layers": False}, SHAPE)
    assert per_layer.r1.shape == (SHAPE.n_layers, SHAPE.n_heads)
    pos = torch.arange(10)
    assert not torch.allclose(per_layer.score_bias(0, None, None, pos), per_layer.score_bias(1, None, None, pos))


@pytest.mark.parametrize("name", ["kerple_log", "kerple_power", "fire", "sandwich"])
def test_bias_finite_at_64x_train_length(name):
    torch.manual_seed(0)
    scheme = build_scheme({"name": name}, SHAPE)
    L = 64 * SHAPE.train_seq_len
    bias = scheme.score_bias(1, None, None, torch.tensor([0, L // 2, L - 1]), torch.arange(L))  # (H, 3, L)
    assert bias.shape == (SHAPE.n_heads, 3, L) and torch.isfinite(bias).all()


def test_fire_input_is_normalised_to_unit_interval():
    """psi(i - j) / psi(max(L, i)) lies in [0, 1] for causal pairs at any length, so the MLP only
    ever sees inputs like those of training: the mechanism FIRE relies on to extrapolate."""
    fire = build_scheme({"name": "fire"}, SHAPE)
    seen = []
    hook = fire.layers[0].mlp[0].register_forward_hook(lambda m, inp, out: seen.append(inp[0]))
    L = 64 * SHAPE.train_seq_len
    q, k = torch.tensor([[5], [SHAPE.train_seq_len], [L - 1]]), torch.arange(L)[None, :]
    fire.pair_bias(0, q, k)
    hook.remove()
    x = seen[0][..., 0].detach()
    causal = k <= q
    assert x[causal].min() >= 0 and x[causal].max() <= 1 + 1e-6
    assert x[2, 0] == pytest.approx(1.0, abs=1e-4)  # farthest key of the last query


def fire_as_in_the_paper(layer, q_pos, k_pos) -> torch.Tensor:
    """FIRE from its paper (Li et al. 2023), written independently of relpos_cli/positions/fire.py in
    float64 numpy: b(i, j) = f(psi(i - j) / psi(max(L, i))), psi(x) = log(|c x| + 1), with the
    threshold L = |L_multiplier * init_L| and eps added to the normaliser as in the appendix's code
    listing, f: Linear(1, width) -> ReLU -> Linear(width, H). Only the layer's parameter values are
    read. q_pos (Tq, 1), k_pos (1, Tk) -> (H, Tq, Tk)."""
    import numpy as np

    as64 = lambda t: t.detach().double().numpy()  # noqa: E731
    w1, b1 = as64(layer.mlp[0].weight)[:, 0], as64(layer.mlp[0].bias)  # (width,)
    w2, b2 = as64(layer.mlp[2].weight), as64(layer.mlp[2].bias)  # (H, width), (H,)
    c = float(layer.c)
    threshold = abs(float(layer.threshold_multiplier) * float(layer.init_threshold))
    i, j = q_pos.double().numpy(), k_pos.double().numpy()
    psi = lambda x: np.log(np.abs(c * x) + 1)  # noqa: E731
    x = psi(i - j) / (psi(np.maximum(i, threshold)) + 1e-6)  # (Tq, Tk)
    hidden = np.maximum(0.0, x[..., None] * w1 + b1)  # (Tq, Tk, width)
    return torch.from_numpy(np.moveaxis(hidden @ w2.T + b2, -1, 0)).float()  # (H, Tq, Tk)


def fire_with_learned_c_and_threshold():
    """FIRE whose c and threshold have moved from their initial values, the threshold multiplier
    negative (the paper takes |multiplier * init_L|), and a random MLP."""
    torch.manual_seed(0)
    fire = build_scheme({"name": "fire", "init_c": 0.3, "init_threshold": 20}, SHAPE)
    for layer in fire.layers:
        with torch.no_grad():
            layer.c.fill_(0.45)
            layer.threshold_multiplier.fill_(-0.8)  # L = 16
            for param in layer.mlp.parameters():
                param.normal_()
    return fire


@pytest.mark.parametrize("grad", [True, False], ids=["training", "evaluation"])
@pytest.mark.parametrize("queries, keys", [((0, 50), (0, 50)), ((10, 20), (0, 20)), ((1990, 2048), (1500, 2048)),
                                           ((5, 40), (3, 40))])
def test_fire_matches_the_papers_formula(grad, queries, keys):
    """Both of FIRE's paths (the MLP per pair when training, the piecewise-linear form without
    gradients) against the paper's formula: queries before and past the threshold L = 16, far past
    it, and keys that do not start at 0. Mutations checked: the normaliser psi(max(L, j)) (key, not
    query), the threshold without its abs, and psi without c each fail here."""
    fire = fire_with_learned_c_and_threshold()
    q, k = torch.arange(*queries)[:, None], torch.arange(*keys)[None, :]
    with torch.set_grad_enabled(grad):
        got = fire.pair_bias(1, q, k)
    assert got.requires_grad == grad
    assert torch.allclose(got.detach(), fire_as_in_the_paper(fire.layers[1], q, k), atol=1e-4, rtol=1e-4)


def fire_with_knots_inside_the_unit_interval():
    torch.manual_seed(0)
    fire = build_scheme({"name": "fire", "init_threshold": 20}, SHAPE)
    first = fire.layers[0].mlp[0]
    with torch.no_grad():
        for param in fire.layers[0].mlp.parameters():
            param.normal_()
        first.bias.copy_(-first.weight[:, 0] * torch.rand(first.bias.shape))  # knots at U(0, 1)
    return fire


def test_fire_without_gradients_equals_its_mlp():
    """Evaluation computes FIRE's MLP as the piecewise-linear function it is (no hidden layer per
    pair); it must give the paper's numbers, knots inside [0, 1], a unit with w1 = 0 and a unit
    that never switches on included, at 64x the training length. Mutation checked: taking the
    piece above the last knot at finite[-1:] - 1 (inside the last piece but one) fails here."""
    fire = fire_with_knots_inside_the_unit_interval()
    first = fire.layers[0].mlp[0]
    with torch.no_grad():
        first.weight[0], first.bias[0] = 0.0, 0.7  # constant unit
        first.weight[1], first.bias[1] = 0.0, -0.7  # dead unit
    L = 64 * SHAPE.train_seq_len
    q, k = torch.tensor([[0], [7], [19], [20], [L // 3], [L - 1]]), torch.arange(L)[None, :]
    with torch.no_grad():
        fast = fire.pair_bias(0, q, k)  # (H, 6, L)
    assert not fast.requires_grad
    assert torch.allclose(fast, fire_as_in_the_paper(fire.layers[0], q, k), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("queries, first_key", [((0, 7), 0), ((15, 25), 0), ((2016, 2048), 0), ((1990, 2048), 1500)])
def test_fire_query_blocks_equal_the_written_out_formula(queries, first_key):
    """Evaluation's query blocks have consecutive positions: FIRE then reads psi of the distances as
    windows of one vector, and gives keys that lie in one piece of the MLP for the whole block that
    piece's slope and intercept as scalars. Blocks at the start, across the threshold (20), far past
    it, and against keys that do not start at 0; the long block has both kinds of keys."""
    fire = fire_with_knots_inside_the_unit_interval()
    q, k = torch.arange(*queries)[:, None], torch.arange(first_key, queries[1])[None, :]
    with torch.no_grad():
        fast = fire.pair_bias(0, q, k)
    assert torch.allclose(fast, fire_as_in_the_paper(fire.layers[0], q, k), atol=1e-4, rtol=1e-4)


def test_fire_key_runs_split_keys_by_piece():
    from relpos_cli.positions.fire import key_runs

    fire = fire_with_knots_inside_the_unit_interval()
    knots = fire.layers[0].linear_pieces()[0]
    q, k = torch.arange(2016, 2048)[:, None], torch.arange(2048)[None, :]
    x = fire.layers[0].psi_of_distances(q, k) / (fire.layers[0].psi(q.float()) + fire.layers[0].eps)
    runs = key_runs(x, knots)
    assert [r[0] for r in runs] == [0, *[r[1] for r in runs[:-1]]] and runs[-1][1] == 2048  # they tile the keys
    pure = [r for r in runs if r[2] is not None]
    assert pure and any(r[2] is None for r in runs)
    for start, stop, piece in pure:  # brute force: every entry's own piece
        assert (torch.searchsorted(knots, x[:, start:stop].contiguous()) == piece).all()
    scrambled = x[:, torch.randperm(2048)]  # columns out of order: thousands of runs, left to the per-entry path
    assert key_runs(scrambled, knots) == [(0, 2048, None)]
    with torch.no_grad():
        reference = fire.layers[0].mlp(scrambled[..., None]).movedim(-1, 0)
        assert torch.allclose(fire.layers[0].piecewise_linear(scrambled), reference, atol=1e-5, rtol=1e-5)


POSITION_BIAS_SCHEMES = [n for n, cls in REGISTRY.items() if cls.bias_input in (BiasInput.DISTANCE, BiasInput.INDEX_PAIR)]


@pytest.mark.parametrize("name", POSITION_BIAS_SCHEMES)
def test_position_bias_is_elementwise(name):
    """What the distance table and query chunks rely on: the bias of one (query, key) pair, or one
    distance, from scalar indices (also under torch.vmap) equals that entry of the dense bias."""
    torch.manual_seed(0)
    scheme = build_scheme({"name": name}, SHAPE)
    for p in scheme.parameters():
        torch.nn.init.normal_(p)
    scheme.constrain_parameters()
    pos = torch.arange(300)
    dense = scheme.score_bias(1, None, None, pos)  # (H, 300, 300)
    if scheme.bias_input is BiasInput.DISTANCE:
        one = lambda i, j: scheme.distance_bias(1, i - j)  # noqa: E731
    else:
        one = lambda i, j: scheme.pair_bias(1, i, j)  # noqa: E731
    with torch.no_grad():
        for i, j in [(0, 0), (5, 2), (299, 0), (100, 99), (3, 7)]:
            assert torch.allclose(one(torch.tensor(i), torch.tensor(j)).reshape(-1), dense[:, i, j], atol=1e-5), (i, j)
        qi, kj = torch.tensor([0, 5, 299, 100]), torch.tensor([0, 2, 0, 99])
        mapped = torch.vmap(lambda a, b: one(a, b).reshape(-1))(qi, kj)  # (4, H)
        assert torch.allclose(mapped, dense[:, qi, kj].T, atol=1e-5)


# ---- Sandwich -----------------------------------------------------------------------------------

def sandwich_from_the_paper(distance: int, d: int, h: int, n_heads: int) -> float:
    """Chi et al. 2023, Sandwich: p_m . p_n = sum_{i=1}^{d/2} cos((m - n) / 10000^(2i/d)), minus d/2,
    divided by the compression 8h/H of head h = 1..H."""
    inner = sum(math.cos(distance / 10000 ** (2 * i / d)) for i in range(1, d // 2 + 1))
    return (inner - d / 2) / (8 * h / n_heads)


def test_sandwich_matches_the_paper():
    sandwich = build_scheme({"name": "sandwich", "dim": 32}, SHAPE)
    bias = sandwich.score_bias(0, None, None, torch.arange(60))  # (H, 60, 60)
    for i, j in [(7, 7), (8, 7), (30, 1), (59, 0), (40, 38)]:
        for h in range(SHAPE.n_heads):
            assert bias[h, i, j].item() == pytest.approx(sandwich_from_the_paper(i - j, 32, h + 1, SHAPE.n_heads), abs=1e-4)


@pytest.mark.parametrize("block", [2**24, 7 * 60, 1])  # every frequency in one kernel, 7 at a time, one at a time
def test_sandwich_sums_its_frequencies_in_chunks_of_any_size(block, monkeypatch):
    from relpos_cli.positions import sandwich as module

    monkeypatch.setattr(module, "FREQUENCY_BLOCK_ELEMENTS", block)
    sandwich = build_scheme({"name": "sandwich", "dim": 32}, SHAPE)
    distances = torch.arange(60)
    table = sandwich.distance_bias(0, distances)  # (H, 60)
    for d in (0, 1, 13, 59):
        for h in range(SHAPE.n_heads):
            assert table[h, d].item() == pytest.approx(sandwich_from_the_paper(d, 32, h + 1, SHAPE.n_heads), abs=1e-4)


# ---- Shaw ---------------------------------------------------------------------------------------

def test_shaw_matches_the_naive_relative_key_form():
    torch.manual_seed(0)
    shaw = build_scheme({"name": "shaw", "max_distance": 3}, SHAPE)
    torch.nn.init.normal_(shaw.table)
    T, Dh = 12, SHAPE.head_dim
    q = torch.randn(2, SHAPE.n_heads, T, Dh)
    pos = torch.arange(T)
    bias = shaw.score_bias(1, q, q, pos)
    # naive (T, T, Dh) tensor a_ij = R[clip(j - i)] as in Shaw et al. eq. (4)
    rel = (pos[None, :] - pos[:, None]).clamp(-3, 3) + 3
    a = shaw.table[1][rel]  # (T, T, Dh)
    ref = torch.einsum("bhid,ijd->bhij", q, a) / math.sqrt(Dh)
    assert torch.allclose(bias, ref, atol=1e-5)


# ---- xPos and CoPE against x-transformers -------------------------------------------------------

def half_to_interleaved(x: torch.Tensor) -> torch.Tensor:
    """Reorder head dims from rope's half-split pairs (i, i + d/2) to interleaved pairs (2i, 2i+1)."""
    return torch.stack(x.chunk(2, dim=-1), dim=-1).flatten(-2)


@pytest.mark.parametrize("scale_base", [512.0, 64.0])
def test_xpos_matches_x_transformers(scale_base):
    from x_transformers.x_transformers import RotaryEmbedding, apply_rotary_pos_emb

    xpos = build_scheme({"name": "xpos", "scale_base": scale_base}, SHAPE)
    Dh, T = SHAPE.head_dim, 100
    ref = RotaryEmbedding(Dh, use_xpos=True, scale_base=scale_base)
    q, k = torch.randn(2, 1, SHAPE.n_heads, T, Dh).unbind(0)
    freqs, scale = ref.forward_from_seq_len(T)
    q_ref = apply_rotary_pos_emb(half_to_interleaved(q), freqs, scale)
    k_ref = apply_rotary_pos_emb(half_to_interleaved(k), freqs, scale**-1)
    q_ours, k_ours = xpos.rotate(0, q, k, torch.arange(T))
    assert torch.allclose(half_to_interleaved(q_ours), q_ref, atol=1e-5)
    assert torch.allclose(half_to_interleaved(k_ours), k_ref, atol=1e-5)


def test_xpos_decay_depends_on_distance_only_and_shrinks_with_it():
    xpos = build_scheme({"name": "xpos", "scale_base": 32.0}, SHAPE)
    for offset in (0, 700):
        scale = xpos.decay(torch.arange(200) + offset)  # (T, Dh) query scale; keys get 1 / scale
        pair = scale[:, None, :] / scale[None, :, :]  # (Tq, Tk, Dh) factor on q_m . k_n per dim
        distance = torch.arange(200)
        expected = xpos.zeta.repeat(2) ** ((distance[:, None] - distance[None, :]) / 32.0)[..., None]
        assert torch.allclose(pair, expected, rtol=1e-4)
    assert torch.all(xpos.zeta < 1) and torch.all(expected[100, :100].diff(dim=0) > 0)  # nearer keys decay less


def test_cope_matches_x_transformers():
    from x_transformers.x_transformers import CoPE

    torch.manual_seed(0)
    cope = build_scheme({"name": "cope", "max_positions": 8}, SHAPE)
    torch.nn.init.normal_(cope.pos_emb)
    Dh, T = SHAPE.head_dim, 30
    ref = CoPE(Dh, SHAPE.n_heads, 8)
    with torch.no_grad():
        ref.pos_emb.copy_(cope.pos_emb[1])
    q, k = torch.randn(2, 2, SHAPE.n_heads, T, Dh).unbind(0)
    sim = (q @ k.transpose(-1, -2)) / math.sqrt(Dh)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    expected = ref(q, sim.masked_fill(future, -torch.finfo(sim.dtype).max))
    ours = cope.score_bias(1, q, k, torch.arange(T))
    assert torch.allclose(ours[..., ~future], expected[..., ~future], atol=1e-5)


def test_cope_positions_are_clamped():
    """A key far back counts at most max_positions - 1: its bias is that of the last embedding."""
    cope = build_scheme({"name": "cope", "max_positions": 4}, SHAPE)
    torch.nn.init.normal_(cope.pos_emb)
    q = torch.randn(1, SHAPE.n_heads, 50, SHAPE.head_dim)
    k = q * 100  # gates ~1 wherever q . k > 0 strongly: positions grow ~ with distance
    bias = cope.score_bias(0, q, k, torch.arange(50))
    last = q @ cope.pos_emb[0, -1]  # (1, H, T)
    assert torch.allclose(bias[..., 49, 0], last[..., 49], atol=1e-4)


# ---- every new scheme through the CLI at >= 4x its train length ---------------------------------

def read_lengths(run_dir, rope_scaling: str = "none") -> list[tuple[int, float]]:
    variant = variant_tag({} if rope_scaling == "none" else {"rope_scaling.factor": "auto_per_length",
                                                              "rope_scaling.type": rope_scaling})
    rows = list(csv.DictReader(report_path(run_dir, "eval_length", variant, ".csv").open()))
    return [(int(r["length"]), float(r["ppl"])) for r in rows]


def with_weights_drawn(run_dir, device, cfg=None):
    """A trained run's model with every weight drawn again, seeded: N(0, 0.5) for the position
    parameters (then constrained), N(0, 1) for the others. Two training steps leave a tiny model
    near uniform predictions, where attention, and so any error in it, hardly moves the loss."""
    from relpos_cli.checkpoint import load_trained_model

    cfg, model = load_trained_model(run_dir, device, cfg)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * (0.5 if name.startswith("scheme.") else 1.0))
    model.scheme.constrain_parameters()
    return cfg, model


def eager_loss(run_dir, length: int, n_tokens: int) -> float:
    """Brute force of eval-length's non-overlapping protocol: the run's model with the eager
    reference attention (explicit L x L logits), the first n_tokens validation targets cut into
    windows of `length` (which divides n_tokens), each window from an empty context, mean loss in float64."""
    import numpy as np
    import torch.nn.functional as F
    from omegaconf import OmegaConf

    from relpos_cli.data import load_token_data

    cfg, model = with_weights_drawn(run_dir, torch.device("cpu"))
    model.attn_backend = "eager"
    data = load_token_data(OmegaConf.to_container(cfg.data, resolve=True))
    tokens = torch.from_numpy(np.asarray(data.validation[: n_tokens + 1]).astype(np.int64))
    total = 0.0
    with torch.no_grad():
        for start in range(0, n_tokens, length):
            window = tokens[start : start + length + 1]
            logits = model(window[None, :-1])[0].double()  # (length, V)
            total += F.cross_entropy(logits, window[1:], reduction="sum").item()
    return total / n_tokens


def test_new_schemes_train_and_evaluate_at_4x_through_the_cli(tmp_path, monkeypatch):
    """Each scheme's eval-length perplexity at 1x and 4x its training length (through `relpos
    eval-length`, weights drawn at random, with its default backend, in blocks of 32 queries as at long lengths: distance
    tables read in place, Shaw's far keys without a bias, FIRE's query blocks) equals the brute force
    with eager attention. Mutations checked, each fails here: Shaw's far keys given r_-(K-1) instead of
    r_-K (shaw.py far_bias), a window's first target left unscored (evaluate.py score_plan)."""
    from relpos_cli import attention, evaluate

    sweep = tmp_path / "sweep"
    monkeypatch.chdir(tmp_path)  # in-process runs point outputs/latest in the cwd
    code, _, err = run_in_process("train", "-m", f"pos={','.join(NEW_SCHEMES)}", *TINY, "train.steps=2",
                                  f"hydra.sweep.dir={sweep}")
    assert code == 0, err
    runs = sorted(p.parent for p in sweep.glob("*/checkpoint.pt"))
    assert len(runs) == len(NEW_SCHEMES)
    monkeypatch.setattr(evaluate, "load_trained_model", with_weights_drawn)
    monkeypatch.setattr(attention, "DISTANCE_BLOCK", 32)  # query blocks of 32, as 512 are at long lengths
    monkeypatch.setattr(attention, "DENSE_BYTES", 4 * 4 * 64 * 64)  # auto: query blocks past 64 tokens
    monkeypatch.setattr(attention, "BLOCK_BYTES", 4 * 4 * 32 * 128)
    code, _, err = run_in_process("eval-length", str(sweep), "eval.lengths=[32,128]", "eval.tokens=256")  # 128 = 4x
    assert code == 0, err
    for run in runs:
        rows = read_lengths(run)
        assert [length for length, _ in rows] == [32, 128], run
        for length, ppl in rows:
            assert math.log(ppl) == pytest.approx(eager_loss(run, length, 256), rel=1e-5), (run.name, length)


def test_t5_boundaries_partial_rope_and_rope_scaling_through_the_cli(tmp_path, monkeypatch):
    """In-process (a traceback would be raised into the test): ten subprocesses took 40 s."""
    def relpos(*args: str) -> tuple[int, str]:
        code, _, err = run_in_process(*args)
        return code, " ".join(err.split())  # rich wraps long lines

    t5, rope = tmp_path / "t5", tmp_path / "rope"
    monkeypatch.chdir(tmp_path)  # in-process runs point outputs/latest in the cwd
    assert relpos("train", "pos=t5", "pos.boundaries=[0,1,2,5,17]", *TINY, "train.steps=2", f"hydra.run.dir={t5}")[0] == 0
    assert relpos("train", "pos=rope", "pos.rotary_fraction=0.5", *TINY, "train.steps=2", f"hydra.run.dir={rope}")[0] == 0
    assert relpos("eval-length", str(t5), "eval.lengths=[32,128]", "eval.tokens=256")[0] == 0
    assert all(math.isfinite(p) for _, p in read_lengths(t5, "none"))
    plain = None
    for scaling in ["none", "linear", "ntk", "dynamic", "yarn"]:
        code, err = relpos("eval-length", str(rope), "eval.lengths=[32,128]", "eval.tokens=256",
                           f"eval.rope_scaling.type={scaling}")
        assert code == 0, err
        rows = read_lengths(rope, scaling)
        assert all(math.isfinite(p) for _, p in rows)
        plain = plain or rows
        assert rows[0] == plain[0]  # factor=auto leaves the training length untouched
        assert (rows[1] == plain[1]) == (scaling == "none")  # and rescales at 4x
    # t5 has no rotation: scaled results would be the default ones under another name
    code, err = relpos("eval-length", str(t5), "eval.lengths=[32,128]", "eval.tokens=256", "eval.rope_scaling.type=yarn")
    assert code == 2 and "eval.rope_scaling applies to schemes that rotate q and k" in err, err
    code, err = relpos("eval-length", str(rope), "eval.lengths=[128]", "eval.tokens=256", "eval.rope_scaling.type=bogus")
    assert code == 2 and "eval.rope_scaling.type='bogus'" in err, err


def test_schemes_command_lists_every_registered_scheme():
    from omegaconf import OmegaConf

    from relpos_cli.config import default_group
    from relpos_cli.positions import REGISTRY, build_scheme

    assert "relpos schemes --model tiny" in run_cli("schemes", "--help").stdout
    out = run_cli("schemes", "--model", "tiny").stdout
    rows: dict[str, list[list[str]]] = {}  # scheme -> its table lines (name, then paper), split into cells
    name = None
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) != 5:
            continue
        if cells[0] in REGISTRY:
            name = cells[0]
        rows.setdefault(name, []).append(cells)
    for name, cls in REGISTRY.items():
        paper, hooks = " ".join(r[0] for r in rows[name][1:]), [r[1] for r in rows[name] if r[1]]
        assert paper == cls.paper and hooks == (list(cls.hooks()) or ["-"]), rows[name]
        assert rows[name][0][2] == cls.bias_input.value
        # the declaration of the scheme as its yaml builds it (DAPE is as relative as its base)
        built = build_scheme(OmegaConf.to_container(default_group("pos", name)), ModelShape(32, 2, 2, 64))
        assert rows[name][0][4] == ("yes" if built.relative else "no")
    assert rows["kerple_log"][1][3] == "(r1, r2)" and rows["rope"][0][3] == "0"
    for name in ("nope", "../config", "../pos/rope"):  # a name of conf/model, not a path to another yaml
        bad = run_cli("schemes", "--model", name, check=False)
        assert bad.returncode == 2 and f"no model config {name!r}; choose one of: " in bad.stderr
        assert "Traceback" not in bad.stderr


# ---- runs saved before a scheme option existed ---------------------------------------------------

def test_runs_saved_before_an_option_existed_evaluate_as_trained(tmp_path):
    """A saved run config without the options added by the scheme fixes gets the values that
    reproduce the old schemes: zero-initialised unscaled T5, per-layer KERPLE clamped as before,
    Sandwich over Vaswani's frequencies, the fixed d^-0.5 sinusoid (no parameter in the checkpoint)."""
    from omegaconf import OmegaConf

    from relpos_cli.checkpoint import load_config
    from relpos_cli.results import CONFIG_FILE
    from relpos_cli.positions.sinusoidal import sinusoidal_table

    def saved(pos: dict) -> dict:
        (tmp_path / CONFIG_FILE).write_text(OmegaConf.to_yaml({"pos": pos}))
        return OmegaConf.to_container(load_config(tmp_path).pos)

    assert saved({"name": "t5", "num_buckets": 32})["parameterization"] == "zero"
    assert saved({"name": "t5", "parameterization": "hf"})["parameterization"] == "hf"  # saved values win
    kerple = build_scheme(saved({"name": "kerple_log"}), SHAPE)
    assert kerple.r1.shape == (SHAPE.n_layers, SHAPE.n_heads)
    state = {"r1": torch.full((SHAPE.n_layers, SHAPE.n_heads), -0.5), "r2": torch.full((SHAPE.n_layers, SHAPE.n_heads), 0.3)}
    kerple.load_state_dict(state)  # raw values the old forward pass clamped: the same values now
    assert torch.all(kerple.r1 == 1e-2) and torch.all(kerple.r2 == 0.3)

    sandwich = build_scheme(saved({"name": "sandwich", "dim": 32}), SHAPE)
    p = sinusoidal_table(torch.arange(60), 32, 10000.0)  # Vaswani's table: k = 0..d'/2-1
    bias = sandwich.score_bias(0, None, None, torch.arange(60))
    for h in range(SHAPE.n_heads):
        assert torch.allclose(bias[h], (p @ p.T - 16) / (8 * (h + 1) / SHAPE.n_heads), atol=1e-4)

    sinusoidal = build_scheme(saved({"name": "sinusoidal", "base": 10000.0}), SHAPE)
    assert list(sinusoidal.state_dict()) == [] and sinusoidal.scale.item() == pytest.approx(SHAPE.d_model**-0.5)


# ---- FIRE's thresholds, read once per forward pass ------------------------------------------------------

def test_fire_reads_its_thresholds_once_a_pass_and_afresh_in_the_next(monkeypatch):
    fire = build_scheme({"name": "fire", "init_threshold": 40.0}, ModelShape(32, 2, 3, 40))
    reads = []
    read = fire.read_within_thresholds
    monkeypatch.setattr(fire, "read_within_thresholds", lambda positions: reads.append(1) or read(positions))
    positions = torch.arange(41)  # the last query, 40, is at every layer's threshold: a table each

    def tables(positions):
        return [fire.pair_bias_as_distances(layer, positions) is not None for layer in range(3)]

    with fire.forward_pass(positions):
        pass
    assert reads == []  # a pass that asks for no table (every path but the fused kernel's) reads nothing
    with fire.forward_pass(positions):
        assert tables(positions) == [True] * 3 and tables(positions) == [True] * 3
    assert len(reads) == 1  # one read from the device for the pass's six tables
    # an optimizer step between passes moves layer 1's threshold below the last query; CUDA's fused AdamW
    # does it without bumping the parameter's version counter, as .data does here
    fire.layers[1].threshold_multiplier.data.mul_(0.9)
    with fire.forward_pass(positions):
        assert tables(positions) == [True, False, True]
    assert len(reads) == 2
    assert tables(torch.arange(45)) == [False] * 3  # outside a pass, or for other positions: read at the call
    assert tables(positions) == [True, False, True] and len(reads) == 2 + 3 + 3  # a read per call
    with fire.forward_pass(positions):
        assert tables(positions) == [True, False, True]
        assert tables(torch.arange(45)) == [False] * 3  # other positions inside a pass: not the pass's answer
    assert len(reads) == 8 + 1 + 3


@pytest.mark.parametrize("autocast", [False, True])
def test_fire_computes_every_layer_s_table_at_once_in_a_training_pass(autocast, monkeypatch):
    """In a pass that records gradients every layer's table is its own FireLayer's (values, and the
    gradients of every parameter), from one computation for all the layers; the layer past its threshold
    gets none. Under bf16 autocast both run the MLP in bf16 (nn.Linear and baddbmm alike): within bf16's
    rounding. Mutations checked: one layer's c for all; the normaliser without the threshold."""
    fire = build_scheme({"name": "fire", "init_threshold": 40.0}, ModelShape(32, 2, 3, 40))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in fire.named_parameters():
            if not name.endswith("threshold_multiplier"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        fire.layers[1].threshold_multiplier.mul_(0.9)  # layer 1's threshold below the last query: no table
        fire.layers[2].threshold_multiplier.mul_(1.5)  # layer 2's normaliser is its threshold, past the last query
    batched = []
    every_layer = fire.last_rows_of_all_layers
    monkeypatch.setattr(fire, "last_rows_of_all_layers", lambda positions: batched.append(1) or every_layer(positions))
    positions = torch.arange(41)
    weights = torch.randn(3, 2, 41, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        with fire.forward_pass(positions):
            got = [fire.pair_bias_as_distances(layer, positions) for layer in range(3)]
            other = fire.pair_bias_as_distances(0, positions[:30])  # other positions in the pass: their own table
        want = [fire.layers[layer](positions[-1:, None], positions[None, :])[:, 0].flip(-1) for layer in range(3)]
        want_other = fire.layers[0](positions[29:30, None], positions[None, :30])[:, 0].flip(-1)
    assert got[1] is None and batched == [1]
    torch.testing.assert_close(other.float(), want_other.float(), rtol=0, atol=0)
    # as the fused kernel reads a table, so that no layer's call copies it (Tensor.to(float32, memory_format=...)
    # of a float32 tensor returns it as it is, transposed: it was, at 17488f2)
    assert all(got[layer].dtype == torch.float32 and got[layer].is_contiguous() for layer in (0, 2))
    tolerance = dict(rtol=2e-2, atol=2e-2) if autocast else dict(rtol=1e-6, atol=1e-6)
    for layer in (0, 2):  # float32 (the kernel's) against the layer's own, bf16 under autocast
        torch.testing.assert_close(got[layer], want[layer].float(), **tolerance)
    params = list(fire.parameters())
    grads = torch.autograd.grad(sum((got[l] * weights[l]).sum() for l in (0, 2)), params, allow_unused=True)
    wants = torch.autograd.grad(sum((want[l].float() * weights[l]).sum() for l in (0, 2)), params, allow_unused=True)
    for p, a, b in zip(params, grads, wants):
        a, b = (torch.zeros_like(p) if t is None else t for t in (a, b))
        torch.testing.assert_close(a, b, **tolerance)


def test_the_model_brackets_each_forward_pass_for_its_scheme(monkeypatch):
    from relpos_cli.model import BlockOptions, Transformer

    model = Transformer(64, ModelShape(32, 2, 2, 16), {"name": "fire"}, block=BlockOptions(mlp_hidden=32))
    passes = []
    enter = model.scheme.forward_pass
    monkeypatch.setattr(model.scheme, "forward_pass", lambda positions: passes.append(positions.tolist()) or enter(positions))
    model(torch.randint(0, 64, (2, 16)))
    model.loss(torch.randint(0, 64, (1, 8)), torch.randint(0, 64, (1, 8)))
    assert passes == [list(range(16)), list(range(8))]
    assert model.scheme._pass is None  # forgotten after the pass
