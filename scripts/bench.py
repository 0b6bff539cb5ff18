"""Speed benchmark: training tokens/s and MFU per scheme (relpos vs x-transformers), and evaluation
seconds + peak memory at long lengths. Prints a table and writes JSON.

    PYTHONPATH=$PWD python scripts/bench.py --steps 6 --json bench.json
    PYTHONPATH=$PWD python scripts/bench.py --gpu          # CUDA: ~125M params, seq 1024, bf16

MFU = model FLOPs per second / the fp32 (CPU) or bf16 (CUDA) matmul rate measured in the same run.
Model FLOPs per token = 6 * parameters + 12 * layers * d_model * seq (PaLM, appendix B).
Each evaluation point runs in a fresh subprocess so its peak RSS is its own.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from relpos_cli.atomic import atomic_write_text  # noqa: E402
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


def xt_model(cfg: dict, scheme: str) -> torch.nn.Module:
    from x_transformers import Decoder, TransformerWrapper

    net = TransformerWrapper(
        num_tokens=cfg["vocab"], max_seq_len=cfg["seq_len"], use_abs_pos_emb=False, tie_embedding=True,
        attn_layers=Decoder(dim=cfg["d_model"], depth=cfg["n_layers"], heads=cfg["n_heads"], **XT_OPTIONS[scheme]),
    )
    net.loss = lambda x, y: torch.nn.functional.cross_entropy(net(x).flatten(0, 1), y.flatten())
    return net


def model_flops_per_token(model: torch.nn.Module, cfg: dict) -> float:
    params = sum(p.numel() for p in model.parameters())
    return 6 * params + 12 * cfg["n_layers"] * cfg["d_model"] * cfg["seq_len"]


def train_speed(model: torch.nn.Module, cfg: dict, device: torch.device, steps: int, warmup: int, amp: bool) -> float:
    """Tokens/s of full AdamW steps (forward, backward, clip, step) after `warmup` untimed steps."""
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.randint(0, cfg["vocab"], (warmup + steps, cfg["batch"], cfg["seq_len"] + 1), device=device)
    for i, batch in enumerate(data):
        if i == warmup:
            sync(device)
            start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = model.loss(batch[:, :-1], batch[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    sync(device)
    return steps * cfg["batch"] * cfg["seq_len"] / (time.perf_counter() - start)


def memory_mb(field: str) -> float:
    """VmRSS (now) or VmHWM (peak since the last reset) of this process, in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def eval_child(scheme: str, length: int, max_tokens: int, device: str) -> dict:
    """One evaluation batch at `length` in this (fresh) process: seconds and peak RSS (Linux).

    The peak is reset once the model and tokens exist (a forked child inherits its parent's
    high-water mark), so peak - base is what the forward passes add."""
    cfg = dict(CPU_CFG, seq_len=length)
    torch.manual_seed(0)
    model = relpos_model(cfg, scheme).to(device).eval()
    windows = max(1, max_tokens // length)
    tokens = torch.randint(0, cfg["vocab"], (windows, length + 1), device=device)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    base = memory_mb("VmRSS")
    with torch.no_grad():
        model.loss(tokens[:, :-1], tokens[:, 1:])  # warm-up: compiles FlexAttention for this shape
        start = time.perf_counter()
        model.loss(tokens[:, :-1], tokens[:, 1:])
        seconds = time.perf_counter() - start
    peak = memory_mb("VmHWM")
    return {"scheme": scheme, "length": length, "windows": windows, "seconds": seconds, "base_rss_mb": base,
            "peak_rss_mb": peak, "added_mb": peak - base}


def run_eval_point(scheme: str, length: int, max_tokens: int, device: str) -> dict:
    cmd = [sys.executable, __file__, "--eval-child", scheme, str(length), str(max_tokens), device]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"scheme": scheme, "length": length, "error": proc.stderr.strip().splitlines()[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schemes", default="none,rope,alibi,t5")
    ap.add_argument("--steps", type=int, default=6, help="timed training steps per model (0: skip training)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--eval-lengths", default="1024,4096,16384")
    ap.add_argument("--max-tokens-per-batch", type=int, default=16384, help="as eval.max_tokens_per_batch")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--gpu", action="store_true", help="CUDA: 125M config, bf16 autocast, TF32, MFU vs bf16 matmul")
    ap.add_argument("--json", type=Path, default=Path("bench.json"))
    ap.add_argument("--eval-child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.eval_child:
        scheme, length, max_tokens, device = args.eval_child
        print(json.dumps(eval_child(scheme, int(length), int(max_tokens), device)))
        return

    device = torch.device("cuda" if args.gpu else "cpu")
    if args.gpu:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    cfg = GPU_CFG if args.gpu else CPU_CFG
    peak_dtype = torch.bfloat16 if args.gpu else torch.float32
    rate = matmul_rate(device, peak_dtype, 8192 if args.gpu else 2048)
    try:
        import x_transformers  # noqa: F401

        have_xt = True
    except ImportError:
        have_xt = False

    schemes = args.schemes.split(",")
    train_rows = []
    for scheme in schemes if args.steps > 0 else []:
        torch.manual_seed(0)
        model = relpos_model(cfg, scheme)
        tps = train_speed(model, cfg, device, args.steps, args.warmup, args.gpu)
        row = {"scheme": scheme, "tokens_per_s": tps, "mfu": tps * model_flops_per_token(model, cfg) / rate}
        if have_xt and scheme in XT_OPTIONS:
            torch.manual_seed(0)
            ref = xt_model(cfg, scheme)
            row["xt_tokens_per_s"] = train_speed(ref, cfg, device, args.steps, args.warmup, args.gpu)
            row["speedup_vs_xt"] = tps / row["xt_tokens_per_s"]
        train_rows.append(row)
        print(json.dumps(row), flush=True)

    eval_rows = []
    if not args.gpu:
        for length in [int(x) for x in args.eval_lengths.split(",") if x]:
            for scheme in schemes:
                eval_rows.append(run_eval_point(scheme, length, args.max_tokens_per_batch, "cpu"))
                print(json.dumps(eval_rows[-1]), flush=True)
        for row in eval_rows:
            base = next((r for r in eval_rows if r["scheme"] == "none" and r["length"] == row["length"]), None)
            if base and "error" not in row and "error" not in base:
                row["peak_vs_none"] = row["peak_rss_mb"] / base["peak_rss_mb"]
                row["added_vs_none"] = row["added_mb"] / base["added_mb"]

    result = {"device": str(device), "threads": torch.get_num_threads(), "torch": torch.__version__,
              "config": cfg, "steps": args.steps, "matmul_flops": rate, "train": train_rows, "eval": eval_rows}
    atomic_write_text(args.json, json.dumps(result, indent=2))
    print(f"\n{device} ({torch.get_num_threads()} threads), torch {torch.__version__}; "
          f"{'bf16' if args.gpu else 'fp32'} matmul {rate / 1e9:.1f} GFLOP/s; config {cfg}")
    print(f"{'scheme':<8} {'tok/s':>9} {'MFU':>6} {'x-tf tok/s':>11} {'ratio':>6}")
    for r in train_rows:
        xt = f"{r['xt_tokens_per_s']:>11,.0f} {r['speedup_vs_xt']:>5.2f}x" if "xt_tokens_per_s" in r else ""
        print(f"{r['scheme']:<8} {r['tokens_per_s']:>9,.0f} {r['mfu']:>6.1%} {xt}")
    if eval_rows:
        print(f"\n{'scheme':<8} {'length':>7} {'windows':>7} {'seconds':>8} {'peak RSS MiB':>12} {'vs none':>8} "
              f"{'added MiB':>9} {'vs none':>8}")
        for r in eval_rows:
            if "error" in r:
                print(f"{r['scheme']:<8} {r['length']:>7} error: {r['error']}")
                continue
            print(f"{r['scheme']:<8} {r['length']:>7} {r['windows']:>7} {r['seconds']:>8.2f} {r['peak_rss_mb']:>12.0f} "
                  f"{r.get('peak_vs_none', float('nan')):>7.2f}x {r['added_mb']:>9.0f} {r.get('added_vs_none', float('nan')):>7.2f}x")
    print(f"\nJSON: {args.json}")


if __name__ == "__main__":
    main()
