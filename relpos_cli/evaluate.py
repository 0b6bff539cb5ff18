"""Perplexity versus evaluation length for a trained run (non-overlapping windows).

The same first ``eval.tokens`` validation tokens are scored at every length L: they are cut into
``eval.tokens // L`` windows of L tokens, each window starts from an empty context, and every token
is scored once. Shorter windows mean less context per token on average: that is the protocol.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from relpos_cli.checkpoint import load_config, load_trained_model
from relpos_cli.config import apply_overrides, default_group
from relpos_cli.data import load_token_data
from relpos_cli.errors import RelposError
from relpos_cli.model import Transformer
from relpos_cli.train import resolve_device

PROTOCOLS = ("nonoverlapping",)


@torch.no_grad()
def score_nonoverlapping(model: Transformer, tokens: torch.Tensor, length: int, batch_windows: int) -> tuple[float, int]:
    """Sum of next-token losses (nats) over len(tokens)-1 // length windows; returns (sum, count)."""
    n_windows = (len(tokens) - 1) // length
    windows = tokens[: n_windows * length + 1]
    inputs = windows[:-1].view(n_windows, length)  # (W, L)
    targets = windows[1:].view(n_windows, length)
    device = next(model.parameters()).device
    total = 0.0
    for x, y in zip(inputs.split(batch_windows), targets.split(batch_windows)):
        total += model.loss(x.to(device), y.to(device), reduction="sum").item()
    return total, n_windows * length


def eval_lengths(cfg: DictConfig) -> list[int]:
    lengths = sorted({int(l) for l in cfg.eval.lengths} | {int(cfg.train.seq_len)})
    bad = [l for l in lengths if l <= 0]
    if bad:
        raise RelposError(f"eval.lengths must be positive, got {bad}")
    return lengths


def evaluate_run(run_dir: Path, overrides: list[str]) -> tuple[DictConfig, list[dict[str, Any]]]:
    """Load the run, apply eval overrides, score every length; returns (config, rows)."""
    cfg = load_config(run_dir)
    cfg.eval = OmegaConf.merge(default_group("eval"), cfg.get("eval", {}))
    cfg = apply_overrides(cfg, overrides)
    if cfg.eval.protocol not in PROTOCOLS:
        raise RelposError(f"eval.protocol={cfg.eval.protocol!r}; choose one of: {', '.join(PROTOCOLS)}")
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

    rows = []
    for length in lengths:
        model.scheme.configure_eval(length, cfg.eval)
        batch_windows = max(1, int(cfg.eval.max_tokens_per_batch) // length)
        try:
            total, count = score_nonoverlapping(model, tokens, length, batch_windows)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not isinstance(e, torch.OutOfMemoryError) and "memory" not in str(e):
                raise
            raise RelposError(
                f"out of memory at eval length {length} ({batch_windows} windows per batch); "
                f"lower eval.max_tokens_per_batch (now {cfg.eval.max_tokens_per_batch})"
            ) from None
        loss = total / count
        rows.append({"length": length, "tokens": count, "loss": loss, "ppl": math.exp(loss), "protocol": cfg.eval.protocol})
    train_ppl = next(r["ppl"] for r in rows if r["length"] == cfg.train.seq_len)
    for r in rows:
        r["ppl_ratio"] = r["ppl"] / train_ppl
    return cfg, rows
