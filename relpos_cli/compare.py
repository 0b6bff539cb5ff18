"""`relpos compare`: one table over many runs, rows = configurations, columns = eval lengths.

A configuration is (what differs between the runs' resolved configs apart from the seed, eval
variant); cells are mean ± std over its runs (seeds). Folder names play no part in the grouping.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from omegaconf import OmegaConf
from rich.table import Table
from rich.text import Text

from relpos_cli.atomic import atomic_write_text
from relpos_cli.checkpoint import CHECKPOINT_FILE, CONFIG_FILE, FAILED_FILE
from relpos_cli.errors import Interrupted, RelposError
from relpos_cli.config import flatten_config
from relpos_cli.console import describe_os_error
from relpos_cli.evaluate import DEFAULT_VARIANT, load_eval_config, variant_settings, variant_tag
from relpos_cli.eval_task import read_task_results
from relpos_cli.report import eval_results, protocol_label, rows_to_csv
from relpos_cli.tables import column_blocks, configuration_labels, decimals
from relpos_cli.tasks import NO_TASK, models_language, trains_on_task

# keys that never define a configuration: the seed, bookkeeping, where things live, and how the token
# cache is built (data.streaming gives the same tokens)
IGNORED_PREFIXES = ("seed", "hydra", "wandb", "device", "data.cache_dir", "data.streaming", "eval")
METRICS = ("ppl", "loss", "ppl_ratio", "bpb")
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


def load_run(path: Path) -> Run:
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
    run.config = OmegaConf.to_container(OmegaConf.load(path / CONFIG_FILE), resolve=False)
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


def ensure_evaluated(runs: list[Run], overrides: list[str], evaluate: Callable[[Path, list[str]], None] | None) -> None:
    """Evaluate runs that lack the variant named by `overrides`; a failure marks that run failed."""
    for run in runs:
        if run.failure:
            continue
        try:
            wanted = variant_tag(variant_settings(load_eval_config(run.path, overrides, "compare").eval))
            if wanted in run.results:
                continue
            if evaluate is None:
                run.failure = f"not evaluated ({wanted}); run `relpos eval-length {run.path}`"
                continue
            evaluate(run.path, overrides)
            run.results = load_run(run.path).results
        except Interrupted:  # Ctrl-C or kill: the whole command stops, not this run alone
            raise
        except RelposError as e:
            run.failure = f"evaluation failed: {e}"
        except OSError as e:
            run.failure = f"evaluation failed: {describe_os_error(e)}"
        except Exception as e:  # one broken run must not stop the comparison of the others
            run.failure = f"evaluation failed: {type(e).__name__}: {e}"
            traceback.print_exc()


def skip_runs_without(runs: list[Run], metric: str) -> None:
    """Runs evaluated before `metric` existed (bpb) cannot be shown in it: marked failed, with the fix."""
    for run in runs:
        dated = sorted(v for v, rows in run.results.items() if any(metric not in r for r in rows))
        if dated and not run.failure:
            run.failure = (f"its eval results ({', '.join(dated)}) predate {metric}; "
                           f"re-evaluate: relpos eval-length {run.path} [eval overrides]")


def skip_task_only_runs(runs: list[Run]) -> None:
    """Runs trained on a task alone have no language-model numbers worth comparing: listed, with why."""
    for run in runs:
        task = run.config.get("task", {})
        if not run.failure and not models_language(task):
            run.failure = f"trained on task={task['name']} alone (no perplexity): relpos compare {run.path} --metric accuracy"


def differing_keys(configs: list[dict[str, Any]]) -> list[str]:
    flat = [flatten_config(c) for c in configs]
    keys = sorted({k for f in flat for k in f if not k.startswith(IGNORED_PREFIXES)})
    differing = [k for k in keys if len({json.dumps(f.get(k), sort_keys=True) for f in flat}) > 1]
    return sorted(differing, key=lambda k: (not k.endswith(".name"), k))  # names first: pos.name=alibi, ...


def labelled_runs(runs: list[Run]) -> tuple[list[str], list[tuple[Run, dict[str, Any], str, tuple]]]:
    """The runs that did not fail, each with its flat config, its label (tables.configuration_labels)
    and the values of the keys that differ between runs, seed left out (what groups runs); plus the
    keys the labels name."""
    ok = [r for r in runs if not r.failure]
    keys = differing_keys([r.config for r in ok]) or ["pos.name"]
    flats = [flatten_config(r.config) for r in ok]
    shown, labels = configuration_labels(flats, keys)
    # a key another scheme lacks is left out of the values
    return shown, [(run, flat, label, tuple((k, flat[k]) for k in keys if k in flat))
                   for run, flat, label in zip(ok, flats, labels)]


def group_runs(runs: list[Run], metric: str = "ppl") -> list[dict[str, Any]]:
    """One group per (differing config values, eval variant): mean, sample std and n per length.
    Each group is labelled by the keys that differ (tables.configuration_labels): `rope`,
    `alibi, seq_len=256`; `label_keys` names those keys."""
    shown, labelled = labelled_runs(runs)
    groups: dict[tuple, dict[str, Any]] = {}
    for run, flat, label, values in labelled:
        for variant, rows in run.results.items():
            g = groups.setdefault(
                (json.dumps(values, default=str), variant),  # values may hold lists (task.depths, pos.boundaries)
                {"label": label, "label_keys": shown, "config": dict(values), "variant": variant,
                 "protocol": protocol_label(rows[0]),
                 "train_len": flat.get("train.seq_len"), "tokens": set(), "runs": [], "values": {}},
            )
            g["runs"].append(str(run.path))
            for r in rows:
                g["values"].setdefault(int(r["length"]), []).append(float(r[metric]))
                g["tokens"].add(int(r["tokens"]))
    out = []
    for g in groups.values():
        g["cells"] = summarize(g.pop("values"))
        g["tokens"] = sorted(g["tokens"])
        g["line_label"] = g["label"] if g["variant"] == DEFAULT_VARIANT else f"{g['label']} [{g['variant']}]"
        out.append(g)
    return sorted(out, key=lambda g: (g["label"], g["variant"]))


def summarize(values: dict[int, list[float]]) -> dict[int, dict[str, Any]]:
    """length -> mean, sample std (None for one run) and n of the values at that length."""
    return {
        length: {"mean": statistics.fmean(v), "std": statistics.stdev(v) if len(v) > 1 else None, "n": len(v)}
        for length, v in sorted(values.items())
    }


def all_lengths(groups: list[dict[str, Any]]) -> list[int]:
    return sorted({l for g in groups for l in g["cells"]})


def best_per_length(groups: list[dict[str, Any]]) -> dict[int, float]:
    """Lowest mean per length (lower is better for every metric in METRICS)."""
    return {l: min(g["cells"][l]["mean"] for g in groups if l in g["cells"]) for l in all_lengths(groups)}


def cell_text(cell: dict[str, Any] | None) -> str:
    if cell is None:
        return "–"
    if cell["std"] is None:  # one run: no spread to show
        return f"{cell['mean']:.3f} (n=1)"
    return f"{cell['mean']:.3f} ± {cell['std']:.3f} (n={cell['n']})"


def _tokens_text(g: dict[str, Any]) -> str:
    return ",".join(f"{t:,}" for t in g["tokens"])


def _varies(groups: list[dict[str, Any]], value_of: Callable[[dict[str, Any]], Any]) -> bool:
    return len({value_of(g) for g in groups}) > 1


def compare_table(groups: list[dict[str, Any]], metric: str, title: str, width: int = 80):
    """The terminal table, made to read at `width` columns: short labels, each length's column
    holding the mean over the std, what every row shares (protocol, tokens, variant) in the caption,
    and, when the lengths still do not fit, the lengths split over several tables."""
    from rich.console import Group

    lengths, best = all_lengths(groups), best_per_length(groups)
    train_lens = {g["train_len"] for g in groups}
    several_variants = _varies(groups, lambda g: g["variant"])  # the variant names its protocol too
    shared = {"protocol": lambda g: g["protocol"], "tokens": _tokens_text}
    columns = [name for name, value_of in shared.items() if _varies(groups, value_of) and not (name == "protocol" and several_variants)]
    keys = ", ".join(groups[0]["label_keys"]) or "pos.name"
    common = [f"{value_of(groups[0])}" + (" tokens" if name == "tokens" else "")
              for name, value_of in shared.items() if not _varies(groups, value_of)]
    if not several_variants and groups[0]["variant"] != DEFAULT_VARIANT:
        common.append(f"eval variant {groups[0]['variant']}")
    marked = len(train_lens) == 1 and next(iter(train_lens)) in lengths
    caption = (f"rows: {keys} (the keys that differ)" + (", eval variant in brackets" if several_variants else "")
               + "; n: runs (seeds); cells: mean ± sample std; bold: best per length"
               + ("; *: train length" if marked else "") + (f"; {', '.join(common)}" if common else ""))
    labels = [g["label"] + (f"\n[{g['variant']}]" if several_variants and g["variant"] != DEFAULT_VARIANT else "")
              for g in groups]

    def cell(g: dict[str, Any], l: int) -> Text:
        c = g["cells"].get(l)
        if c is None:
            return Text("–")
        places = decimals(c["mean"])
        text = f"{c['mean']:.{places}f}" + (f"\n±{c['std']:.{places}f}" if c["std"] is not None else "")
        if c["n"] != len(g["runs"]):
            text += f"\nn={c['n']}"
        return Text(text, style="bold green") if math.isclose(c["mean"], best[l]) else Text(text)

    cells = [[cell(g, l) for l in lengths] for g in groups]
    headers = [f"{l}" + ("*" if marked and l in train_lens else "") for l in lengths]
    text_width = lambda text: max(len(line) for line in str(text).splitlines())  # noqa: E731
    widths = [max(text_width(h), *(text_width(row[i]) for row in cells)) for i, h in enumerate(headers)]
    fixed = [min(24, max(len(line) for label in labels for line in label.splitlines())),
             *(max(len(str(shared[c](g))) for g in groups) for c in columns), 3]
    blocks = column_blocks(fixed, widths, width)
    tables = []
    for block in blocks:
        table = Table()
        table.add_column("configuration", overflow="fold")
        for name in columns:
            table.add_column(name, overflow="fold")
        table.add_column("n", justify="right")
        for i in block:
            table.add_column(headers[i], justify="right", no_wrap=True)
        for g, label, row in zip(groups, labels, cells):
            table.add_row(Text(label), *(Text(str(shared[name](g))) for name in columns), str(len(g["runs"])), *(row[i] for i in block))
        tables.append(table)
    # title and caption at the console's width, not the (narrower) table's
    return Group(Text(title, style="italic"), *tables, Text(caption, style="dim"))


def compare_markdown(groups: list[dict[str, Any]], metric: str, title: str, failed: list[Run]) -> str:
    lengths, best = all_lengths(groups), best_per_length(groups)
    head = ["configuration", "eval variant", "protocol", "tokens", *(f"{metric}@{l}" for l in lengths)]
    lines = [f"{title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g in groups:
        cells = []
        for l in lengths:
            c = g["cells"].get(l)
            cells.append(f"**{cell_text(c)}**" if c and math.isclose(c["mean"], best[l]) else cell_text(c))
        lines.append("| " + " | ".join([g["label"], g["variant"], g["protocol"], _tokens_text(g), *cells]) + " |")
    lines += ["", f"Rows: configurations named by the keys that differ ({', '.join(groups[0]['label_keys'])}). "
              f"Cells: mean ± sample std of {metric} over runs (n = runs, one per seed); bold = best per length."]
    if failed:
        lines += ["", "Failed or unevaluated runs:", *(f"- {r.path}: {r.failure}" for r in failed)]
    return "\n".join(lines) + "\n"


def compare_csv(groups: list[dict[str, Any]]) -> str:
    lengths = all_lengths(groups)
    columns = ["configuration", "variant", "protocol", "tokens", "train_len"]
    columns += [f"{l}_{s}" for l in lengths for s in ("mean", "std", "n")]
    rows = []
    for g in groups:
        row = {"configuration": g["label"], "variant": g["variant"], "protocol": g["protocol"],
               "tokens": _tokens_text(g), "train_len": g["train_len"]}
        for l, c in g["cells"].items():
            row.update({f"{l}_mean": c["mean"], f"{l}_std": c["std"], f"{l}_n": c["n"]})
        rows.append(row)
    return rows_to_csv(rows, columns)


def write_compare(out_dir: Path, groups: list[dict[str, Any]], metric: str, title: str, failed: list[Run],
                  fmt: str = "png") -> list[Path]:
    from relpos_cli.plots import plot_compare

    out_dir = Path(out_dir)
    paths = [out_dir / f"compare{s}" for s in (".csv", ".md", ".json", f".{fmt}")]
    atomic_write_text(paths[0], compare_csv(groups))
    atomic_write_text(paths[1], compare_markdown(groups, metric, title, failed))
    payload = {"metric": metric, "groups": groups, "failed": [{"run": str(r.path), "reason": r.failure} for r in failed]}
    atomic_write_text(paths[2], json.dumps(payload, indent=2))
    protocols = "; ".join(sorted({f"{g['protocol']}, {_tokens_text(g)} tokens" for g in groups}))
    plot_compare(paths[3], [{**g, "label": g["line_label"]} for g in groups], metric, f"{title}\n{protocols}",
                 {g["train_len"] for g in groups if g["train_len"]}, legend_title=", ".join(groups[0]["label_keys"]))
    return paths


def long_rows(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (configuration, length): the shape a W&B line plot with one line per group needs."""
    return [
        {"configuration": g["line_label"], "length": int(l), "mean": c["mean"], "std": c["std"], "n": c["n"]}
        for g in groups
        for l, c in g["cells"].items()
    ]



