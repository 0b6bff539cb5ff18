"""Training on a task: batches of task examples (alone or mixed into language modelling), the
answer-only loss, and the fixed validation examples.

- **Lengths** (the NoPE protocol): each training example's length is drawn uniformly from
  [the task's minimum, train.seq_len], its depth (passkey) uniformly from [0, 1]. Examples sit at
  the start of their row (positions 0..n-1, as at evaluation) and are right-padded to
  train.seq_len; causal attention never lets a real token see a pad, and pads have no target.
  Under train.length_schedule each batch has its own length (train.py's BatchPlan): the examples
  are drawn up to it and padded to it, and mixed language-model rows have that length too.
- **Loss**: targets are -100 except on answer tokens, and the loss is the mean over the batch's
  rows of each row's mean loss over its scored tokens. A task row scores its answer tokens only; a
  language-model row (``task.mix`` < 1) scores all train.seq_len tokens, as in plain training. So
  every example weighs the same whatever the length of its answers, and with ``task.mix`` = m,
  round(m * batch_size) of the rows are task examples and the task carries that share of the loss.
  A mean of equal-sized row groups stays exact when grad_accum or torchrun split the batch.
- **State**: one torch Generator draws everything (the language-model windows first, then each task
  row's length, depth and example seed), so the checkpoint's sampler state resumes a run bitwise.
- **Validation**: ``task.val_examples`` fixed examples (lengths and depths drawn from task.seed,
  filler from the validation split) scored with the same loss: ``val_loss`` of a task run,
  ``val_task_loss`` beside the language-model ``val_loss`` of a mixed run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor

from relpos_cli import distributed
from relpos_cli.data import TokenData, corpus_tokenizer
from relpos_cli.distributed import Ranks
from relpos_cli.errors import RelposError
from relpos_cli.tasks import NO_TASK, build_task, task_name, task_settings
from relpos_cli.tasks.base import Encoder, Example, Task

IGNORE = -100  # F.cross_entropy's ignore_index: no loss, no gradient
VALIDATION_STREAM = 1  # the validation examples' seed: (task.seed, this), apart from the eval cells'


def padded_batch(examples: list[Example], seq_len: int, pad_id: int) -> tuple[Tensor, Tensor]:
    """Examples of <= seq_len tokens -> (tokens, targets), each (B, seq_len): an example at the start
    of its row, pads after it; targets[t] = tokens[t + 1] where that token is an answer token."""
    x = torch.full((len(examples), seq_len), pad_id, dtype=torch.int64)
    y = torch.full((len(examples), seq_len), IGNORE, dtype=torch.int64)
    for row, ex in enumerate(examples):
        ids = torch.from_numpy(ex.input_ids)
        x[row, : len(ids)] = ids
        for start, end in ex.answer_spans:
            y[row, start - 1 : end - 1] = ids[start:end]  # logits at t predict token t + 1
    return x, y


def answer_loss(model, tokens: Tensor, targets: Tensor, positions: Tensor | None = None) -> Tensor:
    """Mean over rows of each row's mean loss over its scored (non -100) targets; positions as
    model.loss (train.randomized_positions)."""
    losses = model.loss(tokens, targets, reduction="none", positions=positions)  # (B, T); 0 where the target is ignored
    scored = (targets != IGNORE).sum(1).clamp(min=1)  # (B,)
    return (losses.sum(1) / scored).mean()


def draw_example(task: Task, generator: torch.Generator, max_length: int) -> Example:
    """One training example: its length, depth and content seed drawn from `generator`."""
    length = int(torch.randint(task.shortest_example(), max_length + 1, (1,), generator=generator))
    depth = float(torch.rand(1, generator=generator)) if task.has_depth else None
    seed = int(torch.randint(2**62, (1,), generator=generator))
    return task.example(np.random.default_rng(seed), length, depth)


class TaskSampler:
    """Training batches of (tokens, targets): the rows of `lm` (language-model windows, if mixing;
    this shares its generator) first, then `task_rows` task examples."""

    def __init__(self, task: Task, seq_len: int, task_rows: int, lm, seed: int, pad_id: int, device: torch.device):
        self.task, self.seq_len, self.task_rows, self.lm = task, seq_len, task_rows, lm
        self.pad_id, self.device = pad_id, device
        self.generator = lm.generator if lm is not None else torch.Generator().manual_seed(seed)

    def __call__(self, length: int | None = None) -> tuple[Tensor, Tensor]:
        """A batch of rows of `length` tokens (default train.seq_len; train.length_schedule): task
        examples up to that length, padded to it."""
        length = length or self.seq_len
        examples = [draw_example(self.task, self.generator, length) for _ in range(self.task_rows)]
        x, y = padded_batch(examples, length, self.pad_id)
        x, y = x.to(self.device), y.to(self.device)
        if self.lm is None:
            return x, y
        lm_x, lm_y = self.lm(length)  # (lm_rows, T) each, drawn before the task rows
        return torch.cat([lm_x, x]), torch.cat([lm_y, y])


def validation_examples(task: Task, count: int, seq_len: int, seed: int) -> list[Example]:
    generator = torch.Generator().manual_seed(int(np.random.SeedSequence([seed, VALIDATION_STREAM]).generate_state(1)[0]))
    return [draw_example(task, generator, seq_len) for _ in range(count)]


@torch.no_grad()
def answer_validation_loss(model, x: Tensor, y: Tensor, batch_size: int, device: torch.device,
                           ranks: Ranks = Ranks()) -> float:
    """Mean over the examples of each one's mean answer loss; under DDP each rank scores every
    world_size-th example."""
    model.eval()
    total = 0.0
    rows = torch.arange(ranks.rank, len(x), ranks.world_size)
    for chunk in rows.split(batch_size):
        total += answer_loss(model, x[chunk].to(device), y[chunk].to(device)).item() * len(chunk)
    model.train()
    return distributed.sum_over_ranks(total, ranks, device) / len(x)


@dataclass
class TaskTraining:
    """What train.py needs to train on a task: the sampler, the loss and the validation losses."""

    name: str
    mix: float
    sampler: TaskSampler
    val_x: Tensor  # (val_examples, seq_len)
    val_y: Tensor

    loss = staticmethod(answer_loss)

    @property
    def mixed(self) -> bool:
        """Language modelling too: val_loss stays the corpus loss and the task's is val_task_loss."""
        return self.mix < 1

    def validation(self, model, batch_size: int, device: torch.device, ranks: Ranks) -> dict[str, float]:
        loss = answer_validation_loss(model, self.val_x, self.val_y, batch_size, device, ranks)
        return {"val_task_loss" if self.mixed else "val_loss": loss}


