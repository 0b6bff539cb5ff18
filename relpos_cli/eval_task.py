"""`relpos eval-task`: exact-match accuracy of trained runs on a task, per length (and depth).

For each eval length L (``task.eval_lengths``, default 1x..16x the training length) and, for
passkey, each needle depth, ``task.samples`` examples of exactly L tokens are drawn from
``task.seed`` (the same for every run: relpos_cli/tasks/examples.py). An answer counts as correct
when every one of its tokens is the model's argmax given the example up to it. Under teacher
forcing that is one forward pass per example, and it equals greedy decoding: greedy decoding
produces the whole answer exactly when each answer token is the argmax after the correct tokens
before it. Examples of a cell are batched up to ``eval.max_tokens_per_batch`` tokens and run through
the model's ordinary forward (the memory-linear attention paths of eval-length at long L), with
the LM head applied only at the positions that predict answer tokens.

Accuracy = correct answers / answers (one answer per example for passkey and copy, one per query
for assoc_recall, one per read for flip_flop). The **effective length** is the longest eval length
L such that accuracy is >= ``task.threshold`` at every eval length up to L (0 if it fails at the
shortest); passkey's is read from its accuracy over all depths.

Each length but the last is stored (merged with the stored result, as the final result is) as soon
as it is scored: a stop (Ctrl-C, kill, a time limit) keeps the lengths finished and names them.

Which task: the run's own (with its saved task.* settings), or another named with ``task=<name>``
(its conf/task defaults), e.g. to score a language-model run zero-shot. A ``task=<name>`` whose
settings are the run's own (``task=niah_single_1`` on a run trained on it) is the run's own task;
one whose settings differ is another task, though it may share the module (``task=niah`` on a run
trained on niah_multikey_1). ``task.*`` overrides that change what an example looks like (anything
but eval_lengths, depths, samples, threshold, mix, val_examples), or another task than the run's,
form a variant whose files carry its tag.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import threading
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from rich.table import Table

from relpos_cli.atomic import atomic_write_text
from relpos_cli.checkpoint import load_config, load_trained_model
from relpos_cli.config import (apply_overrides, canonical_numbers, check_override_keys, conf_dir, default_group,
                               flatten_config, parse_overrides)
from relpos_cli.console import print_note
from relpos_cli.data import corpus_tokenizer, load_token_data
from relpos_cli.fingerprint import check_data_unchanged, check_tokens_unchanged
from relpos_cli.errors import Interrupted, RelposError
from relpos_cli.distributed import machine_memory, resolve_device
from relpos_cli.precision import eval_autocast, eval_precision
from relpos_cli.evaluate import Progress, representable, variant_settings
from relpos_cli.extension import EVAL_METHOD_KEYS, METHOD_KEYS, resolve_longest_factor
from relpos_cli.intervals import wilson
from relpos_cli.interrupt import in_worker
from relpos_cli.logs import recorded_writer
from relpos_cli.plots import plot_accuracy, plot_depth_heatmap, plot_format
from relpos_cli.report import report_result, result_title
from relpos_cli.results import EVAL_TASK_STEM, report_path, rows_to_csv, task_report_paths, variant_tag
from relpos_cli.sampled_positions import random_positions
from relpos_cli.settings import validate_eval
from relpos_cli.tasks import NO_TASK, TASK_NOT_VARIANT_KEYS, TaskSettings, build_task, task_name, task_names, task_settings
from relpos_cli.tasks.base import Encoder
from relpos_cli.tasks.examples import eval_dataset, fingerprint, first_example_fingerprint
from relpos_cli.terminal import progress_bar
from relpos_cli.tracking import log_eval_task

# what eval-task may change in a trained run: the task scored, where, how big a batch, the figures'
# format, and whether changed data is accepted; anything else is the run's own
TASK_EVAL_KEYS = ("task", "task.*", "device", "eval.max_tokens_per_batch", "eval.allow_changed_data", "eval.precision",
                  "plots.*", *(f"eval.{key}.*" for key in EVAL_METHOD_KEYS))
NOT_LEARNED_TEXT = ("NOT LEARNED: accuracy at the training length is below the threshold, so the longer "
                    "lengths do not measure length generalization")
ALL_DEPTHS = "all"  # the depth column of passkey's per-length rows (accuracy over every depth)
TASK_COLUMNS = ["task", "length", "depth", "accuracy", "ci_low", "ci_high", "correct", "answers", "samples", "threshold",
                "effective_length", "effective_length_lower", "learned", "train_len", "precision", "variant"]


@dataclass
class TaskEval:
    """One eval-task setting for one run: its config (task replaced and overridden) and variant."""

    cfg: DictConfig
    settings: TaskSettings
    variant: str
    variant_settings: dict[str, Any]  # "task.<key>" -> value, for the files' extra columns
    left_out: list[int] = field(default_factory=list)  # eval lengths too short for the task's examples
    own_task: bool = True  # the task the run trained on (False: scored zero-shot on another)

    @property
    def train_len(self) -> int:
        return int(self.cfg.train.seq_len)


# task keys that only shape training: eval-task would accept and record them while nothing changed
TRAINING_ONLY = {"mix": "the share of task rows in training batches", "val_examples": "the validation examples of training"}


def _split_overrides(overrides: list[str]) -> tuple[str | None, list[str]]:
    """(task name from task=<name> or None, the other overrides), refusing keys eval-task does not take."""
    check_override_keys(overrides, TASK_EVAL_KEYS, "eval-task")
    chosen, rest = None, []
    for o in parse_overrides(overrides):
        key = o.key_or_group.lstrip("+~")
        if key.removeprefix("task.") in TRAINING_ONLY and key.startswith("task."):
            raise RelposError(f"{o.input_line}: {key} is a training setting ({TRAINING_ONLY[key[5:]]}); "
                              f"evaluation does not read it, drop it")
        if o.key_or_group == "task" and not o.is_delete():
            chosen = str(o.value())
        else:
            rest.append(o.input_line)
    return chosen, rest


def _task_defaults(name: str) -> DictConfig:
    if name == NO_TASK or not (conf_dir() / "task" / f"{name}.yaml").is_file():
        raise RelposError(f"unknown task {name!r}; choose one of: {', '.join(task_names())}")
    return default_group("task", name)


def _example_settings(task_cfg: Any) -> dict[str, Any]:
    """A task config's settings that shape its examples (name included, TASK_NOT_VARIANT_KEYS left out),
    flat, with canonical numbers: two configs with the same are the same task setting."""
    flat = canonical_numbers(flatten_config(OmegaConf.to_container(task_cfg, resolve=True)))
    return {k: v for k, v in flat.items() if k.split(".")[0] not in TASK_NOT_VARIANT_KEYS}


def load_task_eval_config(run_dir: Path, overrides: list[str]) -> TaskEval:
    """The run's config with the task to score (the run's own or task=<name>) and the overrides applied.

    task=<name> names a configuration (conf/task/<name>.yaml), and several share a module's `name`
    (niah_single_1 and niah_multikey_1 are both niah): it is the run's own task when its settings
    are the run's (then scored as with no task=, the default variant), and another one, tagged
    task=<name> and scored with its own settings, when they differ, whatever its name."""
    chosen, rest = _split_overrides(overrides)
    cfg = load_config(run_dir, whole_run=True)
    trained_on = task_name(cfg)
    if chosen == NO_TASK and trained_on != NO_TASK:
        raise RelposError(f"task=none is language modelling, which eval-length measures; eval-task scores a task: "
                          f"choose one of: {', '.join(task_names())}")
    if (chosen or trained_on) == NO_TASK:
        raise RelposError(f"{run_dir} trained without a task: name one, e.g. task=passkey (choose: {', '.join(task_names())})")
    named = _task_defaults(chosen) if chosen else None
    own = None  # only a configuration of the run's own module can be the run's task
    if trained_on != NO_TASK and (named is None or named.name == trained_on):
        # the run's saved task over today's defaults: keys added since it trained take their defaults
        own = OmegaConf.merge(_task_defaults(trained_on), cfg.task)
    own_task = own is not None and (named is None or _example_settings(named) == _example_settings(own))
    reference = own if own_task else named
    cfg.task = OmegaConf.create(OmegaConf.to_container(reference, resolve=True))
    cfg.eval = OmegaConf.merge(default_group("eval"), cfg.get("eval", {}))
    cfg = apply_overrides(cfg, rest)
    validate_eval(cfg)  # eval.* ranges, as eval-length checks them
    cfg.eval.precision = eval_precision(cfg.eval.precision, resolve_device(cfg.device))  # auto: bf16 on CUDA, fp32 on CPU
    settings = task_settings(OmegaConf.to_container(cfg.task, resolve=True))
    # factor=longest -> its number before the variant is named, as eval-length's load_eval_config does: the
    # files of `longest` over [112, 224] (factor 2) and over [112, 896] (factor 8) are different models, and
    # one file named `longest` merged the lengths of both (with_stored)
    resolve_longest_factor(cfg.eval, max(settings.lengths(int(cfg.train.seq_len))), int(cfg.train.seq_len))
    before = _example_settings(reference)
    changed = {f"task.{k}": v for k, v in sorted(_example_settings(cfg.task).items()) if before.get(k) != v}
    tag_settings = {k.removeprefix("task."): v for k, v in changed.items()}
    if not own_task:
        tag_settings = {"task": chosen, **tag_settings}
    # how positions are used at evaluation (eval.rope_scaling, self_extend, rerope, window), tagged as eval-length tags them
    methods = {k: v for k, v in variant_settings(cfg.eval).items() if k.split(".")[0] in (*EVAL_METHOD_KEYS, "precision")}
    changed.update({f"eval.{k}": v for k, v in methods.items()})
    return TaskEval(cfg, settings, variant_tag({**tag_settings, **methods}), changed, own_task=own_task)


@torch.no_grad()
def exact_matches(model, input_ids: torch.Tensor, spans: list[list[tuple[int, int]]],
                  positions: torch.Tensor | None = None) -> list[list[bool]]:
    """Per example, per answer span [start, end): is every answer token the argmax given the tokens
    before it? input_ids (B, L) on the model's device; one forward pass for the batch, at
    `positions` (L,) shared by the batch (default 0..L-1)."""
    targets = torch.full_like(input_ids, -1)
    for row, example_spans in enumerate(spans):
        for start, end in example_spans:
            targets[row, start - 1 : end - 1] = input_ids[row, start:end]  # logits at t predict token t + 1
    scored = targets >= 0  # (B, L)
    hit = torch.zeros_like(scored)
    hit[scored] = model(input_ids, at=scored, positions=positions).argmax(-1) == targets[scored]
    return [[bool(hit[row, start - 1 : end - 1].all()) for start, end in example_spans]
            for row, example_spans in enumerate(spans)]


def learned(length_rows: list[dict[str, Any]], threshold: float, train_len: int, own_task: bool = True) -> bool | None:
    """Did the run learn the task it trained on: accuracy >= threshold at its training length? Until
    it does, its accuracy at longer lengths says nothing about length generalization. None for a
    task it did not train on (scored zero-shot) or a result without the training length."""
    at_train = [r["accuracy"] for r in length_rows if r["length"] == train_len]
    return bool(at_train[0] >= threshold) if own_task and at_train else None


def effective_length(length_rows: list[dict[str, Any]], threshold: float, key: str = "accuracy") -> int:
    """The longest length L with `key` (accuracy, or ci_low: the lower 95% Wilson bound) >= threshold
    at every length up to L; 0 if the shortest fails."""
    effective = 0
    for r in sorted(length_rows, key=lambda r: r["length"]):
        if r[key] < threshold:
            break
        effective = r["length"]
    return effective


def with_intervals(per_length: list[dict[str, Any]], cells: list[dict[str, Any]], threshold: float, train_len: int,
                   own_task: bool) -> None:
    """Every unit (length row, depth cell) gets its 95% Wilson interval over its answers (ci_low,
    ci_high), and every row the run's effective lengths (of the accuracy, and of its lower bound)
    and whether it learned the task. In place.

    Args:
        per_length: the rows of all depths per length (accuracy, correct, answers, length).
        cells: passkey's (length, depth) cells, or [].
        threshold: task.threshold.
        train_len: the run's training length.
        own_task: whether the run trained on the task scored (else `learned` is None).
    """
    for r in (*per_length, *cells):
        r["ci_low"], r["ci_high"] = wilson(r["correct"], r["answers"])
    effective = effective_length(per_length, threshold)
    lower = effective_length(per_length, threshold, key="ci_low")
    run_learned = learned(per_length, threshold, train_len, own_task)
    for r in (*per_length, *cells):
        r["effective_length"], r["effective_length_lower"], r["learned"] = effective, lower, run_learned


def _score_cell(model, rows: dict[str, list], device: torch.device, batch: int,
                positions: Callable[[int], torch.Tensor] | None = None,
                advance: Callable[[int], None] = lambda n: None) -> tuple[int, int]:
    """(correct answers, answers) over a cell's examples; positions(L) draws each example's own
    positions (task.eval_positions=randomized), one example per forward pass then; advance(n)
    after each forward pass of n examples."""
    ids = torch.from_numpy(np.asarray(rows["input_ids"], dtype=np.int64))  # (samples, L)
    spans = [list(zip(s, e)) for s, e in zip(rows["answer_starts"], rows["answer_ends"])]
    batch = batch if positions is None else 1
    correct = answers = 0
    for i in range(0, len(ids), batch):
        drawn = None if positions is None else positions(ids.shape[1]).to(device)
        for example in exact_matches(model, ids[i : i + batch].to(device), spans[i : i + batch], drawn):
            correct += sum(example)
            answers += len(example)
        advance(len(ids[i : i + batch]))
    return correct, answers


def _score_length(model, dataset, first_cell: int, length: int, depths: list, settings: TaskSettings,
                  device: torch.device, max_tokens: int, common: dict[str, Any], cells: list[dict[str, Any]],
                  advance: Callable[[int], None], position_limit: int | None) -> tuple[int, int, str]:
    """(correct answers, answers, the first example's fingerprint) at one length over its depth cells;
    passkey's cells, each with its first example's fingerprint, are appended to `cells`.
    position_limit: draw each example's positions from [0, position_limit) (task.eval_positions=randomized)."""
    batch = max(1, max_tokens // length)
    length_correct = length_answers = 0
    first = []
    for i, depth in enumerate(depths):
        rows = dataset[(first_cell + i) * settings.samples : (first_cell + i + 1) * settings.samples]
        first.append(fingerprint(rows["input_ids"][0], rows["answer_starts"][0], rows["answer_ends"][0]))
        positions = None
        if position_limit is not None:  # the same draws for every run: seeded by task.seed and the cell
            generator = torch.Generator().manual_seed(settings.seed * 1_000_003 + length * 101 + i)
            positions = lambda n, g=generator: random_positions(position_limit, n, g)  # noqa: E731
        try:
            correct, answers = _score_cell(model, rows, device, batch, positions, advance)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not isinstance(e, torch.OutOfMemoryError) and "memory" not in str(e):
                raise
            raise RelposError(f"out of memory at task length {length} with eval.max_tokens_per_batch={max_tokens}; "
                              f"lower eval.max_tokens_per_batch") from None
        length_correct, length_answers = length_correct + correct, length_answers + answers
        if depth is not None:
            cells.append({"length": length, "depth": depth, "accuracy": correct / answers, "correct": correct,
                          "answers": answers, "samples": settings.samples, "first_example": first[-1], **common})
    return length_correct, length_answers, first[0]


def scored_lengths(task, settings: TaskSettings, train_len: int) -> list[int]:
    """The eval lengths (settings.lengths) a task's examples fit in. A length task.eval_lengths names
    must fit; the ones eval-task adds itself (the training length, the default multiples of it) are
    left out with a note when they are too short, as for a run that trained below the task's length
    and is scored zero-shot."""
    need = task.shortest_example()
    named = set(settings.eval_lengths or ())
    for length in sorted(named):
        task.check_length(length, f"eval length {length} (task.eval_lengths)")
    lengths = settings.lengths(train_len)
    short = [l for l in lengths if l < need]
    if short:
        added = "the training length" if short == [train_len] else f"multiples of the training length {train_len}"
        if len(short) == len(lengths):
            raise RelposError(f"task={task.name} needs examples of >= {need} tokens; the eval lengths eval-task picks "
                              f"for this run ({added}: {', '.join(map(str, short))}) are shorter: name longer ones with "
                              f"task.eval_lengths=[{need},...]")
        print_note(f"task={task.name} needs examples of >= {need} tokens: eval lengths {', '.join(map(str, short))} "
                   f"({added}) left out")
    return [l for l in lengths if l >= need]


# what one example token costs while its dataset is built: the numpy ids, the Python list of them,
# its text and the Arrow column (measured ~30 bytes with the byte tokenizer, rounded up)
EXAMPLE_BYTES_PER_TOKEN = 40


def check_examples_fit(lengths: list[int], per_length: int) -> None:
    """Refuse, before allocating, an evaluation whose examples cannot fit in this machine's memory
    (task.eval_lengths=[100000000000]): a failed allocation deep in numpy, or the kernel's OOM killer."""
    need = sum(lengths) * per_length * EXAMPLE_BYTES_PER_TOKEN
    memory = machine_memory()
    if memory is not None and need > memory:  # None (not POSIX): the allocation itself will say
        raise RelposError(f"the examples of eval lengths up to {max(lengths):,} tokens ({per_length} per length) need "
                          f"about {need / 2**30:,.0f} GiB, more than this machine's {memory / 2**30:,.0f} GiB of memory: "
                          f"lower task.eval_lengths or task.samples")


def _position_limit(settings: TaskSettings, cfg: DictConfig, lengths: list[int]) -> int | None:
    """N of task.eval_positions=randomized (the run's train.randomized_positions), None for 0..L-1."""
    if settings.eval_positions == "sequential":
        return None
    limit = cfg.train.get("randomized_positions")
    if limit is None:
        raise RelposError("task.eval_positions=randomized draws positions like train.randomized_positions, "
                          "which this run did not train with; use task.eval_positions=sequential")
    if max(lengths) > limit:
        raise RelposError(f"task.eval_positions=randomized draws {max(lengths)} positions from the run's "
                          f"train.randomized_positions={limit}: eval lengths must be at most {limit}")
    return int(limit)


Scored = Callable[[TaskEval, list[dict[str, Any]], list[dict[str, Any]]], None]


def evaluate_task(
    run_dir: Path, overrides: list[str], progress: Progress = lambda total: nullcontext(lambda n: None),
    building: Progress | None = None, scored: Scored = lambda ev, per_length, cells: None, merging: bool = True,
) -> tuple[TaskEval, list[dict[str, Any]], list[dict[str, Any]]]:
    """Score every (length, depth) cell; returns (setting, per-length rows, per-cell rows: passkey only).
    progress(total examples) gives the advance(n) callback called after each batch of examples;
    building(total examples), the same while examples not cached yet are generated; scored(setting,
    per-length rows, cells) after each length but the last (whose rows are the result), with the rows
    scored so far, so that a caller can store them before a stop loses them (evaluate_task_and_report).
    merging: the result will be merged with the stored one (not --replace), so that one is checked first
    (check_stored_examples)."""
    ev = load_task_eval_config(run_dir, overrides)
    cfg, settings = ev.cfg, ev.settings
    device = resolve_device(cfg.device)
    max_tokens = int(cfg.eval.max_tokens_per_batch)
    if max_tokens <= 0:
        raise RelposError(f"eval.max_tokens_per_batch must be positive, got {max_tokens}")
    data_cfg = OmegaConf.to_container(cfg.data, resolve=True)
    allow = bool(cfg.eval.get("allow_changed_data", False))
    changes = check_data_unchanged(run_dir, data_cfg, allow, "eval")  # corpus filler, and the tokenizer
    data = load_token_data(data_cfg)
    changes += check_tokens_unchanged(run_dir, data, allow, "eval")
    task = build_task(settings, Encoder(corpus_tokenizer(data_cfg, data), data.validation))
    lengths = scored_lengths(task, settings, ev.train_len)
    position_limit = _position_limit(settings, cfg, lengths)
    _, model = load_trained_model(run_dir, device, cfg)  # with the eval-time method, checked before any scoring
    if position_limit is not None:
        model.scheme.check_length(position_limit)
    lengths = representable(model.scheme, lengths, set(settings.eval_lengths or ()), "task.eval_lengths")
    if position_limit is not None and model.method.extension is not None:
        raise RelposError(f"{', '.join(f'eval.{key}' for key in METHOD_KEYS)} assume positions 0..L-1; "
                          "use task.eval_positions=sequential with them")
    ev.left_out = sorted(set(settings.lengths(ev.train_len)) - set(lengths))
    check_examples_fit(lengths, len(settings.eval_depths()) * settings.samples)
    if merging:
        check_stored_examples(result_json(run_dir, ev.variant), task, settings, lengths)
    cache_root = Path(str(data_cfg["cache_dir"])).expanduser()
    try:
        dataset = eval_dataset(task, settings, lengths, cache_root, data.cache_dir.name, building or progress)
    except MemoryError:
        raise RelposError(f"out of memory building the examples of eval lengths up to {max(lengths):,} tokens "
                          f"({settings.samples} per cell); lower task.eval_lengths or task.samples") from None

    depths = settings.eval_depths()
    common = {"task": settings.name, "threshold": settings.threshold, "train_len": ev.train_len, "variant": ev.variant,
              "precision": cfg.eval.precision,
              **ev.variant_settings, **({"data_changed": "; ".join(changes)} if changes else {})}
    cells, per_length = [], []
    cell = 0
    with progress(len(lengths) * len(depths) * settings.samples) as advance, eval_autocast(device, cfg.eval.precision):
        for length in lengths:
            length_correct, length_answers, first = _score_length(
                model, dataset, cell, length, depths, settings, device, max_tokens, common, cells, advance,
                position_limit)
            cell += len(depths)
            per_length.append({"length": length, "depth": ALL_DEPTHS if task.has_depth else None,
                               "accuracy": length_correct / length_answers, "correct": length_correct,
                               "answers": length_answers, "samples": settings.samples * len(depths),
                               **({} if task.has_depth else {"first_example": first}), **common})
            if length != lengths[-1]:
                scored(ev, *_so_far(ev, per_length, cells))
    with_intervals(per_length, cells, settings.threshold, ev.train_len, ev.own_task)
    return ev, per_length, cells


def check_stored_examples(path: Path, task, settings: TaskSettings, lengths: list[int]) -> None:
    """Refuse to merge with a stored result that would keep units scored on other examples than this
    relpos draws there (the task's examples changed since: a merged table would mix two sets of them).
    Each unit stores its first example's fingerprint; units stored before that are not checked, nor
    those this evaluation scores again with as many examples (it replaces them). A missing or
    unreadable file is with_stored's to handle."""
    def checkable(u: Any) -> bool:  # a unit as eval-task writes it: any other is with_stored's to judge
        if not isinstance(u, dict):
            return False
        depth = u.get("depth")
        return (isinstance(u.get("first_example"), str) and type(u.get("length")) is int and u["length"] > 0
                and isinstance(u.get("samples"), int) and (depth is None if not task.has_depth else type(depth) in (int, float) and 0 <= depth <= 1))

    try:
        stored = json.loads(path.read_text())
        units = [u for u in stored["cells" if task.has_depth else "lengths"] if checkable(u)]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return
    scored = {(length, depth): settings.samples for length in lengths for depth in settings.eval_depths()}
    kept = [u for u in units if _kept_by_merge(u, scored)]
    try:  # each unit's first example is drawn again
        check_examples_fit([u["length"] for u in kept], 1)
    except RelposError:
        raise RelposError(f"{path} holds lengths up to {max(u['length'] for u in kept):,}, too long to draw their "
                          f"examples again and check them: evaluate with --replace") from None
    changed = sorted({u["length"] for u in kept
                      if first_example_fingerprint(task, settings.seed, u["length"], u["depth"]) != u["first_example"]})
    if changed:
        every = sorted({*lengths, *(u["length"] for u in units)})
        raise RelposError(f"{path} holds task={task.name} lengths {', '.join(map(str, changed))} scored on other examples "
                          f"than this relpos draws (how it writes them changed since): score them again with --replace "
                          f"task.eval_lengths=[{','.join(map(str, every))}]")


def _so_far(ev: TaskEval, per_length: list[dict[str, Any]], cells: list[dict[str, Any]]
            ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Copies of the rows scored so far, their intervals, effective lengths and `learned` computed over
    them alone: a result stored mid-evaluation is consistent with what it holds, and the scoring goes
    on with its own rows untouched."""
    rows, units = [dict(r) for r in per_length], [dict(c) for c in cells]
    with_intervals(rows, units, ev.settings.threshold, ev.train_len, ev.own_task)
    return rows, units


# ---- reporting -----------------------------------------------------------------------------------


def threshold_text(rows: list[dict[str, Any]]) -> str:
    r = rows[0]
    lower = r.get("effective_length_lower")
    by_bound = "" if lower is None else f", {lower} by its lower 95% bound"
    return f"effective length {r['effective_length']} (accuracy >= {r['threshold']:g} up to it{by_bound})"


def accuracy_table(per_length: list[dict[str, Any]], cells: list[dict[str, Any]], title: str) -> Table:
    """Rows = lengths, columns = passkey's depths then the accuracy over all of them; the threshold,
    effective length and answers per row in the caption, so the table fits 80 columns."""
    depths = sorted({c["depth"] for c in cells})
    first = per_length[0]
    per_answer = "" if first["answers"] == first["samples"] else f" ({first['answers']:,} answers at the first length)"
    # lengths kept from a stored result (with_stored) may have been scored with more examples than the new ones
    if len({r["samples"] for r in per_length}) == 1:
        examples = f"{first['samples']:,} examples per length"
    else:
        examples = "examples per length: " + ", ".join(f"{r['samples']:,} at {r['length']}" for r in per_length)
    pooled = " over all depths" if depths else ""  # flip_flop, copy, ...: one cell per length
    caption = f"{threshold_text(per_length)}; {examples}{per_answer}; under each accuracy{pooled} its 95% Wilson interval"
    if first.get("learned") is False:
        caption = f"{NOT_LEARNED_TEXT}; {caption}"
    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
    table.add_column("length", justify="right")
    for d in depths:
        table.add_column(f"depth {d:g}", justify="right")
    table.add_column("accuracy" if not depths else "all", justify="right")
    for r in per_length:
        marker = "*" if r["length"] == r["train_len"] else ""
        by_depth = [next((f"{c['accuracy']:.3f}" for c in cells if c["length"] == r["length"] and c["depth"] == d), "–")
                    for d in depths]
        table.add_row(f"{r['length']}{marker}", *by_depth, f"{r['accuracy']:.3f}\n{r['ci_low']:.2f}–{r['ci_high']:.2f}")
    table.caption += "; * = the training length"
    return table


def result_json(run_dir: Path, variant: str) -> Path:
    """A variant's eval_task JSON: the stored result that with_stored merges with and compare reads."""
    return report_path(run_dir, EVAL_TASK_STEM, variant, ".json")


# what differs between scored units (first_example: not in units stored before it was)
UNIT_KEYS = ("length", "depth", "accuracy", "correct", "answers", "samples", "first_example")


def _unit(r: dict[str, Any]) -> tuple[int, Any]:
    return r["length"], r["depth"]


def _kept_by_merge(stored: dict[str, Any], scored: dict[tuple[int, Any], int]) -> bool:
    """Whether merging keeps a stored unit over an evaluation that scored `scored` ((length, depth) -> its
    examples): one it did not score, or scored with fewer examples."""
    key = _unit(stored)
    return key not in scored or stored["samples"] > scored[key]


def with_stored(run_dir: Path, ev: TaskEval, per_length: list[dict[str, Any]], cells: list[dict[str, Any]]
                ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
    """The new result merged into the stored one of the same variant, so that an evaluation never
    replaces a more thorough one: a stored unit (a length; for passkey a (length, depth) cell) that
    this evaluation did not score, or scored with fewer samples, is kept. Examples are drawn per
    (seed, length, depth, index), so units scored in different evaluations are the same examples as
    one evaluation would score. Passkey's per-length rows are summed again from the merged cells;
    the effective length and `learned` are recomputed. Returns (per-length rows, cells, units kept)."""
    path = result_json(run_dir, ev.variant)
    try:
        stored = json.loads(path.read_text())
        stored_units = stored["cells"] if ev.settings.cls.has_depth else stored["lengths"]
        old = {_unit(u): u for u in stored_units if isinstance(u.get("samples"), int)}
    except FileNotFoundError:
        return per_length, cells, 0
    except (ValueError, KeyError, TypeError, AttributeError):  # unreadable: not a result to keep
        print_note(f"{path} is unreadable: replaced")
        return per_length, cells, 0
    new = {_unit(u): u for u in (cells if ev.settings.cls.has_depth else per_length)}
    scored = {key: unit["samples"] for key, unit in new.items()}
    kept = [u for u in old.values() if _kept_by_merge(u, scored)]
    # the lengths the stored result left out (past a learned table, shorter than the task) stay left out:
    # the run cannot score them whatever this evaluation asked, and compare reads left_out to tell a
    # result evaluated at fewer lengths than asked from one evaluated at every length it can score
    stored_left_out = stored.get("left_out") if isinstance(stored, dict) else None
    if isinstance(stored_left_out, list):
        scored = {key[0] for key in (*new, *(_unit(u) for u in kept))}
        ev.left_out = sorted((set(ev.left_out) | {l for l in stored_left_out if isinstance(l, int)}) - scored)
    if not kept:
        return per_length, cells, 0
    common = {k: v for k, v in per_length[0].items() if k not in UNIT_KEYS}  # this evaluation's settings
    merged = {**new, **{_unit(u): {**common, **{k: u[k] for k in UNIT_KEYS if k in u}} for u in kept}}
    units = [merged[key] for key in sorted(merged, key=lambda k: (k[0], -1 if k[1] is None else k[1]))]
    if ev.settings.cls.has_depth:
        cells, per_length = units, []
        for length in sorted({u["length"] for u in units}):
            same = [u for u in units if u["length"] == length]
            correct, answers = sum(u["correct"] for u in same), sum(u["answers"] for u in same)
            per_length.append({**common, "length": length, "depth": ALL_DEPTHS, "accuracy": correct / answers,
                               "correct": correct, "answers": answers, "samples": sum(u["samples"] for u in same)})
    else:
        per_length = units
    with_intervals(per_length, cells, ev.settings.threshold, ev.train_len, ev.own_task)
    return per_length, cells, len(kept)


def write_task_files(run_dir: Path, ev: TaskEval, per_length: list[dict[str, Any]], cells: list[dict[str, Any]]
                     ) -> None:
    """eval_task CSV (per-length rows, then the depth cells) and JSON, each replaced atomically."""
    paths = task_report_paths(run_dir, ev.variant, bool(cells), "png")  # the figures' format: not written here
    columns = TASK_COLUMNS + list(ev.variant_settings) + (["data_changed"] if "data_changed" in per_length[0] else [])
    atomic_write_text(paths[".csv"], rows_to_csv([*per_length, *cells], columns))
    methods = {k.removeprefix("eval."): v for k, v in ev.variant_settings.items() if k.startswith("eval.")}
    payload = {"task": ev.settings.name, "variant": ev.variant, "settings": OmegaConf.to_container(ev.cfg.task),
               "eval_methods": methods,
               "train_len": ev.train_len, "threshold": ev.settings.threshold,
               "effective_length": per_length[0]["effective_length"],
               "effective_length_lower": per_length[0]["effective_length_lower"], "learned": per_length[0]["learned"],
               "lengths": per_length, "cells": cells,
               "left_out": ev.left_out}
    atomic_write_text(paths[".json"], json.dumps(payload, indent=2))  # last: compare reads it


def write_task_report(run_dir: Path, ev: TaskEval, per_length: list[dict[str, Any]], cells: list[dict[str, Any]],
                      title: str, fmt: str) -> list[Path]:
    """The accuracy-vs-length figure, (depths) the depth x length heatmap, then the CSV and JSON
    (write_task_files); returns the paths written."""
    paths = task_report_paths(run_dir, ev.variant, bool(cells), fmt)
    plot_accuracy(paths["plot"], per_length, cells, title)
    if cells:
        plot_depth_heatmap(paths["heatmap"], cells, title)
    write_task_files(run_dir, ev, per_length, cells)
    return list(paths.values())


class StoredSoFar:
    """The lengths of an eval-task stored as it goes. Each length but the last is merged with the stored
    result (with_stored) and written (CSV, JSON) as soon as it is scored, so a stop (Ctrl-C, kill, a
    time limit's SIGINT) keeps the lengths finished: minutes of GPU time at long lengths. Not under
    --replace, which overwrites the stored result: stopped, it leaves the stored file as it was. The
    plots wait for the final write (on a tiny run, 0.4-0.8 s for the two figures against 20-30 ms for
    the merge, CSV and JSON).

    The writes come from the scoring thread (in_worker) while the main thread may be unwinding on a
    signal: `stop` waits for a write under way and lets none begin after it, still inside
    recorded_writer (the run dir's lock held), so no file is half-written, nothing is written once the
    lock is gone, and the stop's message names exactly the lengths the JSON holds."""

    def __init__(self, run_dir: Path, replace: bool):
        self.run_dir, self.replace = run_dir, replace
        self.lock = threading.Lock()
        self.stopped = False
        self.kept: list[int] = []  # this evaluation's lengths in the stored JSON
        self.rest: list[int] = []  # the lengths it has yet to score
        self.path: Path | None = None

    def write(self, ev: TaskEval, per_length: list[dict[str, Any]], cells: list[dict[str, Any]]) -> None:
        """Store the rows scored so far (evaluate_task's `scored`), unless the command is stopping."""
        with self.lock:
            if self.stopped or self.replace:  # --replace overwrites the stored result: only once it is whole
                return
            done = [r["length"] for r in per_length]
            rest = [l for l in ev.settings.lengths(ev.train_len) if l not in ev.left_out and l not in done]
            ev = dataclasses.replace(ev)  # with_stored adds the stored file's left_out: `rest` reads the scoring's own
            write_task_files(self.run_dir, ev, *with_stored(self.run_dir, ev, per_length, cells)[:2])
            self.kept, self.rest, self.path = done, rest, result_json(self.run_dir, ev.variant)

    def written(self, ev: TaskEval, lengths: list[int]) -> None:
        """The final write is done: every length of the evaluation is stored."""
        self.kept, self.rest, self.path = lengths, [], result_json(self.run_dir, ev.variant)

    def stop(self, e: Interrupted) -> Interrupted:
        """The stop's one line, once no write is under way or will begin: which lengths the JSON keeps
        and how to score the rest; `e` itself when nothing was stored."""
        with self.lock:
            self.stopped = True
        if not self.kept:
            return e
        signum = e.exit_code - 128
        line = f"{signal.Signals(signum).name}: stopped; lengths {', '.join(map(str, self.kept))} kept in {self.path}"
        if self.rest:
            line += (f"; to score the rest, run eval-task again with task.eval_lengths="
                     f"[{','.join(map(str, self.rest))}] (as it was, it scores every length again)")
        return Interrupted(line, signum)


def evaluate_task_and_report(run_dir: Path, overrides: list[str], console, replace: bool = False) -> list[Path]:
    """eval-task for one run: score (with a progress bar), merge with the stored result (with_stored;
    replace: overwrite it instead), print the table, write the files, log to relpos.log and W&B;
    returns the paths. Each length but the last is stored as soon as it is scored (StoredSoFar): a stop
    keeps them and says so."""
    fmt = plot_format(load_task_eval_config(run_dir, overrides).cfg)  # bad settings fail before the scoring
    with recorded_writer(run_dir, "eval-task") as log:
        label = f"eval-task {Path(run_dir).resolve().name}"
        so_far = StoredSoFar(run_dir, replace)
        try:
            ev, per_length, cells = in_worker(lambda: evaluate_task(
                run_dir, overrides, lambda total: progress_bar(console, label, total, "examples"),
                lambda total: progress_bar(console, f"{label}: building examples", total, "examples"), so_far.write,
                merging=not replace))
            lengths = [r["length"] for r in per_length]
            # merged with the stored result as each interim write was (StoredSoFar.write), or as it is with --replace
            per_length, cells, kept = (per_length, cells, 0) if replace else with_stored(run_dir, ev, per_length, cells)
            if kept:
                unit = "(length, depth) cells" if cells else "lengths"
                print_note(f"kept {kept} {unit} of the stored result that this evaluation did not score or scored with "
                           f"fewer examples, so nothing more thorough is replaced (--replace overwrites them)")
            title = result_title(run_dir, ev.cfg.pos.name, f"task={ev.settings.name}  ", ev.train_len, ev.variant)
            line = (f"eval-task {ev.settings.name} {ev.variant}: {threshold_text(per_length)}; "
                    + ", ".join(f"acc@{r['length']} {r['accuracy']:.3f}" for r in per_length))

            def write() -> list[Path]:
                paths = write_task_report(run_dir, ev, per_length, cells, title, fmt)
                so_far.written(ev, lengths)
                return paths

            return report_result(run_dir, console, log, accuracy_table(per_length, cells, title), line, log_eval_task,
                                 ev.variant, write)
        except Interrupted as e:
            raise so_far.stop(e) from None
