"""What a run dir holds: the name of every file relpos writes there, and the readers of its result files.

Each file name is defined here once; commands write these files (train, eval-length, eval-task,
inspect, compare), and everything that reads them back (compare, the W&B sink, resume) reads them
through this module, so no reader imports the command that wrote the file.

    run dir/
      config.yaml           the resolved run config (checkpoint.save_config)
      checkpoint.pt         the final weights; checkpoints/step_*.pt while training
      metrics.jsonl         one JSON row per log step (tracking.Tracker)
      failed.json           a job that failed, and its overrides
      wandb_id.txt          the id of the dir's W&B run
      eval_length[.V].{csv,json,png}, eval_positions[.V].{csv,png}   eval-length, variant V
      eval_task[.V].{csv,json,png}, eval_task_heatmap[.V].png        eval-task, variant V
      inspect/              inspect's figures, symmetry.json, inspect.md
    compare folder/
      compare.{csv,md,json,png}, compare_accuracy.{csv,md,json,png}
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from pathlib import Path
from typing import Any

from relpos_cli.errors import RelposError

CONFIG_FILE = "config.yaml"
CHECKPOINT_FILE = "checkpoint.pt"
CHECKPOINT_DIR = "checkpoints"
METRICS_FILE = "metrics.jsonl"
FAILED_FILE = "failed.json"
LOG_FILE = "relpos.log"  # the run's log (relpos_cli/logs.py)
IMPORT_FILE = "import.json"  # where an imported run's weights came from (relpos import)
WANDB_ID_FILE = "wandb_id.txt"
INSPECT_DIR = "inspect"
SYMMETRY_FILE = "symmetry.json"  # in INSPECT_DIR
INSPECT_INDEX = "inspect.md"  # in INSPECT_DIR: names every picture
# a result file is <stem>[.<variant>]<suffix> in the run dir (report_path)
EVAL_LENGTH_STEM = "eval_length"  # eval-length: per length
EVAL_POSITIONS_STEM = "eval_positions"  # eval-length: per position inside the window
EVAL_TASK_STEM = "eval_task"  # eval-task: per length (and depth)
EVAL_TASK_HEATMAP_STEM = "eval_task_heatmap"  # eval-task: depth x length figure
COMPARE_STEM = "compare"  # perplexity: compare.csv/.md/.json/.png
COMPARED_METRICS = ("ppl", "loss", "ppl_ratio", "bpb")  # compare --metric over eval_length results
COMPARE_ACCURACY_STEM = "compare_accuracy"  # task accuracy
FORMATS = ("png", "pdf", "svg")  # plots.format: the figures' file types

DEFAULT_VARIANT = "default"


def compare_stem(metric: str) -> str:
    """compare.* for perplexity, compare_<metric>.* for another metric: one comparison's files never
    replace another's (a bpb table in compare.csv, which no column says is bpb)."""
    return COMPARE_STEM if metric == "ppl" else f"{COMPARE_STEM}_{metric}"


