"""Metrics go to metrics.jsonl in the run dir and to one W&B run per run dir (offline by default).

One W&B run per relpos run: its training curves, eval-length and eval-task results (charts of each metric against
the eval length, a Table, the plots, summary scalars such as eval/ppl@2048) and inspect pictures sit
on one run page, and the W&B runs table can sort runs by any of those scalars. The run's id is kept
in wandb_id.txt.

- online: a later command (eval-length, eval-task, inspect) resumes the run by its id and adds its results.
- offline: W&B cannot resume an offline run (each wandb.init writes a new offline-run-* dir, and dirs
  sharing an id collide on `wandb sync`). So whenever a command adds to a run dir, its offline run is
  rebuilt from the run dir's files: the old offline dir of that id is removed and one new dir holds
  everything (RESULT_LOGGERS below). The run dir stays the record; the W&B run is a view of it.

Sweep jobs share a W&B group (the sweep dir, set into wandb.group when the job starts), job_type is
what the dir holds (train, inspect, compare), and tags name the scheme (pos=...) and the task.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from relpos_cli.atomic import atomic_write_text
from relpos_cli.errors import RelposError
from relpos_cli.results import (
    COMPARE_ACCURACY_STEM, COMPARED_METRICS, CONFIG_FILE, DEFAULT_VARIANT, EVAL_LENGTH_STEM, EVAL_TASK_HEATMAP_STEM, EVAL_TASK_STEM,
    INSPECT_DIR, METRICS_FILE, WANDB_ID_FILE,
    compare_long_rows, compare_stem, eval_results, read_metrics, read_symmetry, read_task_results, report_figures, report_path,
    stored_eval_length,
)
from relpos_cli.settings import WANDB_MODES
from relpos_cli.tasks import task_name, trains_on_task

DEFAULT_INIT_TIMEOUT = 60.0  # seconds; conf/config.yaml's wandb.init_timeout (run configs saved before it lack it)


class Tracker:
    """Training's log: one JSON line per log step in metrics.jsonl, the same row live into W&B."""

    def __init__(self, run_dir: Path, config: Mapping[str, Any]):
        self.run_dir = Path(run_dir)
        self.metrics_path = self.run_dir / METRICS_FILE
        # a fresh run has no metrics.jsonl yet, which _job_type would read as an inspect dir
        self.wandb = open_run(self.run_dir, config, job_type="train")

    def log(self, row: Mapping[str, Any]) -> None:
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(dict(row)) + "\n")
        if self.wandb is not None:
            self.wandb.log(training_keys(row), step=row["step"])

    def finish(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


class NullTracker:
    """What ranks other than 0 of a DDP run log to: nothing, so the run dir has one writer."""

    def log(self, row: Mapping[str, Any]) -> None:
        pass

    def finish(self) -> None:
        pass


# ---- the W&B run of a run dir ------------------------------------------------------------------------


def _mode(config: Mapping[str, Any]) -> str:
    mode = config["wandb"]["mode"]
    if mode not in WANDB_MODES:
        raise RelposError(f"wandb.mode={mode!r}; choose one of: {', '.join(WANDB_MODES)}")
    return mode


def _run_id(run_dir: Path) -> str:
    id_file = run_dir / WANDB_ID_FILE
    if id_file.exists():
        return id_file.read_text().strip()
    run_id = uuid.uuid4().hex[:8]
    atomic_write_text(id_file, run_id)
    return run_id


def run_tags(config: Mapping[str, Any]) -> list[str]:
    """pos=<scheme>, task=<task> for a run trained on one, then wandb.tags."""
    tags = [f"pos={config['pos']['name']}"] if config.get("pos") else []
    if isinstance(config.get("task"), Mapping) and trains_on_task(config["task"]):
        tags.append(f"task={task_name(config)}")
    return tags + [str(t) for t in config["wandb"].get("tags") or [] if str(t) not in tags]


def _job_type(run_dir: Path) -> str:
    if (run_dir / METRICS_FILE).exists():
        return "train"
    stems = (*(compare_stem(m) for m in COMPARED_METRICS), COMPARE_ACCURACY_STEM)
    compared = any((run_dir / f"{stem}.json").exists() for stem in stems)
    return "compare" if compared else "inspect"


def _init_wandb(run_dir: Path, config: Mapping[str, Any], job_type: str):
    """The one place W&B runs are created: the run dir's id, name, group and tags; None if disabled."""
    settings = config["wandb"]
    mode = _mode(config)
    if mode == "disabled":
        return None
    try:
        import wandb
    except ImportError as e:  # a dependency, but a bare GPU image may lack it
        raise RelposError(f"wandb.mode={mode} needs the wandb package ({e}): pip install wandb, or give "
                          f"wandb.mode=disabled") from None

    os.environ.setdefault("WANDB_SILENT", "true")
    timeout = float(settings.get("init_timeout") or DEFAULT_INIT_TIMEOUT)
    try:
        return wandb.init(
            # strings, as the schema types them: a shell's wandb.group=123 arrives as an int, which W&B refuses
            project=str(settings["project"]),
            entity=None if settings.get("entity") is None else str(settings["entity"]),
            group=None if settings.get("group") is None else str(settings["group"]),
            tags=run_tags(config),
            name=str(config["name"]) if config.get("name") is not None else run_dir.name,
            id=_run_id(run_dir),
            resume="allow" if mode == "online" else None,  # offline runs are rebuilt instead (module docstring)
            dir=str(run_dir),
            mode=mode,
            job_type=job_type,
            config=dict(config),
            # bounded: without a network W&B would retry for minutes before it gives up
            settings=wandb.Settings(init_timeout=timeout),
        )
    except Exception as e:  # W&B's own errors, its settings' validation, timeouts: the W&B side of the boundary
        reason = str(e).strip().splitlines()[0].rstrip(".") if str(e).strip() else type(e).__name__
        hint = ("log in (wandb login) and check the network, or use wandb.mode=offline (sync later with `wandb sync`) "
                "or wandb.mode=disabled" if mode == "online" else "or use wandb.mode=disabled")
        raise RelposError(
            f"W&B could not start a run (wandb.mode={mode}, wandb.init_timeout={timeout:g} s): {reason}; {hint}"
        ) from None


def _remove_offline_runs(run_dir: Path) -> None:
    for old in (run_dir / "wandb").glob(f"offline-run-*-{_run_id(run_dir)}"):
        shutil.rmtree(old, ignore_errors=True)


def open_run(run_dir: Path, config: Mapping[str, Any], job_type: str | None = None):
    """The run dir's W&B run, open for logging (None if disabled). Offline, a new offline dir
    replaces the old one and already holds every result the run dir has (RESULT_LOGGERS).
    job_type: what the dir holds, read from its files unless given (training names it before its
    first metrics.jsonl row)."""
    run_dir = Path(run_dir)
    offline = _mode(config) == "offline"
    if offline:
        _remove_offline_runs(run_dir)  # before wandb.init: a new dir may get the old one's name (1 s clock)
    run = _init_wandb(run_dir, config, job_type or _job_type(run_dir))
    if run is not None and offline:
        for log_results in RESULT_LOGGERS:
            log_results(run, run_dir)
    return run


def _saved_config(run_dir: Path) -> dict[str, Any] | None:
    from omegaconf import OmegaConf

    path = run_dir / CONFIG_FILE
    return OmegaConf.to_container(OmegaConf.load(path), resolve=True) if path.is_file() else None


def publish(run_dir: Path, log_new: Callable[[Any, Path], None], config: Mapping[str, Any] | None = None) -> None:
    """Add results a command has just written into run_dir to the dir's W&B run.

    log_new(run, run_dir) logs them (one of RESULT_LOGGERS, or a narrower call of one): online into
    the resumed run; offline the rebuilt run already holds them. The W&B config is the run's saved
    config.yaml, or `config` for dirs without one (a compare folder, a fresh inspect)."""
    run_dir = Path(run_dir)
    config = _saved_config(run_dir) or config
    if config is None or _mode(config) == "disabled":
        return
    run = open_run(run_dir, config)
    if _mode(config) == "online":
        log_new(run, run_dir)
    run.finish()


# ---- building blocks: what any result adds to a W&B run ------------------------------------------------


def training_keys(row: Mapping[str, Any]) -> dict[str, Any]:
    """A metrics.jsonl row as W&B keys: train/* and val/loss (the W&B step is the training step)."""
    return {("val/loss" if k == "val_loss" else f"train/{k}"): v for k, v in row.items() if k != "step"}


def log_curve(run, prefix: str, x: str, rows: Sequence[Mapping[str, Any]], metrics: Sequence[str]) -> None:
    """Results keyed by x (an eval length): one history row per x, charted against `prefix/x`
    (define_metric), and summary scalars `prefix/metric@x` for every x, so the runs table can sort by
    them. eval-length logs ppl/loss/bpb/ppl_ratio with it; any per-length result (accuracy) can."""
    named = prefix.replace(".", "\\.")  # escaped: W&B reads "." as nesting (eval_task.task=… against a phantom 0)
    run.define_metric(f"{named}/{x}", hidden=True)
    for m in metrics:
        run.define_metric(f"{named}/{m}", step_metric=f"{named}/{x}")
    for r in rows:
        run.log({f"{prefix}/{x}": r[x], **{f"{prefix}/{m}": r[m] for m in metrics if m in r}})
    run.summary.update({f"{prefix}/{m}@{r[x]}": r[m] for r in rows for m in metrics if m in r})


# W&B stores a logged Table as an artifact named run-<8-char id>-<key> (its plot's as <key>_plot_table), at
# most 128 characters: a longer key (an eval variant of several settings) would fail the logging, and
# offline, where every command rebuilds the run from the result files, every later command on the run
TABLE_KEY_MAX = 96


def table_key(key: str) -> str:
    """`key`, or where it is too long for W&B (TABLE_KEY_MAX) its start and a hash of the whole: one
    key per variant still, and the same on every rebuild."""
    if len(key) <= TABLE_KEY_MAX:
        return key
    return f"{key[:TABLE_KEY_MAX - 9]}-{hashlib.sha1(key.encode()).hexdigest()[:8]}"


def log_table(run, key: str, rows: Sequence[Mapping[str, Any]], x: str, y: str, stroke: str | None = None) -> None:
    """rows as a W&B Table plus a line plot of y against x (one line per `stroke` value), under
    table_key(key)."""
    import wandb

    key = table_key(key)
    columns = list(rows[0])
    table = wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows])
    run.log({key: table, f"{key}_plot": wandb.plot.line(table, x, y, stroke=stroke, title=f"{y} vs {x}")})


