"""eval-task throughput at 16x the training length: examples/s and tokens/s of exact-match scoring
(one teacher-forced forward per example, the LM head only at answer positions), per scheme and task.

    PYTHONPATH=$PWD python scripts/bench_tasks.py
    PYTHONPATH=$PWD python scripts/bench_tasks.py --schemes rope,alibi --tasks passkey --train-len 256 --samples 16

Prints a table and writes it to bench_tasks.json (--json).

The model is untrained (throughput does not depend on the weights) with the default `small` shape;
examples come from the same generator and batching (eval.max_tokens_per_batch) as `relpos eval-task`.
Generation is timed apart from scoring. Each (scheme, task) point is timed after one warm-up batch
(FlexAttention compiles on first use at a new length).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from relpos_cli.atomic import atomic_write_text  # noqa: E402
from relpos_cli.config import conf_dir  # noqa: E402
from relpos_cli.eval_task import exact_matches  # noqa: E402
from relpos_cli.model import build_model  # noqa: E402
from relpos_cli.tasks import build_task, task_settings  # noqa: E402
from relpos_cli.tasks.base import Encoder  # noqa: E402
from relpos_cli.tasks.examples import cell_examples  # noqa: E402
from relpos_cli.tokenizers import ByteTokenizer  # noqa: E402


def bench(scheme: str, task_name: str, train_len: int, samples: int, max_tokens: int, model_cfg: dict) -> dict:
    torch.manual_seed(0)
    model = build_model({"model": model_cfg, "pos": {"name": scheme}, "train": {"seq_len": train_len}}, 256).eval()
    task_cfg = OmegaConf.to_container(OmegaConf.load(conf_dir() / "task" / f"{task_name}.yaml"))
    task = build_task(task_settings(task_cfg), Encoder(ByteTokenizer()))
    length = 16 * train_len
    start = time.perf_counter()
    examples = list(cell_examples(task, 0, length, 0.5 if task.has_depth else None, samples))
    generate_s = time.perf_counter() - start
    ids = torch.from_numpy(np.stack([ex.input_ids for ex in examples]))
    spans = [ex.answer_spans for ex in examples]
    batch = max(1, max_tokens // length)
    exact_matches(model, ids[:batch], spans[:batch])  # warm-up (compiles flex kernels at this length)
    start = time.perf_counter()
    for i in range(0, samples, batch):
        exact_matches(model, ids[i : i + batch], spans[i : i + batch])
    score_s = time.perf_counter() - start
    return {"scheme": scheme, "task": task_name, "length": length, "examples": samples, "batch": batch,
            "generate_s": generate_s, "score_s": score_s, "examples_per_s": samples / score_s,
            "tokens_per_s": samples * length / score_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemes", default="none,rope,alibi,t5")
    parser.add_argument("--tasks", default="passkey,assoc_recall")
    parser.add_argument("--train-len", type=int, default=128)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16384, help="eval.max_tokens_per_batch")
    parser.add_argument("--model", default="small", help="conf/model/NAME.yaml")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=Path("bench_tasks.json"), help="the rows printed, and the setup")
    args = parser.parse_args()
    from relpos_cli.errors import RelposError
    from relpos_cli.positions import named_schemes

    try:
        schemes = named_schemes(args.schemes)
    except RelposError as e:
        raise SystemExit(f"bench_tasks: --schemes: {e}") from None
    tasks = args.tasks.split(",")
    known_tasks = sorted(p.stem for p in (conf_dir() / "task").glob("*.yaml") if p.stem != "none")
    if unknown := [t for t in tasks if t not in known_tasks]:
        raise SystemExit(f"bench_tasks: --tasks: unknown task {', '.join(unknown)}; choose from {', '.join(known_tasks)}")
    if not (conf_dir() / "model" / f"{args.model}.yaml").is_file():
        models = sorted(p.stem for p in (conf_dir() / "model").glob("*.yaml"))
        raise SystemExit(f"bench_tasks: --model {args.model}: choose from {', '.join(models)}")
    for name in ("train_len", "samples", "max_tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"bench_tasks: --{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.threads is not None and args.threads < 1:
        raise SystemExit(f"bench_tasks: --threads must be at least 1, got {args.threads}")
    if not args.json.parent.is_dir():  # found now, not after the whole run
        raise SystemExit(f"bench_tasks: --json {args.json}: no directory {args.json.parent}")
    if args.threads:
        torch.set_num_threads(args.threads)
    model_cfg = OmegaConf.to_container(OmegaConf.load(conf_dir() / "model" / f"{args.model}.yaml"))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, model={args.model} {model_cfg}, "
          f"train length {args.train_len}, eval length {16 * args.train_len}, eval.max_tokens_per_batch={args.max_tokens}")
    print(f"{'scheme':<8} {'task':<13} {'length':>6} {'examples':>8} {'batch':>5} {'gen s':>6} {'score s':>8} "
          f"{'examples/s':>10} {'tokens/s':>9}")
    rows = []
    for task in tasks:
        for scheme in schemes:
            r = bench(scheme, task, args.train_len, args.samples, args.max_tokens, model_cfg)
            rows.append(r)
            print(f"{r['scheme']:<8} {r['task']:<13} {r['length']:>6} {r['examples']:>8} {r['batch']:>5} "
                  f"{r['generate_s']:>6.2f} {r['score_s']:>8.2f} {r['examples_per_s']:>10.2f} {r['tokens_per_s']:>9,.0f}")
    atomic_write_text(args.json, json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(),
                                             "model": args.model, "model_config": model_cfg, "train_len": args.train_len,
                                             "max_tokens_per_batch": args.max_tokens, "rows": rows}, indent=2) + "\n")
    print(f"\nJSON: {args.json}")


if __name__ == "__main__":
    main()
