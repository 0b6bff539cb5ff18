"""How the fused kernels pick their launch (relpos_cli/kernels/_launch.launch_tiles): each kernel's own
tiles and warps on CUDA (narrow: 16-bit up to head dim 64; wide: float32 or wider heads), 16 x 16
under the interpreter, the caller's where given, and a one-line error for a tile or warp count
Triton cannot take, through every public kernel function. Which tiles each kernel declares is
checked by compiling them (tests/test_kernels_compile.py: no register spills at the narrow ones).
"""

import pytest
import torch

from triton_setup import DEVICE, NO_TRITON  # first: the interpreter before triton is imported

pytest.importorskip("triton", reason=NO_TRITON)

from relpos_cli import kernels  # noqa: E402
from relpos_cli.errors import RelposError  # noqa: E402
from relpos_cli.kernels._launch import KernelTiles, Tiles, launch_tiles  # noqa: E402

TABLE = KernelTiles(narrow=Tiles(128, 64, 8), wide=Tiles(64, 32, 4))


def rows(dtype=torch.bfloat16, head_dim=64):
    return torch.empty(1, 2, 8, head_dim, dtype=dtype, device="meta")


@pytest.mark.parametrize("dtype, head_dim, expected", [
    (torch.bfloat16, 64, TABLE.narrow), (torch.float16, 32, TABLE.narrow),
    (torch.float32, 64, TABLE.wide), (torch.bfloat16, 128, TABLE.wide), (torch.float32, 16, TABLE.wide),
])
def test_cuda_launches_a_kernel_at_its_own_tiles(dtype, head_dim, expected):
    assert launch_tiles(TABLE, rows(dtype, head_dim), None, None, None, interpreted=False) == expected


def test_the_interpreter_takes_16_by_16_whatever_the_kernel_declares():
    assert launch_tiles(TABLE, rows(), None, None, None, interpreted=True)[:2] == (16, 16)


def test_given_values_win_one_by_one():
    assert launch_tiles(TABLE, rows(), 32, None, None, interpreted=False) == Tiles(32, 64, 8)
    assert launch_tiles(TABLE, rows(), None, 16, None, interpreted=False) == Tiles(128, 16, 8)
    assert launch_tiles(TABLE, rows(), None, None, 4, interpreted=False) == Tiles(128, 64, 4)
    assert launch_tiles(TABLE, rows(torch.float32), 16, 16, 2, interpreted=True) == Tiles(16, 16, 2)


@pytest.mark.parametrize("given, message", [
    (dict(block_m=24), "block_m=24 must be a power of two >= 16"),
    (dict(block_n=8), "block_n=8 must be a power of two >= 16"),
    (dict(block_m=-16), "block_m=-16 must be"),
    (dict(block_n=0), "block_n=0 must be"),
    (dict(num_warps=0), "num_warps=0 must be"),
    (dict(num_warps=3), "num_warps=3 must be 1, 2, 4, 8 or 16"),
    (dict(num_warps=32), "num_warps=32 must be"),
])
def test_a_tile_or_warp_count_triton_cannot_take_is_refused_in_one_line(given, message):
    args = dict(block_m=None, block_n=None, num_warps=None) | given
    with pytest.raises(RelposError, match=message) as caught:
        launch_tiles(TABLE, rows(), args["block_m"], args["block_n"], args["num_warps"], interpreted=False)
    assert "\n" not in str(caught.value)


def calls():
    """Each public kernel function on small tensors on DEVICE (the interpreter's CPU, else CUDA), its
    extra inputs made up: the refusal comes before anything is computed."""
    def made(*shape):
        return torch.zeros(*shape, device=DEVICE)
    q, k, v = (torch.randn(1, 2, 20, 16, device=DEVICE) for _ in range(3))
    return {
        "distance_attention": lambda **tiles: kernels.distance_attention(q, k, v, made(2, 20), **tiles),
        "linear_distance_attention": lambda **tiles: kernels.linear_distance_attention(q, k, v, made(2), **tiles),
        # FIRE's grid of 9 points, (|c|, L, eps) and the positions
        "fire_attention": lambda **tiles: kernels.fire_attention(q, k, v, made(2, 9), made(3) + 1,
                                                                 torch.arange(20, device=DEVICE), **tiles),
        "forgetting_attention": lambda **tiles: kernels.forgetting_attention(q, k, v, made(1, 2, 20), **tiles),
        "stickbreaking_attention": lambda **tiles: kernels.stickbreaking_attention(q, k, v, **tiles),
        "cope_attention": lambda **tiles: kernels.cope_attention(q, k, v, made(1, 2, 20, 4), **tiles),
        "shaw_attention": lambda **tiles: kernels.shaw_attention(q, k, v, made(1, 2, 20, 7), **tiles),
        "dape_attention": lambda **tiles: kernels.dape_attention(q, k, v, made(2, 20), made(3, 4), made(3),
                                                                 made(2, 3), made(2), **tiles),
    }


@pytest.mark.parametrize("name", sorted(kernels.KERNEL_MODULES))
def test_every_kernel_function_takes_tiles_and_warps_and_refuses_bad_ones(name):
    call = calls()[name]
    with torch.no_grad():
        assert call(block_m=16, block_n=32, num_warps=2).shape == (1, 2, 20, 16)
        for bad, message in [(dict(block_n=8), "block_n=8"), (dict(num_warps=5), "num_warps=5")]:
            with pytest.raises(RelposError, match=message):
                call(**bad)
