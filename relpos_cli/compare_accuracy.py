"""`relpos compare --metric accuracy`: task accuracy over runs, rows = configurations, columns =
eval lengths, cells = mean ± std over seeds and how many seeds reach the threshold.

Runs are grouped as for perplexity (the config keys that differ between them, seed left out) and
by task variant. Each run contributes its eval_task result for the task setting the overrides
name (the run's own task by default; ``task=<name>`` and ``task.*`` as for eval-task); a run
lacking it, or evaluated on fewer lengths, depths or samples than asked, is evaluated first. The
threshold (``task.threshold``) is applied here, to the stored accuracies, so changing it needs no
new evaluation. Per configuration: the effective length of the mean accuracy curve, and each
seed's own. Runs that also have perplexities (eval_length.json, default variant) show them in the
same table.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from rich.text import Text

from relpos_cli.errors import RelposError
from relpos_cli.evaluate import AUTO_FACTOR_TAG
from relpos_cli.intervals import separated, wilson
from relpos_cli.eval_task import TaskEval, effective_length, evaluate_task_and_report, learned, load_task_eval_config
from relpos_cli.plots import plot_format
from relpos_cli.results import COMPARE_ACCURACY_STEM, DEFAULT_VARIANT, rows_to_csv
from relpos_cli.rope_options import AUTO_FACTOR
from relpos_cli.runs import (
    ACCURACY, Run, check_groups, comparison_title, failure_recorded, labelled_runs, read_run, name_variants,
    report_comparison, shared_caption, summarize, write_comparison,
)
from relpos_cli.tables import length_tables
from relpos_cli.tasks import trains_on_task
from relpos_cli.tracking import log_compare_accuracy


def stored_samples(payload: dict[str, Any] | None, ev: TaskEval) -> int:
    """The fewest examples a stored result has in a requested unit (length, or passkey's (length,
    depth) cell), 0 if one is missing: a result with at least the requested samples everywhere is
    used as it is (it is more thorough), not evaluated again."""
    if payload is None:
        return 0
    depths = [d for d in ev.settings.eval_depths() if d is not None]
    units = payload["cells"] if depths else payload["lengths"]
    stored = {(u["length"], u["depth"] if depths else None): u.get("samples", 0) for u in units}
    wanted = set(ev.settings.lengths(ev.train_len)) - set(payload.get("left_out", []))  # too short for the task
    return min((stored.get((l, d), 0) for l in wanted for d in depths or [None]), default=0)


def _has_requested(payload: dict[str, Any] | None, ev: TaskEval) -> bool:
    return stored_samples(payload, ev) >= ev.settings.samples


def stored_method_variants(run: Run, overrides: list[str], ev: TaskEval) -> list[TaskEval]:
    """The run's other stored results of the requested task setting under eval-time position methods
    (eval.rope_scaling, self_extend, rerope, window): shown beside the requested one."""
    found = []
    for variant, payload in run.task_results.items():
        methods = payload.get("eval_methods") or {}
        if variant == ev.variant or not methods or payload.get("task") != ev.settings.name:
            continue
        try:
            # a stored tag names factor=auto as auto_per_length (evaluate.variant_settings): replay it as auto
            replay = {k: AUTO_FACTOR if v == AUTO_FACTOR_TAG else v for k, v in methods.items()}
            other = load_task_eval_config(run.path, [*overrides, *(f"eval.{k}={v}" for k, v in replay.items())])
        except RelposError:  # the requested overrides set another method: not the same setting
            continue
        if other.variant == variant and _has_requested(payload, other):
            found.append(other)
    return found


def ensure_task_evaluated(runs: list[Run], overrides: list[str],
                          evaluate: Callable[[Path, list[str]], None] | None) -> dict[str, list[TaskEval]]:
    """Each usable run's requested task setting (run path -> [TaskEval, then the stored results of
    that setting under eval-time position methods]); runs lacking the requested result are evaluated
    (or, without `evaluate`, listed); a failure marks that run failed."""
    settings: dict[str, list[TaskEval]] = {}
    for run in runs:
        if run.failure:
            continue
        with failure_recorded(run):
            try:
                ev = load_task_eval_config(run.path, overrides)
            except RelposError as e:
                if "trained without a task" not in str(e):
                    raise
                run.failure = str(e)
                continue
            if not _has_requested(run.task_results.get(ev.variant), ev):
                if evaluate is None:
                    stored = run.task_results.get(ev.variant)
                    what = (f"not evaluated on {ev.settings.name} ({ev.variant})" if stored is None else
                            f"evaluated on {ev.settings.name} ({ev.variant}) at fewer lengths, depths or samples than asked")
                    run.failure = f"{what}; run `{' '.join(['relpos eval-task', str(run.path), *overrides])}`"
                    continue
                evaluate(run.path, overrides)
                run.task_results = read_run(run.path).task_results
            settings[str(run.path)] = [ev, *stored_method_variants(run, overrides, ev)]
    return settings


def group_accuracy(runs: list[Run], settings: dict[str, list[TaskEval]]) -> list[dict[str, Any]]:
    """One group per (differing config values, task variant): accuracy mean/std/n per requested
    length, seeds at or above the threshold, effective lengths; perplexity cells where runs have them."""
    shown, labelled = labelled_runs(runs)
    groups: dict[tuple, dict[str, Any]] = {}
    for run, flat, label, values, ev in ((*entry, ev) for entry in labelled for ev in settings[str(entry[0].path)]):
        g = groups.setdefault((json.dumps(values, default=str), ev.variant, ev.settings.name), {
            "label": label, "label_keys": shown, "config": dict(values), "task": ev.settings.name,
            "variant": ev.variant, "train_len": ev.train_len, "threshold": ev.settings.threshold,
            "samples": stored_samples(run.task_results[ev.variant], ev), "runs": [], "accuracy": {}, "answers": {},
            "ppl": {}, "seed_effective": [], "seed_learned": []})
        wanted = set(ev.settings.lengths(ev.train_len))
        rows = [r for r in run.task_results[ev.variant]["lengths"] if r["length"] in wanted]
        g["runs"].append(str(run.path.resolve()))
        g["samples"] = min(g["samples"], stored_samples(run.task_results[ev.variant], ev))
        g["seed_effective"].append(effective_length(rows, ev.settings.threshold))
        g["seed_learned"].append(learned(rows, ev.settings.threshold, ev.train_len, ev.own_task))
        for r in rows:
            g["accuracy"].setdefault(r["length"], []).append(r["accuracy"])
            pooled = g["answers"].setdefault(r["length"], [0, 0])  # correct, answers over the seeds
            pooled[0], pooled[1] = pooled[0] + r["correct"], pooled[1] + r["answers"]
        for r in run.results.get(DEFAULT_VARIANT, []):
            g["ppl"].setdefault(int(r["length"]), []).append(float(r["ppl"]))
    out = []
    for g in groups.values():
        accuracies, pooled = g.pop("accuracy"), g.pop("answers")
        g["cells"] = summarize(accuracies)
        for length, cell in g["cells"].items():
            cell["reached"] = sum(a >= g["threshold"] for a in accuracies[length])
            cell["correct"], cell["answers"] = pooled[length]
            cell["ci_low"], cell["ci_high"] = wilson(*pooled[length])
        g["ppl_cells"] = summarize(g.pop("ppl"))
        curve = [{"length": l, "accuracy": c["mean"], "ci_low": c["ci_low"]} for l, c in g["cells"].items()]
        g["effective_length"] = effective_length(curve, g["threshold"])
        g["effective_length_lower"] = effective_length(curve, g["threshold"], key="ci_low")
        g["not_learned"] = sum(flag is False for flag in g["seed_learned"])
        if g["not_learned"]:  # its long-length cells are no length generalization: say so wherever it is shown
            seeds = len(g["seed_learned"])
            g["label"] += " (not learned)" if g["not_learned"] == seeds else f" (not learned: {g['not_learned']}/{seeds} seeds)"
        out.append(g)
    name_variants(out, labelled)
    return sorted(out, key=lambda g: (g["task"], g["label"], g["variant"]))


def _lengths(groups: list[dict[str, Any]], key: str) -> list[int]:
    return sorted({l for g in groups for l in g[key]})


def accuracy_cell_text(cell: dict[str, Any] | None) -> str:
    if cell is None:
        return "–"
    spread = "" if cell["std"] is None else f" ± {cell['std']:.3f}"
    return (f"{cell['mean']:.3f}{spread} ({cell['reached']}/{cell['n']}) "
            f"[{cell['ci_low']:.2f}, {cell['ci_high']:.2f}] n={cell['answers']}")


def bold_lengths(groups: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """length -> the one cell shown bold: the best mean accuracy, when its 95% interval (over the
    answers pooled across seeds) lies above every other row's; a best its interval cannot tell apart
    from any other, or a length only one row has, is not bold. Every row, not just the runner-up by
    mean: a lower mean over fewer answers has a wider interval that can reach higher."""
    bold = {}
    for length in _lengths(groups, "cells"):
        ranked = sorted((g["cells"][length] for g in groups if length in g["cells"]), key=lambda c: c["mean"], reverse=True)
        best, others = ranked[0], ranked[1:]
        if others and all(separated((best["ci_low"], best["ci_high"]), (c["ci_low"], c["ci_high"])) for c in others):
            bold[length] = best
    return bold


def bold_cells(groups: list[dict[str, Any]]) -> set[int]:
    """The ids of the cells shown bold: bold_lengths over the rows of each task on its own. Accuracies
    of different tasks (copy and flip_flop runs in one sweep) say nothing about which row is better:
    a flip_flop row at 0.95 was bold over a copy row at 0.10."""
    tasks: dict[Any, list[dict[str, Any]]] = {}
    for g in groups:
        tasks.setdefault(g.get("task"), []).append(g)
    return {id(c) for same in tasks.values() for c in bold_lengths(same).values()}


def ppl_cell_text(cell: dict[str, Any] | None) -> str:
    if cell is None:
        return "–"
    return f"{cell['mean']:.3f}" + ("" if cell["std"] is None else f" ± {cell['std']:.3f}")


def _effective_text(g: dict[str, Any]) -> str:
    return (f"{g['effective_length']} (lower bound: {g['effective_length_lower']}; seeds: "
            f"{', '.join(str(e) for e in g['seed_effective'])})")


def _table_rows(groups: list[dict[str, Any]], bold: Callable[[str], str]) -> tuple[list[str], list[list[str]]]:
    """Header and cells shared by the terminal table and the markdown."""
    lengths, ppl_lengths = _lengths(groups, "cells"), _lengths(groups, "ppl_cells")
    best = bold_cells(groups)
    head = ["configuration", "task", "variant", *(f"acc@{l}" for l in lengths), "effective length",
            *(f"ppl@{l}" for l in ppl_lengths)]
    body = []
    for g in groups:
        cells = []
        for l in lengths:
            c = g["cells"].get(l)
            text = accuracy_cell_text(c)
            cells.append(bold(text) if c is not None and id(c) in best else text)
        body.append([g["label"], g["task"], g["eval_label"] or "–", *cells, _effective_text(g),
                     *(ppl_cell_text(g["ppl_cells"].get(l)) for l in ppl_lengths)])
    return head, body


def _legend(groups: list[dict[str, Any]]) -> str:
    thresholds = ", ".join(f"{t:g}" for t in sorted({g["threshold"] for g in groups}))
    samples = ", ".join(str(s) for s in sorted({g["samples"] for g in groups}))
    return (f"Cells: exact-match accuracy, mean ± sample std over runs (one per seed), (k/n) = seeds with "
            f"accuracy >= {thresholds} of n, [low, high] = 95% Wilson interval over the n answers pooled across seeds; "
            f"at least {samples} examples per cell (length, depth). Effective length = the longest length up to which "
            f"accuracy stays >= {thresholds}: of the mean curve, of its interval's lower bound, then per seed. "
            f"Bold = best accuracy per length among the rows of one task, only where its interval lies above every other such row's. (not learned): seeds whose accuracy at the training length is below the "
            f"threshold, so their longer lengths do not measure length generalization. ppl: the runs' eval_length results (default variant), where they exist.")


def accuracy_table(groups: list[dict[str, Any]], title: str, width: int = 80):
    """The terminal table, made to read at `width` columns: short labels, each length's cell holding
    the mean, the std and the seeds reaching the threshold on lines of their own, what every row
    shares (task, variant) in the caption, and the lengths split over several tables when they do
    not fit. The markdown file has the wide version."""
    from rich.console import Group

    lengths = _lengths(groups, "cells")
    best = bold_cells(groups)
    shared = [f"task {next(iter(tasks))}" for tasks in [{g["task"] for g in groups}] if len(tasks) == 1]
    # the task once: a label whose keys hold task.name (runs trained on several tasks) already says it
    several = [name for name in ("task", "variant") if len({g[name] for g in groups}) > 1
               and not (name == "task" and "task.name" in groups[0]["label_keys"])]
    labels = [", ".join([g["label"], *(g["task"] if name == "task" else g["eval_label"] for name in several
                                       if name == "task" or g["eval_label"] != "–")]) for g in groups]

    def cell(g: dict[str, Any], l: int) -> Text:
        c = g["cells"].get(l)
        if c is None:
            return Text("–")
        text = (f"{c['mean']:.3f}" + ("" if c["std"] is None else f"\n±{c['std']:.3f}") + f"\n{c['reached']}/{c['n']}"
                + f"\n{c['ci_low']:.2f}–{c['ci_high']:.2f}")
        return Text(text, style="bold green") if id(c) in best else Text(text)

    cells = [[cell(g, l) for l in lengths] for g in groups]
    headers = [f"{l}" + ("*" if l in {g["train_len"] for g in groups} else "") for l in lengths]
    effective = [f"{g['effective_length']}\n{g['effective_length_lower']}" for g in groups]
    thresholds = ", ".join(f"{t:g}" for t in sorted({g["threshold"] for g in groups}))
    samples = ", ".join(str(s) for s in sorted({g["samples"] for g in groups}))
    keys = ", ".join(groups[0]["label_keys"]) or "pos.name"
    shared += shared_caption(groups)
    caption = (f"rows: {keys}{''.join(f', {n}' for n in several)}; cells: exact-match "
               f"accuracy, mean ± sample std over seeds, then seeds >= {thresholds} / seeds, then the 95% Wilson "
               f"interval over the answers pooled across seeds; bold: best per length among a task's rows, where its "
               f"interval lies above every other one's; "
               f"*: train length; eff. L: effective length of the mean curve (accuracy >= {thresholds} up to it), under it "
               f"that of the interval's lower bound; "
               f"at least {samples} examples per cell" + (f"; {', '.join(shared)}" if shared else "")
               + ("; (not learned): accuracy at the training length below the threshold, so longer lengths do not "
                  "measure length generalization" if any(g["not_learned"] for g in groups) else ""))
    tables = length_tables(labels, [], headers, cells, [("eff. L", {"justify": "right"}, effective)], width)
    return Group(Text(title), *tables, Text(caption))


def accuracy_markdown(groups: list[dict[str, Any]], title: str, failed: list[Run]) -> str:
    head, body = _table_rows(groups, lambda t: f"**{t}**")
    lines = [title, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    lines += ["", "".join(f"{part[0].upper()}{part[1:]}. " for part in shared_caption(groups)) + _legend(groups)]
    if failed:
        lines += ["", "Failed, unevaluated or skipped runs:", *(f"- {r.path}: {r.failure}" for r in failed)]
    return "\n".join(lines) + "\n"


def accuracy_csv(groups: list[dict[str, Any]]) -> str:
    lengths, ppl_lengths = _lengths(groups, "cells"), _lengths(groups, "ppl_cells")
    cell_keys = ("mean", "std", "n", "reached", "answers", "ci_low", "ci_high")
    columns = ["configuration", "task", "variant", "train_len", "threshold", "samples", "effective_length",
               "effective_length_lower", "seed_effective_lengths", "not_learned"]
    columns += [f"{l}_{s}" for l in lengths for s in cell_keys]
    columns += [f"ppl{l}_{s}" for l in ppl_lengths for s in ("mean", "std", "n")]
    rows = []
    for g in groups:
        row = {"configuration": g["label"], "task": g["task"], "variant": g["variant"], "train_len": g["train_len"],
               "threshold": g["threshold"], "samples": g["samples"], "effective_length": g["effective_length"],
               "effective_length_lower": g["effective_length_lower"], "seed_effective_lengths": " ".join(str(e) for e in g["seed_effective"]), "not_learned": g["not_learned"]}
        for l, c in g["cells"].items():
            row.update({f"{l}_{k}": c[k] for k in cell_keys})
        for l, c in g["ppl_cells"].items():
            row.update({f"ppl{l}_{k}": c[k] for k in ("mean", "std", "n")})
        rows.append(row)
    return rows_to_csv(rows, columns)


def write_accuracy_compare(out_dir: Path, groups: list[dict[str, Any]], title: str, failed: list[Run],
                           fmt: str = "png") -> list[Path]:
    thresholds = sorted({g["threshold"] for g in groups})
    plot = {"metric": "exact-match accuracy", "title": f"{title}\nthreshold {', '.join(f'{t:g}' for t in thresholds)} (dashed)",
            "train_lengths": {g["train_len"] for g in groups}, "hlines": thresholds}
    return write_comparison(out_dir, COMPARE_ACCURACY_STEM, fmt, accuracy_csv(groups), accuracy_markdown(groups, title, failed),
                            ACCURACY, groups, failed, plot)


def run_accuracy_compare(runs: list[Run], overrides: list[str], out_dir: Path, evaluate: bool, console) -> list[Path]:
    """`relpos compare --metric accuracy` on loaded runs: evaluate (if asked), group, print, write, log."""
    usable = [r for r in runs if not r.failure]
    with_task = [r for r in usable if trains_on_task(r.config["task"])]
    names_task = any(o.split("=", 1)[0] == "task" for o in overrides)
    if usable and not with_task and not names_task:
        raise RelposError("no run here trained on a task: name the task to score them on, e.g. task=passkey")
    fmt = "png"
    if usable:  # a bad override is the user's one error, not every run's
        fmt = plot_format(load_task_eval_config((with_task or usable)[0].path, overrides).cfg)
    settings = ensure_task_evaluated(
        runs, overrides, (lambda run, ov: evaluate_task_and_report(run, ov, console)) if evaluate else None)
    failed = [r for r in runs if r.failure]
    groups = group_accuracy(runs, settings)
    check_groups(groups, failed)
    title = comparison_title("task accuracy", runs, failed)
    return report_comparison(console, accuracy_table(groups, title, console.width), runs, out_dir,
                             lambda: write_accuracy_compare(out_dir, groups, title, failed, fmt), log_compare_accuracy)
