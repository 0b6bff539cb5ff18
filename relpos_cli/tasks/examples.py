"""Evaluation examples as a Hugging Face dataset, generated once per setting and cached.

Every (length, depth) cell holds ``task.samples`` examples; example i of a cell is built from the
seed (task.seed, length, depth, i) alone, so every run, scheme and grid sees the same examples in a
cell, and adding lengths or samples leaves the others as they were. The dataset (columns: length,
depth, placed_depth, index, input_ids, answer_starts, answer_ends, text) is saved under
``data.cache_dir/tasks/<task>-<key>/``, keyed by the task's settings, the cells and the corpus
cache it was tokenized with (so the tokenizer and, for filler=corpus, the text); it is written to a
temp dir and renamed into place, so a reader never sees half of one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator

import numpy as np

from relpos_cli.tasks import TaskSettings
from relpos_cli.tasks.base import Example, Task

# what generated examples look like: raised whenever a generator changes what it draws, so a cache made
# by the old code is never read as the new one's (2: task.filler=corpus draws the last window too; 3: segments
# are encoded as they stand mid-document, without the start mark a SentencePiece tokenizer adds to each text;
# 4: a text that opens an example is encoded as a document start, with that mark; 5: also where the mark
# changes its token count, and RULER's tasks pad before their question rather than before their prompt)
FORMAT = 5
DONE_FILE = "dataset_info.json"  # written by save_to_disk: the dir is complete once it is there


def cell_rng(seed: int, length: int, depth: float | None, index: int) -> np.random.Generator:
    depth_code = 0 if depth is None else 1 + round(depth * 1_000_000)
    return np.random.default_rng([seed, length, depth_code, index])


def cell_examples(task: Task, seed: int, length: int, depth: float | None, samples: int) -> Iterator[Example]:
    for index in range(samples):
        yield task.example(cell_rng(seed, length, depth, index), length, depth)


def fingerprint(input_ids: Any, answer_starts: Any, answer_ends: Any) -> str:
    """An example's identity: its ids and answer spans, hashed. A stored eval-task result keeps its first
    example's for each length (or cell), so that a later evaluation merged into it can tell whether this
    relpos still draws those examples there (FORMAT keeps example caches apart; this, stored scores)."""
    blob = json.dumps([[int(i) for i in input_ids], [int(s) for s in answer_starts], [int(e) for e in answer_ends]])
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def first_example_fingerprint(task: Task, seed: int, length: int, depth: float | None) -> str | None:
    """The fingerprint of the first example this relpos draws in the cell; None where the task has none."""
    if length < task.shortest_example():
        return None
    ex = next(cell_examples(task, seed, length, depth, 1))
    return fingerprint(ex.input_ids, [s for s, _ in ex.answer_spans], [e for _, e in ex.answer_spans])


def _rows(task: Task, settings: TaskSettings, lengths: list[int],
          advance: Callable[[int], None] = lambda n: None) -> dict[str, list[Any]]:
    rows: dict[str, list[Any]] = {k: [] for k in ("length", "depth", "placed_depth", "index", "input_ids",
                                                  "answer_starts", "answer_ends", "text")}
    for length in lengths:
        for depth in settings.eval_depths():
            for index, ex in enumerate(cell_examples(task, settings.seed, length, depth, settings.samples)):
                advance(1)
                for key, value in (("length", length), ("depth", depth), ("placed_depth", ex.depth), ("index", index),
                                   ("input_ids", ex.input_ids.tolist()), ("text", ex.text),
                                   ("answer_starts", [s for s, _ in ex.answer_spans]),
                                   ("answer_ends", [e for _, e in ex.answer_spans])):
                    rows[key].append(value)
    return rows


def dataset_key(settings: TaskSettings, lengths: list[int], corpus_key: str) -> str:
    ident = {"format": FORMAT, "task": settings.name, "generator": settings.generator, "seed": settings.seed,
             "samples": settings.samples, "lengths": lengths, "depths": settings.eval_depths(), "corpus": corpus_key}
    blob = json.dumps(ident, sort_keys=True, default=str)
    return f"{settings.name}-{hashlib.sha1(blob.encode()).hexdigest()[:12]}"


def eval_dataset(task: Task, settings: TaskSettings, lengths: list[int], cache_root: Path, corpus_key: str,
                 progress: Callable[[int], ContextManager[Callable[[int], None]]] | None = None):
    """The eval examples of every (length, depth) cell, in that order, samples per cell: from the
    cache, or generated now and cached; progress(total examples) gives the advance(n) callback
    called as each one is built."""
    import datasets

    datasets.disable_progress_bars()
    path = Path(cache_root) / "tasks" / dataset_key(settings, lengths, corpus_key)
    if not (path / DONE_FILE).is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
        try:
            total = len(lengths) * len(settings.eval_depths()) * settings.samples
            with (progress or (lambda n: nullcontext(lambda k: None)))(total) as advance:
                rows = _rows(task, settings, lengths, advance)
            datasets.Dataset.from_dict(rows).save_to_disk(str(tmp))
            os.replace(tmp, path)
        except OSError:
            if not (path / DONE_FILE).is_file():  # not another process finishing the same cache first
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return datasets.load_from_disk(str(path))