def log_images(run, images: Mapping[str, Path]) -> None:
    """Figure files as W&B images (key -> path); PNG only: W&B does not show PDF or SVG files
    (plots.format=pdf|svg runs keep their W&B charts and tables)."""
    import wandb

    shown = {key: wandb.Image(str(path)) for key, path in images.items() if Path(path).suffix == ".png" and Path(path).is_file()}
    if shown:
        run.log(shown)


# ---- result files -> W&B (each logs what run_dir holds of its kind; the offline rebuild calls all) ------


def log_training(run, run_dir: Path) -> None:
    """metrics.jsonl, step by step; the last step's row is then committed, so that the results logged
    after it (without a step) get rows of their own instead of joining the last training step's."""
    rows = read_metrics(run_dir)
    for row in rows:
        run.log(training_keys(row), step=row["step"])
    if rows:
        run.log({}, commit=True)


def eval_prefix(variant: str) -> str:
    return "eval" if variant == DEFAULT_VARIANT else f"eval.{variant}"


def log_eval_length(run, run_dir: Path, variants: Sequence[str] | None = None) -> None:
    """eval_length*.json (every variant, or those named): ppl, loss, bpb and ppl_ratio against the
    length, summary scalars at each length plus the ratio at the longest, the Table and the plots."""
    # the named variants' files only: another variant's unreadable file must not fail a logging that does not need it
    results = eval_results(Path(run_dir)) if variants is None else {v: stored_eval_length(Path(run_dir), v) for v in variants}
    for variant, rows in results.items():
        if not rows:
            continue
        prefix = eval_prefix(variant)
        log_curve(run, prefix, "length", rows, ["ppl", "loss", "bpb", "ppl_ratio"])
        longest = max(rows, key=lambda r: r["length"])
        run.summary.update({f"{prefix}/longest_length": longest["length"], f"{prefix}/ppl_ratio_longest": longest["ppl_ratio"]})
        key = prefix.replace("eval", EVAL_LENGTH_STEM, 1)
        log_table(run, key, rows, "length", "ppl")
        log_images(run, {f"{prefix}/{p.stem.split('.')[0]}": p for p in report_figures(Path(run_dir), variant)})


