"""Registry of tasks: one module per task in this package, one yaml in conf/task/.

Adding a task = a module here whose :class:`~relpos_cli.tasks.base.Task` subclass is decorated
with ``@register("name")`` plus ``conf/task/name.yaml`` holding ``name: name``, the keys every
task shares (see :data:`SHARED_KEYS`) and the constructor's own keyword arguments.
``task: none`` (conf/task/none.yaml) is plain language modelling and builds no task.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Mapping

from relpos_cli.errors import RelposError
from relpos_cli.registry import import_modules, registrar
from relpos_cli.tasks.base import Encoder, Task, check_range

REGISTRY: dict[str, type[Task]] = {}
NO_TASK = "none"
# keys of every task yaml, read here rather than by the task's constructor
SHARED_KEYS = ("name", "mix", "eval_lengths", "samples", "threshold", "seed", "val_examples", "eval_positions")
DEPTH_KEY = "depths"  # the eval grid's depths: tasks with has_depth only
# settings that choose which cells are scored, how many examples, or how a number is read, but not
# what one example looks like: evaluating with other values rewrites the same eval_task files
TASK_NOT_VARIANT_KEYS = ("mix", "eval_lengths", "samples", "threshold", "val_examples", DEPTH_KEY)
# settings that shape evaluation and validation only, never a trained weight: compare leaves them out
# of a run's configuration (tests/test_compare_grouping.py trains runs differing in each)
EVAL_ONLY_KEYS = ("eval_lengths", "samples", "threshold", "seed", "val_examples", "eval_positions", DEPTH_KEY)
EVAL_MULTIPLES = (1, 2, 4, 8, 16)  # default eval lengths: these multiples of the training length
MAX_LENGTH = 2**31 - 1  # token positions and counts are int32-safe; far past what fits in memory anyway
# positions of an eval example: 0..L-1, or (runs trained with train.randomized_positions=N) a sorted
# sample of L distinct positions from [0, N) per example, as Ruoss et al. 2023 evaluate: their
# randomized encodings sample at test time too (google-deepmind/randomized_positional_encodings)
EVAL_POSITIONS = ("sequential", "randomized")


register = registrar(REGISTRY, "task")


def _import_all() -> None:
    import_modules(__path__, __name__, skip=("base", "training", "examples"))


def trains_on_task(task_cfg: Mapping[str, Any]) -> bool:
    """A run's saved `task` config names a task (alone or mixed into language modelling)."""
    return task_cfg.get("name", NO_TASK) != NO_TASK


def models_language(task_cfg: Mapping[str, Any]) -> bool:
    """A run's saved `task` config leaves language modelling in its batches: it has perplexities."""
    return not trains_on_task(task_cfg) or task_cfg.get("mix", 1) < 1


def task_names() -> list[str]:
    return sorted(REGISTRY)


def task_name(cfg: Mapping[str, Any]) -> str:
    """The run's task; configs saved before tasks existed trained language models."""
    task = cfg.get("task") or {}
    return task.get("name", NO_TASK) if isinstance(task, Mapping) else str(task)


@dataclass(frozen=True)
class TaskSettings:
    """A task config (conf/task/<name>.yaml + overrides), checked: shared keys and the generator's own."""

    name: str
    mix: float
    eval_lengths: tuple[int, ...] | None
    samples: int
    threshold: float
    seed: int
    val_examples: int
    depths: tuple[float, ...] | None
    eval_positions: str  # one of EVAL_POSITIONS
    generator: dict[str, Any] = field(default_factory=dict)  # the task class's keyword arguments

    @property
    def cls(self) -> type[Task]:
        return REGISTRY[self.name]

    def lengths(self, train_len: int) -> list[int]:
        """Eval lengths: task.eval_lengths or 1x..16x the training length, the training length always in."""
        chosen = self.eval_lengths or tuple(m * train_len for m in EVAL_MULTIPLES)
        return sorted(set(chosen) | {train_len})

    def eval_depths(self) -> list[float | None]:
        return list(self.depths) if self.cls.has_depth else [None]


