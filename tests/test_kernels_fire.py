"""The fused FIRE kernel past its threshold (relpos_cli/kernels/fire.py), forward only, against eager
attention with the bias written out here from FIRE's formula and its grid (psi of the distance over each
query's normaliser, then the grid's linear interpolation); and against FIRE's own MLP within the grid's
stated error. Lengths that are no multiple of the tile, grouped-query shapes, queries that are the last
Tq of Tk keys, positions that start past 0, queries on both sides of the threshold.

Without CUDA in Triton's interpreter, on tiny shapes (tests/triton_setup.py).
"""

import pytest
import torch

from triton_setup import CUDA, DEVICE, NO_TRITON, qkv, token_major  # first: the interpreter before triton is imported

pytest.importorskip("triton", reason=NO_TRITON)

from relpos_cli.attention import eager_attention  # noqa: E402
from relpos_cli.errors import RelposError  # noqa: E402
from relpos_cli.kernels import fire  # noqa: E402
from relpos_cli.kernels.fire import fire_attention  # noqa: E402
from relpos_cli.positions.fire import FireLayer  # noqa: E402

pytestmark = pytest.mark.skipif(not CUDA and not fire.INTERPRETED,
                                reason="no CUDA and TRITON_INTERPRET was set to something else than 1 before the tests")


def fire_layer(H: int, threshold: float, c: float = 0.3, seed: int = 0) -> FireLayer:
    """A FIRE layer with drawn MLP weights (so its bias varies across heads and distances) and the
    given threshold and c (negative c: psi takes |c x|)."""
    torch.manual_seed(seed)
    layer = FireLayer(H, 8, c, threshold)
    with torch.no_grad():
        for p in layer.mlp.parameters():
            p.copy_(torch.randn(p.shape))
    return layer.to(DEVICE)


def inputs(B=2, H=4, Hk=2, Tq=37, Tk=37, Dh=16, dtype=torch.float32, seed=0):
    q, k, v = qkv(B, H, Hk, Tq, Tk, Dh, dtype, torch.Generator().manual_seed(seed))
    return [t.detach() for t in (q, k, v)]


def written_out_bias(grid: torch.Tensor, c: float, threshold: float, eps: float, positions: torch.Tensor,
                     Tq: int) -> torch.Tensor:
    """FIRE's bias off the grid, (H, Tq, Tk), pair by pair in float64: for query position p and key
    position p', x = log(|c| (p - p') + 1) / (log(|c| max(p, L) + 1) + eps), then grid[h] at G x,
    linearly interpolated (future pairs get any value: masked)."""
    cells = grid.shape[1] - 1
    p = positions[-Tq:].double()[:, None]
    distance = (p - positions.double()[None, :]).clamp(min=0)
    x = torch.log(abs(c) * distance + 1) / (torch.log(abs(c) * p.clamp(min=threshold) + 1) + eps)
    at = x * cells
    cell = at.floor().clamp(max=cells - 1)
    below, above = grid.double()[:, cell.long()], grid.double()[:, cell.long() + 1]
    return (below + (at - cell) * (above - below)).float()


def reference(q, k, v, bias):
    group = q.shape[1] // k.shape[1]
    return eager_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), bias.to(q.dtype))


def run(layer: FireLayer, q, k, v, positions, **tiles):
    with torch.no_grad():
        return fire_attention(q, k, v, layer.formula_grid(), layer.formula_constants(), positions, **tiles)


@pytest.mark.parametrize("shape,first,threshold,c", [
    (dict(Tq=37, Tk=37, H=4, Hk=4), 0, 10.0, 0.3),  # multi-head, T no multiple of 16, most queries past L
    (dict(Tq=37, Tk=37, H=4, Hk=2), 0, 10.0, -0.3),  # grouped-query attention; psi of |c x|
    (dict(Tq=33, Tk=33, H=3, Hk=1), 5, 100.0, 0.05),  # positions from 5, every query within L
    (dict(Tq=21, Tk=50, H=2, Hk=2), 7, 40.0, 1.0),  # the last 21 of 50 keys, positions 7..56, L among them
])
def test_values_match_eager_attention_with_the_bias_written_out(shape, first, threshold, c):
    """Mutations checked: the normaliser at L for every query (no max) fails; psi without the + 1 in
    the normaliser fails; the interpolation from the cell above fails; the causal mask `<=` as `<`
    fails; the queries' positions read from the first Tq keys (no offset) fails the Tq < Tk case."""
    q, k, v = inputs(**shape)
    layer = fire_layer(shape["H"], threshold, c)
    positions = torch.arange(first, first + shape["Tk"], device=DEVICE)
    bias = written_out_bias(layer.formula_grid(), c, threshold, layer.eps, positions, shape["Tq"])
    ours = run(layer, q, k, v, positions)
    assert token_major(ours)
    torch.testing.assert_close(ours, reference(q, k, v, bias), rtol=0, atol=2e-5)


