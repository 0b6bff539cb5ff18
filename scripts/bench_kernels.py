"""Fused-kernel benchmark: each fused Triton kernel (relpos_cli/kernels) at its own launch settings and
over tile sizes and warp counts, against SDPA without a bias (FlashAttention: the floor a kernel with
a bias can approach), at the training shape of scripts/bench.py's GPU config (forward + backward)
and at one long evaluation window (forward, no grad). What a GPU session tunes the kernels'
KernelTiles from (relpos_cli/kernels/_launch.py): on an H100 the kernels' forward took 1.3-1.7x
flex's where flex reads a table or a formula (docs/results/gpu.md), at 128 x 64 tiles with 4 warps,
where every kernel spilled registers; their own tiles now compile without spills (but DAPE's
backward), untimed.

    PYTHONPATH=$PWD python scripts/bench_kernels.py --json bench_kernels.json       # CUDA
    PYTHONPATH=$PWD python scripts/bench_kernels.py --dry-run --json /tmp/k.json   # CPU, Triton's interpreter, tiny

Each kernel gets the inputs its scheme hands it (attention.fused_call, from the scheme's default
options at its initial parameters, built for the training shape's length: FIRE's evaluation window
passes its threshold, which runs kernels.fire_attention). "own": every kernel of the call at its module's KernelTiles
(forward and backward kernels at tiles of their own); "MxN wW": all of them at M x N with W warps.
Every kernel is timed at its own settings first, then every kernel at the first H100 run's (128 x 64,
4 warps), then the other settings, so that --deadline-s cuts the alternatives first. q, k, v are drawn
N(0, 1); stick-breaking's and CoPE's walks stop early on such logits (EARLY_STOPPING), so each is also
timed at its own settings on logits near -6, where it walks every key tile ("own, full walk"): what a
trained model costs lies between the two, depending on its weights.
CUDA: median milliseconds of triton.testing.do_bench; the dry run times one call with the clock (its
numbers mean nothing). A setting that fails (out of shared memory, a compile error) is recorded as
its error. Every figure is written to the JSON as it is taken;
--deadline-s stops cleanly before that many seconds.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
# one per kernel (alibi: the distance kernel's linear bias; t5: its table; fire: past its threshold, evaluation only)
SCHEMES = ("alibi", "t5", "fox", "stickbreaking", "cope", "dape", "shaw", "fire")
# trained through another scheme's kernel (FIRE: the distance kernel's table, as T5), so timed in evaluation only
EVALUATION_ONLY = ("fire",)
# kernels whose walk from the nearest keys stops where the weights let it (stick-breaking: every stick spent;
# CoPE: every gate count at its cap). Logits of N(0, 1), as drawn here, stop it after about 130-160 keys;
# each is timed again at its own settings on logits near -6 (FULL_WALK), where it walks every key tile
EARLY_STOPPING = ("stickbreaking", "cope")
FULL_WALK = "own, full walk"
# (B, H, T, Dh): bench.py's GPU training batch of 8 x 1024 at 12 heads of 64; one 16k evaluation window
SHAPES = {"train": (8, 12, 1024, 64), "eval": (1, 12, 16384, 64)}
DRY_SHAPES = {"train": (1, 2, 48, 16), "eval": (1, 2, 64, 16)}
# (block_m, block_n, num_warps), None for the kernels' own; the first of each is timed for every kernel,
# then the second (what the first H100 run used: 128 x 64, 4 warps in bf16), then the rest
SETTINGS = (None, (128, 64, 4), (64, 64, 8), (128, 32, 8), (64, 64, 4), (128, 128, 8), (64, 32, 8), (128, 64, 8))
DAPE_SETTINGS = (None, (16, 16, 4), (32, 16, 8), (16, 32, 8), (16, 16, 16))  # a DAPE program holds every head's tiles
DRY_SETTINGS = (None, (16, 16, 4), (32, 16, 2))


def timer(dry: bool) -> Callable[[Callable[[], Any]], float]:
    """Milliseconds per call of fn: do_bench's median on CUDA; one clocked call in a dry run."""
    if dry:
        def clocked(fn: Callable[[], Any]) -> float:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        return clocked
    import triton.testing

    return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def never_stopping(shape: tuple[int, int, int, int]) -> list:
    """q, k, v (float32, CPU) whose every logit q . k / sqrt(Dh) is about -6, q and k lying along opposite
    directions: gates of 0.0025, so over 16k keys a stick-breaking query spends about 40 of the 110 that
    stop its walk, and a CoPE count reaches about 40 of its cap of 63 (tests/test_bench_kernels.py)."""
    import torch

    g = torch.Generator().manual_seed(0)
    Dh = shape[-1]
    along = math.sqrt(6 * math.sqrt(Dh) / Dh)  # in each of Dh components: q . k = -6 sqrt(Dh)
    q, k, v = (torch.randn(shape, generator=g) * 0.05 for _ in range(3))
    return [q + along, k - along, v * 20]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, required=True, help="written after each figure")
    ap.add_argument("--dry-run", action="store_true", help="CPU under Triton's interpreter, tiny shapes, float32")
    ap.add_argument("--deadline-s", type=float, default=240, help="stop cleanly before this many seconds")
    ap.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated, one scheme per kernel")
    args = ap.parse_args()
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel modules define their kernels
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "scripts"))
    import torch
    import torch.nn.functional as F
    from gpu_check import Deadline, commit, first_line, save, time_limit

    from relpos_cli import kernels
    from relpos_cli.attention import fused_call, fused_kernel
    from relpos_cli.errors import RelposError
    from relpos_cli.positions import build_scheme, named_schemes
    from relpos_cli.positions.base import ModelShape

    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("bench_kernels: no CUDA device (use --dry-run on CPU)")
    try:
        schemes = named_schemes(args.schemes)
    except RelposError as e:
        raise SystemExit(f"bench_kernels: {e}") from None
    if no_kernel := [s for s in schemes if fused_kernel(build_scheme({"name": s}, ModelShape(32, 2, 1, 64))) is None]:
        raise SystemExit(f"bench_kernels: pos={', '.join(no_kernel)} has no fused kernel")
    device = "cpu" if args.dry_run else "cuda"
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    shapes = DRY_SHAPES if args.dry_run else SHAPES
    deadline = Deadline(args.deadline_s, 0 if args.dry_run else 5)
    ms = timer(args.dry_run)
    import triton

    data: dict[str, Any] = {
        "device": "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name(0), "torch": torch.__version__,
        "triton": triton.__version__, "commit": commit(), "dry_run": args.dry_run, "dtype": str(dtype).removeprefix("torch."),
        "started_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "shapes": {k: dict(zip("BHTD", v)) for k, v in shapes.items()},
        "what": "median ms per call; train: forward + backward, eval: forward without grad",
        "sdpa": {}, "kernels": {},
    }

    def measure(fn: Callable[[], Any]) -> float | str:
        if deadline.left() < (0 if args.dry_run else 10):
            return "skipped: deadline"
        try:
            with time_limit(min(60.0, deadline.left())):
                return round(ms(fn), 4)
        except Exception as e:  # noqa: BLE001 -- out of shared memory, a compile error: recorded, go on
            return first_line(e)
        finally:
            if device == "cuda":
                torch.cuda.empty_cache()

    def drawn(shape: tuple[int, int, int, int], grad: bool) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        return [torch.randn(shape, generator=g).to(device, dtype).requires_grad_(grad) for _ in range(3)]

    calls: dict[tuple[str, str], Callable[[dict], Callable[[], Any]]] = {}  # (phase, scheme) -> settings -> a timed call
    full_walks: dict[tuple[str, str], Callable[[], Any]] = {}  # (phase, scheme) -> its call at its own settings
    for phase, shape in shapes.items():
        grad = phase == "train"
        q, k, v = drawn(shape, grad)
        upstream = torch.randn_like(q)

        def run(call: Callable[[], torch.Tensor], grad: bool = grad, upstream: torch.Tensor = upstream) -> Callable[[], Any]:
            if grad:
                return lambda: call().backward(upstream)
            return lambda: torch.no_grad()(call)()

        data["sdpa"][phase] = measure(run(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True)))
        print(f"{phase} sdpa (no bias): {data['sdpa'][phase]} ms", flush=True)
        save(args.json, data)
        B, H, T, Dh = shape
        for name in schemes:
            if grad and name in EVALUATION_ONLY:
                continue
            # trained at the training shape's length, evaluated past it (FIRE's threshold is that length)
            scheme = build_scheme({"name": name}, ModelShape(H * Dh, H, 1, shapes["train"][2])).to(device)
            layer_input = torch.randn(B, T, H * Dh, generator=torch.Generator().manual_seed(1)).to(device)
            layer_input.requires_grad_(grad)
            # made as training makes them (bf16 autocast), then leaves: each timed call runs the kernel alone, with a
            # gradient for the inputs that get one in training (not ALiBi's fixed slopes)
            def kernel_call(q: torch.Tensor) -> tuple[str, list]:
                """The scheme's kernel and its inputs for q (formed from q where the scheme's are)."""
                with torch.autocast(device, dtype=dtype, enabled=not args.dry_run), torch.set_grad_enabled(grad):
                    kernel, inputs = fused_call(scheme, fused_kernel(scheme), 0, q, torch.arange(T, device=device),
                                                layer_input, grad)
                return kernel, [t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
                                for t in inputs]

            kernel, inputs = kernel_call(q)
            data["kernels"].setdefault(name, {"kernel": kernel})[phase] = {}
            function = getattr(kernels, kernel)
            calls[phase, name] = lambda given, function=function, q=q, k=k, v=v, inputs=inputs, run=run: run(
                lambda: function(q, k, v, *inputs, **given))
            if name in EARLY_STOPPING:
                q_far, k_far, v_far = (t.to(device, dtype).requires_grad_(grad) for t in never_stopping(shape))
                inputs_far = kernel_call(q_far)[1]
                full_walks[phase, name] = run(lambda function=function, q=q_far, k=k_far, v=v_far, inputs=inputs_far:
                                              function(q, k, v, *inputs))
    # every kernel at its own settings, then every kernel at the first run's, then the alternatives: a
    # deadline cuts the alternatives first, and the first run's settings before any kernel's own
    for chosen in (slice(0, 1), slice(1, 2), slice(2, None)):
        for (phase, name), call in calls.items():
            kernel = data["kernels"][name]["kernel"]
            settings = DRY_SETTINGS if args.dry_run else DAPE_SETTINGS if kernel == "dape_attention" else SETTINGS
            for setting in settings[chosen]:
                given = dict(zip(("block_m", "block_n", "num_warps"), setting or ()))
                label = "own" if setting is None else "{}x{} w{}".format(*setting)
                data["kernels"][name][phase][label] = measure(call(given))
                print(f"{phase} {name} ({kernel}) {label}: {data['kernels'][name][phase][label]}", flush=True)
                save(args.json, data)
            if chosen.start == 0 and (phase, name) in full_walks:  # right after its own settings
                data["kernels"][name][phase][FULL_WALK] = measure(full_walks[phase, name])
                print(f"{phase} {name} ({kernel}) {FULL_WALK}: {data['kernels'][name][phase][FULL_WALK]}", flush=True)
                save(args.json, data)
    data["wall_s"] = round(deadline.elapsed(), 1)
    save(args.json, data)
    print(f"bench_kernels: {data['wall_s']} s; {args.json}")


if __name__ == "__main__":
    main()
