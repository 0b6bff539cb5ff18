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
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, Collection, ContextManager

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from relpos_cli.checkpoint import load_config, load_trained_model
from relpos_cli.config import (apply_overrides, canonical_numbers, check_override_keys, default_group, flatten_config,
                               override_keys, validate_run_config)
from relpos_cli.console import print_note
from relpos_cli.data import load_token_data
from relpos_cli.errors import RelposError
from relpos_cli.extension import resolve_longest_factor
from relpos_cli.fingerprint import check_data_unchanged, check_tokens_unchanged
from relpos_cli.model import Transformer
from relpos_cli.precision import eval_autocast, eval_precision
from relpos_cli.positions.rope import scaling_params
from relpos_cli.results import perplexity, variant_tag
from relpos_cli.rope_options import AUTO_FACTOR
from relpos_cli.distributed import resolve_device

# what eval-length (and compare) may change in a trained run: anything else is the run's own
EVAL_KEYS = ("eval.*", "device", "plots.*")
# eval keys that change how many tokens are scored, how fast, or which columns are added, not what a number means
EVAL_NOT_VARIANT_KEYS = ("lengths", "tokens", "max_tokens_per_batch", "context_use")


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


def batch_count(n_targets: int, length: int, stride: int, max_tokens_per_batch: int, train_len: int | None = None) -> int:
    """Forward passes score_windows makes, and context_use's too given train_len: what a progress bar counts."""
    plans = [(length, window_plan(n_targets, length, stride))]
    if train_len is not None:
        plans += context_plans(n_targets, length, train_len, stride).items()
    return sum(math.ceil(len(plan) / max(1, max_tokens_per_batch // window)) for window, plan in plans)


@torch.no_grad()
def score_windows(
    model: Transformer, tokens: torch.Tensor, length: int, stride: int, max_tokens_per_batch: int,
    advance: Callable[[int], None] = lambda n: None,
) -> tuple[np.ndarray, np.ndarray]:
    """Loss sum (nats) and count per position index inside the window: two (length,) arrays.
    advance(1) after each forward pass."""
    return score_plan(model, tokens, length, window_plan(len(tokens) - 1, length, stride), max_tokens_per_batch, advance)


@torch.no_grad()
def score_plan(
    model: Transformer, tokens: torch.Tensor, length: int, plan: list[tuple[int, int]], max_tokens_per_batch: int,
    advance: Callable[[int], None] = lambda n: None,
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
        losses = model.token_losses(windows[:, :-1], windows[:, 1:]).double().cpu()  # (W, L), no (W, L, V) logits
        scored = offsets[None, :] >= torch.tensor([f for _, f in batch])[:, None]  # (W, L)
        loss_sum += (losses * scored).sum(0)
        count += scored.sum(0)
        advance(1)
    return loss_sum.numpy(), count.numpy()


def context_plans(n_targets: int, length: int, train_len: int, stride: int) -> dict[int, list[tuple[int, int]]]:
    """context_use's plan per window size (length, train_len; one when they are equal): windows of each
    ending where the other's do, scoring the targets past the first max(length, train_len)."""
    longest = max(length, train_len)
    later = window_plan(n_targets, longest, stride)[1:]  # (start, first scored offset)
    if not later:
        raise RelposError(f"eval.context_use needs more than {longest} eval tokens (eval.tokens)")
    # same end, same scored targets: offsets move back by the shift
    return {window: [(start + longest - window, first - (longest - window)) for start, first in later]
            for window in (length, train_len)}


def context_use(
    model: Transformer, tokens: torch.Tensor, length: int, train_len: int, stride: int, max_tokens_per_batch: int,
    advance: Callable[[int], None] = lambda n: None,
) -> dict[str, float | int]:
    """The ALiBi paper's appendix-B measure: the same targets scored with windows of `length` and of
    `train_len` tokens, both advanced by `stride`, every window of one ending where the other's does.

    Scored: the targets past the first max(length, train_len) (so the first, context-starved window
    of either size is left out), each once, with >= window - stride tokens of context. gain =
    loss(train_len windows) - loss(length windows), in nats: > 0 when tokens beyond the training
    length lower the loss."""
    losses = {}
    for window, plan in context_plans(len(tokens) - 1, length, train_len, stride).items():
        loss_sum, count = score_plan(model, tokens, window, plan, max_tokens_per_batch, advance)
        losses[window] = float(loss_sum.sum() / count.sum())
    return {"context_tokens": int(count.sum()), "context_loss": losses[length],
            "context_loss_train_window": losses[train_len], "context_gain": losses[train_len] - losses[length]}


def eval_lengths(cfg: DictConfig) -> list[int]:
    lengths = sorted({int(l) for l in cfg.eval.lengths} | {int(cfg.train.seq_len)})
    bad = [l for l in lengths if l <= 0]
    if bad:
        raise RelposError(f"eval.lengths must be positive, got {bad}")
    return lengths


# eval.rope_scaling.factor=auto scales each eval length by L / L_train: every length is a differently
# scaled model, which the variant's name (so its files' names) and its tables say
AUTO_FACTOR_TAG = "auto_per_length"
# eval keys whose default null means a value (extension.build_extension): given explicitly, the same model
NULL_MEANS = {"sinks.count": 0, "rerope.slope": 0}


def variant_settings(eval_cfg: DictConfig) -> dict[str, Any]:
    """Eval settings that differ from conf/eval/default.yaml (a `variant`), as flat dotted keys; RoPE
    scaling's default factor=auto is named too (auto_per_length), since it is a model per length."""
    ours = canonical_numbers(flatten_config(OmegaConf.to_container(eval_cfg, resolve=True)))
    defaults = canonical_numbers(flatten_config(OmegaConf.to_container(default_group("eval"), resolve=True)))
    # resolved (load_eval_config): fp32 results are the default variant, as every result before bf16 was;
    # auto is a config not resolved for a device (none was named): no variant of its own
    defaults["precision"] = ours.get("precision") if ours.get("precision") == "auto" else "fp32"
    if ours.get("rope_scaling.type", "none") != "none" and ours.get("rope_scaling.factor") == AUTO_FACTOR:
        defaults["rope_scaling.factor"], ours["rope_scaling.factor"] = None, AUTO_FACTOR_TAG
    ours.update({k: None for k, value in NULL_MEANS.items() if ours.get(k) == value})
    return {
        k: v for k, v in sorted(ours.items()) if k.split(".")[0] not in EVAL_NOT_VARIANT_KEYS and defaults.get(k, "<unset>") != v
    }


def rope_factor(eval_cfg: DictConfig, length: int, train_len: int) -> float | None:
    """The RoPE scaling factor eval.rope_scaling applies at `length` (None: no eval-time scaling)."""
    params = scaling_params(eval_cfg.get("rope_scaling") or {}, length, train_len)
    return None if params is None else params["factor"]


def check_stride(cfg: DictConfig) -> int | None:
    """The sliding stride (None for nonoverlapping); it may not skip tokens at any eval length."""
    stride = cfg.eval.stride if cfg.eval.protocol == "sliding" else None
    # context_use also slides windows of the training length
    windows = [*eval_lengths(cfg), *([int(cfg.train.seq_len)] if cfg.eval.get("context_use") else [])]
    too_short = sorted({l for l in windows if stride is not None and l < int(stride)})
    if too_short:
        raise RelposError(f"eval.stride={stride} is longer than eval lengths {too_short}; tokens would be skipped")
    return stride


def load_eval_config(run_dir: Path, overrides: list[str], command: str = "eval-length") -> DictConfig:
    """The run's saved config with the eval overrides applied, validated; eval.precision resolved
    for the device (auto: bf16 on CUDA, fp32 on CPU) and eval.rope_scaling.factor=longest from the
    longest eval length, so the variant names what runs (before any scoring: the stored result a
    command checks, or compare looks for, is that of the variant scored)."""
    check_override_keys(overrides, EVAL_KEYS, command)
    cfg = apply_overrides(load_config(run_dir, whole_run=True), overrides)
    validate_run_config(cfg)
    check_stride(cfg)
    cfg.eval.precision = eval_precision(cfg.eval.precision, resolve_device(cfg.device))
    resolve_longest_factor(cfg.eval, max(eval_lengths(cfg)), int(cfg.train.seq_len))
    return cfg


Progress = Callable[[int], ContextManager[Callable[[int], None]]]


def representable(scheme, lengths: list[int], named: Collection[int], key: str) -> list[int]:
    """The lengths the scheme can represent. Lengths the user named (in `named`) must all be; of the
    default ones, those past the scheme (an imported model's learned position table) are left out
    with a note naming the key that asks for them anyway. RelposError (one line) if none is left."""
    kept, past = [], []
    for length in lengths:
        try:
            scheme.check_length(length)
        except RelposError as e:
            if length in named:
                raise
            past.append((length, str(e).split(";")[0]))
            continue
        kept.append(length)
    if past:
        why = past[0][1]
        if not kept:
            raise RelposError(f"{why}: every default eval length is past it; name shorter ones with {key}=[...]")
        print_note(f"eval lengths {', '.join(str(l) for l, _ in past)} left out: {why} (name lengths with {key}=[...])")
    return kept


def load_eval_model(run_dir: Path, cfg: DictConfig, lengths: list[int], named: bool = True) -> tuple[Transformer, list[int]]:
    """The run's model for scoring `lengths` under cfg's eval settings (load_eval_config), every
    setting checked before any scoring, and the lengths it scores (representable: default lengths
    past the scheme are left out). named: whether the user named the lengths (eval.lengths on the
    command line)."""
    _, model = load_trained_model(run_dir, resolve_device(cfg.device), cfg)
    return model, representable(model.scheme, lengths, lengths if named else (), "eval.lengths")


def eval_tokens(cfg: DictConfig, data, longest: int) -> tuple[torch.Tensor, int]:
    """The first eval.tokens + 1 validation tokens every length scores, and the bytes of text their
    targets tokens[1:] cover (what bits per byte divide by)."""
    n_tokens = int(cfg.eval.tokens)
    if n_tokens < longest:
        raise RelposError(f"eval.tokens={n_tokens} is smaller than the longest eval length {longest}")
    if n_tokens + 1 > len(data.validation):
        raise RelposError(
            f"eval.tokens={n_tokens} needs {n_tokens + 1} validation tokens; the split has {len(data.validation)}"
        )
    tokens = torch.from_numpy(np.asarray(data.validation[: n_tokens + 1]).astype(np.int64))
    return tokens, int(data.token_bytes[tokens[1:].numpy()].sum())


def score_length(model: Transformer, cfg: DictConfig, tokens: torch.Tensor, length: int, stride: int | None,
                 advance: Callable[[int], None]) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """(loss sum, count) per position at one eval length, and the context-use columns if asked;
    running out of memory is one line naming the key that fixes it."""
    budget = int(cfg.eval.max_tokens_per_batch)
    window_stride = stride or length
    try:
        loss_sum, count = score_windows(model, tokens, length, window_stride, budget, advance)
        context = (context_use(model, tokens, length, int(cfg.train.seq_len), window_stride, budget, advance)
                   if cfg.eval.get("context_use") else {})
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not isinstance(e, torch.OutOfMemoryError) and "memory" not in str(e):
            raise
        raise RelposError(
            f"out of memory at eval length {length} with eval.max_tokens_per_batch="
            f"{cfg.eval.max_tokens_per_batch}; lower eval.max_tokens_per_batch"
        ) from None
    return loss_sum, count, context


def evaluate_run(
    run_dir: Path, overrides: list[str], progress: Progress = lambda total: nullcontext(lambda n: None),
) -> tuple[DictConfig, list[dict[str, Any]], list[dict[str, Any]]]:
    """Load the run once, score every length; returns (config, length rows, per-position rows).
    progress(total forward passes) gives the advance(n) callback the scoring reports to."""
    cfg = load_eval_config(run_dir, overrides)
    stride = check_stride(cfg)
    named = "eval.lengths" in override_keys(overrides)
    model, lengths = load_eval_model(run_dir, cfg, eval_lengths(cfg), named)
    allow = bool(cfg.eval.allow_changed_data)
    changes = check_data_unchanged(run_dir, cfg.data, allow, "eval")
    data = load_token_data(OmegaConf.to_container(cfg.data, resolve=True))
    changes += check_tokens_unchanged(run_dir, data, allow, "eval")
    tokens, scored_bytes = eval_tokens(cfg, data, max(lengths))

    settings = variant_settings(cfg.eval)
    common = {"protocol": cfg.eval.protocol, "precision": cfg.eval.precision, "variant": variant_tag(settings),
              **{f"eval.{k}": v for k, v in settings.items()}}
    if changes:
        common["data_changed"] = "; ".join(changes)
    rows, position_rows = [], []
    budget = int(cfg.eval.max_tokens_per_batch)
    device = next(model.parameters()).device
    train_len = int(cfg.train.seq_len) if cfg.eval.get("context_use") else None  # its passes are counted too
    with progress(sum(batch_count(len(tokens) - 1, l, stride or l, budget, train_len) for l in lengths)) as advance, \
            eval_autocast(device, cfg.eval.precision):
        for length in lengths:
            loss_sum, count, context = score_length(model, cfg, tokens, length, stride, advance)
            loss = float(loss_sum.sum() / count.sum())
            if not math.isfinite(loss):
                raise RelposError(f"the model's loss at eval length {length} is {loss}: not a result, so nothing was "
                                  f"written; the run's weights or its data are broken (see its metrics.jsonl)")
            factor = rope_factor(cfg.eval, length, int(cfg.train.seq_len))
            rows.append({"length": length, "tokens": int(count.sum()), "loss": loss, "ppl": perplexity(loss),
                         "bpb": float(loss_sum.sum()) / math.log(2) / scored_bytes, "stride": stride or length,
                         **({"rope_factor": factor} if factor is not None else {}), **context, **common})
            position_rows += [
                {"length": length, "position": p, "loss": float(loss_sum[p] / count[p]), "count": int(count[p]),
                 "stride": stride or length, **common}
                for p in range(length)
                if count[p] > 0
            ]
    train_loss = next(r["loss"] for r in rows if r["length"] == cfg.train.seq_len)
    for r in rows:  # ppl / ppl@train as exp of the losses' difference: inf / inf (diverged runs) would be nan
        r["ppl_ratio"] = perplexity(r["loss"] - train_loss)
    return cfg, rows, position_rows