def log_eval_task(run, run_dir: Path, variants: Sequence[str] | None = None) -> None:
    """eval_task*.json (every variant, or those named): accuracy against the length (summary scalars
    eval_task/accuracy@L), the effective length and its threshold, the Table (a line per passkey
    depth) and the figures."""
    for variant, payload in read_task_results(Path(run_dir)).items():
        if variants is not None and variant not in variants:
            continue
        prefix = eval_prefix(variant).replace("eval", EVAL_TASK_STEM, 1)
        log_curve(run, prefix, "length", payload["lengths"], ["accuracy"])
        run.summary.update({f"{prefix}/effective_length": payload["effective_length"], f"{prefix}/threshold": payload["threshold"],
                            **({f"{prefix}/effective_length_lower": payload["effective_length_lower"]}
                               if "effective_length_lower" in payload else {})})
        rows = [{**r, "depth": str(r["depth"])} for r in (*payload["lengths"], *payload["cells"])]
        log_table(run, f"{prefix}/table", rows, "length", "accuracy", stroke="depth")
        log_images(run, {f"{prefix}/{stem}": report_path(Path(run_dir), stem, variant, ".png")
                         for stem in (EVAL_TASK_STEM, EVAL_TASK_HEATMAP_STEM)})


def log_inspect(run, run_dir: Path) -> None:
    """inspect/symmetry.json as a Table (layer, head, measures) and the inspect figures it names."""
    record = read_symmetry(run_dir)
    if record is None:
        return
    import wandb

    folder = Path(run_dir) / INSPECT_DIR
    measures = list(next(iter(record["layers"].values())))
    rows = [[int(layer), h, *(entry[m][n] for m in measures)]
            for layer, entry in record["layers"].items() for n, h in enumerate(record["heads"])]
    run.log({"inspect/symmetry": wandb.Table(columns=["layer", "head", *measures], data=rows)})
    # the latest inspect's figures, which symmetry.json names (not a user's files beside them); one
    # written before it named them: every file there
    names = record.get("figures") or sorted(p.name for p in folder.iterdir())
    log_images(run, {f"inspect/{Path(name).stem}": folder / name for name in names})


