"""Perplexity versus evaluation length for a trained run, under a stated protocol.

The same first ``eval.tokens`` validation targets are scored at every length L, each exactly once:

- nonoverlapping: windows of L tokens advanced by L; each window starts from an empty context.
- sliding: windows of L tokens advanced by ``eval.stride`` S; the first window scores all its
  tokens, later ones only their last S, so every later scored token sees >= L - S tokens of context.

Both are one plan (nonoverlapping is sliding with S = L). When L does not divide the token count the
last window is the final L tokens, scoring only those not scored yet, so coverage stays equal.
The per-position loss (mean loss at each index inside the window) shows where a scheme breaks.
Bits per byte (the summed loss in bits over the UTF-8 bytes the scored tokens stand for) compares
runs across tokenizers; for the byte tokenizer it is loss / ln 2.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from relpos_cli.checkpoint import load_config, load_trained_model
from relpos_cli.config import apply_overrides, default_group, flatten_config
from relpos_cli.data import load_token_data
from relpos_cli.errors import RelposError
from relpos_cli.model import Transformer
from relpos_cli.train import resolve_device

PROTOCOLS = ("nonoverlapping", "sliding")
# eval keys that change how many tokens are scored, how fast, or which columns are added, not what a number means
NOT_VARIANT_KEYS = ("lengths", "tokens", "max_tokens_per_batch", "context_use")
DEFAULT_VARIANT = "default"


def window_plan(n_targets: int, length: int, stride: int) -> list[tuple[int, int]]:
    """(start, first scored offset) per window of `length` over `n_targets` targets, each scored once."""
    if n_targets < length:
        raise RelposError(f"{n_targets} eval tokens are fewer than the eval length {length}")
    plan = [(0, 0)]
    scored_until = length
    while scored_until < n_targets:
        end = min(scored_until + stride, n_targets)
        plan.append((end - length, scored_until - (end - length)))
        scored_until = end
    return plan


def score_windows(
    model: Transformer, tokens: torch.Tensor, length: int, stride: int, max_tokens_per_batch: int
) -> tuple[np.ndarray, np.ndarray]:
    """Loss sum (nats) and count per position index inside the window: two (length,) arrays."""
    return score_plan(model, tokens, length, window_plan(len(tokens) - 1, length, stride), max_tokens_per_batch)


@torch.no_grad()
def score_plan(
    model: Transformer, tokens: torch.Tensor, length: int, plan: list[tuple[int, int]], max_tokens_per_batch: int
) -> tuple[np.ndarray, np.ndarray]:
    """score_windows over a given plan of (start, first scored offset) windows of `length` tokens."""
    batch_windows = max(1, max_tokens_per_batch // length)
    device = next(model.parameters()).device
    offsets = torch.arange(length)
    loss_sum = torch.zeros(length, dtype=torch.float64)
    count = torch.zeros(length, dtype=torch.int64)
    for i in range(0, len(plan), batch_windows):
        batch = plan[i : i + batch_windows]
        starts = torch.tensor([s for s, _ in batch])
        idx = starts[:, None] + torch.arange(length + 1)  # (W, L+1)
        windows = tokens[idx].to(device)
        losses = model.loss(windows[:, :-1], windows[:, 1:], reduction="none").double().cpu()  # (W, L)
        scored = offsets[None, :] >= torch.tensor([f for _, f in batch])[:, None]  # (W, L)
        loss_sum += (losses * scored).sum(0)
        count += scored.sum(0)
    return loss_sum.numpy(), count.numpy()


def context_use(
    model: Transformer, tokens: torch.Tensor, length: int, train_len: int, stride: int, max_tokens_per_batch: int
) -> dict[str, float | int]:
    """The ALiBi paper's appendix-B measure: the same targets scored with windows of `length` and of
    `train_len` tokens, both advanced by `stride`, every window of one ending where the other's does.

    Scored: the targets past the first max(length, train_len) (so the first, context-starved window
    of either size is left out), each once, with >= window - stride tokens of context. gain =
    loss(train_len windows) - loss(length windows), in nats: > 0 when tokens beyond the training
    length lower the loss."""
    longest = max(length, train_len)
    later = window_plan(len(tokens) - 1, longest, stride)[1:]  # (start, first scored offset)
    if not later:
        raise RelposError(f"eval.context_use needs more than {longest} eval tokens (eval.tokens)")
    losses = {}
    for window in (length, train_len):
        shift = longest - window  # same end, same scored targets: offsets move back by the shift
        plan = [(start + shift, first - shift) for start, first in later]
        loss_sum, count = score_plan(model, tokens, window, plan, max_tokens_per_batch)
        losses[window] = float(loss_sum.sum() / count.sum())
    return {"context_tokens": int(count.sum()), "context_loss": losses[length],
            "context_loss_train_window": losses[train_len], "context_gain": losses[train_len] - losses[length]}


def eval_lengths(cfg: DictConfig) -> list[int]:
    lengths = sorted({int(l) for l in cfg.eval.lengths} | {int(cfg.train.seq_len)})
    bad = [l for l in lengths if l <= 0]
    if bad:
        raise RelposError(f"eval.lengths must be positive, got {bad}")
    return lengths


def variant_settings(eval_cfg: DictConfig) -> dict[str, Any]:
    """Eval settings that differ from conf/eval/default.yaml (a `variant`), as flat dotted keys."""
    ours = flatten_config(OmegaConf.to_container(eval_cfg, resolve=True))
    defaults = flatten_config(OmegaConf.to_container(default_group("eval"), resolve=True))
    return {
        k: v for k, v in sorted(ours.items()) if k.split(".")[0] not in NOT_VARIANT_KEYS and defaults.get(k, "<unset>") != v
    }


def variant_tag(settings: dict[str, Any]) -> str:
    """`default`, or `key=value,...` (Hydra's override_dirname style) safe in a file name."""
    if not settings:
        return DEFAULT_VARIANT
    return ",".join(f"{k}={re.sub(r'[^A-Za-z0-9._-]', '-', str(v))}" for k, v in settings.items())


def check_eval_config(cfg: DictConfig) -> int | None:
    """Validate protocol and stride; returns the sliding stride (None for nonoverlapping)."""
    e = cfg.eval
    if e.protocol not in PROTOCOLS:
        raise RelposError(f"eval.protocol={e.protocol!r}; choose one of: {', '.join(PROTOCOLS)}")
    stride = e.get("stride")
    if e.protocol == "nonoverlapping":
        if stride is not None:
            raise RelposError("eval.stride applies only to eval.protocol=sliding")
        if e.get("context_use"):
            raise RelposError("eval.context_use=true compares sliding windows: add eval.protocol=sliding eval.stride=S "
                              f"(S <= train.seq_len={cfg.train.seq_len}, like every eval length)")
        return None
    if stride is None or int(stride) <= 0:
        raise RelposError(f"eval.protocol=sliding needs a positive eval.stride (got {stride})")
    too_short = [l for l in eval_lengths(cfg) if l < int(stride)]
    if too_short:
        raise RelposError(f"eval.stride={stride} is longer than eval lengths {too_short}; tokens would be skipped")
    return int(stride)


def load_eval_config(run_dir: Path, overrides: list[str]) -> DictConfig:
    cfg = load_config(run_dir)
    cfg.eval = OmegaConf.merge(default_group("eval"), cfg.get("eval", {}))
    cfg = apply_overrides(cfg, overrides)
    check_eval_config(cfg)
    return cfg


def evaluate_run(run_dir: Path, overrides: list[str]) -> tuple[DictConfig, list[dict[str, Any]], list[dict[str, Any]]]:
    """Load the run once, score every length; returns (config, length rows, per-position rows)."""
    cfg = load_eval_config(run_dir, overrides)
    stride = check_eval_config(cfg)
    device = resolve_device(cfg.device)
    _, model = load_trained_model(run_dir, device)
    lengths = eval_lengths(cfg)
    for length in lengths:
        model.scheme.check_length(length)

    data = load_token_data(OmegaConf.to_container(cfg.data, resolve=True))
    n_tokens = int(cfg.eval.tokens)
    if n_tokens < max(lengths):
        raise RelposError(f"eval.tokens={n_tokens} is smaller than the longest eval length {max(lengths)}")
    if n_tokens + 1 > len(data.validation):
        raise RelposError(
            f"eval.tokens={n_tokens} needs {n_tokens + 1} validation tokens; the split has {len(data.validation)}"
        )
    tokens = torch.from_numpy(np.asarray(data.validation[: n_tokens + 1]).astype(np.int64))
    # every length scores the same targets, tokens[1:], each once: the bytes of text they cover
    scored_bytes = int(data.token_bytes[tokens[1:].numpy()].sum())

    settings = variant_settings(cfg.eval)
    common = {"protocol": cfg.eval.protocol, "variant": variant_tag(settings), **{f"eval.{k}": v for k, v in settings.items()}}
    rows, position_rows = [], []
    for length in lengths:
        model.scheme.configure_eval(length, cfg.eval)
        window_stride = stride or length
        try:
            loss_sum, count = score_windows(model, tokens, length, window_stride, int(cfg.eval.max_tokens_per_batch))
            context = (context_use(model, tokens, length, int(cfg.train.seq_len), window_stride,
                                   int(cfg.eval.max_tokens_per_batch)) if cfg.eval.get("context_use") else {})
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not isinstance(e, torch.OutOfMemoryError) and "memory" not in str(e):
                raise
            raise RelposError(
                f"out of memory at eval length {length} with eval.max_tokens_per_batch="
                f"{cfg.eval.max_tokens_per_batch}; lower eval.max_tokens_per_batch"
            ) from None
        loss = float(loss_sum.sum() / count.sum())
        bpb = float(loss_sum.sum()) / math.log(2) / scored_bytes
        rows.append({"length": length, "tokens": int(count.sum()), "loss": loss, "ppl": math.exp(loss), "bpb": bpb,
                     "stride": window_stride, **context, **common})
        position_rows += [
            {"length": length, "position": p, "loss": float(loss_sum[p] / count[p]), "count": int(count[p]), "stride": window_stride, **common}
            for p in range(length)
            if count[p] > 0
        ]
    train_ppl = next(r["ppl"] for r in rows if r["length"] == cfg.train.seq_len)
    for r in rows:
        r["ppl_ratio"] = r["ppl"] / train_ppl
    return cfg, rows, position_rows
