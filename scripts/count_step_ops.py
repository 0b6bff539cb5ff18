"""Count the ATen ops one training step dispatches, and time its host work, per scheme, on CPU.

A training step on a GPU waits on its host for most schemes (docs/gpu.md, "Sixth run"): every op is a
launch from Python, and so is every Triton kernel. This measures the host's side without a GPU: a model
of `--layers` layers with model.attn_backend=fused, on tensors so small that computing them costs next
to nothing, with every Triton kernel's launch replaced by one that runs nothing (the fused kernels'
host code runs whole: checks, allocations, launch settings; their outputs are left unwritten), takes a
warm-up step, then one forward and backward under a dispatch mode that counts every ATen op (the
Triton launches it would make are counted apart), then `--steps` more, timed. Schemes without a bias
run SDPA. On CPU the rotation of RoPE, xPos and p-RoPE runs as PyTorch ops (one Triton kernel each way
on CUDA), so their counts and times are higher here than their launches there.

    python scripts/count_step_ops.py --schemes none,alibi,t5,kerple_log --layers 12 --json ops.json

Prints one line per scheme (ATen ops, Triton launches, host ms a step, and the differences from the
first scheme) and writes {"layers", "d_model", "seq_len", "steps", "threads", "commit", "ops": {scheme:
n}, "launches": {scheme: n}, "host_ms": {scheme: median ms a step}, "top": {scheme: {op: n}}} to --json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class NoLaunch:
    """Stands for a Triton kernel: kernel[grid](*args) runs nothing and is counted."""

    def __init__(self, launches: Counter, name: str):
        self.launches, self.name = launches, name

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches[self.name] += 1
        return launch


def stub_kernels(launches: Counter) -> None:
    """Replace every Triton kernel of relpos_cli.kernels' modules by a NoLaunch counting into `launches`."""
    import importlib
    import pkgutil

    from triton.runtime.jit import KernelInterface

    import relpos_cli.kernels as package

    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for name, value in list(vars(module).items()):
            if isinstance(value, KernelInterface):
                setattr(module, name, NoLaunch(launches, name))


def step_ops(scheme: str, layers: int, d_model: int, seq_len: int, steps: int,
             launches: Counter) -> tuple[Counter, int, float]:
    """(ATen ops (name -> count) of one forward and backward of the loss, after a warm-up step; the
    Triton launches it makes; the median host milliseconds of `steps` more)."""
    import statistics
    import time

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from relpos_cli.model import build_model

    class Counted(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: Counter = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func._schema.name] += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    cfg = {"model": {"d_model": d_model, "n_layers": layers, "n_heads": 4, "attn_backend": "fused"},
           "train": {"seq_len": seq_len}, "pos": {"name": scheme}}
    model = build_model(cfg, 64)
    tokens = torch.randint(0, 64, (2, seq_len + 1))
    model.loss(tokens[:, :-1], tokens[:, 1:]).backward()  # caches filled (T5's buckets per length)
    launches.clear()
    model.zero_grad(set_to_none=True)  # as training does before each step: gradients assigned, not added
    with Counted() as counted:
        model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    launched = sum(launches.values())
    seconds = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
        seconds.append(time.perf_counter() - start)
    return counted.ops, launched, statistics.median(seconds) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schemes", default="none,alibi,t5,kerple_log,sandwich,fox,rope",
                    help="comma-separated; the first is the one the others are compared with")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per scheme (the median is kept)")
    ap.add_argument("--json", type=Path, help="write the counts here")
    args = ap.parse_args()
    if args.layers < 1 or args.seq_len < 1 or args.steps < 1 or args.d_model < 4 or args.d_model % 4:
        ap.error("--layers, --seq-len and --steps must be at least 1, --d-model a multiple of the 4 heads")
    os.environ["TRITON_INTERPRET"] = "1"  # the fused backend's checks pass on CPU; the kernels are stubbed
    sys.path.insert(0, str(REPO))
    from relpos_cli.errors import RelposError
    from relpos_cli.positions import named_schemes

    try:
        schemes = named_schemes(args.schemes)
    except RelposError as e:
        ap.error(f"--schemes: {e}")
    import torch

    torch.set_num_threads(1)
    launches: Counter = Counter()
    stub_kernels(launches)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    data = {"layers": args.layers, "d_model": args.d_model, "seq_len": args.seq_len, "steps": args.steps, "threads": 1,
            "commit": commit or None,
            "what": "one training step (forward and backward) on CPU, model.attn_backend=fused, Triton's launches "
                    "replaced by ones that run nothing: its ATen ops, its Triton launches, and the median wall ms of "
                    "--steps steps (the host's work: the tensors are tiny)",
            "ops": {}, "launches": {}, "host_ms": {}, "top": {}}
    for scheme in schemes:
        try:
            ops, launched, ms = step_ops(scheme, args.layers, args.d_model, args.seq_len, args.steps, launches)
        except RelposError as e:
            raise SystemExit(f"count_step_ops: pos={scheme}: {e}")
        data["ops"][scheme], data["launches"][scheme] = sum(ops.values()), launched
        data["host_ms"][scheme], data["top"][scheme] = round(ms, 2), dict(ops.most_common(15))
        first = schemes[0]
        print(f"{scheme}: {data['ops'][scheme]} ops ({data['ops'][scheme] - data['ops'][first]:+d}), {launched} Triton "
              f"launches, {ms:.2f} host ms a step ({ms - data['host_ms'][first]:+.2f} against {first})", flush=True)
    if args.json:
        tmp = args.json.with_name(args.json.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(args.json)


if __name__ == "__main__":
    main()
