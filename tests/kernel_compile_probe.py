"""Compile the fused Triton kernels (relpos_cli/kernels) for an H100, sm_90, on a machine without a
GPU, with the arguments their host code passes on CUDA; print what came out as one JSON object.

Run by tests/test_kernels_compile.py in a subprocess, with TRITON_INTERPRET unset (triton.jit reads
it when a kernel is defined: the interpreter's kernels cannot be compiled). By hand:

    python tests/kernel_compile_probe.py bfloat16            # or float32, float32-tf32
    python tests/kernel_compile_probe.py float32 --only dape_attention --block 64 64
    python tests/kernel_compile_probe.py bfloat16 --only cope_attention --block 32 32 --warps 8

How: each kernel module's launched kernels are found (the module's triton.jit functions that no
other triton.jit function calls), replaced by recorders, and the module's public function is run
forward and backward on meta tensors (no data, any device check skipped), so every launch is
recorded with the arguments, constexprs (tiles from _launch.launch_tiles and each kernel module's
KernelTiles) and num_warps / num_stages the host code computes for CUDA. Then each recorded launch is compiled with
the kernel's own warmup (Triton's launch path up to the compiled binary, no launch) against a
stand-in driver that answers "sm_90", GPU or none. ptxas, from the triton wheel, makes the cubin.
Nothing is run and no number is checked. Works with triton 3.6 (the GPU machine's) and 3.9.

Output: {"config", "target", "triton", "kernels": {name (and, for a kernel launched again with other
constexprs, "name CONSTEXPR=value,..."): {"shared", "num_warps", "num_stages",
"constexprs", "registers", "stack", "seconds"} or {"error"}}, "not_launched", "unexpected"}, or
{"skip": reason} where this triton has no CUDA backend or no ptxas.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

# one model of the GPU runs (docs/gpu.md: d_model 768, 12 heads, sequence 1024): head dim 64
B, H, T, HEAD_DIM = 2, 12, 1024, 64
DAPE_WIDTH = 32  # pos.mlp_width's default (relpos_cli/positions/dape.py)
COPE_POSITIONS = 64  # CoPE's max_positions default
SHAW_DISTANCE = 16  # Shaw's max_distance default
CONFIGS = {"float32": ("float32", False), "float32-tf32": ("float32", True), "bfloat16": ("bfloat16", False)}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def find_ptxas() -> str | None:
    """The ptxas triton would run for sm_90, None if there is none."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas  # triton >= 3.5
        return get_ptxas(90).path
    except ImportError:
        pass
    except Exception:  # noqa: BLE001 - triton raises RuntimeError and others when it finds none
        return None
    try:
        from triton import knobs
        return knobs.nvidia.ptxas.path
    except Exception:  # noqa: BLE001
        pass
    wheel = Path(importlib.import_module("triton").__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return str(wheel) if wheel.exists() else shutil.which("ptxas")


def no_cuda_compiler() -> str | None:
    """Why this triton cannot compile for CUDA, None if it can."""
    from triton.backends import backends
    if "nvidia" not in backends:
        return f"triton {importlib.import_module('triton').__version__} has no CUDA backend (backends: {sorted(backends)})"
    ptxas = find_ptxas()
    if not ptxas or not Path(ptxas).exists():
        return "triton's CUDA backend finds no ptxas (the wheel's backends/nvidia/bin/ptxas, or TRITON_PTXAS_PATH)"
    return None


class StandInDriver:
    """What JITFunction.run asks of the active driver before compiling, on a machine with no GPU."""

    def __init__(self, target):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def kernel_modules() -> dict[str, object]:
    """Every module of relpos_cli.kernels, imported (TRITON_INTERPRET unset: compilable kernels)."""
    import relpos_cli.kernels as package
    return {info.name: importlib.import_module(f"{package.__name__}.{info.name}")
            for info in pkgutil.iter_modules(package.__path__)}


def launched_kernels(modules: dict[str, object]) -> dict[str, tuple[object, str]]:
    """name -> (module, name) for the triton.jit functions defined in these modules that no other
    triton.jit function calls: the kernels the host code launches."""
    from triton.runtime.jit import JITFunction
    jitted = {}
    for module in modules.values():
        for name, obj in vars(module).items():
            if isinstance(obj, JITFunction) and obj.fn.__module__ == module.__name__:
                jitted[name] = (module, obj)
    sources = {name: obj.src for name, (_, obj) in jitted.items()}
    called = {name for name in jitted
              if any(re.search(rf"\b{re.escape(name)}\s*\(", src) for other, src in sources.items() if other != name)}
    return {name: (module, name) for name, (module, _) in jitted.items() if name not in called}


def host_calls(dtype, block: tuple[int, int] | None, warps: int | None = None, head_dim: int = HEAD_DIM):
    """public function name -> a call of it, forward and backward (forward only for fire_attention), on
    meta tensors of head_dim; block, warps: the tiles and num_warps passed to it (each kernel's own
    where None)."""
    import torch

    def t(*shape, dt=dtype):
        return torch.empty(shape, device="meta", dtype=dt, requires_grad=True)

    def qkv():
        return t(B, H, T, head_dim), t(B, H, T, head_dim), t(B, H, T, head_dim)

    tiles = ({} if block is None else {"block_m": block[0], "block_n": block[1]}) | ({} if warps is None else {"num_warps": warps})
    f32 = torch.float32
    return {
        # FoX's D is a float64 cumsum (positions/fox.py token_values)
        "forgetting_attention": lambda fn: fn(*qkv(), t(B, H, T, dt=torch.float64), **tiles),
        "stickbreaking_attention": lambda fn: fn(*qkv(), attend_current=False, **tiles),
        # per_position: float32 whatever q's dtype; per_distance: q @ table.T in q's dtype (positions/cope.py,
        # shaw.py kernel_inputs)
        "cope_attention": lambda fn: fn(*qkv(), t(B, H, T, COPE_POSITIONS, dt=f32), **tiles),
        # the base table and the MLP's parameters: float32 (parameters and distance_bias)
        "dape_attention": lambda fn: fn(*qkv(), t(H, T, dt=f32), t(DAPE_WIDTH, 2 * H, dt=f32), t(DAPE_WIDTH, dt=f32),
                                        t(H, DAPE_WIDTH, dt=f32), t(H, dt=f32), **tiles),
        "distance_attention": lambda fn: fn(*qkv(), t(H, T, dt=f32), **tiles),
        # ALiBi's fixed slopes: no gradient
        "linear_distance_attention": lambda fn: fn(*qkv(), torch.empty(H, device="meta", dtype=f32), **tiles),
        # forward only (evaluation): no input records a gradient; FIRE's grid of 8,193 points, (|c|, L, eps), positions
        "fire_attention": lambda fn: fn(*(x.detach() for x in qkv()), torch.empty(H, 8193, device="meta", dtype=f32),
                                        torch.empty(3, device="meta", dtype=f32),
                                        torch.empty(T, device="meta", dtype=torch.int64), **tiles),
        "shaw_attention": lambda fn: fn(*qkv(), t(B, H, T, 2 * SHAW_DISTANCE + 1), **tiles),
        # RoPE's cos and sin (T, Dh) in q's dtype, no gradient (positions/rope.py rotation); no tiles to take
        "rotary_embedding": lambda fn: fn(t(B, H, T, head_dim), *(torch.empty(T, head_dim, device="meta", dtype=dtype)
                                                                  for _ in range(2))),
        "rotary_embedding_pair": lambda fn: fn(t(B, H, T, head_dim), t(B, H, T, head_dim),
                                               *(torch.empty(T, head_dim, device="meta", dtype=dtype) for _ in range(4))),
    }


class Recorder:
    """Stands for a kernel in its module while the host code runs: kernel[grid](*args, **kwargs)
    records the launch."""

    def __init__(self, name, launches):
        self.name, self.launches = name, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((self.name, grid, args, kwargs))
        return launch


def record_launches(modules, kernels, calls, only):
    """Run each public function's host code with the kernels replaced by recorders -> the launches
    [(kernel name, grid, args, kwargs)], and host calls that failed {function: error}."""
    import torch
    from relpos_cli.kernels import KERNEL_MODULES, OTHER_MODULES

    launches, failed = [], {}
    originals = {name: getattr(module, name) for name, (module, _) in kernels.items()}
    checks = {name: getattr(module, "check_device") for name, module in modules.items() if hasattr(module, "check_device")}
    try:
        for name, (module, _) in kernels.items():
            setattr(module, name, Recorder(name, launches))
        for name in checks:  # meta tensors are not CUDA tensors; nothing runs on them
            modules[name].check_device = lambda *args: None
        for public, module_name in (KERNEL_MODULES | OTHER_MODULES).items():
            if only and public not in only:
                continue
            if public not in calls:
                failed[public] = "no host call for it in tests/kernel_compile_probe.py host_calls: add one"
                continue
            try:
                outs = calls[public](getattr(modules[module_name], public))
                outs = outs if isinstance(outs, tuple) else (outs,)  # the rotation of a pair gives two
                if all(out.requires_grad for out in outs):  # a forward-only kernel (fire_attention) has no backward
                    torch.autograd.backward(outs, [torch.empty_like(out) for out in outs])
            except Exception:  # noqa: BLE001 - reported, the test fails on it
                failed[public] = traceback.format_exc(limit=3)
    finally:
        for name, fn in originals.items():
            setattr(kernels[name][0], name, fn)
        for name, check in checks.items():
            modules[name].check_device = check
    return launches, failed


def resource_usage(cubin: bytes) -> dict[str, int]:
    """REG and STACK (bytes of local memory: register spills and local arrays) of a cubin, from the
    wheel's cuobjdump; {} where there is none."""
    tool = Path(find_ptxas() or "").with_name("cuobjdump")
    if not tool.exists():
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        out = subprocess.run([str(tool), "--dump-resource-usage", str(path)], capture_output=True, text=True).stdout
    found = dict(re.findall(r"\b(REG|STACK):(\d+)", out))
    return {"registers": int(found["REG"]), "stack": int(found["STACK"])} if "REG" in found else {}


def compile_launch(fn, grid, args, kwargs) -> dict:
    import torch
    args = [a.dtype if isinstance(a, torch.Tensor) else a for a in args]  # warmup takes dtypes for tensors
    start = time.perf_counter()
    compiled = fn.warmup(*args, grid=grid, **kwargs)
    seconds = time.perf_counter() - start
    meta = compiled.metadata
    return {"shared": meta.shared, "num_warps": meta.num_warps, "num_stages": meta.num_stages,
            "constexprs": {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")},
            "launch_options": {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs},
            "arg_dtypes": sorted({str(a).removeprefix("torch.") for a in args if not isinstance(a, (int, float))}),
            **resource_usage(compiled.asm["cubin"]), "seconds": round(seconds, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", choices=sorted(CONFIGS))
    parser.add_argument("--only", nargs="*", help="public functions (forgetting_attention, ...) to compile")
    parser.add_argument("--block", nargs=2, type=int, metavar=("M", "N"), help="block_m, block_n passed to them")
    parser.add_argument("--warps", type=int, help="num_warps passed to them")
    parser.add_argument("--head-dim", type=int, default=HEAD_DIM, help=f"q, k, v's head size (default {HEAD_DIM})")
    opts = parser.parse_args()
    if interpreting():
        print(json.dumps({"error": "TRITON_INTERPRET is set: the kernels would be interpreted functions"}))
        return 2

    import torch
    import triton
    reason = no_cuda_compiler()
    if reason:
        print(json.dumps({"skip": reason}))
        return 0
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    driver.set_active(StandInDriver(GPUTarget("cuda", 90, 32)))  # an H100 whatever GPU, if any, is here
    target = driver.active.get_current_target()

    dtype_name, tf32 = CONFIGS[opts.config]
    torch.backends.cuda.matmul.allow_tf32 = tf32  # what _launch.dot_precision reads for fp32 tiles
    modules = kernel_modules()
    kernels = launched_kernels(modules)
    calls = host_calls(getattr(torch, dtype_name), tuple(opts.block) if opts.block else None, opts.warps, opts.head_dim)
    launches, failed = record_launches(modules, kernels, calls, opts.only)

    results = {public: {"error": f"host code: {error}"} for public, error in failed.items()}
    first_kwargs: dict[str, dict] = {}
    for name, grid, args, kwargs in launches:
        # a kernel launched again with other constexprs (distance.py's for a table and for slopes) is
        # another binary: reported under its name and the constexprs that differ from its first launch's
        first = first_kwargs.setdefault(name, kwargs)
        differ = [f"{key}={value}" for key, value in kwargs.items() if first.get(key) != value]
        key = f"{name} {','.join(differ)}" if differ else name
        try:
            results[key] = compile_launch(getattr(kernels[name][0], name), grid, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - reported per kernel
            results[key] = {"error": f"{type(exc).__name__}: {str(exc)[-3000:]}"}
    launched = {name for name, *_ in launches}
    from relpos_cli.kernels import KERNEL_MODULES, OTHER_MODULES
    wanted = {name for name, (module, _) in kernels.items()
              if not opts.only or module.__name__.rsplit(".", 1)[1] in {(KERNEL_MODULES | OTHER_MODULES)[p] for p in opts.only}}
    print(json.dumps({"config": opts.config, "target": [target.backend, target.arch, target.warp_size],
                      "triton": triton.__version__, "kernels": results,
                      "not_launched": sorted(wanted - launched), "unexpected": sorted(launched - set(kernels))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
