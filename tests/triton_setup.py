"""What the fused-kernel tests share: Triton's interpreter on a machine without CUDA.

triton.jit reads TRITON_INTERPRET when a kernel is defined, so it is set here, before triton is first
imported, and stays set for the process. Under the interpreter the kernels run on CPU tensors as
numpy programs, on tiny shapes; with CUDA the same tests run compiled, and the long bf16/fp32 tests
too (the interpreter's tl.dot gives garbage on bfloat16 tiles, triton 3.9, so bf16 is checked on CUDA
only). A test module imports this first, then `pytest.importorskip("triton", reason=NO_TRITON)`.
"""

import os

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
DEVICE = "cuda" if CUDA else "cpu"
NO_TRITON = "the fused kernels need triton (pip install triton; CPU: the interpreter)"