def test_within_the_grids_stated_error_of_fires_own_mlp():
    """The bias the kernel adds is FIRE's exact MLP (FireLayer's forward) to within formula_error_bound
    b per head, so against eager attention with the exact bias each output moves at most as far as a
    bias change of b can move a softmax-weighted mean of values in [-1, 1]: the weights change by a
    factor within [e^-2b, e^2b], their sum of changes by at most e^2b - 1, about 2b."""
    H, T = 3, 45
    layer = fire_layer(H, threshold=12.0, c=0.2, seed=1)
    q, k, v = inputs(H=H, Hk=H, Tq=T, Tk=T)
    v = v.clamp(-1, 1)
    positions = torch.arange(T, device=DEVICE)
    with torch.no_grad():
        exact = layer(positions[:, None], positions[None, :])  # (H, T, T): the MLP itself
        bound = layer.formula_error_bound()
    assert bound.max() > 1e-4  # drawn weights: the grid's error is not negligible, so the bound is tested
    difference = (run(layer, q, k, v, positions) - reference(q, k, v, exact)).abs().amax((0, 2, 3))  # (H,)
    assert (difference <= 2 * bound + 1e-6).all(), (difference, bound)


def test_tiles_that_differ_give_the_same_values():
    q, k, v = inputs(Tq=50, Tk=50)
    layer = fire_layer(4, 20.0)
    positions = torch.arange(50, device=DEVICE)
    base = run(layer, q, k, v, positions)
    for tiles in (dict(block_m=16, block_n=32), dict(block_m=32, block_n=16)):
        torch.testing.assert_close(run(layer, q, k, v, positions, **tiles), base, rtol=0, atol=2e-6)


def test_half_precision_within_its_rounding():
    q, k, v = inputs(Tq=40, Tk=40, dtype=torch.float16)
    layer = fire_layer(4, 16.0)
    positions = torch.arange(40, device=DEVICE)
    bias = written_out_bias(layer.formula_grid(), 0.3, 16.0, layer.eps, positions, 40)
    ours = run(layer, q, k, v, positions)
    assert ours.dtype == torch.float16
    torch.testing.assert_close(ours.float(), reference(q.float(), k.float(), v.float(), bias), rtol=0, atol=5e-3)


def test_bad_inputs_are_one_line():
    q, k, v = inputs(Tq=20, Tk=20)
    layer = fire_layer(4, 10.0)
    grid, constants, positions = layer.formula_grid(), layer.formula_constants(), torch.arange(20, device=DEVICE)
    with torch.no_grad():
        for bad, message in [((grid[:2], constants, positions), "grid must be"),
                             ((grid.double(), constants, positions), "grid must be"),
                             ((grid, constants[:2], positions), "constants must be"),
                             ((grid, constants, positions[:19]), "positions must be"),
                             ((grid, constants, positions.float()), "positions must be")]:
            with pytest.raises(RelposError, match=message):
                fire_attention(q, k, v, *bad)
    with pytest.raises(RelposError, match="fire_attention computes no gradients"):
        fire_attention(q.requires_grad_(), k, v, grid, constants, positions)


@pytest.mark.skipif(not CUDA, reason="needs CUDA: compiled kernels at evaluation lengths")
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-3), (torch.bfloat16, 3e-2)])
def test_cuda_long_sequences(dtype, atol):
    """T = 3000 (no multiple of any tile), default tiles, most queries past L = 1024, against eager
    attention in float32 with the bias written out; bf16 within bf16's rounding."""
    T = 3000
    q, k, v = inputs(B=1, H=4, Hk=2, Tq=T, Tk=T, Dh=64, dtype=dtype)
    layer = fire_layer(4, 1024.0, c=0.1)
    positions = torch.arange(T, device=DEVICE)
    bias = written_out_bias(layer.formula_grid(), 0.1, 1024.0, layer.eps, positions, T)
    ours = run(layer, q, k, v, positions)
    assert ours.dtype == dtype
    torch.testing.assert_close(ours.float(), reference(q.float(), k.float(), v.float(), bias), rtol=0, atol=atol)