def _number_list(key: str, value: Any, low: float, high: float | None = None, integer: bool = True) -> tuple:
    """A non-empty list of numbers (integers if asked) in [low, high], as a tuple."""
    if not isinstance(value, (list, tuple)) or not value:
        raise RelposError(f"task.{key} must be a non-empty list, got {value!r}")
    for v in value:
        try:
            check_range(key, v, low, high, integer)
        except RelposError:
            bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
            raise RelposError(f"task.{key} must hold {'integers' if integer else 'numbers'} {bounds}, got {list(value)}") from None
    return tuple(value)


def task_settings(task_cfg: Mapping[str, Any]) -> TaskSettings:
    """Check a task config's shared keys (one line each, with the allowed range) and split off the
    generator's own keys; the generator's values are checked when the task is built."""
    cfg = {"eval_positions": EVAL_POSITIONS[0], **task_cfg}  # runs saved before the key existed
    name = cfg.get("name")
    if name not in REGISTRY:
        raise RelposError(f"unknown task {name!r}; choose one of: {', '.join(sorted([NO_TASK, *task_names()]))}")
    missing = [k for k in SHARED_KEYS if k not in cfg]
    if missing:
        raise RelposError(f"task={name} lacks {', '.join('task.' + k for k in missing)} (deleted with ~?)")
    check_range("mix", cfg["mix"], 0, 1)
    check_range("samples", cfg["samples"], 1, integer=True)
    check_range("threshold", cfg["threshold"], 0, 1)
    check_range("seed", cfg["seed"], 0, integer=True)
    check_range("val_examples", cfg["val_examples"], 1, integer=True)
    if cfg["eval_positions"] not in EVAL_POSITIONS:
        raise RelposError(f"task.eval_positions must be one of {', '.join(EVAL_POSITIONS)}, got {cfg['eval_positions']!r}")
    lengths = None if cfg["eval_lengths"] is None else _number_list("eval_lengths", cfg["eval_lengths"], 1)
    if lengths and max(lengths) > MAX_LENGTH:
        raise RelposError(f"task.eval_lengths must be at most {MAX_LENGTH} (2^31 - 1), got {max(lengths)}")
    depths = None
    if REGISTRY[name].has_depth:
        if DEPTH_KEY not in cfg:
            raise RelposError(f"task={name} lacks task.{DEPTH_KEY} (deleted with ~?)")
        depths = tuple(float(d) for d in _number_list(DEPTH_KEY, cfg[DEPTH_KEY], 0, 1, integer=False))
        repeated = sorted({d for d in depths if depths.count(d) > 1})
        if repeated:  # the same seeded examples again: counted twice, they would pass for independent ones
            raise RelposError(f"task.{DEPTH_KEY} holds {', '.join(f'{d:g}' for d in repeated)} more than once; "
                              f"each depth's examples are drawn from task.seed, so a repeat scores the same examples again")
    generator = {k: v for k, v in cfg.items() if k not in (*SHARED_KEYS, DEPTH_KEY)}
    return TaskSettings(name, float(cfg["mix"]), lengths, int(cfg["samples"]), float(cfg["threshold"]),
                        int(cfg["seed"]), int(cfg["val_examples"]), depths, str(cfg["eval_positions"]), generator)


def build_task(settings: TaskSettings, encoder: Encoder) -> Task:
    """Instantiate the task with its own keys as keyword arguments (unknown keys: one line naming the known ones)."""
    cls = settings.cls
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "encoder"}
    unknown = sorted(set(settings.generator) - accepted)
    if unknown:
        options = sorted(accepted | set(SHARED_KEYS) | ({DEPTH_KEY} if cls.has_depth else set()))
        raise RelposError(f"task={settings.name} has no option {', '.join(unknown)}; its options are: {', '.join(options)}")
    return cls(encoder, **settings.generator)


_import_all()
