"""The fused Triton kernels (relpos_cli/kernels) compiled for an H100 (sm_90) without a GPU: every
kernel the host code launches, forward and backward, with the launch settings that code uses on
CUDA, must compile and fit an H100's shared memory per block, but DAPE's where kernels.serves sends
its calls elsewhere (kernels.DAPE_FOOTPRINT), which must be exactly where it does not fit (checked
at head sizes 64 and 128); and in bfloat16 none may spill registers to local memory, but those SPILLING
declares (with why), which must still spill.

What runs: tests/kernel_compile_probe.py, in a subprocess with TRITON_INTERPRET unset (the other
kernel tests set it for this process, and triton.jit then makes interpreted functions that cannot be
compiled), HOME, TRITON_HOME, TRITON_CACHE_DIR and TMPDIR in this test's tmp_path. It finds the
kernels (the kernel modules' triton.jit functions no other triton.jit function calls), runs each
public function (forgetting_attention, ...) forward and backward on meta tensors with the kernels
replaced by recorders, so the grid, arguments, constexprs (each kernel's tiles and num_warps from
_launch.launch_tiles at head dim 64: its module's KernelTiles, narrow in bfloat16, wide in float32)
and num_stages (_launch.pipeline_stages) are the host code's own, then compiles
each recorded launch through the kernel's warmup for sm_90 (ptxas from the triton wheel) and reports
each kernel's shared memory (the compiled kernel's metadata.shared, what Triton's launcher checks
against the device's limit), registers and stack bytes as JSON. Shapes: B 2, 12 heads, length 1024,
head dim 64 (docs/gpu.md's bench model); DAPE with its default MLP width 32. Dtype configurations:
q, k, v in bfloat16; in float32 with TF32 off (PRECISION "ieee") and on ("tf32"), as
_launch.dot_precision picks from torch.backends.cuda.matmul.allow_tf32.

What this shows: the kernels pass Triton's front end, its GPU passes and ptxas for sm_90 with the
triton installed here, and their shared memory at these settings as that triton lays it out, against
232448 bytes (227 KiB, the "Hardware limit" an H100 reports for one block; Triton's launcher raises
OutOfResources above it). What it does not show: the triton that runs on the GPU machine may differ
(3.6 there, 3.9.0 where this was written; the figures, and whether a kernel compiles at all,
differ between the two: put the other triton first on PYTHONPATH to compile with it); nothing
runs, so no number is checked (the interpreter tests on CPU and the same tests on CUDA do that);
spills are judged in bfloat16 only, with this triton's ptxas (the float32 ones are printed: the wide
tiles are not chosen spill-free yet); other head dims, head counts (DAPE
holds all heads in one program), grouped-query shapes, stick-breaking's attend_current=True and
float16 are not compiled.

Run time on one core, triton 3.9: bfloat16 ~30 s, float32 with TF32 ~80 s (run by default); float32
with TF32 off ~4.5 minutes (tl.dot on fp32 tiles without tensor cores), marked slow (`-m "not slow"`
skips it). `-s` prints each configuration's table of kernels.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import torch

from kernel_compile_probe import B, CONFIGS, H, HEAD_DIM, T
from relpos_cli.kernels import serves

DAPE_KERNELS = {"_dape_forward": False, "_dape_backward": True}  # -> whether a call that launches it needs gradients
BACKWARD_DELTA = "_attention_backward_delta"  # DAPE's backward's preprocessing (relpos_cli/kernels/output_grad.py)

REPO = Path(__file__).resolve().parents[1]
PROBE = REPO / "tests" / "kernel_compile_probe.py"
H100_SHARED_PER_BLOCK = 232448  # cudaDevAttrMaxSharedMemoryPerBlockOptin of an H100 (227 KiB)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="the fused kernels need triton (pip install triton); none installed to compile them")


def compile_kernels(config: str, tmp_path: Path, *options: str) -> dict:
    """Run the probe for one dtype configuration (and its options) -> its JSON report; skips where this
    triton cannot compile for CUDA."""
    home, tmp = tmp_path / "home", tmp_path / "tmp"
    home.mkdir()
    tmp.mkdir()
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(HOME=str(home), TRITON_HOME=str(home), TRITON_CACHE_DIR=str(tmp_path / "triton"), TMPDIR=str(tmp),
               PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(PROBE), config, *options], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=1200)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines, f"the probe exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    report = json.loads(lines[-1])
    if "skip" in report:
        pytest.skip(report["skip"])
    assert "error" not in report, report["error"]
    # Triton's MLIR passes write their errors to stderr only (the exception says "PassManager::run failed")
    report["stderr_errors"] = [line for line in proc.stderr.splitlines() if "error" in line.lower()][:20]
    return report


# kernels that spill registers at the narrow tiles their module declares, with the reason: at every tile
# and warp count tried, or at settings a GPU measured faster than spill-free ones (the modules' comments);
# the rest must not spill at the narrow tiles their module declares (_launch.KernelTiles)
MEASURED_FASTER = "spills at 4 warps, which ran faster on an H200 than the spill-free 8 (kernels/{}.py's tiles)"
SPILLING = {"_dape_backward": "holds all heads' eight score-sized tiles in one program (kernels/dape.py)",
            "_dape_forward": MEASURED_FASTER.format("dape"),
            "_distance_backward_kv": MEASURED_FASTER.format("distance"),
            # the probe's name for the kernel launched again with other constexprs (kernel_compile_probe.py)
            "_distance_backward_kv LINEAR=True": "ALiBi's slopes at the table's tiles: 24 bytes with triton 3.9, the "
                                                 "tiles untimed for slopes",
            **{name: MEASURED_FASTER.format("forgetting") for name in ("_fox_forward", "_fox_backward_kv")}}


def assert_no_spills(kernels: dict, table: str) -> None:
    """No register spills (stack bytes: local memory) in the 16-bit kernels but the SPILLING ones,
    which must still spill (else the entry has gone stale)."""
    compiled = {name: result for name, result in kernels.items() if "stack" in result}
    if not compiled:
        pytest.skip("no cuobjdump beside ptxas to read registers and spills from")
    spilled = sorted(name for name, result in compiled.items() if result["stack"] and name not in SPILLING)
    assert not spilled, (f"{spilled} spill registers at the tiles their module declares: pick tiles or warps "
                         f"that do not (tests/kernel_compile_probe.py --block M N --warps W), or declare why in "
                         f"SPILLING\n{table}")
    stale = sorted(name for name in SPILLING if name in compiled and not compiled[name]["stack"])
    assert not stale, f"{stale} no longer spill: take them out of SPILLING"


def assert_dape_served_where_it_fits(kernels: dict, dtype: str, head_dim: int) -> None:
    """kernels.serves runs DAPE's forward (no grad) and backward (training) on CUDA exactly where they
    compiled within an H100's shared memory, at the probe's 12 heads of head_dim (DAPE_FOOTPRINT)."""
    q = SimpleNamespace(is_cuda=True, dtype=getattr(torch, dtype), shape=(B, H, T, head_dim),
                        element_size=lambda: torch.empty((), dtype=getattr(torch, dtype)).element_size())
    for name, needs_grad in DAPE_KERNELS.items():
        fits = "error" not in kernels[name] and kernels[name]["shared"] <= H100_SHARED_PER_BLOCK
        assert serves("dape_attention", q, needs_grad) == fits, (
            f"{name} at {H} heads of {head_dim} in {dtype}: {kernels[name].get('shared', kernels[name].get('error'))} "
            f"bytes of shared memory, but kernels.serves says {'it runs' if not fits else 'it does not'} "
            f"(relpos_cli.kernels.DAPE_FOOTPRINT)")


def describe(name: str, result: dict) -> str:
    if "error" in result:
        return f"{name}: did not compile: {result['error']}"
    over = result["shared"] > H100_SHARED_PER_BLOCK
    return (f"{name}: shared {result['shared']} bytes ({'OVER' if over else 'within'} {H100_SHARED_PER_BLOCK}), "
            f"{result['num_warps']} warps, {result['num_stages']} stages, {result.get('registers', '?')} registers, "
            f"stack {result.get('stack', '?')} bytes, tiles {result['constexprs']}, {result['seconds']} s")


@pytest.mark.parametrize("config", [pytest.param("float32", marks=pytest.mark.slow), "float32-tf32", "bfloat16"])
def test_kernels_compile_for_h100_and_fit_shared_memory(config, tmp_path):
    report = compile_kernels(config, tmp_path)
    assert report["target"] == ["cuda", 90, 32], report["target"]
    kernels = report["kernels"]
    assert not report["not_launched"], (f"kernels the host code never launched for these calls (a launch path the probe "
                                        f"misses, or dead code): {report['not_launched']}")
    assert not report["unexpected"], f"launches of unknown kernels: {report['unexpected']}"
    assert kernels, "no kernel was found"
    table = "\n".join(describe(name, result) for name, result in sorted(kernels.items()))
    print(f"\n{config} (triton {report['triton']}, sm_90):\n{table}")
    assert_dape_served_where_it_fits(kernels, CONFIGS[config][0], HEAD_DIM)
    if config == "bfloat16":
        assert_no_spills(kernels, table)
    failed = {name: "did not compile" if "error" in result else f"{result['shared']} bytes of shared memory"
              for name, result in sorted(kernels.items())
              if name not in DAPE_KERNELS and ("error" in result or result["shared"] > H100_SHARED_PER_BLOCK)}
    assert not failed, (f"{config}: {len(failed)} of {len(kernels)} kernels do not compile for sm_90 or ask for more "
                        f"shared memory than an H100 has per block ({H100_SHARED_PER_BLOCK} bytes): "
                        f"{', '.join(f'{name} ({why})' for name, why in failed.items())}. "
                        f"All of them, with triton {report['triton']}:\n{table}\nErrors the probe wrote to stderr:\n"
                        + "\n".join(report["stderr_errors"]))


@pytest.mark.parametrize("config", ["bfloat16", "float32-tf32"])
def test_dape_at_head_size_128_runs_where_it_fits(config, tmp_path):
    """Twice the head size takes twice DAPE's shared memory: in bf16 its forward still fits an H100 and
    its backward does not; in float32 neither does. kernels.serves must say the same."""
    report = compile_kernels(config, tmp_path, "--only", "dape_attention", "--head-dim", "128")
    print(f"\n{config}, head dim 128:\n" + "\n".join(describe(name, result) for name, result in sorted(report["kernels"].items())))
    assert set(report["kernels"]) == set(DAPE_KERNELS) | {BACKWARD_DELTA}, report["kernels"]
    assert_dape_served_where_it_fits(report["kernels"], CONFIGS[config][0], 128)


def test_cope_at_head_size_16_compiles_its_backward_unpipelined(tmp_path):
    """CoPE's backward at a padded head size of 16 with bf16 q and its float32 table (what the model
    gives) failed to compile with triton 3.6, software-pipelined ("Fatal pipeliner error", found on an
    H200 when it was one kernel; the probe reproduces it with that triton first on PYTHONPATH): both its
    programs launch with one stage there, and compile with the triton at hand."""
    report = compile_kernels("bfloat16", tmp_path, "--only", "cope_attention", "--head-dim", "16")
    kernels = report["kernels"]
    print("\nbfloat16, head dim 16:\n" + "\n".join(describe(name, result) for name, result in sorted(kernels.items())))
    assert set(kernels) == {"_cope_forward", "_cope_backward_q", "_cope_backward_kv"}, kernels
    assert [name for name, result in kernels.items() if "error" in result] == [], report["stderr_errors"]
    assert kernels["_cope_backward_q"]["num_stages"] == kernels["_cope_backward_kv"]["num_stages"] == 1
