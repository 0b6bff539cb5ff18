"""Long-evaluation benchmark: what a user waits for and how much memory it takes, per scheme.

Default mode: for each scheme, a tiny run is trained (untimed: d_model 64, 2 layers, 8 heads, a few
steps), then one fresh `relpos eval-length RUN eval.lengths=[L] eval.tokens=L` process is timed end
to end (imports, loading, compiling if any, scoring, writing the report) with its peak RSS (the
child's own, from wait4). Every run uses an empty $RELPOS_CACHE made for this invocation, so
nothing compiled by an earlier process is reused: the cold start a user meets first.

    PYTHONPATH=$PWD python scripts/bench_eval.py                       # L = 16384, the bias schemes
    PYTHONPATH=$PWD python scripts/bench_eval.py --schemes none,fire --length 4096

--extensions mode: the same fresh-process timing for one tiny RoPE run, plain and under each eval-time
extension method (docs/extension.md), at each length: time and peak RSS against plain RoPE.

    PYTHONPATH=$PWD python scripts/bench_eval.py --extensions --lengths 4096,16384,32768

--backends mode: one attention layer of that model (B = max(1, 16384 // L) windows, no grad) per
backend and length, in this process: first call (compile included for flex) and second call.

    PYTHONPATH=$PWD python scripts/bench_eval.py --backends --lengths 256,1024,16384 --schemes alibi,t5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from relpos_cli.atomic import atomic_write_text  # noqa: E402

MODEL = dict(d_model=64, n_layers=2, n_heads=8)
BIAS_SCHEMES = "none,rope,alibi,t5,kerple_log,kerple_power,sandwich"


def relpos(args: list[str], env: dict) -> tuple[float, float, int, str]:
    """Run `python -m relpos_cli ARGS` in a fresh process: (seconds, peak RSS MiB, exit code, stderr tail)."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "relpos_cli", *args], cwd=env["BENCH_CWD"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return time.perf_counter() - start, usage.ru_maxrss / 1024, proc.returncode, stderr.strip()[-300:]


# eval-time extension methods at the bench run's training length 128 (windows well inside every length)
EXTENSIONS = {
    "rope": [],
    "self_extend": ["eval.self_extend.group=8", "eval.self_extend.window=64"],
    "rerope": ["eval.rerope.window=64"],
    "leaky_rerope": ["eval.rerope.window=64", "eval.rerope.slope=0.25"],
    "streaming": ["eval.sinks.count=4", "eval.sinks.window=128"],
    "lm_infinite": ["eval.sinks.count=4", "eval.sinks.window=128", "eval.sinks.max_distance=128"],
}


def bench_env(work: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), RELPOS_CACHE=str(work / "cache"), BENCH_CWD=str(work))
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # compiled kernels go to the fresh $RELPOS_CACHE/inductor
    return env


def train_tiny(scheme: str, run: Path, env: dict) -> tuple[int, str]:
    """The untimed tiny run every mode evaluates: (exit code, stderr tail)."""
    model = [f"model.{k}={v}" for k, v in MODEL.items()]
    train = ["train", f"pos={scheme}", "model=tiny", *model, "train.steps=2", "train.seq_len=128",
             "train.batch_size=4", "train.eval_every=0", "wandb.mode=disabled", f"hydra.run.dir={run}"]
    _, _, code, err = relpos(train, env)
    return code, err


def extension_rows(lengths: list[int], work: Path) -> list[dict]:
    env = bench_env(work)
    run = work / "runs" / "rope"
    code, err = train_tiny("rope", run, env)
    if code:
        raise SystemExit(f"train: {err}")
    rows = []
    for length in lengths:
        for method, overrides in EXTENSIONS.items():
            seconds, peak, code, err = relpos(["eval-length", str(run), f"eval.lengths=[{length}]", f"eval.tokens={length}",
                                               *overrides], env)
            rows.append({"method": method, "length": length, "seconds": seconds, "peak_rss_mb": peak}
                        if code == 0 else {"method": method, "length": length, "error": err})
            print(json.dumps(rows[-1]), flush=True)
        base = next((r for r in rows if r["method"] == "rope" and r["length"] == length and "error" not in r), None)
        for r in rows:
            if base and r["length"] == length and "error" not in r:
                r["time_vs_rope"] = r["seconds"] / base["seconds"]
                r["peak_vs_rope"] = r["peak_rss_mb"] / base["peak_rss_mb"]
    return rows


def fresh_process_rows(schemes: list[str], length: int, work: Path) -> list[dict]:
    env = bench_env(work)
    rows = []
    for scheme in schemes:
        run = work / "runs" / scheme
        code, err = train_tiny(scheme, run, env)
        if code:
            rows.append({"scheme": scheme, "length": length, "error": f"train: {err}"})
        else:
            seconds, peak, code, err = relpos(["eval-length", str(run), f"eval.lengths=[{length}]", f"eval.tokens={length}"], env)
            rows.append({"scheme": scheme, "length": length, "seconds": seconds, "peak_rss_mb": peak}
                        if code == 0 else {"scheme": scheme, "length": length, "error": err})
        print(json.dumps(rows[-1]), flush=True)
    base = next((r for r in rows if r["scheme"] == "none" and "error" not in r), None)
    for r in rows:
        if base and "error" not in r:
            r["time_vs_none"] = r["seconds"] / base["seconds"]
            r["peak_vs_none"] = r["peak_rss_mb"] / base["peak_rss_mb"]
    return rows


