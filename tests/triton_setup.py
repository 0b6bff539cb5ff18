"""What the fused-kernel tests share: Triton's interpreter on a machine without CUDA.

triton.jit reads TRITON_INTERPRET when a kernel is defined, so it is set here, before triton is first
imported, and stays set for the process. Under the interpreter the kernels run on CPU tensors as
numpy programs, on tiny shapes; with CUDA the same tests run compiled, and the long bf16/fp32 tests
too (the interpreter's tl.dot gives garbage on bfloat16 tiles, triton 3.9, so bf16 is checked on CUDA
only). A test module imports this first, then `pytest.importorskip("triton", reason=NO_TRITON)`.
"""

import math
import os

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
DEVICE = "cuda" if CUDA else "cpu"
NO_TRITON = "the fused kernels need triton (pip install triton; CPU: the interpreter)"


def qkv(B: int, H: int, Hk: int, Tq: int, Tk: int, Dh: int, dtype: torch.dtype, generator: torch.Generator,
        q_scale: float = 1.0, projected: bool = False) -> list[torch.Tensor]:
    """q (B, H, Tq, Dh) times q_scale (spreading the logits), k, v (B, Hk, Tk, Dh): N(0, 1), drawn in
    that order from `generator`, on DEVICE in `dtype`, requiring grad: leaves, contiguous, or with
    projected=True the same values as views of projections, as the model's attention hands them to
    the kernels (_launch.kernel_layout reads them in place): q of a (B, Tq, H Dh + 3) tensor, k and
    v interleaved per token in one (B, Tk, 2, Hk, Dh), each (B, T, heads, Dh) transposed."""
    q = q_scale * torch.randn(B, H, Tq, Dh, generator=generator)
    k = torch.randn(B, Hk, Tk, Dh, generator=generator)
    v = torch.randn(B, Hk, Tk, Dh, generator=generator)
    if not projected:
        return [t.to(DEVICE, dtype).requires_grad_() for t in (q, k, v)]
    q_rows = torch.zeros(B, Tq, H * Dh + 3, device=DEVICE, dtype=dtype)  # 3 more: rows no multiple of the heads
    q_rows[..., :H * Dh] = q.transpose(1, 2).flatten(2)
    kv_rows = torch.stack((k, v), 2).permute(0, 3, 2, 1, 4).contiguous().to(DEVICE, dtype)  # (B, Tk, 2, Hk, Dh)
    q_rows.requires_grad_(), kv_rows.requires_grad_()
    views = [q_rows[..., :H * Dh].unflatten(-1, (H, Dh)).transpose(1, 2),
             kv_rows[:, :, 0].transpose(1, 2), kv_rows[:, :, 1].transpose(1, 2)]
    assert all(not t.is_contiguous() and t.stride(-1) == 1 for t in views) and views[1].stride() == views[2].stride()
    return views


def token_major(*tensors: torch.Tensor) -> bool:
    """Whether each (B, H, T, Dh) tensor is laid out as (B, T, H, Dh), as the kernels write their
    output and q, k, v's gradients (relpos_cli/kernels/_launch.token_major)."""
    return all(t.transpose(1, 2).is_contiguous() for t in tensors)


def check(ours: torch.Tensor, ref: torch.Tensor, wrt: list[torch.Tensor], atol: float) -> tuple[torch.Tensor, ...]:
    """ours equals ref within atol, and so do their gradients with respect to each of wrt (named by
    its index there) under one random upstream gradient: shapes and dtypes too. -> ours' gradients."""
    assert ours.shape == ref.shape and ours.dtype == ref.dtype
    assert torch.allclose(ours, ref, atol=atol, rtol=0), (ours - ref).abs().max()
    # its own generator: the same upstream gradient whichever tests ran before in the process
    upstream = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5), dtype=ref.dtype).to(ref.device)
    grads_ours = torch.autograd.grad((ours * upstream).sum(), wrt)
    grads_ref = torch.autograd.grad((ref * upstream).sum(), wrt)
    for name, a, b in zip(range(len(wrt)), grads_ours, grads_ref, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.allclose(a, b, atol=atol, rtol=0), (name, (a - b).abs().max())
    return grads_ours


def check_low_precision(ours: torch.Tensor, eager: torch.Tensor, ref: torch.Tensor, wrt: tuple[list, list, list],
                        floor: float = 1e-3) -> None:
    """FlashAttention's own test rule for 16-bit kernels: ours (in bf16 or fp16) is at most twice as far
    from the float32 reference `ref` as relpos's eager attention in the same 16-bit autocast (`eager`)
    is, on the values and on the gradients with respect to wrt = (ours' leaves, eager's, ref's) under one
    random upstream gradient (rounded to ours' dtype, as autograd hands it to a 16-bit output); `floor`
    (times the gradient's largest entry) keeps exact agreement from failing."""
    def gap(a: torch.Tensor, b: torch.Tensor) -> float:
        return (a.float() - b.float()).abs().max().item()

    assert ours.shape == ref.shape and ours.dtype != ref.dtype
    assert gap(ours, ref) <= 2 * gap(eager, ref) + floor, (gap(ours, ref), gap(eager, ref))
    upstream = torch.randn_like(ref).to(ours.dtype).float()
    grads = [torch.autograd.grad((out.float() * upstream).sum(), leaves) for out, leaves in zip((ours, eager, ref), wrt)]
    for name, (a, e, r) in enumerate(zip(*grads, strict=True)):
        scale = max(1.0, r.abs().max().item())
        assert gap(a, r) <= 2 * gap(e, r) + floor * scale, (name, gap(a, r), gap(e, r), scale)


def tiles_per_kernel(monkeypatch, module, tiles: list[tuple[object, tuple[int, int]]]) -> None:
    """Launch each kernel that `module` (one that calls _launch.launch_tiles) launches at the tiles
    paired with its KernelTiles in `tiles` (matched by identity: two kernels' tables may be equal),
    as CUDA launches each kernel at its own; under the interpreter they would all get 16 x 16."""
    from relpos_cli.kernels._launch import Tiles

    def launch_tiles(cuda, q, block_m, block_n, num_warps, interpreted):
        return Tiles(*next(blocks for table, blocks in tiles if table is cuda), 4)

    monkeypatch.setattr(module, "launch_tiles", launch_tiles)


def opposed_qkv(T: int, Dh: int, logit: float, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (1, 2, T, Dh) and k, v (1, 1, T, Dh), float32, requiring grad, q and k along opposite directions
    (plus noise of 0.3) so that every logit q . k / sqrt(Dh) is near `logit` (< 0): gates that stay small,
    sticks that last, counts that grow slowly."""
    g = torch.Generator().manual_seed(seed)
    along = math.sqrt(-logit * math.sqrt(Dh) / Dh)  # q . k = logit sqrt(Dh) in all
    q = (along + 0.3 * torch.randn(1, 2, T, Dh, generator=g)).requires_grad_()
    k = (-along + 0.3 * torch.randn(1, 1, T, Dh, generator=g)).requires_grad_()
    return q, k, torch.randn(1, 1, T, Dh, generator=g).requires_grad_()


def cuda_tiles(monkeypatch, modules, *kernel_tiles) -> None:
    """Launch each kernel that `modules` launch (tiles_per_kernel) at its KernelTiles' narrow tiles, the
    ones CUDA takes for bf16 at head sizes up to 64: under the interpreter the kernels' own sizes,
    whatever the dtype."""
    for module in modules:
        tiles_per_kernel(monkeypatch, module, [(tiles, tiles.narrow[:2]) for tiles in kernel_tiles])
