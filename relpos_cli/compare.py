"""`relpos compare`: one table over many runs, rows = configurations, columns = eval lengths.

A configuration is (what differs between the runs' resolved configs apart from the seed, eval
variant); cells are mean ± std over its runs (seeds). Folder names play no part in the grouping.
With --paired-with ROW every other row is also given as its difference from ROW, run by run of one
seed: runs of one seed share their initialisation and data order, so the spread of the differences
is what tells two rows apart, not the spread of each row across seeds.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any, Callable

from rich.text import Text

from relpos_cli.compare_accuracy import run_accuracy_compare
from relpos_cli.console import print_note
from relpos_cli.errors import RelposError
from relpos_cli.config import override_keys
from relpos_cli.evaluate import eval_lengths, load_eval_config, variant_settings
from relpos_cli.intervals import mean_interval, separated
from relpos_cli.plots import plot_format
from relpos_cli.report import evaluate_and_report
from relpos_cli.results import COMPARED_METRICS, compare_stem, protocol_label, rows_to_csv, variant_tag
from relpos_cli.runs import (
    ACCURACY, Run, check_groups, comparison_title, distinct_runs, failure_recorded, find_runs, labelled_runs, read_run,
    name_variants, report_comparison, shared_caption, summarize, write_comparison,
)
from relpos_cli.tables import decimals, length_tables
from relpos_cli.tasks import models_language, trains_on_task
from relpos_cli.tracking import log_compare


def shortfall(rows: list[dict[str, Any]], lengths: list[int] | None, tokens: int) -> list[str]:
    """What a stored result (its length rows) lacks of what was asked: each requested length (None:
    those it has) missing or scored over fewer than `tokens` tokens (1: any). A length scored over
    more is used as it is (it is more thorough), not evaluated again."""
    stored = {int(r["length"]): int(r["tokens"]) for r in rows}
    return [f"length {l} missing" if l not in stored else f"length {l} over {stored[l]:,} of {tokens:,} tokens"
            for l in (stored if lengths is None else lengths) if stored.get(l, 0) < tokens]


def ensure_evaluated(runs: list[Run], overrides: list[str], evaluate: Callable[[Path, list[str]], None] | None) -> set[int] | None:
    """Evaluate runs that lack the variant named by `overrides`, or whose stored one lacks a length or
    the tokens that the overrides ask for (eval.lengths, eval.tokens; defaults ask for nothing: a run
    evaluated on other lengths on purpose is not evaluated again); a failure marks that run failed.
    Returns the requested lengths (with each run's train length), None when eval.lengths is not given."""
    given = override_keys(overrides)
    requested: set[int] | None = set() if "eval.lengths" in given else None
    for run in runs:
        if run.failure:
            continue
        with failure_recorded(run):
            cfg = load_eval_config(run.path, overrides, "compare")
            lengths = eval_lengths(cfg) if requested is not None else None
            wanted = variant_tag(variant_settings(cfg.eval))
            short = shortfall(run.results.get(wanted, []), lengths, int(cfg.eval.tokens) if "eval.tokens" in given else 1)
            if requested is not None:
                requested.update(lengths)
            if wanted in run.results and not short:
                continue
            if evaluate is None:
                why = f" as asked ({wanted}: {', '.join(short)})" if wanted in run.results else f" ({wanted})"
                run.failure = f"not evaluated{why}; run `relpos eval-length {shlex.join([str(run.path), *overrides])}`"
                continue
            evaluate(run.path, overrides)
            run.results = read_run(run.path).results
    return requested


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


def group_runs(runs: list[Run], metric: str = "ppl", lengths: set[int] | None = None) -> list[dict[str, Any]]:
    """One group per (differing config values, eval variant): mean, sample std and n per length (of
    `lengths` alone when given: those asked for), and each run's [seed, value] (`per_seed`). Each group
    is labelled by the keys that differ (tables.configuration_labels): `rope`, `alibi, seq_len=256`;
    `label_keys` names those keys."""
    shown, labelled = labelled_runs(runs)
    groups: dict[tuple, dict[str, Any]] = {}
    for run, flat, label, values in labelled:
        for variant, stored in run.results.items():
            rows = [r for r in stored if lengths is None or int(r["length"]) in lengths]
            if not rows:
                continue
            g = groups.setdefault(
                (json.dumps(values, default=str), variant),  # values may hold lists (task.depths, pos.boundaries)
                {"label": label, "label_keys": shown, "config": dict(values), "variant": variant,
                 "protocol": protocol_label(rows[0]),
                 "train_len": flat.get("train.seq_len"), "tokens": set(), "runs": [], "values": {}, "per_seed": {}},
            )
            g["runs"].append(str(run.path.resolve()))  # compare.json may lie anywhere (--out): not relative to the cwd
            for r in rows:
                g["values"].setdefault(int(r["length"]), []).append(float(r[metric]))
                g["per_seed"].setdefault(int(r["length"]), []).append([flat.get("seed"), float(r[metric])])
                g["tokens"].add(int(r["tokens"]))
    out = []
    for g in groups.values():
        g["cells"] = cells_with_intervals(g.pop("values"))
        g["tokens"] = sorted(g["tokens"])
        out.append(g)
    name_variants(out, labelled)
    return sorted(out, key=lambda g: (g["label"], g["variant"]))


def cells_with_intervals(values: dict[int, list[float]]) -> dict[int, dict[str, Any]]:
    """length -> mean, sample std, n (runs.summarize) and the 95% interval of the mean, [low, high]
    (None for one value), as bold reads it: a row's cells, or its paired differences."""
    return {l: {**c, "mean_interval": mean_interval(c["mean"], c["std"], c["n"])} for l, c in summarize(values).items()}


def all_lengths(groups: list[dict[str, Any]]) -> list[int]:
    return sorted({l for g in groups for l in g["cells"]})


def bold_cells(groups: list[dict[str, Any]]) -> set[tuple[int, int]]:
    """(id(group), length) of the cells shown bold: per length and protocol (a sliding window's
    perplexity, or bf16's, is no rival of a non-overlapping fp32 one), the lowest mean (lower is
    better for every metric in COMPARED_METRICS), when its 95% interval over seeds (Student's t,
    intervals.mean_interval) lies below every other row's. One seed gives no interval, so a length
    where any row has one run, or only one row, has no bold: a single run ranks nothing."""
    rows: dict[tuple[int, str], list[tuple[dict[str, Any], dict[str, Any]]]] = {}
    for g in groups:
        for l, c in g["cells"].items():
            rows.setdefault((l, g["protocol"]), []).append((g, c))
    bold = set()
    for (l, _), cells in rows.items():
        intervals = [mean_interval(c["mean"], c["std"], c["n"]) for _, c in cells]
        if len(cells) < 2 or None in intervals:
            continue
        best = min(range(len(cells)), key=lambda i: cells[i][1]["mean"])
        low, high = intervals[best]
        # separated() reads higher as better: negated, the best's upper bound under every other lower bound
        if all(separated((-high, -low), (-other[1], -other[0])) for i, other in enumerate(intervals) if i != best):
            bold.add((id(cells[best][0]), l))
    return bold


def baseline_group(groups: list[dict[str, Any]], row: str) -> dict[str, Any]:
    """The row --paired-with names: by its legend label (`line_label`: the configuration, then its
    eval variant in brackets where rows differ in it), or by its configuration label where one row
    has it."""
    found = [g for g in groups if g["line_label"] == row] or [g for g in groups if g["label"] == row]
    if len(found) != 1:
        why = "names no row" if not found else f"names {len(found)} rows (one per eval variant: add it in brackets)"
        raise RelposError(f"--paired-with {row!r} {why}; the rows: {', '.join(repr(g['line_label']) for g in groups)}")
    return found[0]


def add_paired_differences(groups: list[dict[str, Any]], baseline: dict[str, Any]) -> None:
    """Each row but the baseline gets `paired` = {against, cells: length -> mean, std, n (pairs) and the
    95% interval of the mean difference (row - baseline) over the seeds both rows ran}. A row with two
    runs of one seed at a length cannot be paired there (which run would pair?) and is refused."""
    for g in groups:
        for l, pairs in g["per_seed"].items():
            seeds = [seed for seed, _ in pairs]
            if len(set(seeds)) < len(seeds):
                raise RelposError(f"--paired-with: row {g['line_label']!r} has several runs of one seed at length {l} "
                                  f"(seeds {', '.join(map(str, seeds))}): runs pair by seed")
    base = {l: dict(pairs) for l, pairs in baseline["per_seed"].items()}
    for g in groups:
        if g is baseline:
            continue
        differences = {l: [value - base[l][seed] for seed, value in pairs if seed in base.get(l, {})]
                       for l, pairs in g["per_seed"].items()}
        g["paired"] = {"against": baseline["line_label"],
                       "cells": cells_with_intervals({l: d for l, d in differences.items() if d})}


def paired_text(cell: dict[str, Any] | None) -> str:
    """`+0.440 [0.380, 0.500] (n=3)`; without an interval for one pair."""
    if cell is None:
        return "–"
    interval = cell["mean_interval"]
    return f"{cell['mean']:+.3f}" + (f" [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else "") + f" (n={cell['n']})"


def excludes_zero(cell: dict[str, Any] | None) -> bool:
    return bool(cell and cell["mean_interval"] and (cell["mean_interval"][0] > 0 or cell["mean_interval"][1] < 0))


def cell_text(cell: dict[str, Any] | None) -> str:
    if cell is None:
        return "–"
    if cell["std"] is None:  # one run: no spread to show
        return f"{cell['mean']:.3f} (n=1)"
    return f"{cell['mean']:.3f} ± {cell['std']:.3f} (n={cell['n']})"


def _tokens_text(g: dict[str, Any]) -> str:
    """The tokens a row's runs were scored over: `4,096`, or `4,096; 8,192` where its seeds differ."""
    return "; ".join(f"{t:,}" for t in g["tokens"])


def _varies(groups: list[dict[str, Any]], value_of: Callable[[dict[str, Any]], Any]) -> bool:
    return len({value_of(g) for g in groups}) > 1


def compare_table(groups: list[dict[str, Any]], title: str, width: int = 80):
    """The terminal table, made to read at `width` columns: one line per row, named by what tells it
    apart (its config, then its eval variant in a column of its own), each length's column holding
    the mean over the std, what every row shares (settings, eval variant, protocol, tokens, runs per
    row) in the caption, and, when the lengths still do not fit, the lengths split over several tables."""
    from rich.console import Group

    lengths, best = all_lengths(groups), bold_cells(groups)
    train_lens = {g["train_len"] for g in groups}
    several_variants = _varies(groups, lambda g: g["variant"])  # a protocol that varies is named by the variant
    shared = {"protocol": lambda g: g["protocol"], "tokens": _tokens_text, "n": lambda g: str(len(g["runs"]))}
    varying = {name for name, value_of in shared.items() if _varies(groups, value_of)}
    columns = [name for name in shared if name in varying and not (name == "protocol" and several_variants)]
    keys = ", ".join(groups[0]["label_keys"]) or "pos.name"
    runs = len(groups[0]["runs"])
    said = {"protocol": groups[0]["protocol"], "tokens": f"{_tokens_text(groups[0])} tokens",
            "n": f"{runs} run{'s' if runs > 1 else ''} per row"}
    common = [said[name] for name in shared if name not in varying]
    marked = len(train_lens) == 1 and next(iter(train_lens)) in lengths
    caption = "; ".join([f"rows: {keys}" + (", then the eval variant" if several_variants else ""),
                         *shared_caption(groups), "n: runs (seeds)", "cells: mean ± sample std",
                         "bold: best per length and protocol, its 95% interval over seeds (t) below every other row's",
                         *(["*: train length"] if marked else []), *common])

    def cell(g: dict[str, Any], l: int) -> Text:
        c = g["cells"].get(l)
        if c is None:
            return Text("–")
        places = decimals(c["mean"])
        text = f"{c['mean']:.{places}f}" + (f"\n±{c['std']:.{places}f}" if c["std"] is not None else "")
        if c["n"] != len(g["runs"]):
            text += f"\nn={c['n']}"
        return Text(text, style="bold green") if (id(g), l) in best else Text(text)

    cells = [[cell(g, l) for l in lengths] for g in groups]
    headers = [f"{l}" + ("*" if marked and l in train_lens else "") for l in lengths]
    before = [("eval", {"overflow": "fold"}, [Text(g["eval_label"]) for g in groups])] if several_variants else []
    before += [(name, {"overflow": "fold", **({"justify": "right"} if name == "n" else {})},
                [Text(str(shared[name](g))) for g in groups]) for name in columns]
    tables = length_tables([g["label"] for g in groups], before, headers, cells, [], width)
    paired = [g for g in groups if "paired" in g]
    if paired:
        differences = [[Text(paired_text(c).replace(" [", "\n[").replace(" (n", "\n(n"),
                             style="bold green" if excludes_zero(c) else "")
                        for c in (g["paired"]["cells"].get(l) for l in lengths)] for g in paired]
        before = [("eval", {"overflow": "fold"}, [Text(g["eval_label"]) for g in paired])] if several_variants else []
        tables += [Text(f"paired differences against {paired[0]['paired']['against']!r}: row minus it, run by run "
                        f"of one seed; mean, [95% interval], (n seeds); bold: the interval excludes 0", style="italic"),
                   *length_tables([g["label"] for g in paired], before, headers, differences, [], width)]
    # title and caption at the console's width, not the (narrower) table's
    return Group(Text(title, style="italic"), *tables, Text(caption, style="dim"))


def compare_markdown(groups: list[dict[str, Any]], metric: str, title: str, failed: list[Run]) -> str:
    lengths, best = all_lengths(groups), bold_cells(groups)
    head = ["configuration", "eval variant", "protocol", "tokens", *(f"{metric}@{l}" for l in lengths)]
    lines = [f"{title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g in groups:
        cells = []
        for l in lengths:
            c = g["cells"].get(l)
            cells.append(f"**{cell_text(c)}**" if (id(g), l) in best else cell_text(c))
        lines.append("| " + " | ".join([g["label"], g["eval_label"] or "–", g["protocol"], _tokens_text(g), *cells]) + " |")
    lines += ["", f"Rows: configurations named by the keys that tell them apart ({', '.join(groups[0]['label_keys'])}), "
              f"then by what tells their eval variant apart ({compare_stem(metric)}.json has the value of every key that differs, {compare_stem(metric)}.csv the whole variant). "
              + "".join(f"{part[0].upper()}{part[1:]}. " for part in shared_caption(groups))
              + f"Cells: mean ± sample std of {metric} over runs (n = runs, one per seed); bold = best per length "
              f"among the rows of one protocol, where its 95% interval of the mean over seeds (Student's t) lies below "
              f"every other row's (none where a row has one run)."]
    paired = [g for g in groups if "paired" in g]
    if paired:
        head = ["configuration", "eval variant", *(f"{metric}@{l}" for l in lengths)]
        lines += ["", f"Paired differences against {paired[0]['paired']['against']!r}: each row's {metric} minus the "
                      f"baseline's, run by run of one seed; mean [95% interval of the mean difference (Student's t)] "
                      f"(n = seeds both rows ran); bold where the interval excludes 0.", "",
                  "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for g in paired:
            cells = [g["paired"]["cells"].get(l) for l in lengths]
            texts = [f"**{paired_text(c)}**" if excludes_zero(c) else paired_text(c) for c in cells]
            lines.append("| " + " | ".join([g["label"], g["eval_label"] or "–", *texts]) + " |")
    if failed:
        lines += ["", "Failed or unevaluated runs:", *(f"- {r.path}: {r.failure}" for r in failed)]
    return "\n".join(lines) + "\n"


def compare_csv(groups: list[dict[str, Any]]) -> str:
    lengths = all_lengths(groups)
    columns = ["configuration", "variant", "protocol", "tokens", "train_len"]
    columns += [f"{l}_{s}" for l in lengths for s in ("mean", "std", "n")]
    if any("paired" in g for g in groups):
        columns += [f"{l}_paired_{s}" for l in lengths for s in ("mean", "low", "high", "n")]
    rows = []
    for g in groups:
        row = {"configuration": g["label"], "variant": g["variant"], "protocol": g["protocol"],
               # a number a spreadsheet reads as one ("4,096" is text there); seeds over other counts: "4096; 8192"
               "tokens": "; ".join(map(str, g["tokens"])), "train_len": g["train_len"]}
        for l, c in g["cells"].items():
            row.update({f"{l}_mean": c["mean"], f"{l}_std": c["std"], f"{l}_n": c["n"]})
        for l, c in g.get("paired", {}).get("cells", {}).items():
            low, high = c["mean_interval"] or (None, None)
            row.update({f"{l}_paired_mean": c["mean"], f"{l}_paired_low": low, f"{l}_paired_high": high, f"{l}_paired_n": c["n"]})
        rows.append(row)
    return rows_to_csv(rows, columns)


def write_compare(out_dir: Path, groups: list[dict[str, Any]], metric: str, title: str, failed: list[Run],
                  fmt: str = "png") -> list[Path]:
    protocols = "; ".join(sorted({f"{g['protocol']}, {_tokens_text(g)} tokens" for g in groups}))
    plot = {"metric": metric, "title": f"{title}\n{protocols}", "train_lengths": {g["train_len"] for g in groups if g["train_len"]},
            "legend_title": ", ".join(groups[0]["label_keys"])}
    return write_comparison(out_dir, compare_stem(metric), fmt, compare_csv(groups), compare_markdown(groups, metric, title, failed),
                            metric, groups, failed, plot)


def run_compare(paths: list[Path], overrides: list[str], out_dir: Path, evaluate: bool, metric: str, console,
                paired_with: str | None = None) -> list[Path]:
    """The `relpos compare` command: find, evaluate (if asked), group, pair (--paired-with), print,
    write, log."""
    if metric not in (*COMPARED_METRICS, ACCURACY):
        raise RelposError(f"--metric {metric!r}; choose one of: {', '.join((*COMPARED_METRICS, ACCURACY))}")
    if paired_with is not None and metric == ACCURACY:
        raise RelposError("--paired-with pairs perplexity-like metrics (ppl, loss, ppl_ratio, bpb); accuracy cells "
                          "carry each run's Wilson interval instead")
    if Path(out_dir).exists() and not Path(out_dir).is_dir():
        raise RelposError(f"--out {out_dir} is a file; give a directory (compare.csv, .md, .json and .png go into it)")
    found, again = distinct_runs(paths)
    if again:
        print_note(f"counted once: {len(again)} run dir(s) named again by the paths given ({', '.join(map(str, again))})")
    runs = [read_run(p) for p in found]
    if not runs:
        raise RelposError(f"no runs under {', '.join(str(p) for p in paths)}")
    if metric == ACCURACY:
        return run_accuracy_compare(runs, overrides, out_dir, evaluate, console)
    skip_task_only_runs(runs)
    usable = [r for r in runs if not r.failure]
    fmt = "png"
    if usable:  # a bad override is the user's one error, not every run's
        fmt = plot_format(load_eval_config(usable[0].path, overrides, "compare"))
    lengths = ensure_evaluated(runs, overrides, (lambda run, ov: evaluate_and_report(run, ov, console)) if evaluate else None)
    skip_runs_without(runs, metric)
    failed = [r for r in runs if r.failure]
    groups = group_runs(runs, metric, lengths)
    check_groups(groups, failed)
    if paired_with is not None:
        add_paired_differences(groups, baseline_group(groups, paired_with))
    title = comparison_title(metric, runs, failed)
    return report_comparison(console, compare_table(groups, title, console.width), runs, out_dir,
                             lambda: write_compare(out_dir, groups, metric, title, failed, fmt), log_compare)


def compare_sweep(sweep_dir: Path, console) -> list[Path]:
    """What `relpos sweep` compares: perplexity over its language-model runs (no task, or a task
    mixed in), accuracy over its task runs; every job evaluated its own run."""
    ok = [r for r in (read_run(p) for p in find_runs(sweep_dir)) if not r.failure]
    tasks = [r.config["task"] for r in ok]
    written = []
    if not ok or any(map(models_language, tasks)):
        written += run_compare([sweep_dir], [], sweep_dir, False, "ppl", console)
    if any(map(trains_on_task, tasks)):
        written += run_compare([sweep_dir], [], sweep_dir, False, ACCURACY, console)
    return written
