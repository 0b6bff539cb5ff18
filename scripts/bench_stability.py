"""Stability and parity benchmark: does every scheme train properly at the shared defaults?

Trains every registered scheme (and x-transformers for the schemes it has) for a short run of the
default model and recipe on two corpora of different kinds: the stdlib code default and English
text from a local file (--prose). Every run of a (corpus, seed) sees the same token arrays and the
same sampled batches. Prints per run:

- init: the loss at step 1; max>10: the largest training loss after step 10 (a spike when it
  exceeds init);
- ppl: validation perplexity at the training length (the same windows for every run of a corpus);
- ratio: ppl / the best ppl of that corpus and seed.

    PYTHONPATH=$PWD python scripts/bench_stability.py --prose shakespeare.txt --json stability.json
    PYTHONPATH=$PWD python scripts/bench_stability.py --prose shakespeare.txt --schemes sinusoidal,t5 --seeds 0 --impls relpos

The recipe is relpos's conf/train/default.yaml (AdamW 3e-3, betas 0.9/0.95, 60 warmup steps,
cosine to 0.1, weight decay 0.1 on >= 2-D parameters, clip 1.0, batch 32 x 128) with the cosine
ending at --steps; the model is conf/model/small.yaml (d 192, 4 layers, 6 heads, tied embeddings).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omegaconf import OmegaConf  # noqa: E402

from relpos_cli.atomic import atomic_write_text  # noqa: E402
from relpos_cli.config import conf_dir, default_group  # noqa: E402
from relpos_cli.data import load_token_data  # noqa: E402
from relpos_cli.model import Transformer  # noqa: E402
from relpos_cli.errors import RelposError  # noqa: E402
from relpos_cli.positions import named_schemes, scheme_names  # noqa: E402
from relpos_cli.positions.base import ModelShape  # noqa: E402
from relpos_cli.train import WindowSampler, param_groups, lr_multiplier, training_step, validation_windows  # noqa: E402

# x-transformers' own way to get each scheme (TransformerWrapper / Decoder keywords)
XT_OPTIONS = {
    "rope": dict(wrapper={"use_abs_pos_emb": False}, layers={"rotary_pos_emb": True}),
    "alibi": dict(wrapper={"use_abs_pos_emb": False}, layers={"alibi_pos_bias": True}),
    "t5": dict(wrapper={"use_abs_pos_emb": False}, layers={"rel_pos_bias": True}),
    "xpos": dict(wrapper={"use_abs_pos_emb": False}, layers={"rotary_xpos": True}),
    "learned": dict(wrapper={}, layers={}),
    "sinusoidal": dict(wrapper={"scaled_sinu_pos_emb": True}, layers={}),
}
SPIKE_AFTER = 10  # steps: the largest loss after this one is compared with the initial loss


def pos_config(name: str) -> dict:
    path = conf_dir() / "pos" / f"{name}.yaml"
    return OmegaConf.to_container(OmegaConf.load(path)) if path.is_file() else {"name": name}


class XTModel(torch.nn.Module):
    """x-transformers' decoder with relpos's loss signature, so the same training step drives both."""

    def __init__(self, scheme: str, vocab: int, model: dict, seq_len: int):
        super().__init__()
        from x_transformers import Decoder, TransformerWrapper

        options = XT_OPTIONS[scheme]
        self.net = TransformerWrapper(
            num_tokens=vocab, max_seq_len=seq_len, tie_embedding=True, **options["wrapper"],
            attn_layers=Decoder(dim=model["d_model"], depth=model["n_layers"], heads=model["n_heads"],
                                ff_mult=model["mlp_ratio"], **options["layers"]),
        )
        self.scheme = torch.nn.Identity()  # no parameters to constrain
        self.scheme.constrain_parameters = lambda: None

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        logits = self.net(tokens)  # (B, T, V)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction=reduction)


def corpus_config(corpus: str, prose: Path | None) -> dict:
    if corpus == "stdlib":
        return OmegaConf.to_container(default_group("data", "stdlib"), resolve=True)
    cfg = OmegaConf.to_container(default_group("data", "text_files"), resolve=True)
    cfg["files"] = [str(prose.resolve())]
    return cfg


@torch.no_grad()
def validation_ppl(model: torch.nn.Module, windows: torch.Tensor, batch: int) -> float:
    model.eval()
    total = sum(model.loss(w[:, :-1], w[:, 1:], reduction="sum").item() for w in windows.split(batch))
    model.train()
    return math.exp(total / (windows.shape[0] * (windows.shape[1] - 1)))


def train_one(model: torch.nn.Module, data, seed: int, steps: int, train: dict, val: torch.Tensor) -> dict:
    optimizer = torch.optim.AdamW(param_groups(model, train["weight_decay"]), lr=train["lr"], betas=tuple(train["betas"]))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_multiplier(s, train["warmup_steps"], steps, train["min_lr_ratio"]))
    sampler = WindowSampler(data.train, train["seq_len"], train["batch_size"], seed, torch.device("cpu"))
    losses = []
    start = time.perf_counter()
    for _ in range(steps):
        loss, _, finite = training_step(model, optimizer, [sampler()], train["grad_clip"])
        scheduler.step()
        losses.append(loss.item() if finite else float("nan"))
    seconds = time.perf_counter() - start
    # a non-finite step (its update skipped) is the worst loss: max() would pass over a NaN after the first
    worst = max(losses[SPIKE_AFTER:], key=nan_last)
    return {"losses": losses, "init": losses[0], "max_after_10": worst, "spike": not worst <= losses[0],
            "nonfinite_steps": sum(not math.isfinite(x) for x in losses),
            "ppl": validation_ppl(model, val, train["batch_size"]), "seconds": seconds}


def nan_last(x: float) -> float:
    """A sort key that puts NaN above every number (inf included): max() picks it."""
    return math.inf if math.isnan(x) else x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prose", type=Path, help="a local English text file (the second corpus)")
    parser.add_argument("--corpora", default="stdlib,prose")
    parser.add_argument("--schemes", default=",".join(scheme_names()))
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--steps", type=int, default=150, help="training steps per run (the cosine ends there)")
    parser.add_argument("--impls", default="relpos,x-transformers", help="which implementations to train")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write every run (with its loss curve) here")
    args = parser.parse_args()
    corpora = args.corpora.split(",")
    impls = args.impls.split(",")
    if set(impls) - {"relpos", "x-transformers"}:
        sys.exit(f"error: --impls takes relpos and/or x-transformers, got {args.impls}")
    if "prose" in corpora and (args.prose is None or not args.prose.is_file()):
        sys.exit(f"error: --prose must name a text file (got {args.prose}); or pass --corpora stdlib")
    try:
        named_schemes(args.schemes)
    except RelposError as e:
        sys.exit(f"error: --schemes: {e}")
    if args.steps <= SPIKE_AFTER:
        sys.exit(f"error: --steps must be more than {SPIKE_AFTER} (the spike check reads the losses after step {SPIKE_AFTER})")
    if unknown_corpora := sorted(set(corpora) - {"stdlib", "prose"}):
        sys.exit(f"error: --corpora takes stdlib and/or prose, got {', '.join(unknown_corpora)}")
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        sys.exit(f"error: --seeds takes comma-separated integers, got {args.seeds}")
    if args.threads < 1:
        sys.exit(f"error: --threads must be at least 1, got {args.threads}")
    if "x-transformers" in impls:
        try:
            import x_transformers  # noqa: F401
        except ImportError:
            sys.exit("error: --impls x-transformers needs `pip install x-transformers` (or pass --impls relpos)")
    torch.set_num_threads(args.threads)
    model_cfg = OmegaConf.to_container(default_group("model", "small"))
    train_cfg = OmegaConf.to_container(default_group("train"))
    shape = ModelShape(model_cfg["d_model"], model_cfg["n_heads"], model_cfg["n_layers"], train_cfg["seq_len"])

    runs = []
    for corpus in corpora:
        data = load_token_data(corpus_config(corpus, args.prose))
        val = validation_windows(data.validation, train_cfg["seq_len"], train_cfg["val_batches"] * train_cfg["batch_size"])
        for seed in seeds:
            builders = []
            if "relpos" in impls:
                builders += [("relpos", s, lambda s=s: Transformer(data.vocab_size, shape, pos_config(s), model_cfg["mlp_ratio"]))
                             for s in args.schemes.split(",")]
            if "x-transformers" in impls:
                builders += [("x-transformers", s, lambda s=s: XTModel(s, data.vocab_size, model_cfg, train_cfg["seq_len"]))
                             for s in args.schemes.split(",") if s in XT_OPTIONS]
            for impl, scheme, build in builders:
                torch.manual_seed(seed)
                result = train_one(build(), data, seed, args.steps, train_cfg, val)
                runs.append({"corpus": corpus, "seed": seed, "impl": impl, "scheme": scheme, **result})
                print(f"{corpus:7s} seed {seed} {impl:14s} {scheme:13s} init {result['init']:.3f} "
                      f"max>10 {result['max_after_10']:.3f}{' SPIKE' if result['spike'] else ''}"
                      f"{f' ({n} non-finite steps)' if (n := result['nonfinite_steps']) else ''} "
                      f"ppl {result['ppl']:.3f} ({result['seconds']:.0f} s)", flush=True)
    print_table(runs, args.steps)
    if args.json:
        atomic_write_text(args.json, json.dumps(runs, indent=1))


def print_table(runs: list[dict], steps: int) -> None:
    """One row per (corpus, implementation, scheme): over seeds, the worst spike margin, mean ppl,
    ppl / best ppl of the corpus (best = lowest mean over seeds)."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["corpus"], r["impl"], r["scheme"]), []).append(r)
    best = {}
    for (corpus, _, _), rs in groups.items():
        mean = sum(r["ppl"] for r in rs) / len(rs)
        best[corpus] = min(best.get(corpus, mean), mean)
    print(f"\n{steps} steps per run; loss in nats; max>10 = largest training loss after step {SPIKE_AFTER} "
          f"(the worst seed); ppl = validation ppl at the training length, mean over seeds\n")
    print("| corpus | implementation | scheme | seeds | init loss | max loss after step 10 | spike | ppl | ppl / best |")
    print("|---|---|---|---:|---:|---:|---|---:|---:|")
    for (corpus, impl, scheme), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1] != "relpos")):
        worst = max(rs, key=lambda r: nan_last(r["max_after_10"] - r["init"]))
        ppl = sum(r["ppl"] for r in rs) / len(rs)
        spikes = sum(r["spike"] for r in rs)
        print(f"| {corpus} | {impl} | {scheme} | {len(rs)} | {worst['init']:.2f} | {worst['max_after_10']:.2f} | "
              f"{'yes (' + str(spikes) + ')' if spikes else 'no'} | {ppl:.3f} | {ppl / best[corpus]:.2f} |")


if __name__ == "__main__":
    main()
