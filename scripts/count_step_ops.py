"""Count the ATen ops one training step dispatches around the attention kernels, per scheme, on CPU.

A training step on a GPU waits on its host for most schemes (docs/gpu.md, "Sixth run"): every op is a
launch from Python. This counts them without a GPU: a model of `--layers` layers with
model.attn_backend=fused takes one warm-up step, then one forward and backward under a dispatch mode
that counts every ATen op, with each fused attention kernel replaced by a stand-in (its output a copy
of q, gradients to q only), so what is counted is the rest of the step: the projections, the MLPs,
the scheme's tables and rotations, the loss. Schemes without a bias run SDPA (one op each way).
On CPU the rotation of RoPE, xPos and p-RoPE runs as PyTorch ops (one Triton kernel on CUDA), so
their counts are higher here than their launches there.

    python scripts/count_step_ops.py --schemes none,alibi,t5,kerple_log --layers 12 --json ops.json

Prints one line per scheme (ops, and the difference from the first scheme) and writes
{"layers", "d_model", "seq_len", "commit", "ops": {scheme: n}, "top": {scheme: {op: n}}} to --json.
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


def stub_kernels() -> None:
    """Replace every fused attention kernel (relpos_cli.kernels.KERNEL_MODULES) by a stand-in whose
    output is a copy of q and whose backward gives q the output's gradient, the others none."""
    import importlib

    import torch

    from relpos_cli import kernels

    class StandIn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, *rest):
            ctx.inputs = len(rest)
            return q.clone()

        @staticmethod
        def backward(ctx, grad):
            return (grad, *([None] * ctx.inputs))

    for name, module in kernels.KERNEL_MODULES.items():
        setattr(importlib.import_module(f"relpos_cli.kernels.{module}"), name,
                lambda q, k, v, *rest, **tiles: StandIn.apply(q, k, v, *rest))


def step_ops(scheme: str, layers: int, d_model: int, seq_len: int) -> Counter:
    """ATen ops (name -> count) of one forward and backward of the loss, after a warm-up step."""
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
    with Counted() as counted:
        model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    return counted.ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schemes", default="none,alibi,t5,kerple_log,sandwich,fox,rope",
                    help="comma-separated; the first is the one the others are compared with")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--json", type=Path, help="write the counts here")
    args = ap.parse_args()
    if args.layers < 1 or args.seq_len < 1 or args.d_model < 4 or args.d_model % 4:
        ap.error("--layers and --seq-len must be at least 1, --d-model a multiple of the 4 heads")
    os.environ["TRITON_INTERPRET"] = "1"  # the fused backend's checks pass on CPU; the kernels are stubbed
    sys.path.insert(0, str(REPO))
    from relpos_cli.errors import RelposError
    from relpos_cli.positions import named_schemes

    try:
        schemes = named_schemes(args.schemes)
    except RelposError as e:
        ap.error(f"--schemes: {e}")
    stub_kernels()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    data = {"layers": args.layers, "d_model": args.d_model, "seq_len": args.seq_len, "commit": commit or None,
            "what": "ATen ops of one training step (forward and backward) on CPU, model.attn_backend=fused, the "
                    "fused attention kernels stubbed out", "ops": {}, "top": {}}
    for scheme in schemes:
        try:
            ops = step_ops(scheme, args.layers, args.d_model, args.seq_len)
        except RelposError as e:
            raise SystemExit(f"count_step_ops: pos={scheme}: {e}")
        data["ops"][scheme], data["top"][scheme] = sum(ops.values()), dict(ops.most_common(15))
        first = data["ops"][schemes[0]]
        print(f"{scheme}: {data['ops'][scheme]} ops ({data['ops'][scheme] - first:+d} against {schemes[0]})", flush=True)
    if args.json:
        tmp = args.json.with_name(args.json.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(args.json)


if __name__ == "__main__":
    main()
