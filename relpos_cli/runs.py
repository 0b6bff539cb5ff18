"""Runs as compare and the sweep see them: found under folders, loaded from their run dirs
(config, failure, every stored result), labelled by the config keys that tell them apart, and
summarised per length (mean, sample std, n over seeds).

`relpos compare` (perplexity, relpos_cli/compare.py; accuracy, relpos_cli/compare_accuracy.py)
and `relpos sweep` read runs through here; the result files themselves are read by
relpos_cli/results.py.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from omegaconf import OmegaConf
from rich.text import Text

from relpos_cli.atomic import atomic_write_text
from relpos_cli.checkpoint import read_config
from relpos_cli.config import canonical_numbers, flatten_config
from relpos_cli.console import describe_os_error
from relpos_cli.errors import Interrupted, RelposError
from relpos_cli.plots import plot_compare
from relpos_cli.results import CHECKPOINT_FILE, CONFIG_FILE, FAILED_FILE, IMPORT_FILE, eval_results, read_task_results
from relpos_cli.settings import HOUSEKEEPING_KEYS
from relpos_cli.tables import configuration_labels, shared_settings, variant_labels
from relpos_cli.tasks import EVAL_ONLY_KEYS, NO_TASK
from relpos_cli.tracking import publish

# keys that never define a configuration: the seed, bookkeeping, where things live, how the token
# cache is built (data.streaming gives the same tokens), the figures' format, relpos inspect's
# settings, training's housekeeping: how often it logs, validates (on its own windows, drawing
# nothing from the training generators) and checkpoints, and a task's evaluation settings, which
# leave the weights bitwise the same (tests/test_compare_grouping.py trains runs that differ in each
# of these train and task keys alone)
IGNORED_PREFIXES = ("seed", "hydra", *HOUSEKEEPING_KEYS, "train.val_batches", *(f"task.{key}" for key in EVAL_ONLY_KEYS))
ACCURACY = "accuracy"  # task runs: eval_task results (relpos_cli/compare_accuracy.py)


@dataclass
class Run:
    path: Path
    config: dict[str, Any] = field(default_factory=dict)
    results: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # variant -> length rows
    task_results: dict[str, dict[str, Any]] = field(default_factory=dict)  # task variant -> eval_task payload
    failure: str | None = None


def find_runs(path: Path) -> list[Path]:
    """Run dirs under path (itself, a sweep, or nested sweeps): dirs holding config.yaml or .hydra/."""
    path = Path(path)
    if not path.exists():
        raise RelposError(f"run dir not found: {path}")
    found = []
    for root, dirs, files in os.walk(path):
        if CONFIG_FILE in files or ".hydra" in dirs:
            found.append(Path(root))
            dirs.clear()  # runs do not hold runs
        dirs[:] = sorted(d for d in dirs if d not in ("wandb", ".hydra"))
    return sorted(found)


def distinct_runs(paths: list[Path]) -> tuple[list[Path], list[Path]]:
    """The run dirs under paths (find_runs), each once: a run named twice (the same sweep twice, a
    symlink to it beside it, a sweep and one of its runs) would count as two seeds. Returns (the
    runs, each as first found; the other paths to a run already found)."""
    runs: dict[Path, Path] = {}
    again = []
    for path in paths:
        for run in find_runs(path):
            if runs.setdefault(run.resolve(), run) is not run:
                again.append(run)
    return list(runs.values()), again


def read_run(path: Path) -> Run:
    """The run dir as compare sees it: its config, its failure, or every stored result (not the
    model: that is checkpoint.load_run's)."""
    run = Run(path)
    if (path / FAILED_FILE).is_file():
        try:
            info = json.loads((path / FAILED_FILE).read_text())
            run.failure = f"{info.get('type', 'Error')}: {info.get('error', 'failed')}"
        except ValueError:
            run.failure = "failed (unreadable failed.json)"
        return run
    if not (path / CONFIG_FILE).is_file():
        run.failure = f"no {CONFIG_FILE}: the job failed before training"
        return run
    try:
        run.config = OmegaConf.to_container(read_config(path / CONFIG_FILE), resolve=False)
    except RelposError as e:  # this run is skipped, the others are compared
        run.failure = str(e)
        return run
    run.config.setdefault("task", {"name": NO_TASK})  # saved before tasks existed: language modelling
    if not (path / CHECKPOINT_FILE).is_file():
        run.failure = f"no {CHECKPOINT_FILE}: training did not finish"
        return run
    try:
        run.results = eval_results(path)
    except RelposError as e:
        run.failure = str(e)
    try:
        run.task_results = read_task_results(path)
    except RelposError as e:
        run.failure = str(e)
    return run


def split_runs_and_overrides(args: list[str]) -> tuple[list[Path], list[str]]:
    """Existing paths or arguments without '=' name run dirs or sweep dirs; the others are overrides.

    (Hydra names sweep runs `0_pos=rope,seed=0`, so a path may hold '='.)"""
    runs: list[Path] = []
    options = [a for a in args if a.startswith("-") and not Path(a).exists()]  # past the command's own options
    if options:
        raise RelposError(f"no such option: {options[0]} (--help lists the command's options)")
    paths = [a for a in args if "=" not in a or Path(a).exists()]
    overrides = [a for a in args if a not in paths]
    for arg in paths:
        runs.extend(find_runs(Path(arg)) or [Path(arg)])
    if not runs:
        raise RelposError("name at least one run dir (outputs/...)")
    return runs, overrides


# model keys whose null (or absence, in a run saved before them) means a value derived from other
# keys, as relpos_cli/model.py builds the model: key -> (the keys it is derived from, the derivation)
DERIVED_MODEL_KEYS = {
    "model.mlp_hidden": (("model.mlp_ratio", "model.d_model"), lambda ratio, d_model: ratio * d_model),
    "model.n_kv_heads": (("model.n_heads",), lambda n_heads: n_heads),
}


def compared_settings(run: Run, lineage: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The run's flat config as compare labels it. A model key whose null means a derived default
    holds the value the run uses (mlp_hidden=null beside an imported run's 256 is 4 x d_model = 256,
    the same MLP). An imported run's train.* keys are relpos's defaults, not how its model was
    trained (`steps=600` would be a claim about SmolLM2): only train.seq_len, the context it was
    trained at, is kept. A fine-tuned run's init_from is its parent as it differs from the run
    (parent_differences). lineage: the runs already followed down to this one (a parent of its own
    child would loop)."""
    flat = canonical_numbers(flatten_config(run.config))
    for key, (inputs, derive) in DERIVED_MODEL_KEYS.items():
        if flat.get(key) is None and all(k in flat for k in inputs):
            flat[key] = derive(*(flat[k] for k in inputs))
    if (run.path / IMPORT_FILE).is_file():
        flat = {k: v for k, v in flat.items() if not k.startswith("train.") or k == "train.seq_len"}
    if flat.get("init_from"):
        flat["init_from"] = parent_differences(flat, Path(flat["init_from"]), (*lineage, run.path.resolve()))
    return flat


def parent_differences(child: dict[str, Any], parent_dir: Path, lineage: tuple[Path, ...]) -> dict[str, Any] | str:
    """init_from as it tells configurations apart: the parent's compared settings where they differ
    from the child's, seed and housekeeping left out ({"train.seq_len": 64, "train.steps": 600}).
    Children fine-tuned alike from parents that differ only in their seed are then seeds of one
    configuration, where their parents' paths made a row of each. With the child's own settings it
    says everything its parent's would (a grandparent as the parent's own init_from). The path as
    given where the parent's config.yaml cannot be read (moved, deleted)."""
    if parent_dir.resolve() in lineage:  # a parent of its own child: followed no further
        return str(parent_dir)
    try:
        config = OmegaConf.to_container(read_config(parent_dir / CONFIG_FILE), resolve=False)
    except (OSError, RelposError):
        return str(parent_dir)
    if not isinstance(config, dict):
        return str(parent_dir)
    parent = compared_settings(Run(parent_dir, config), lineage)
    # the parent's own keys: an imported parent has no train.* but seq_len, which is no difference
    differences = {k: v for k, v in sorted(parent.items())
                   if k != "init_from" and not k.startswith(IGNORED_PREFIXES) and v != child.get(k)}
    if parent.get("init_from") is not None:
        differences["init_from"] = parent["init_from"]
    return differences


def differing_keys(flat: list[dict[str, Any]]) -> list[str]:
    keys = sorted({k for f in flat for k in f if not k.startswith(IGNORED_PREFIXES)})
    differing = [k for k in keys if len({json.dumps(f.get(k), sort_keys=True) for f in flat}) > 1]
    return sorted(differing, key=lambda k: (not k.endswith(".name"), k))  # names first: pos.name=alibi, ...


def labelled_runs(runs: list[Run]) -> tuple[list[str], list[tuple[Run, dict[str, Any], str, tuple]]]:
    """The runs that did not fail, each with its flat config, its label (tables.configuration_labels)
    and the values of the keys that differ between runs, seed left out (what groups runs); plus the
    keys the labels name."""
    ok = [r for r in runs if not r.failure]
    flats = [compared_settings(r) for r in ok]
    keys = differing_keys(flats) or ["pos.name"]
    shown, labels = configuration_labels(flats, keys)
    # a key another scheme lacks is left out of the values
    return shown, [(run, flat, label, tuple((k, flat[k]) for k in keys if k in flat))
                   for run, flat, label in zip(ok, flats, labels)]


def name_variants(groups: list[dict[str, Any]], labelled: list[tuple[Run, dict[str, Any], str, tuple]]) -> None:
    """Each group's `eval_label` (what tells its eval variant apart from the others' or "" when all
    rows share one; tables.variant_labels) and `line_label` (the legend entry), and on every group what
    all rows share, said once under tables: `shared` (config) and `shared_eval` (variant items)."""
    compact, shared_eval = variant_labels([g["variant"] for g in groups])
    shared = shared_settings([flat for _, flat, _, _ in labelled]) if labelled else ""
    for g in groups:
        g["eval_label"] = compact[g["variant"]] if len(compact) > 1 else ""
        g["line_label"] = g["label"] + (f" [{g['eval_label']}]" if g["eval_label"] not in ("", "–") else "")
        g["shared"], g["shared_eval"] = shared, shared_eval


def shared_caption(groups: list[dict[str, Any]]) -> list[str]:
    """What every row has in common, for the line under a table: `all rows: pos=rope, d_model=64`,
    `eval: protocol=sliding, stride=64`."""
    parts = [f"all rows: {groups[0]['shared']}"] if groups[0]["shared"] else []
    return parts + ([f"eval: {groups[0]['shared_eval']}"] if groups[0]["shared_eval"] else [])


def summarize(values: dict[int, list[float]]) -> dict[int, dict[str, Any]]:
    """length -> mean, sample std (None for one run) and n of the values at that length. A diverged
    run's perplexity is inf: the mean is then inf and the spread nan (statistics.stdev raises on inf)."""
    def spread(v: list[float]) -> float | None:
        if len(v) < 2:
            return None
        return statistics.stdev(v) if all(map(math.isfinite, v)) else math.nan

    return {length: {"mean": statistics.fmean(v), "std": spread(v), "n": len(v)} for length, v in sorted(values.items())}


# ---- a comparison: evaluating its runs, its files, what it prints ----------------------------------


@contextmanager
def failure_recorded(run: Run) -> Iterator[None]:
    """Evaluating one run of a comparison: a failure marks that run failed, and the others go on;
    Ctrl-C or kill stops the whole command."""
    try:
        yield
    except Interrupted:  # Ctrl-C or kill: the whole command stops, not this run alone
        raise
    except RelposError as e:
        run.failure = f"evaluation failed: {e}"
    except OSError as e:  # a full disk, a read-only run dir: the path and what to do, no traceback
        run.failure = f"evaluation failed: {describe_os_error(e)}"
    except Exception as e:  # one broken run must not stop the comparison of the others
        run.failure = f"evaluation failed: {type(e).__name__}: {e}"
        traceback.print_exc()


def check_groups(groups: list[dict[str, Any]], failed: list[Run]) -> None:
    if not groups:
        raise RelposError("no evaluated runs to compare: " + "; ".join(f"{r.path}: {r.failure}" for r in failed))


def comparison_title(what: str, runs: list[Run], failed: list[Run]) -> str:
    """A comparison's title: what it compares and how many runs it shows (those that did not fail)."""
    shown = len(runs) - len(failed)
    return f"relpos compare: {what} vs eval length, {shown} run{'s' if shown != 1 else ''}"


def write_comparison(out_dir: Path, stem: str, fmt: str, csv_text: str, markdown: str, metric: str,
                     groups: list[dict[str, Any]], failed: list[Run], plot: dict[str, Any]) -> list[Path]:
    """<stem>.csv, .md, .json (metric, groups, failed runs) and the figure in fmt (plots.plot_compare
    with the `plot` arguments, one line per group); returns the paths."""
    out_dir = Path(out_dir)
    paths = [out_dir / f"{stem}{s}" for s in (".csv", ".md", ".json", f".{fmt}")]
    atomic_write_text(paths[0], csv_text)
    atomic_write_text(paths[1], markdown)
    payload = {"metric": metric, "groups": groups, "failed": [{"run": str(r.path), "reason": r.failure} for r in failed]}
    atomic_write_text(paths[2], json.dumps(payload, indent=2))
    plot_compare(paths[3], [{**g, "label": g["line_label"]} for g in groups], **plot)
    return paths


def report_comparison(console, table, runs: list[Run], out_dir: Path, write: Callable[[], list[Path]],
                      log_new: Callable[[Any, Path], None]) -> list[Path]:
    """Print the table and the skipped runs, write the files, add them to out_dir's W&B run (with the
    first usable run's W&B settings) and name them."""
    console.print(table)
    for r in runs:
        if r.failure:
            console.print(Text.assemble(("skipped", "yellow"), f" {r.path}: {r.failure}"), soft_wrap=True)
    written = write()
    first = next(r for r in runs if not r.failure)
    publish(out_dir, log_new, {"wandb": first.config.get("wandb", {"mode": "disabled"}),
                               "compared_runs": [str(r.path.resolve()) for r in runs]})
    console.print("wrote " + ", ".join(str(p) for p in written))
    return written