def _log_comparison(run, out_dir: Path, stem: str) -> None:
    """<stem>.json: one row per (configuration, length), plotted one line per configuration."""
    path = Path(out_dir) / f"{stem}.json"
    if not path.exists():
        return
    report = json.loads(path.read_text())
    rows = compare_long_rows(report["groups"], accuracy=stem == COMPARE_ACCURACY_STEM)
    log_table(run, stem, rows, "length", "mean", stroke="configuration")
    # the figure under a key of its own: under the table's key it replaced the table in the run's summary
    log_images(run, {f"{stem}_figure": p for p in sorted(Path(out_dir).glob(f"{stem}.*"))})


def log_compare(run, out_dir: Path) -> None:
    """compare.json (perplexity) and compare_<metric>.json (loss, ppl_ratio, bpb), those the folder holds."""
    for metric in COMPARED_METRICS:
        _log_comparison(run, out_dir, compare_stem(metric))


def log_compare_accuracy(run, out_dir: Path) -> None:
    """compare_accuracy.json (task accuracy)."""
    _log_comparison(run, out_dir, COMPARE_ACCURACY_STEM)


# Every kind of result file a dir can hold, in the order a rebuilt offline run logs them. A new kind
# of result (a task's accuracy per length) adds its logger here and calls publish() after writing.
RESULT_LOGGERS: list[Callable[[Any, Path], None]] = [log_training, log_eval_length, log_eval_task, log_inspect, log_compare,
                                                     log_compare_accuracy]
