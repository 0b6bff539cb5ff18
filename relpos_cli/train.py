"""The training job: data -> model -> AdamW with warmup + cosine -> checkpoint, metrics, W&B."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from relpos_cli.attention import check_backend
from relpos_cli.checkpoint import (
    CHECKPOINT_FILE,
    CONFIG_FILE,
    FAILED_FILE,
    as_current,
    holds_training_state,
    latest_training_state,
    load_config,
    load_weights,
    remove_partial_writes,
    restore_rng_states,
    rng_states,
    save_checkpoint,
    save_config,
    save_periodic_checkpoint,
    truncate_metrics,
)
from relpos_cli import distributed
from relpos_cli.compile_cache import replays_cuda_graphs
from relpos_cli.data import TokenData, load_token_data, resolve_data_paths
from relpos_cli.distributed import Ranks, micro_batches
from relpos_cli.errors import Interrupted, RelposError, RunDirTaken
from relpos_cli.fingerprint import check_data_unchanged, check_parent_tokenizer, check_tokens_unchanged, record_data
from relpos_cli.interrupt import STOP_SIGNALS
from relpos_cli.lineage import command_line_keys, inherit, parent_weights
from relpos_cli.logs import log, run_log
from relpos_cli.model import Transformer, build_model
from relpos_cli.precision import autocast
from relpos_cli.config import (
    canonical_numbers,
    check_pos_scaling_takes_effect,
    flatten_config,
    save_hydra_record,
    validate_run_config,
)
from relpos_cli.console import plain_console
from relpos_cli.requeue import active_preemption_signal
from relpos_cli.results import IMPORT_FILE, perplexity
from relpos_cli.rundir import check_fresh_run_dir, point_latest_at, refuse_if_trained, run_dir_lock
from relpos_cli.sampled_positions import pose_positions, random_positions
from relpos_cli.settings import HOUSEKEEPING_KEYS, check_settings_take_effect
from relpos_cli.terminal import TrainingDisplay, step_line
from relpos_cli.tasks.training import task_training
from relpos_cli.tracking import NullTracker, Tracker

console = plain_console()


def lr_multiplier(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to min_ratio at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class WindowSampler:
    """Random training windows (x, y = x shifted by one) drawn with its own seeded generator.
    Only the sampled windows are read from `tokens` (the cache's memmap), so a train split larger
    than RAM is never loaded whole."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int, device: torch.device):
        if len(tokens) < seq_len + 1:  # a window is seq_len + 1 tokens (y is x shifted by one)
            raise RelposError(f"the train split has {len(tokens)} tokens, too few for train.seq_len={seq_len}")
        self.tokens = tokens
        self.seq_len, self.batch_size, self.device = seq_len, batch_size, device
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch of windows of `length` tokens (default train.seq_len)."""
        length = length or self.seq_len
        # starts 0..len - length - 1, the last one included (randint's bound is exclusive), as validation's
        starts = torch.randint(0, len(self.tokens) - length, (self.batch_size,), generator=self.generator)
        idx = starts[:, None] + torch.arange(length + 1)  # (B, T+1)
        windows = torch.from_numpy(np.asarray(self.tokens[idx.numpy()]).astype(np.int64))  # (B, T+1)
        windows = windows.to(self.device, non_blocking=True)
        return windows[:, :-1], windows[:, 1:]


PLAN_SEED_OFFSET = 7919  # the batch plan's generator is seeded apart from the window sampler's


class BatchPlan:
    """What each training batch is besides its tokens: its length (train.length_schedule) and its
    positions (train.randomized_positions or train.position_skip). Random draws come from a generator of its own,
    checkpointed with the others, so a resumed run draws exactly what the uninterrupted one did,
    and the windows sampled are the same with or without these settings.

    Randomized positions (Ruoss et al. 2023): a sorted sample of L distinct positions from [0, N),
    one per batch (every sequence of the batch shares it, so position tensors stay (T,)). PoSE
    (train.position_skip=N): the window's positions in two chunks with a random skip between them,
    up to N - 1, also one draw per batch."""

    def __init__(self, t: DictConfig, seed: int):
        self.seq_len, self.min_len, self.schedule, self.steps = t.seq_len, t.min_seq_len, t.length_schedule, t.steps
        self.limit = t.randomized_positions
        self.skip_target = t.get("position_skip")
        self.generator = torch.Generator().manual_seed(seed + PLAN_SEED_OFFSET)

    def length(self, step: int) -> int:
        """The length of step `step`'s batch (steps count from 1)."""
        if self.schedule == "uniform":
            return int(torch.randint(self.min_len, self.seq_len + 1, (1,), generator=self.generator))
        if self.schedule == "curriculum":  # min_seq_len at step 1, seq_len at the last step
            return self.min_len + round((self.seq_len - self.min_len) * (step - 1) / max(1, self.steps - 1))
        return self.seq_len

    def positions(self, length: int, device: torch.device) -> torch.Tensor | None:
        """(length,) increasing positions below N (randomized or PoSE's), or None (0..length-1)."""
        if self.skip_target is not None:
            return pose_positions(self.skip_target, length, self.generator).to(device)
        if self.limit is None:
            return None
        return random_positions(self.limit, length, self.generator).to(device)

    def check_scheme(self, scheme) -> None:
        key, limit = ("train.position_skip", self.skip_target) if self.skip_target is not None else \
            ("train.randomized_positions", self.limit)
        if limit is None:
            return
        if not scheme.reads_positions:
            raise RelposError(f"{key} applies to schemes whose logits read position values; "
                              f"pos={scheme.name} does not (it sees only their order), so it would change nothing")
        try:
            scheme.check_length(limit)
        except RelposError as e:
            raise RelposError(f"{key}={limit} draws positions up to {limit - 1}: {e}") from None


def validation_windows(tokens: np.ndarray, seq_len: int, count: int) -> torch.Tensor:
    """`count` evenly spaced windows of seq_len + 1 tokens: the same ones at every evaluation."""
    usable = len(tokens) - seq_len - 1
    if usable < 0:
        raise RelposError(f"the validation split has {len(tokens)} tokens, too few for one window of "
                          f"train.seq_len={seq_len} (+1, the last token's target)")
    starts = np.linspace(0, usable, num=min(count, usable + 1)).astype(np.int64)
    return torch.stack([torch.from_numpy(np.asarray(tokens[s : s + seq_len + 1]).astype(np.int64)) for s in starts])


@torch.no_grad()
def validation_loss(model: Transformer, windows: torch.Tensor, batch_size: int, device: torch.device,
                    ranks: Ranks = Ranks()) -> float:
    """Mean loss over the windows; under DDP each rank scores every world_size-th window."""
    model.eval()
    total = 0.0
    for chunk in windows[ranks.rank :: ranks.world_size].split(batch_size):
        chunk = chunk.to(device)
        total += model.loss(chunk[:, :-1], chunk[:, 1:], reduction="sum").item()
    model.train()
    return distributed.sum_over_ranks(total, ranks, device) / (windows.shape[0] * (windows.shape[1] - 1))


def check_finite_end(model: Transformer, last: dict, skipped: int, steps: int, last_good: Path | None) -> None:
    """A run whose last loss, validation loss or weights are not finite has failed (train.on_nan=skip can
    get there): no checkpoint.pt, so nothing evaluates it as a result."""
    bad = [f"{k} {last[k]}" for k in ("loss", "val_loss") if k in last and not math.isfinite(last[k])]
    if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
        bad.append("non-finite weights")
    if bad:
        raise RelposError(
            f"training ended non-finite ({', '.join(bad)} at step {steps}; {skipped} of {steps} steps skipped): "
            f"no checkpoint.pt written; last good checkpoint: {last_good or 'none'}"
        )


def takes_weight_decay(model: Transformer, name: str, p: torch.nn.Parameter) -> bool:
    """The model's own weight matrices and embeddings decay, its norms do not (nanoGPT); the position
    scheme's parameters decay as the scheme declares (PositionScheme.decayed_parameters)."""
    if name.startswith("scheme."):
        return model.scheme.takes_weight_decay(name.removeprefix("scheme."))
    return p.dim() >= 2


def param_groups(model: Transformer, weight_decay: float) -> list[dict]:
    """AdamW's two groups: the parameters that take weight decay (each scheme names its own), and the rest."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in named if takes_weight_decay(model, n, p)]
    no_decay = [p for n, p in named if not takes_weight_decay(model, n, p)]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def training_step(model: Transformer, optimizer, batches: list[tuple[torch.Tensor, torch.Tensor]], grad_clip: float,
                  loss_fn=None, no_sync=contextlib.nullcontext, ranks: Ranks = Ranks(),
                  positions: torch.Tensor | None = None, stable_grads: bool = False):
    """Forward and backward over the micro-batches (gradients add up), clip; the optimizer steps only if
    the loss and the gradient norm are finite. Returns (loss, grad_norm, finite), the loss being the
    mean over the global batch. The finiteness check is one host sync per step: the price of never
    letting a non-finite update reach the weights (and so never checkpointing NaNs).
    loss_fn: model.loss, its DDP wrapper or their torch.compile'd version; no_sync: the DDP wrapper's,
    so only the last micro-batch all-reduces the gradients. positions: the batch's (T,) positions
    (train.randomized_positions), None for 0..T-1. stable_grads: keep each parameter's gradient in one
    tensor from step to step, zeroed in place, instead of dropping it: under CUDA graphs with micro-steps
    (train.compile=reduce-overhead, train.grad_accum > 1), a gradient that autograd took from a replay's
    output lives in the graphs' memory pool, which the next micro-step's replay overwrites before the
    sum is complete (torch's cudagraph trees say so, and recommend this)."""
    if stable_grads:
        for p in model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    optimizer.zero_grad(set_to_none=not stable_grads)
    micro_losses = []
    given = {} if positions is None else {"positions": positions}
    for i, (x, y) in enumerate(batches):
        with no_sync() if i < len(batches) - 1 else contextlib.nullcontext():
            micro_loss = (loss_fn or model.loss)(x, y, **given) / len(batches)
            micro_loss.backward()
        micro_losses.append(micro_loss.detach())
    # the same loss on every rank, so every rank takes the same finite / non-finite decision
    loss = distributed.mean_over_ranks(torch.stack(micro_losses).sum(), ranks)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    finite = bool(torch.isfinite(loss) & torch.isfinite(grad_norm))
    if finite:
        optimizer.step()
        model.scheme.constrain_parameters()  # projected gradient descent for constrained schemes (KERPLE)
    return loss, grad_norm, finite


class StopRequest:
    """SIGINT/SIGTERM/SIGHUP (interrupt.STOP_SIGNALS: Ctrl-C, a kill, a closed terminal) only set a
    flag: the loop finishes its step, saves a checkpoint and stops (after the last step, the run finishes).
    A second signal stops at once (KeyboardInterrupt). In a SLURM sweep job, submitit's preemption
    signal (see requeue.py) is taken the same way, then handed on so the job is requeued."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        self._preemption = active_preemption_signal()

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            for sig in (*STOP_SIGNALS, self._preemption):
                if sig is not None:
                    self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None and signum != self._preemption:
            raise KeyboardInterrupt
        self.signum = signum

    @property
    def preempted(self) -> bool:
        return self.signum is not None and self.signum == self._preemption

    def hand_on(self) -> None:
        """After the checkpoint: let the preemption handler requeue the job (it exits the process)."""
        self._previous[self.signum](self.signum, None)

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def training_state(cfg: DictConfig, step: int, model: Transformer, optimizer, scheduler,
                   generators: dict[str, torch.Generator], vocab_size: int, tokens: int, skipped: int) -> dict[str, Any]:
    """Everything the next step depends on, so a resumed run is bitwise the uninterrupted one (its
    metrics too: tokens seen and steps skipped so far, train.on_nan=skip)."""
    return {
        "step": step,
        "tokens": tokens,
        "skipped_steps": skipped,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": rng_states(generators),
        "vocab_size": vocab_size,
        "config": OmegaConf.to_container(cfg, resolve=True),
    }


def resume(run_dir: Path) -> dict | None:
    """Continue the run in run_dir from its newest intact checkpoint, with its saved config; None if it
    had finished. outputs/latest points at it from the moment it trains again.

    Args:
        run_dir: a run that `relpos train` started; an imported run (relpos import) is refused before
            anything is written into it: its weights come without an optimizer or a schedule.
    """
    run_dir = Path(run_dir)
    if (run_dir / IMPORT_FILE).is_file():
        raise RelposError(f"{run_dir} is an imported run (relpos import): it holds no training state to resume; "
                          f"fine-tune it with relpos train init_from={run_dir}")
    return train(load_config(run_dir, whole_run=True), run_dir, resume=True, latest=run_dir)


def train(cfg: DictConfig, run_dir: Path, resume: bool = False, latest: Path | None = None) -> dict | None:
    """Train one model into run_dir (continuing from its newest checkpoint if resume); returns the final
    metrics (None: resume found the run finished).

    The run dir is checked (a fresh run goes only into a new, empty or relpos dir) and locked for the
    whole run, so it has one writer. Under torchrun every rank calls this with the same run_dir; rank 0
    alone checks, locks and writes (its relpos.log and outputs/latest too).

    Args:
        cfg: the run's config (composed by Hydra, or saved in run_dir for resume).
        run_dir: where the run's files go.
        resume: continue the run in run_dir rather than start one.
        latest: the dir outputs/latest points at once training starts (a run stopped at any step can be
            found there) and again when it ends; None leaves outputs/latest alone.
    """
    ranks = distributed.setup()
    run_dir = Path(run_dir)
    if not ranks.is_main:
        validate_run_config(cfg)
        return _train(cfg, run_dir, resume, ranks, latest)
    with ExitStack() as claim:
        # first: a refused dir gets nothing written into it, not even failed.json or relpos.log
        if not resume:
            check_fresh_run_dir(run_dir)
            run_dir.mkdir(parents=True, exist_ok=True)
        claim.enter_context(run_dir_lock(run_dir, "train"))
        claim.enter_context(run_log(run_dir))
        try:
            validate_run_config(cfg)
            return _train(cfg, run_dir, resume, ranks, latest)
        except RunDirTaken:
            raise  # the run in that dir is someone else's: its log is left alone
        except Interrupted as e:
            log.warning(str(e))
            raise
        except RelposError as e:
            log.error(f"error: {e}")
            raise
        except SystemExit:
            raise  # submitit requeuing the job (logged by requeue.py)
        except BaseException as e:
            log.error(f"stopped by {type(e).__name__}", exc_info=not isinstance(e, KeyboardInterrupt))
            raise


def _announce(text: str) -> None:
    console.print(text, soft_wrap=True)
    log.info(text)


def point_latest(latest: Path | None, ranks: Ranks) -> None:
    """outputs/latest -> latest, from rank 0 only (the other ranks train the same run)."""
    if latest is not None and ranks.is_main:
        point_latest_at(latest)


def _train(cfg: DictConfig, run_dir: Path, resume: bool, ranks: Ranks, latest: Path | None) -> dict | None:
    """The run's steps, as torchtune's recipes name them: set up, then train (each step maybe logged,
    evaluated and checkpointed), then finish.

    Args:
        cfg, run_dir, resume, latest: as train's.
        ranks: this process's place under torchrun.
    """
    trainer = set_up(cfg, run_dir, resume, ranks)
    # from its first step, so a run stopped at any point is outputs/latest (and where resume found it
    # finished: `relpos train resume=X && relpos eval-length outputs/latest` means X)
    point_latest(latest, ranks)
    if trainer is None:
        return None
    # the signals are taken over finish too: one that came while checkpoint.pt was written killed the
    # process there, losing every step since the last periodic checkpoint
    with StopRequest() as stop:
        last = trainer.fit(stop)
        result = trainer.finish(last)
    point_latest(latest, ranks)  # again: a run started meanwhile took it, and `train && eval-length` means this one
    if stop.preempted:  # the signal came during the last step: the run is complete, the job still ends here
        stop.hand_on()
    return result


def check_run_dir(cfg: DictConfig, run_dir: Path, resume: bool, ranks: Ranks) -> tuple[DictConfig, tuple | None] | None:
    """The run dir before anything is trained: half-written files gone, a fresh run refused where a run
    is or where a setting would change nothing, init_from's parent config inherited, and (resume) its
    newest training state found.

    Args:
        cfg: the run's config.
        run_dir: the run dir, locked by the caller.
        resume: continue the run in run_dir.
        ranks: this process's place under torchrun; rank 0 alone writes.

    Returns:
        (cfg, found): the config (with the parent's model and scheme under init_from) and the
        (checkpoint path, state) to resume from (None: a fresh run); None when resume found the run finished.
    """
    if ranks.is_main:
        remove_partial_writes(run_dir)
    if not resume:
        refuse_if_trained(run_dir, holds_training_state(run_dir))
        if cfg.get("init_from"):
            cfg = inherit(cfg, command_line_keys(run_dir))
            validate_run_config(cfg)
        else:
            check_pos_scaling_takes_effect(cfg)
        check_settings_take_effect(cfg)  # a resumed run trains on as it started
    found = latest_training_state(run_dir) if resume else None
    if found is not None:
        check_config_unchanged(cfg, run_dir, *found)
    if found is not None and found[0].name == CHECKPOINT_FILE:
        console.print(f"{run_dir} already finished ({cfg.train.steps} steps); nothing to resume")
        return None
    return cfg, found


# what config.yaml may change between a checkpoint and its resume: where the run trains and what it
# logs and keeps, never what it computes (the seed, the model, the data, the schedule's settings)
RESUME_MAY_CHANGE = (*HOUSEKEEPING_KEYS, "name")


def check_config_unchanged(cfg: DictConfig, run_dir: Path, checkpoint: Path, state: dict) -> None:
    """Resume continues the run its checkpoint holds: a config.yaml edited since (train.steps raised, the lr
    changed) would train on under settings the checkpoint's optimizer, schedule and generators never had,
    and record them as the run's.

    Args:
        cfg: the run's config.yaml, as resume read it.
        run_dir: the run dir.
        checkpoint, state: the checkpoint resume found, and what it holds.
    """
    if "config" not in state:
        return
    now, then = (canonical_numbers(flatten_config(OmegaConf.to_container(c, resolve=True)))
                 for c in (cfg, as_current(state["config"], run_dir)))
    changed = sorted(k for k in now.keys() | then.keys() if now.get(k) != then.get(k)
                     and not any(k == p or k.startswith(p + ".") for p in RESUME_MAY_CHANGE))
    if changed:
        first = changed[0]
        more = f" (and {len(changed) - 1} more: {', '.join(changed[1:])})" if len(changed) > 1 else ""
        raise RelposError(
            f"{run_dir / CONFIG_FILE} was edited since {checkpoint} was saved: {first} is {now.get(first)!r} there, "
            f"{then.get(first)!r} in the checkpoint{more}; resume continues a run as it was trained: restore "
            f"config.yaml, or start a new run (init_from= fine-tunes from a finished one)"
        )


def load_run_data(cfg: DictConfig, run_dir: Path, resume: bool, ranks: Ranks) -> TokenData:
    """The run's token splits; a resumed run's must be those it trained on (checked by fingerprint).

    Args:
        cfg: the run's config (data paths are made absolute here for a fresh run).
        run_dir: the run dir, holding the data fingerprint of a resumed run.
        resume: continue the run in run_dir.
        ranks: rank 0 fills the token cache, the others then read it.
    """
    if resume:  # the same data as before, or the resumed run is not the run it continues
        check_data_unchanged(run_dir, cfg.data, allow=False, how="resume")
    else:
        resolve_data_paths(cfg)  # stored absolute, so the run evaluates from any directory
    with distributed.main_first(ranks):
        data = load_token_data(OmegaConf.to_container(cfg.data, resolve=True))
    if resume:
        check_tokens_unchanged(run_dir, data, allow=False, how="resume", splits=("train", "validation"))
    elif cfg.get("init_from"):
        check_parent_tokenizer(Path(cfg.init_from), OmegaConf.to_container(cfg.data, resolve=True), data)
    return data


def check_cuda_graphs(t: DictConfig, ranks: Ranks) -> None:
    """train.compile's modes that replay CUDA graphs, refused where relpos has not made them safe: under
    several processes (DDP's all-reduce hooks inside a replayed backward: untested) and with batch lengths
    that vary (train.length_schedule: a graph recorded, and its memory kept, per length).

    Args:
        t: the run's train section.
        ranks: this process's place under torchrun.
    """
    mode = t.get("compile", False)
    if not replays_cuda_graphs(mode):
        return
    if ranks.enabled:
        raise RelposError(f"train.compile={mode} (CUDA graphs) is not supported under several processes "
                          f"(DDP's all-reduce inside a replayed backward is untested): use train.compile=true")
    if t.length_schedule != "fixed":
        raise RelposError(f"train.compile={mode} records a CUDA graph per batch length, and "
                          f"train.length_schedule={t.length_schedule} varies it: use train.compile=true")


def set_up(cfg: DictConfig, run_dir: Path, resume: bool, ranks: Ranks) -> Trainer | None:
    """Everything before the first step: device and precision, the run dir, data, model, optimizer and
    schedule, samplers, the training state (a resumed run's checkpoint, or init_from's parent weights),
    metrics and W&B. A setting refused here leaves no config.yaml written.

    Args:
        cfg: the run's config, validated.
        run_dir: the run dir, locked by the caller (rank 0).
        resume: continue the run in run_dir from its newest checkpoint.
        ranks: this process's place under torchrun; rank 0 alone writes.

    Returns:
        The trainer, at the step after its restored state; None when resume found the run finished.
    """
    t = cfg.train
    distributed.check_batch_split(t.batch_size, t.grad_accum, ranks)
    console.quiet = not ranks.is_main
    device = distributed.local_device(distributed.resolve_device(cfg.device), ranks)
    precision = autocast(device, t.get("precision", "auto"))  # checked before anything is written
    check_backend(cfg.model.get("attn_backend", "auto"), device)
    check_cuda_graphs(t, ranks)
    checked = check_run_dir(cfg, run_dir, resume, ranks)
    if checked is None:
        return None
    cfg, found = checked
    if ranks.is_main:
        save_hydra_record(run_dir, cfg)
        (run_dir / FAILED_FILE).unlink(missing_ok=True)  # a resumed run is no longer a failed one
        log.info(f"{'resume' if resume else 'train'} {run_dir} on {socket.gethostname()} (pid {os.getpid()}"
                 + "".join(f", {k} {os.environ[k]}" for k in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT") if k in os.environ)
                 + f")\nconfig:\n{OmegaConf.to_yaml(cfg, resolve=True)}")
    torch.manual_seed(cfg.seed)
    data = load_run_data(cfg, run_dir, resume, ranks)
    model = build_model(cfg, data.vocab_size).to(device)
    plan = BatchPlan(t, cfg.seed)
    plan.check_scheme(model.scheme)  # before the run's config is written: a refused run leaves only its failure
    if ranks.is_main:
        save_config(run_dir, cfg)
        if not resume:
            record_data(run_dir, OmegaConf.to_container(cfg.data, resolve=True), data)

    optimizer = torch.optim.AdamW(
        param_groups(model, t.weight_decay), lr=t.lr, betas=tuple(t.betas), fused=device.type == "cuda"
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_multiplier(s, t.warmup_steps, t.steps, t.min_lr_ratio)
    )
    lm_sampler = lambda rows: WindowSampler(data.train, t.seq_len, rows, cfg.seed, device)  # noqa: E731
    on_task = task_training(cfg, data, lm_sampler, device)  # None: plain language modelling
    sampler = on_task.sampler if on_task else lm_sampler(t.batch_size)
    if on_task and t.length_schedule != "fixed":
        on_task.sampler.task.check_length(t.min_seq_len, f"train.min_seq_len={t.min_seq_len}")
    trainer = Trainer(cfg, run_dir, ranks, device, precision, model, optimizer, scheduler, plan, sampler, on_task,
                      data.vocab_size, validation_windows(data.validation, t.seq_len, t.val_batches * t.batch_size))
    trainer.restore(found)
    if ranks.is_main:
        truncate_metrics(run_dir, trainer.start_step)
        trainer.tracker = Tracker(run_dir, OmegaConf.to_container(cfg, resolve=True))
    _announce(
        f"relpos train pos={cfg.pos.name} params={model.num_params():,} device={device} "
        + (f"x {ranks.world_size} processes " if ranks.enabled else "")
        + f"data={cfg.data.source} ({len(data.train):,} train / {len(data.validation):,} val tokens)"
        + (f" task={on_task.name} ({on_task.sampler.task_rows}/{t.batch_size} rows)" if on_task else "")
        + (f" resumed at step {trainer.start_step}" if resume else "")
        + (f" from {cfg.init_from}" if cfg.get("init_from") and trainer.start_step == 0 else "")
    )
    if t.warmup_steps > t.steps:  # said, not refused: a smoke run of a few steps is a fair thing to ask
        _announce(f"note: train.warmup_steps={t.warmup_steps} > train.steps={t.steps}: the lr rises the whole run "
                  f"and peaks at {t.lr * t.steps / t.warmup_steps:.3g}, not train.lr={t.lr:g}")
    if replays_cuda_graphs(t.get("compile", False)) and device.type != "cuda":
        _announce(f"note: train.compile={t.compile} replays CUDA graphs on CUDA only; on {device.type} it compiles "
                  f"as train.compile=true does")
    trainer.loss_fn, trainer.no_sync = distributed.loss_function(model, ranks, device, t.get("compile", False),
                                                                 on_task and on_task.loss)
    return trainer


class Trainer:
    """One training run once set up (set_up): its steps (train_step), validation (evaluate),
    checkpoints (checkpoint), the loop over them (fit) and its end (finish). Holds what the next step
    depends on; `state` is that as a checkpoint, so a resumed run is bitwise the uninterrupted one."""

    def __init__(self, cfg: DictConfig, run_dir: Path, ranks: Ranks, device: torch.device, precision, model: Transformer,
                 optimizer: torch.optim.Optimizer, scheduler, plan: BatchPlan, sampler, on_task, vocab_size: int,
                 val_windows: torch.Tensor):
        """Args:
            cfg: the run's config.
            run_dir: the run dir (rank 0 writes into it).
            ranks: this process's place under torchrun.
            device: where the model trains.
            precision: the autocast context of each step (train.precision).
            model: the model, on device.
            optimizer: AdamW over model's parameter groups.
            scheduler: the warmup + cosine schedule of optimizer's lr.
            plan: each batch's length and positions.
            sampler: the training batches (language-model windows, or a task's examples).
            on_task: the task the run trains on (tasks.training.TaskTraining), None for language modelling.
            vocab_size: the data's vocabulary, stored in checkpoints.
            val_windows: (N, T + 1) validation windows, the same at every evaluation.
        """
        self.cfg, self.run_dir, self.ranks, self.device, self.precision = cfg, run_dir, ranks, device, precision
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.plan, self.sampler, self.on_task, self.vocab_size = plan, sampler, on_task, vocab_size
        self.val_windows = val_windows
        self.generators = {"sampler": sampler.generator, "plan": plan.generator}
        self.tracker: Tracker | NullTracker = NullTracker()  # W&B and metrics.jsonl on rank 0 (set_up)
        self.loss_fn, self.no_sync = None, contextlib.nullcontext
        self.start_step, self.tokens_seen, self.skipped = 0, 0, 0
        self.last_good: Path | None = None  # the newest periodic checkpoint

    def restore(self, found: tuple[Path, dict] | None) -> None:
        """The training state to start from: a checkpoint's (resume), or at step 0 init_from's parent weights.

        Args:
            found: (checkpoint path, state) of a resumed run, None for a fresh one.
        """
        cfg = self.cfg
        if found is not None:
            self.last_good, state = found
            load_weights(self.model, state["model"], self.last_good, self.run_dir / CONFIG_FILE)
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            restore_rng_states(state["rng"], self.generators)
            self.start_step = state["step"]
            self.tokens_seen = state.get("tokens", self.start_step * cfg.train.batch_size * cfg.train.seq_len)
            # a checkpoint saved before the count was kept: the steps it skipped are not known, counted anew
            self.skipped = state.get("skipped_steps", 0)
        elif cfg.get("init_from"):  # a fine-tuned run's step 0: its parent's final weights
            parent = Path(cfg.init_from)
            load_weights(self.model, parent_weights(cfg, self.vocab_size), parent / CHECKPOINT_FILE,
                         parent / CONFIG_FILE)

    def state(self, step: int) -> dict[str, Any]:
        """The checkpoint after `step`.

        Args:
            step: the last step taken.
        """
        return training_state(self.cfg, step, self.model, self.optimizer, self.scheduler, self.generators,
                              self.vocab_size, self.tokens_seen, self.skipped)

    def train_step(self, step: int) -> tuple[torch.Tensor, torch.Tensor, float, int]:
        """One optimizer step: a batch of the plan's length and positions, forward, backward, update (or,
        non-finite, a stop or a skipped step as train.on_nan says), then the schedule moves on.

        Args:
            step: its number, from 1.

        Returns:
            (loss, grad_norm, lr, length): the global batch's mean loss, the gradient norm before
            clipping, the lr this step used and the batch's length.
        """
        t = self.cfg.train
        length = self.plan.length(step)
        positions = self.plan.positions(length, self.device)
        batches = micro_batches(*self.sampler(length), t.grad_accum, self.ranks)
        with self.precision:
            loss, grad_norm, finite = training_step(self.model, self.optimizer, batches, t.grad_clip, self.loss_fn,
                                                    self.no_sync, self.ranks, positions,
                                                    replays_cuda_graphs(t.compile) and len(batches) > 1)
        if not finite and t.on_nan == "stop":
            # the gradient norm can overflow while the loss is still finite: name the value(s) that did
            values = {"loss": loss.item(), "gradient norm": float(grad_norm)}
            bad = " and ".join(f"{name} ({value})" for name, value in values.items() if not math.isfinite(value))
            raise RelposError(
                f"non-finite {bad} at step {step}; last good checkpoint: {self.last_good or 'none'} "
                f"(train.on_nan=skip drops such steps instead)"
            )
        self.skipped += not finite
        lr = self.scheduler.get_last_lr()[0]  # the step's own: after scheduler.step() it is the next step's
        self.scheduler.step()
        self.tokens_seen += t.batch_size * length
        return loss, grad_norm, lr, length

    def evaluate(self) -> dict[str, float]:
        """Validation metrics: val_loss where the run models language, the task's where it trains on one."""
        t, on_task = self.cfg.train, self.on_task
        row = {}
        if on_task is None or on_task.mixed:
            row["val_loss"] = validation_loss(self.model, self.val_windows, t.batch_size, self.device, self.ranks)
        if on_task is not None:
            row.update(on_task.validation(self.model, t.batch_size, self.device, self.ranks))
        return row

    def checkpoint(self, step: int) -> None:
        """A periodic checkpoint (rank 0), the oldest beyond train.keep_checkpoints removed.

        Args:
            step: the last step taken.
        """
        if self.ranks.is_main:
            self.last_good = save_periodic_checkpoint(self.run_dir, self.state(step), self.cfg.train.keep_checkpoints)
            log.info(f"checkpoint {self.last_good}")

    def fit(self, stop: StopRequest) -> dict:
        """The steps after the restored one up to train.steps, each logged every train.log_every steps,
        validated every train.eval_every and at the end, checkpointed every train.ckpt_every; SIGINT /
        SIGTERM end it after a checkpoint (Interrupted), a preemption signal hands the job on to requeue.

        Args:
            stop: the signals taken (a signal during the last step lets the run finish).

        Returns:
            The last metrics row (that of the last step).
        """
        t = self.cfg.train
        last: dict = {}
        window_start, window_tokens = time.perf_counter(), 0
        with TrainingDisplay(console, t.steps, self.start_step) as display, ExitStack() as on_exit:
            on_exit.callback(self.tracker.finish)  # also when a non-finite loss or a signal ends the loop
            for step in range(self.start_step + 1, t.steps + 1):
                loss, grad_norm, lr, length = self.train_step(step)
                window_tokens += t.batch_size * length
                display.advance()

                is_last = step == t.steps
                validate = (t.eval_every and step % t.eval_every == 0) or is_last
                if step % t.log_every == 0 or validate:
                    elapsed = time.perf_counter() - window_start
                    row = {"step": step, "loss": loss.item(), "lr": lr, "grad_norm": float(grad_norm),
                           "tokens_per_s": window_tokens / elapsed, "tokens": self.tokens_seen}
                    if self.skipped:
                        row["skipped_steps"] = self.skipped
                    if validate:
                        row.update(self.evaluate())
                    self.tracker.log(row)
                    last = row
                    display.show(row)
                    log.info(step_line(row, t.steps))
                    window_start, window_tokens = time.perf_counter(), 0

                stopping = distributed.any_rank(stop.signum is not None, self.ranks, self.device)
                if not is_last and ((t.ckpt_every and step % t.ckpt_every == 0) or stopping):
                    self.checkpoint(step)
                if stopping and not is_last:
                    self.stop(stop, step)
        return last

    def stop(self, stop: StopRequest, step: int) -> None:
        """End the run after the checkpoint of `step`: a preemption hands the job on to be requeued,
        any other signal raises Interrupted naming the checkpoint and the resume command.

        Args:
            stop: the signals taken.
            step: the last step taken.
        """
        if stop.preempted:
            self.tracker.finish()
            stop.hand_on()  # submitit requeues the job and exits; the requeued job resumes from last_good
        signum = stop.signum or signal.SIGTERM  # a rank the signal did not reach stops with the others
        raise Interrupted(
            f"{signal.Signals(signum).name} at step {step}: checkpoint saved to {self.last_good}; "
            f"resume with: relpos train resume={self.run_dir}",
            signum,
        )

    def finish(self, last: dict) -> dict:
        """The end of a run that took all its steps: checked finite, its final checkpoint.pt (rank 0),
        its summary line.

        Args:
            last: the last step's metrics row.

        Returns:
            last.
        """
        t = self.cfg.train
        check_finite_end(self.model, last, self.skipped, t.steps, self.last_good)
        # composed before checkpoint.pt is written: nothing after it may fail, or the run would hold
        # both checkpoint.pt and failed.json
        summary = (f"step {last['step']}: loss {last['loss']:.4f}  val_loss {last['val_loss']:.4f} "
                   f"(ppl {perplexity(last['val_loss']):.3f})  {last['tokens_per_s']:,.0f} tok/s")
        if self.ranks.is_main:
            save_checkpoint(self.run_dir, self.state(t.steps))
            log.info(f"checkpoint {self.run_dir / CHECKPOINT_FILE} (final)")
        _announce(summary)
        _announce(f"run dir: {self.run_dir}")
        return last
