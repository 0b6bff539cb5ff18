"""Training speed benchmark: tokens/s and MFU per scheme, relpos against x-transformers with its
default attention and with its fastest CPU setting (attn_flash=True: fused SDPA). Prints a table
and writes JSON. Long evaluation has its own benchmark: scripts/bench_eval.py.

    PYTHONPATH=$PWD python scripts/bench.py --steps 6 --json bench.json
    PYTHONPATH=$PWD python scripts/bench.py --compile      # also relpos under torch.compile (train.compile)
    PYTHONPATH=$PWD python scripts/bench.py --gpu          # CUDA: ~125M params, seq 1024, bf16

MFU = model FLOPs per second / the fp32 (CPU) or bf16 (CUDA) matmul rate measured in the same run.
Model FLOPs per token = 6 * parameters + 12 * layers * d_model * seq (PaLM, appendix B).
Models are timed in turn, each for --steps steps after --warmup, repeated --rounds times
interleaved (best round kept), so load from other processes hits every model alike.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from relpos_cli.atomic import atomic_write_text  # noqa: E402
from relpos_cli.compile_cache import compile_training_loss  # noqa: E402
from relpos_cli.model import Transformer  # noqa: E402
from relpos_cli.positions.base import ModelShape  # noqa: E402

CPU_CFG = dict(d_model=256, n_layers=4, n_heads=8, seq_len=256, batch=16, vocab=8192)
GPU_CFG = dict(d_model=768, n_layers=12, n_heads=12, seq_len=1024, batch=8, vocab=32768)
XT_OPTIONS = {"rope": {"rotary_pos_emb": True}, "alibi": {"alibi_pos_bias": True}, "t5": {"rel_pos_bias": True},
              "none": {}}


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int) -> float:
    """Measured FLOP/s of an n x n matmul (best of several)."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(5):
        sync(device)
        start = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def relpos_model(cfg: dict, scheme: str, backend: str = "auto") -> torch.nn.Module:
    shape = ModelShape(cfg["d_model"], cfg["n_heads"], cfg["n_layers"], cfg["seq_len"])
    return Transformer(cfg["vocab"], shape, {"name": scheme}, mlp_ratio=4, attn_backend=backend)


def xt_model(cfg: dict, scheme: str, flash: bool) -> torch.nn.Module:
    """x-transformers' equivalent: flash=False is its default (unfused attention), flash=True its
    fastest CPU setting (attn_flash: torch SDPA, its bias passed as a mask)."""
    from x_transformers import Decoder, TransformerWrapper

    net = TransformerWrapper(
        num_tokens=cfg["vocab"], max_seq_len=cfg["seq_len"], use_abs_pos_emb=False, tie_embedding=True,
        attn_layers=Decoder(dim=cfg["d_model"], depth=cfg["n_layers"], heads=cfg["n_heads"], attn_flash=flash,
                            **XT_OPTIONS[scheme]),
    )
    net.loss = lambda x, y: torch.nn.functional.cross_entropy(net(x).flatten(0, 1), y.flatten())
    return net


def model_flops_per_token(model: torch.nn.Module, cfg: dict) -> float:
    params = sum(p.numel() for p in model.parameters())
    return 6 * params + 12 * cfg["n_layers"] * cfg["d_model"] * cfg["seq_len"]


