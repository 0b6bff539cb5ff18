"""A scheme's score_formula (relpos_cli/positions/base.py): the bias a kernel computes per score.

- It equals the declared bias method at every (head, i, j) with j <= i, past the training length
  too: exactly for ALiBi, within FireLayer.formula_error_bound for FIRE's grid. (KERPLE's formula
  is gone: on an H100 flex computing its log or power per score took 2-9x T5's table lookups.)
- FIRE's bound is tight: one hidden unit whose knot sits mid-cell errs by the bound there.
- Under FlexAttention the formula is what runs (the table is never read), and schemes with
  trainable parameters give none while a gradient is recorded.
"""

from types import SimpleNamespace

import pytest
import torch

from relpos_cli import attention
from relpos_cli.positions import REGISTRY, build_scheme
from relpos_cli.positions.base import ModelShape
from relpos_cli.positions.fire import FORMULA_GRID

SHAPE = ModelShape(d_model=64, n_heads=4, n_layers=2, train_seq_len=32)
FORMULA_SCHEMES = sorted(n for n, cls in REGISTRY.items() if cls.overrides("score_formula"))


def randomised(name: str, seed: int = 0):
    """The scheme with every parameter redrawn (KERPLE's r's kept positive, as their projection does)."""
    scheme = build_scheme({"name": name}, SHAPE)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in scheme.parameters():
            p.copy_(torch.randn(p.shape, generator=generator))
        scheme.constrain_parameters()
    return scheme


def pairs(length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(head, i, j) over every head and causal pair of `length` positions, flattened."""
    head, i, j = torch.meshgrid(torch.arange(SHAPE.n_heads), torch.arange(length), torch.arange(length), indexing="ij")
    causal = j <= i
    return head[causal], i[causal], j[causal]


def test_the_schemes_with_a_formula():
    assert FORMULA_SCHEMES == ["alibi", "fire"]


@pytest.mark.parametrize("name", FORMULA_SCHEMES)
def test_formula_equals_the_declared_bias(name):
    scheme = randomised(name)
    length = 5 * SHAPE.train_seq_len  # past FIRE's threshold: its normaliser moves with the query
    head, i, j = pairs(length)
    positions = torch.arange(length)
    with torch.no_grad():
        for layer in range(SHAPE.n_layers):
            formula = scheme.score_formula(layer)(head, i, j)
            table = scheme.score_bias(layer, torch.zeros(1, SHAPE.n_heads, length, 16), None, positions)
            declared = table.expand(1, SHAPE.n_heads, length, length)[0][head, i, j]
            bound = scheme.layers[layer].formula_error_bound()[head] if name == "fire" else 0.0
            assert declared.abs().max() > 0.1  # a bias that moves
            assert ((formula - declared).abs() <= bound + 1e-5 * (1 + declared.abs())).all(), layer


def test_fire_grid_errs_by_its_bound_at_a_knot_mid_cell():
    """One hidden unit, relu(w1 x + b1) with its knot x* placed where a causal pair's input lands
    halfway between two grid points: the interpolant is off by |w2 w1| h / 4 there (h the cell
    width), the bound, and never by more anywhere."""
    scheme = build_scheme({"name": "fire", "mlp_width": 1}, SHAPE)
    layer = scheme.layers[0]
    length = 4 * SHAPE.train_seq_len
    head, i, j = pairs(length)
    with torch.no_grad():
        threshold = float(layer.init_threshold)
        x = torch.log(layer.c * (i - j) + 1) / (torch.log(layer.c * torch.clamp(i.float(), min=threshold) + 1) + layer.eps)
        mid_cell = (x * FORMULA_GRID - (x * FORMULA_GRID).floor() - 0.5).abs().argmin()
        first, last = layer.mlp[0], layer.mlp[2]
        first.weight.fill_(3.0)
        first.bias.fill_(-3.0 * float(x[mid_cell]))  # knot at that pair's input
        last.weight.copy_(torch.tensor([[2.0], [-1.0], [0.5], [4.0]]))
        last.bias.zero_()
        bound = layer.formula_error_bound()
        error = (scheme.score_formula(0)(head, i, j) - scheme.pair_bias(0, i[None], j[None])[head, 0, torch.arange(len(i))]).abs()
    assert torch.allclose(bound, torch.tensor([6.0, 3.0, 1.5, 12.0]) / (4 * FORMULA_GRID))
    assert (error <= bound[head] * (1 + 1e-3) + 1e-6).all()
    for h in range(SHAPE.n_heads):
        pair = (head == h) & (i == i[mid_cell]) & (j == j[mid_cell])
        assert error[pair].item() >= 0.9 * bound[h].item(), h


def test_flex_computes_the_formula_and_reads_no_table(monkeypatch):
    """With the table method broken, flex still gives eager's output (taken before the break):
    the formula runs, not the table."""
    scheme = randomised("alibi")
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, SHAPE.n_heads, 40, 16, generator=g) for _ in range(3))
    positions = torch.arange(40)
    with torch.no_grad():
        expected = attention.eager_attention(q, k, v, scheme.score_bias(0, q, k, positions))

        def no_table(layer, distance):
            raise AssertionError("flex read the distance table")

        monkeypatch.setattr(scheme, "distance_bias", no_table)
        out = attention.attend("flex", scheme, 0, q, k, v, positions, attention.BiasCache())
    assert torch.allclose(out, expected, atol=1e-5)


def test_no_formula_while_parameters_record_a_gradient():
    scheme = randomised("fire")
    assert scheme.score_formula(0) is None
    with torch.no_grad():
        assert scheme.score_formula(0) is not None


def test_alibi_formula_while_training():
    """ALiBi has nothing to train: its formula serves training too."""
    assert randomised("alibi").score_formula(1) is not None


def test_auto_on_cuda_runs_fires_long_evaluations_on_flex():
    """What auto picks on CUDA, asked with a stand-in for a CUDA tensor (resolve_backend reads its
    device, shape, dtype and whether it records a gradient): FIRE's long no-grad calls go to flex (its
    formula), as ALiBi's do, and a distance table in float32 (in 16 bits the fused kernel reads it);
    on CPU chunked."""
    def picks(dtype):
        long = SimpleNamespace(is_cuda=True, shape=(4, 2, 2048, 16), requires_grad=False, dtype=dtype)
        return {name: attention.resolve_backend("auto", build_scheme({"name": name}, SHAPE), long)
                for name in ("fire", "t5", "alibi")}
    assert picks(torch.bfloat16) == {"fire": "flex", "t5": "fused", "alibi": "flex"}
    assert picks(torch.float32) == {"fire": "flex", "t5": "flex", "alibi": "flex"}
    assert attention.resolve_backend("auto", build_scheme({"name": "fire"}, SHAPE), torch.zeros(4, 2, 2048, 16)) == "chunked"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: flex compiled for the GPU")
@pytest.mark.parametrize("name", FORMULA_SCHEMES)
def test_flex_with_the_formula_matches_eager_on_cuda(name):
    """The formula compiled into flex's CUDA kernel, past FIRE's threshold (300 > 32), in fp32."""
    scheme = randomised(name).cuda()
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, SHAPE.n_heads, 300, 16, generator=g).cuda() for _ in range(3))
    positions = torch.arange(300, device="cuda")
    with torch.no_grad():
        expected = attention.eager_attention(q, k, v, scheme.score_bias(0, q, k, positions))
        out = attention.attend("flex", scheme, 0, q, k, v, positions, attention.BiasCache())
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
