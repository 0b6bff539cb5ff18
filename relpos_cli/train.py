"""The training job: data -> model -> AdamW with warmup + cosine -> checkpoint, metrics, W&B."""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from relpos_cli.checkpoint import save_checkpoint, save_config
from relpos_cli.data import load_token_data
from relpos_cli.errors import RelposError
from relpos_cli.model import Transformer, build_model
from relpos_cli.tracking import Tracker

console = Console()


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RelposError("device=cuda but no CUDA device is available; use device=cpu or device=auto")
    if name not in ("cpu", "cuda"):
        raise RelposError(f"device={name!r}; choose one of: auto, cpu, cuda")
    return torch.device(name)


def lr_multiplier(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to min_ratio at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class WindowSampler:
    """Random training windows (x, y = x shifted by one) drawn with its own seeded generator."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int, device: torch.device):
        if len(tokens) <= seq_len + 1:
            raise RelposError(f"the train split has {len(tokens)} tokens, too few for train.seq_len={seq_len}")
        self.tokens = torch.from_numpy(np.asarray(tokens).astype(np.int64))
        self.seq_len, self.batch_size, self.device = seq_len, batch_size, device
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.tokens) - self.seq_len - 1, (self.batch_size,), generator=self.generator)
        idx = starts[:, None] + torch.arange(self.seq_len + 1)  # (B, T+1)
        windows = self.tokens[idx].to(self.device, non_blocking=True)
        return windows[:, :-1], windows[:, 1:]


def validation_windows(tokens: np.ndarray, seq_len: int, count: int) -> torch.Tensor:
    """`count` evenly spaced windows of seq_len + 1 tokens: the same ones at every evaluation."""
    usable = len(tokens) - seq_len - 1
    if usable < 0:
        raise RelposError(f"the validation split has {len(tokens)} tokens, fewer than train.seq_len={seq_len}")
    starts = np.linspace(0, usable, num=min(count, usable + 1)).astype(np.int64)
    return torch.stack([torch.from_numpy(np.asarray(tokens[s : s + seq_len + 1]).astype(np.int64)) for s in starts])


@torch.no_grad()
def validation_loss(model: Transformer, windows: torch.Tensor, batch_size: int, device: torch.device) -> float:
    model.eval()
    total = 0.0
    for chunk in windows.split(batch_size):
        chunk = chunk.to(device)
        total += model.loss(chunk[:, :-1], chunk[:, 1:], reduction="sum").item()
    model.train()
    return total / (windows.shape[0] * (windows.shape[1] - 1))


def check_train_config(cfg: DictConfig) -> None:
    t = cfg.train
    for key in ("steps", "seq_len", "batch_size", "log_every"):
        if int(t[key]) <= 0:
            raise RelposError(f"train.{key} must be positive, got {t[key]}")
    if float(t.lr) <= 0:
        raise RelposError(f"train.lr must be positive, got {t.lr}")


def _param_groups(model: Transformer, weight_decay: float) -> list[dict]:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def train(cfg: DictConfig, run_dir: Path) -> dict:
    """Train one model into run_dir; returns the final metrics."""
    check_train_config(cfg)
    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    data = load_token_data(OmegaConf.to_container(cfg.data, resolve=True))
    model = build_model(cfg, data.vocab_size).to(device)
    save_config(run_dir, cfg)

    t = cfg.train
    optimizer = torch.optim.AdamW(_param_groups(model, t.weight_decay), lr=t.lr, betas=tuple(t.betas))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_multiplier(s, t.warmup_steps, t.steps, t.min_lr_ratio)
    )
    sampler = WindowSampler(data.train, t.seq_len, t.batch_size, cfg.seed, device)
    val_windows = validation_windows(data.validation, t.seq_len, t.val_batches * t.batch_size)
    tracker = Tracker(run_dir, OmegaConf.to_container(cfg, resolve=True), job_type="train")
    console.print(
        f"[bold]relpos train[/] pos={cfg.pos.name} params={model.num_params():,} device={device} "
        f"data={cfg.data.source} ({len(data.train):,} train / {len(data.validation):,} val tokens)"
    )

    # train.compile: torch.compile fuses the forward + loss (and its backward); off by default because
    # compiling takes longer than a short CPU run saves
    loss_fn = torch.compile(model.loss) if t.get("compile", False) else model.loss
    last: dict = {}
    tokens_per_step = t.batch_size * t.seq_len
    window_start, window_steps = time.perf_counter(), 0
    progress = Progress(
        TextColumn("[bold blue]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[status]}"),
        TimeRemainingColumn(), console=console, transient=True,
    )
    with progress:
        task = progress.add_task("train", total=t.steps, status="")
        for step in range(1, t.steps + 1):
            x, y = sampler()
            loss = loss_fn(x, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
            optimizer.step()
            scheduler.step()
            window_steps += 1
            progress.advance(task)

            is_last = step == t.steps
            if step % t.log_every == 0 or is_last:
                elapsed = time.perf_counter() - window_start
                row = {
                    "step": step,
                    "loss": loss.item(),  # the only host sync, once per log step
                    "lr": scheduler.get_last_lr()[0],
                    "grad_norm": float(grad_norm),
                    "tokens_per_s": window_steps * tokens_per_step / elapsed,
                    "tokens": step * tokens_per_step,
                }
                if (t.eval_every and step % t.eval_every == 0) or is_last:
                    row["val_loss"] = validation_loss(model, val_windows, t.batch_size, device)
                tracker.log(row)
                last = row
                status = f"loss {row['loss']:.3f}  {row['tokens_per_s']:,.0f} tok/s"
                if "val_loss" in row:
                    status += f"  val {row['val_loss']:.3f}"
                progress.update(task, status=status)
                window_start, window_steps = time.perf_counter(), 0

    save_checkpoint(run_dir, {"model": model.state_dict(), "vocab_size": data.vocab_size, "step": t.steps})
    tracker.finish()
    console.print(
        f"step {last['step']}: loss {last['loss']:.4f}  val_loss {last['val_loss']:.4f} "
        f"(ppl {math.exp(last['val_loss']):.3f})  {last['tokens_per_s']:,.0f} tok/s"
    )
    console.print(f"run dir: [bold]{run_dir}[/]")
    return last
