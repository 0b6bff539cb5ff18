"""The backward's preprocessing kernel (relpos_cli/kernels/output_grad.py): delta_i = dO_i . O_i per
query row against the float64 sum written out, on the layouts the kernels hand it (the output laid out
(B, T, H, Dh), its gradient as it comes: contiguous, token-major, a view of wider rows), rows that are
no multiple of the tile, head sizes that are no power of two, 16-bit inputs summed in float32.

Without CUDA in Triton's interpreter, on tiny shapes (tests/triton_setup.py).
"""

import pytest
import torch

from triton_setup import CUDA, DEVICE, NO_TRITON  # first: the interpreter before triton is imported

pytest.importorskip("triton", reason=NO_TRITON)

from relpos_cli.kernels import output_grad  # noqa: E402
from relpos_cli.kernels._launch import token_major  # noqa: E402
from relpos_cli.kernels.output_grad import output_grad_dot  # noqa: E402

pytestmark = pytest.mark.skipif(not CUDA and not output_grad.INTERPRETED,
                                reason="no CUDA and TRITON_INTERPRET was set to something else than 1 before the tests")


def drawn(shape, dtype, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def written_out(o, do):
    """sum over the head dimension of o * dO in float64, one product at a time."""
    return (o.double() * do.double()).sum(-1)


@pytest.mark.parametrize("layout", ["contiguous", "token_major", "rows_of_a_projection"])
@pytest.mark.parametrize("shape", [(2, 3, 37, 16), (1, 2, 16, 24), (2, 1, 70, 64)])
def test_each_row_s_dot_product_in_float32(shape, layout):
    """T = 37 and 70: a ragged last tile; Dh = 24: padded to 32 inside. Mutations checked, each failing
    here: dO read with o's strides (the non-contiguous layouts); the rows masked at T - 1; the head
    dimension left unmasked past Dh (24)."""
    B, H, T, Dh = shape
    o = token_major(shape, torch.float32, DEVICE).copy_(drawn(shape, torch.float32, 0))
    if layout == "contiguous":
        do = drawn(shape, torch.float32, 1)
    elif layout == "token_major":
        do = token_major(shape, torch.float32, DEVICE).copy_(drawn(shape, torch.float32, 1))
    else:  # a view of rows wider than H * Dh, as a slice of a projection's output would be
        rows = drawn((B, T, H * Dh + 5), torch.float32, 1)
        do = rows[..., :H * Dh].unflatten(-1, (H, Dh)).transpose(1, 2)
    delta = output_grad_dot(o, do)
    assert delta.shape == (B, H, T) and delta.dtype == torch.float32 and delta.is_contiguous()
    torch.testing.assert_close(delta.double(), written_out(o, do), rtol=1e-5, atol=1e-5)


def test_half_precision_inputs_are_summed_in_float32():
    """fp16 o and dO whose products sum to far more than fp16 can hold exactly: the kernel casts each
    element to float32 before the product (a product in fp16 would round every term to 11 bits).
    Mutation checked: the product and its sum in fp16, cast after, fails."""
    shape = (1, 2, 20, 64)
    o = (1 + drawn(shape, torch.float32, 2).abs()).to(torch.float16)
    do = (1 + drawn(shape, torch.float32, 3).abs()).to(torch.float16)
    delta = output_grad_dot(token_major(shape, torch.float16, DEVICE).copy_(o), do)
    assert delta.dtype == torch.float32
    torch.testing.assert_close(delta.double(), written_out(o, do), rtol=1e-6, atol=1e-4)