def perplexity(loss: float) -> float:
    """exp(loss), inf where that is beyond a float (a diverged run's finite loss above ~709.78): a
    number to show and store (json writes Infinity, which json.loads reads back), never an OverflowError."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def variant_tag(settings: dict[str, Any]) -> str:
    """`default`, or `key=value,...` (Hydra's override_dirname style) safe in a file name."""
    if not settings:
        return DEFAULT_VARIANT
    return ",".join(f"{k}={re.sub(r'[^A-Za-z0-9._-]', '-', str(v))}" for k, v in settings.items())


def report_path(run_dir: Path, stem: str, variant: str, suffix: str) -> Path:
    tag = "" if variant == DEFAULT_VARIANT else f".{variant}"
    return Path(run_dir) / f"{stem}{tag}{suffix}"


def task_report_paths(run_dir: Path, variant: str, with_heatmap: bool, fmt: str) -> dict[str, Path]:
    paths = {suffix: report_path(run_dir, EVAL_TASK_STEM, variant, suffix) for suffix in (".csv", ".json")}
    paths["plot"] = report_path(run_dir, EVAL_TASK_STEM, variant, f".{fmt}")
    if with_heatmap:
        paths["heatmap"] = report_path(run_dir, EVAL_TASK_HEATMAP_STEM, variant, f".{fmt}")
    return paths


def rows_to_csv(rows: list[dict[str, Any]], columns: list[str]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def protocol_label(row: dict[str, Any]) -> str:
    """How a row was scored: protocol, stride, precision (rows stored before eval.precision: fp32)."""
    protocol = row["protocol"] if row["protocol"] == "nonoverlapping" else f"{row['protocol']} stride={row['stride']}"
    return f"{protocol}, {row.get('precision') or 'fp32'}"


# ---- readers -------------------------------------------------------------------------------------


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's rows, oldest first; a line that does not parse (the last line of a killed
    process) is left out. [] without the file."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # the last line of a killed process
    return rows


def read_eval_length(path: Path) -> list[dict[str, Any]]:
    """The rows of one eval_length*.json; RelposError (one line: the file and how to rewrite it) if
    it does not hold a list of length rows (cut short, edited, `null`)."""
    try:
        rows = json.loads(path.read_text())
    except ValueError as e:
        why = type(e).__name__
    else:
        if isinstance(rows, list) and rows and all(isinstance(r, dict) and isinstance(r.get("length"), int) for r in rows):
            return rows
        why = "not a list of eval-length rows"
    raise RelposError(f"{path} is unreadable ({why}); evaluate its variant again with `relpos eval-length "
                      f"{path.parent} ... --replace` to overwrite it")


def stored_eval_length(run_dir: Path, variant: str) -> list[dict[str, Any]]:
    """One eval variant's stored rows ([] if it has none): what eval-length reads, so that another
    variant's unreadable file does not stop it."""
    path = report_path(run_dir, EVAL_LENGTH_STEM, variant, ".json")
    return read_eval_length(path) if path.is_file() else []


def eval_results(run_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """Every eval variant's rows in run_dir (eval_length*.json): variant -> rows."""
    results = {}
    for path in sorted(Path(run_dir).glob("eval_length*.json")):
        rows = read_eval_length(path)
        results[rows[0].get("variant", DEFAULT_VARIANT)] = rows
    return results


def report_figures(run_dir: Path, variant: str) -> list[Path]:
    """The figures eval-length wrote for a variant, whatever plots.format they were written in."""
    candidates = [report_path(run_dir, stem, variant, f".{fmt}") for stem in (EVAL_LENGTH_STEM, EVAL_POSITIONS_STEM) for fmt in FORMATS]
    return [p for p in candidates if p.is_file()]


def read_task_results(run_dir: Path) -> dict[str, dict[str, Any]]:
    """variant -> the eval_task JSON payload, for every eval_task*.json in the run dir."""
    results = {}
    for path in sorted(Path(run_dir).glob("eval_task*.json")):
        try:
            payload = json.loads(path.read_text())
            results[payload["variant"]] = payload
        except (ValueError, KeyError, TypeError) as e:
            raise RelposError(f"{path} is unreadable ({type(e).__name__}); relpos eval-task {run_dir} rewrites it") from None
    return results


def read_symmetry(run_dir: Path) -> dict[str, Any] | None:
    """inspect/symmetry.json (None if the dir has no inspect record)."""
    path = Path(run_dir) / INSPECT_DIR / SYMMETRY_FILE
    return json.loads(path.read_text()) if path.exists() else None


def compare_long_rows(groups: list[dict[str, Any]], accuracy: bool = False) -> list[dict[str, Any]]:
    """A compare.json's (or compare_accuracy.json's) groups as one row per (configuration, length):
    the shape a W&B line plot with one line per group needs."""
    return [{"configuration": g["line_label"], "length": int(l), "mean": c["mean"], "std": c["std"], "n": c["n"],
             **({"reached": c["reached"], "threshold": g["threshold"]} if accuracy else {})}
            for g in groups for l, c in g["cells"].items()]