def trainer(model: torch.nn.Module, cfg: dict, device: torch.device, amp: bool,
            compile: bool | str = False) -> Callable[[int], float]:
    """run(n): n full AdamW steps (forward, backward, clip, step) -> tokens/s. compile: train.compile's
    setting (false, true or a torch.compile mode), the loss compiled the way training compiles it."""
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss_fn = model.loss if compile is False else compile_training_loss(model.loss, compile)
    generator = torch.Generator(device).manual_seed(0)

    def run(steps: int) -> float:
        data = torch.randint(0, cfg["vocab"], (steps, cfg["batch"], cfg["seq_len"] + 1), device=device, generator=generator)
        sync(device)
        start = time.perf_counter()
        for batch in data:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                loss = loss_fn(batch[:, :-1], batch[:, 1:])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        sync(device)
        return steps * cfg["batch"] * cfg["seq_len"] / (time.perf_counter() - start)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schemes", default="none,rope,alibi,t5")
    ap.add_argument("--steps", type=int, default=4, help="timed training steps per model and round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per model first (compiles, if any)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved timing rounds; the best is kept")
    ap.add_argument("--compile", action="store_true", help="also time relpos with its loss under torch.compile")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--gpu", action="store_true", help="CUDA: 125M config, bf16 autocast, TF32, MFU vs bf16 matmul")
    ap.add_argument("--json", type=Path, default=Path("bench.json"))
    args = ap.parse_args()
    from relpos_cli.errors import RelposError
    from relpos_cli.positions import named_schemes

    try:
        schemes = named_schemes(args.schemes)
    except RelposError as e:
        raise SystemExit(f"bench: --schemes: {e}") from None
    for name, least in (("steps", 1), ("rounds", 1), ("warmup", 0), ("threads", 0)):
        if getattr(args, name) < least:
            raise SystemExit(f"bench: --{name} must be at least {least}, got {getattr(args, name)}")
    if args.gpu and not torch.cuda.is_available():
        raise SystemExit("bench: --gpu: no CUDA device (this torch: " + torch.__version__ + ")")
    if not args.json.parent.is_dir():  # found now, not after the whole run
        raise SystemExit(f"bench: --json {args.json}: no directory {args.json.parent}")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.gpu else "cpu")
    if args.gpu:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    cfg = GPU_CFG if args.gpu else CPU_CFG
    peak_dtype = torch.bfloat16 if args.gpu else torch.float32
    try:
        import x_transformers  # noqa: F401

        have_xt = True
    except ImportError:
        have_xt = False

    train_rows, rates = [], []
    for scheme in schemes:
        builders = {"relpos": lambda: (relpos_model(cfg, scheme), False)}
        if args.compile:
            builders["relpos compiled"] = lambda: (relpos_model(cfg, scheme), True)
        if have_xt and scheme in XT_OPTIONS:
            builders["x-transformers"] = lambda: (xt_model(cfg, scheme, flash=False), False)
            builders["x-transformers flash"] = lambda: (xt_model(cfg, scheme, flash=True), False)
        runs, flops = {}, {}
        for name, build in builders.items():
            torch.manual_seed(0)
            try:
                model, compiled = build()
            except AssertionError as e:  # x-transformers refuses attn_flash with T5's rel_pos_bias
                print(f"{scheme}: {name}: not built: {e}", flush=True)
                continue
            flops[name] = model_flops_per_token(model, cfg)
            runs[name] = trainer(model, cfg, device, args.gpu, compiled)
            runs[name](args.warmup)
        best = dict.fromkeys(runs, 0.0)
        for _ in range(args.rounds):
            rates.append(matmul_rate(device, peak_dtype, 8192 if args.gpu else 2048))
            for name, run in runs.items():
                best[name] = max(best[name], run(args.steps))
        row = {"scheme": scheme, "tokens_per_s": best, "model_flops_per_token": flops}
        train_rows.append(row)
        print(json.dumps(row), flush=True)
    rate = max(rates)  # the peak: the best of every measurement taken between the timings
    for row in train_rows:
        row["mfu"] = {name: tps * row["model_flops_per_token"][name] / rate for name, tps in row["tokens_per_s"].items()}

    result = {"device": str(device), "threads": torch.get_num_threads(), "torch": torch.__version__, "config": cfg,
              "steps": args.steps, "rounds": args.rounds, "matmul_flops": rate, "train": train_rows}
    atomic_write_text(args.json, json.dumps(result, indent=2))
    print(f"\n{device} ({torch.get_num_threads()} threads), torch {torch.__version__}; "
          f"{'bf16' if args.gpu else 'fp32'} matmul {rate / 1e9:.1f} GFLOP/s; config {cfg}")
    print(f"{'scheme':<7} {'model':<21} {'tok/s':>8} {'MFU':>6} {'relpos / this':>13}")
    for r in train_rows:
        ours = r["tokens_per_s"]["relpos"]
        for name, tps in r["tokens_per_s"].items():
            print(f"{r['scheme']:<7} {name:<21} {tps:>8,.0f} {r['mfu'][name]:>6.1%} {ours / tps:>12.2f}x")
    print(f"\nJSON: {args.json}")


if __name__ == "__main__":
    main()