def run_compare(paths: list[Path], overrides: list[str], out_dir: Path, evaluate: bool, metric: str, console) -> list[Path]:
    """The `relpos compare` command: find, evaluate (if asked), group, print, write, log."""
    from relpos_cli.plots import plot_format
    from relpos_cli.report import evaluate_and_report
    from relpos_cli.tracking import log_compare, publish

    if metric not in (*METRICS, ACCURACY):
        raise RelposError(f"--metric {metric!r}; choose one of: {', '.join((*METRICS, ACCURACY))}")
    if Path(out_dir).exists() and not Path(out_dir).is_dir():
        raise RelposError(f"--out {out_dir} is a file; give a directory (compare.csv, .md, .json and .png go into it)")
    runs = [load_run(p) for path in paths for p in find_runs(path)]
    if not runs:
        raise RelposError(f"no runs under {', '.join(str(p) for p in paths)}")
    if metric == ACCURACY:
        from relpos_cli.compare_accuracy import run_accuracy_compare

        return run_accuracy_compare(runs, overrides, out_dir, evaluate, console)
    skip_task_only_runs(runs)
    usable = [r for r in runs if not r.failure]
    fmt = "png"
    if usable:  # a bad override is the user's one error, not every run's
        fmt = plot_format(load_eval_config(usable[0].path, overrides, "compare"))
    ensure_evaluated(runs, overrides, (lambda run, ov: evaluate_and_report(run, ov, console)) if evaluate else None)
    skip_runs_without(runs, metric)
    failed = [r for r in runs if r.failure]
    groups = group_runs(runs, metric)
    if not groups:
        raise RelposError("no evaluated runs to compare: " + "; ".join(f"{r.path}: {r.failure}" for r in failed))
    title = f"relpos compare: {metric} vs eval length, {len(runs) - len(failed)} runs"
    console.print(compare_table(groups, metric, title, console.width))
    for r in failed:
        console.print(Text.assemble(("skipped", "yellow"), f" {r.path}: {r.failure}"), soft_wrap=True)
    written = write_compare(out_dir, groups, metric, title, failed, fmt)
    first = next(r for r in runs if not r.failure)
    publish(out_dir, log_compare, {"wandb": first.config.get("wandb", {"mode": "disabled"}),
                                   "compared_runs": [str(r.path) for r in runs]})
    console.print("wrote " + ", ".join(str(p) for p in written))
    return written


def compare_sweep(sweep_dir: Path, console) -> list[Path]:
    """What `relpos sweep` compares: perplexity over its language-model runs (no task, or a task
    mixed in), accuracy over its task runs; every job evaluated its own run."""
    ok = [r for r in (load_run(p) for p in find_runs(sweep_dir)) if not r.failure]
    tasks = [r.config["task"] for r in ok]
    written = []
    if not ok or any(map(models_language, tasks)):
        written += run_compare([sweep_dir], [], sweep_dir, False, "ppl", console)
    if any(map(trains_on_task, tasks)):
        written += run_compare([sweep_dir], [], sweep_dir, False, ACCURACY, console)
    return written