def backend_rows(schemes: list[str], lengths: list[int], backends: list[str]) -> list[dict]:
    from relpos_cli.attention import BiasCache, attend
    from relpos_cli.positions import build_scheme
    from relpos_cli.positions.base import ModelShape

    shape = ModelShape(MODEL["d_model"], MODEL["n_heads"], MODEL["n_layers"], 128)
    rows = []
    for length in lengths:
        torch.manual_seed(0)
        q, k, v = (torch.randn(max(1, 16384 // length), shape.n_heads, length, shape.head_dim) for _ in range(3))
        layer_input = torch.randn(q.shape[0], length, shape.d_model)  # what a token-difference bias (FoX) reads
        positions = torch.arange(length)
        for name in schemes:
            scheme = build_scheme({"name": name}, shape)
            for backend in backends:
                cache, seconds = BiasCache(), []
                with torch.no_grad():
                    for _ in range(2):
                        start = time.perf_counter()
                        attend(backend, scheme, 0, q, k, v, positions, cache, layer_input=layer_input)
                        seconds.append(time.perf_counter() - start)
                rows.append({"scheme": name, "length": length, "windows": q.shape[0], "backend": backend,
                             "first_s": seconds[0], "second_s": seconds[1]})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def print_fresh_rows(rows: list[dict], names: list[str], base: str) -> None:
    """A table of fresh-process timings: the `names` columns, seconds and peak RSS against `base`'s."""
    print(" ".join(f"{n:>13}" for n in names) + f" {'seconds':>8} {'vs ' + base:>8} {'peak RSS MiB':>12} {'vs ' + base:>8}")
    for r in rows:
        head = " ".join(f"{r[n]:>13}" for n in names)
        if "error" in r:
            print(f"{head} error: {r['error']}")
        else:
            print(f"{head} {r['seconds']:>8.1f} {r.get(f'time_vs_{base}', float('nan')):>7.2f}x "
                  f"{r['peak_rss_mb']:>12.0f} {r.get(f'peak_vs_{base}', float('nan')):>7.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schemes", default=BIAS_SCHEMES)
    ap.add_argument("--length", type=int, default=16384, help="fresh-process mode: the eval length")
    ap.add_argument("--backends", action="store_true", help="time attention backends in this process instead")
    ap.add_argument("--extensions", action="store_true", help="time a RoPE run under each eval-time extension method")
    ap.add_argument("--lengths", default="256,1024,16384", help="--backends, --extensions: lengths")
    ap.add_argument("--backend-list", default="sdpa,chunked,flex", help="--backends: which backends")
    ap.add_argument("--json", type=Path, default=Path("bench_eval.json"))
    args = ap.parse_args()
    from relpos_cli.attention import BACKEND_NAMES
    from relpos_cli.errors import RelposError
    from relpos_cli.positions import named_schemes

    try:
        schemes = named_schemes(args.schemes)
    except RelposError as e:
        raise SystemExit(f"bench_eval: --schemes: {e}") from None
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        raise SystemExit(f"bench_eval: --lengths takes comma-separated integers, got {args.lengths}") from None
    if min(lengths + [args.length]) < 1:
        raise SystemExit("bench_eval: --length and --lengths must be positive")
    # this process times on CPU: a backend attend() cannot run here would be timed as another under its name
    backends = args.backend_list.split(",")
    if wrong := [b for b in backends if b not in BACKEND_NAMES or b == "fused"]:
        raise SystemExit(f"bench_eval: --backend-list: {', '.join(wrong)} cannot be timed here; choose from "
                         f"{', '.join(b for b in BACKEND_NAMES if b != 'fused')} (fused is CUDA's: scripts/bench_kernels.py)")
    if not args.json.parent.is_dir():  # found now, not after the whole run
        raise SystemExit(f"bench_eval: --json {args.json}: no directory {args.json.parent}")
    if args.extensions:
        with tempfile.TemporaryDirectory(prefix="relpos-bench-eval-") as work:
            rows = extension_rows(lengths, Path(work))
        print(f"\nfresh `relpos eval-length` process per method and length, model {MODEL}, {torch.get_num_threads()} threads")
        print_fresh_rows(rows, ["method", "length"], "rope")
    elif args.backends:
        rows = backend_rows(schemes, lengths, backends)
        print(f"\n{'scheme':<12} {'length':>6} {'windows':>7} {'backend':<8} {'1st call s':>10} {'2nd call s':>10}")
        for r in rows:
            print(f"{r['scheme']:<12} {r['length']:>6} {r['windows']:>7} {r['backend']:<8} {r['first_s']:>10.2f} {r['second_s']:>10.2f}")
    else:
        with tempfile.TemporaryDirectory(prefix="relpos-bench-eval-") as work:
            rows = fresh_process_rows(schemes, args.length, Path(work))
        print(f"\nfresh `relpos eval-length` process, L={args.length}, model {MODEL}, {torch.get_num_threads()} threads")
        print_fresh_rows(rows, ["scheme"], "none")
    atomic_write_text(args.json, json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(),
                                             "model": MODEL, "rows": rows}, indent=2))
    print(f"\nJSON: {args.json}")


if __name__ == "__main__":
    main()