def mixed_rows(mix: float, batch_size: int) -> int:
    """Task rows of a batch for task.mix; a mix that rounds to no rows (or to all of them) is refused."""
    rows = round(mix * batch_size)
    if 0 < mix < 1 and rows in (0, batch_size):
        raise RelposError(
            f"task.mix={mix} gives {rows} task rows of train.batch_size={batch_size}: choose a mix in "
            f"[{0.5 / batch_size:.3g}, {1 - 0.5 / batch_size:.3g}] for a mixed batch, or 0 / 1"
        )
    return rows


def task_training(cfg: DictConfig, data: TokenData, lm_sampler: Callable[[int], Any],
                  device: torch.device) -> TaskTraining | None:
    """The task a run trains on (None for task=none, and for configs saved before tasks existed).
    lm_sampler(rows): train.py's sampler of language-model windows, for the rows of a mixed batch."""
    if task_name(cfg) == NO_TASK:
        return None
    settings = task_settings(OmegaConf.to_container(cfg.task, resolve=True))
    tokenizer = corpus_tokenizer(OmegaConf.to_container(cfg.data, resolve=True), data)
    t = cfg.train
    task = build_task(settings, Encoder(tokenizer, data.train))
    task.check_length(t.seq_len, f"train.seq_len={t.seq_len}")
    lm_rows = t.batch_size - mixed_rows(settings.mix, t.batch_size)
    lm = lm_sampler(lm_rows) if lm_rows else None
    sampler = TaskSampler(task, t.seq_len, t.batch_size - lm_rows, lm, cfg.seed, tokenizer.eos_id, device)
    val_task = build_task(settings, Encoder(tokenizer, data.validation))
    val_x, val_y = padded_batch(validation_examples(val_task, settings.val_examples, t.seq_len, settings.seed),
                                t.seq_len, tokenizer.eos_id)
    return TaskTraining(settings.name, settings.mix, sampler, val_x, val_y)

