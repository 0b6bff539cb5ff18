"""Perplexity-versus-length results: rich table in the terminal; CSV, JSON and figures in the run dir.

The default eval variant writes eval_length.{csv,json,png} and eval_positions.{csv,png} (figures in
plots.format); any other variant (see evaluate.variant_settings) writes the same names with
`.<variant tag>` before the suffix.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any, Callable

from rich.table import Table

from relpos_cli.atomic import atomic_write_text
from relpos_cli.console import print_note
from relpos_cli.errors import RelposError
from relpos_cli.evaluate import AUTO_FACTOR_TAG, evaluate_run, load_eval_config, variant_settings
from relpos_cli.interrupt import in_worker
from relpos_cli.logs import recorded_writer
from relpos_cli.plots import plot_format, plot_length, plot_positions, run_title
from relpos_cli.results import (
    DEFAULT_VARIANT, EVAL_LENGTH_STEM, EVAL_POSITIONS_STEM, protocol_label, report_path, rows_to_csv, stored_eval_length,
    variant_tag,
)
from relpos_cli.terminal import progress_bar
from relpos_cli.tracking import log_eval_length, publish

LENGTH_COLUMNS = ["length", "tokens", "loss", "ppl", "bpb", "ppl_ratio", "protocol", "stride", "precision", "variant"]
# eval.context_use=true (evaluate.context_use): the same later targets under windows of L and of L_train
CONTEXT_COLUMNS = ["context_tokens", "context_loss", "context_loss_train_window", "context_gain"]
POSITION_COLUMNS = ["length", "position", "loss", "count", "protocol", "stride", "precision", "variant"]


def length_table(rows: list[dict[str, Any]], title: str, train_len: int) -> Table:
    """One row per length; the protocol and token count (the same for every row) in the caption."""
    caption = f"{protocol_label(rows[0])}, {rows[0]['tokens']:,} tokens scored at every length"
    context = has_context(rows)
    if context:
        caption += (f"; context gain = loss with windows of {train_len} minus loss with windows of the length,"
                    " in nats, on the tokens shown")
    scaled = "rope_factor" in rows[0]
    if scaled:
        per_length = rows[0].get("eval.rope_scaling.factor") == AUTO_FACTOR_TAG
        caption += ("; RoPE factor: auto, L / L_train per length, so each row is a differently scaled model"
                    if per_length else "; RoPE factor: one fixed factor at every length")
    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
    for name in ("length", "loss (nats)", "ppl", "bpb", f"ppl ÷ ppl@{train_len}", *(["factor"] if scaled else []),
                 *(["context gain"] if context else [])):
        table.add_column(name, justify="right")
    for r in rows:
        marker = " (train)" if r["length"] == train_len else ""
        table.add_row(f"{r['length']}{marker}", f"{r['loss']:.4f}", f"{r['ppl']:.3f}", f"{r['bpb']:.4f}", f"{r['ppl_ratio']:.2f}x",
                      *([f"{r['rope_factor']:g}"] if scaled else []),
                      *([context_text(r)] if context else []))
    return table


def has_context(rows: list[dict[str, Any]]) -> bool:
    """Whether any row has the context-use columns: a stored length kept beside new ones (with_stored_lengths)
    may have them when the others do not, or lack them when the others have them."""
    return any("context_gain" in r for r in rows)


def context_text(row: dict[str, Any]) -> str:
    return f"{row['context_gain']:+.4f} on {row['context_tokens']:,}" if "context_gain" in row else "–"


def variant_columns(rows: list[dict[str, Any]]) -> list[str]:
    return [k for k in rows[0] if k.startswith("eval.")]


def write_length_report(
    run_dir: Path, rows: list[dict[str, Any]], position_rows: list[dict[str, Any]], title: str, train_len: int,
    fmt: str = "png",
) -> list[Path]:
    """CSV + JSON of both tables and their two figures (in fmt); returns the paths written."""
    variant = rows[0]["variant"]
    extra = variant_columns(rows)
    paths = {
        "length_csv": report_path(run_dir, EVAL_LENGTH_STEM, variant, ".csv"),
        "length_json": report_path(run_dir, EVAL_LENGTH_STEM, variant, ".json"),
        "positions_csv": report_path(run_dir, EVAL_POSITIONS_STEM, variant, ".csv"),
        "length_figure": report_path(run_dir, EVAL_LENGTH_STEM, variant, f".{fmt}"),
        "positions_figure": report_path(run_dir, EVAL_POSITIONS_STEM, variant, f".{fmt}"),
    }
    plot_length(paths["length_figure"], rows, title, train_len)
    plot_positions(paths["positions_figure"], position_rows, title, train_len)
    # eval.allow_changed_data: what changed in the data since training, as eval-task's CSV says it too
    changed = ["data_changed"] if any("data_changed" in r for r in rows) else []
    atomic_write_text(paths["positions_csv"], rows_to_csv(position_rows, POSITION_COLUMNS + extra + changed))
    context = CONTEXT_COLUMNS if has_context(rows) else []  # blank in rows without them
    factor = ["rope_factor"] if "rope_factor" in rows[0] else []  # the RoPE scaling factor each length ran with
    atomic_write_text(paths["length_csv"], rows_to_csv(rows, LENGTH_COLUMNS + factor + context + extra + changed))
    atomic_write_text(paths["length_json"], json.dumps(rows, indent=2))  # last: compare reads it
    return list(paths.values())


def check_not_less_thorough(run_dir: Path, variant: str, tokens: int) -> None:
    """An evaluation never replaces a stored result of its variant scored over more tokens."""
    most = max((int(r.get("tokens", 0)) for r in stored_eval_length(run_dir, variant)), default=0)
    if most > tokens:
        name = report_path(run_dir, EVAL_LENGTH_STEM, variant, ".json").name
        raise RelposError(f"{Path(run_dir) / name} holds a result over {most:,} tokens; eval.tokens={tokens} would "
                          f"replace it with a less thorough one: give eval.tokens={most}, or --replace to overwrite it")


def with_stored_lengths(run_dir: Path, stored: list[dict[str, Any]], rows: list[dict[str, Any]],
                        position_rows: list[dict[str, Any]]
                        ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[int], list[int]]:
    """The stored rows of the same variant (`stored`) scored over the same tokens complete this
    evaluation (their numbers are what it would have computed): lengths it did not score are kept, and
    a length it scored without eval.context_use keeps its stored context-use columns. Returns the rows,
    position rows, the lengths kept and the lengths whose context use was kept."""
    tokens = rows[0]["tokens"]
    same = {r["length"]: r for r in stored if r.get("tokens") == tokens}
    # context_use is no variant key (evaluate.EVAL_NOT_VARIANT_KEYS): scored without it, a length's row is the
    # stored one's numbers, which its stored context columns still describe
    context = [r["length"] for r in rows if not has_context([r]) and has_context([same.get(r["length"], {})])]
    rows = [{**r, **{k: v for k, v in same[r["length"]].items() if k in CONTEXT_COLUMNS}} if r["length"] in context else r
            for r in rows]
    scored = {r["length"] for r in rows}
    # rows stored before a column (bpb, precision) are completed as this evaluation writes rows; one that still
    # lacks a column is dropped (note_dropped_lengths names it), never kept to break the table and the files
    kept = [r for r in (completed(same[length], rows) for length in same if length not in scored) if not lacks_columns(r)]
    if not kept:
        return rows, position_rows, [], context
    lengths = {r["length"] for r in kept}
    derived = sorted(r["length"] for r in kept if "bpb" not in same[r["length"]])
    if derived:
        print_note(f"the stored lengths {', '.join(map(str, derived))} predate bpb: theirs is their loss x this "
                   f"evaluation's bpb / loss (the same tokens cover the same bytes)")
    path = report_path(run_dir, EVAL_POSITIONS_STEM, rows[0]["variant"], ".csv")
    try:
        with path.open(newline="") as f:
            old_positions = [{**r, "length": int(r["length"]), "position": int(r["position"]), "loss": float(r["loss"]),
                              "count": int(r["count"]), "stride": int(r["stride"])}
                             for r in csv.DictReader(f) if int(r["length"]) in lengths]
    except (OSError, ValueError, KeyError):  # no per-position rows to keep: the lengths' own rows still are
        old_positions = []
    by_length = sorted([*rows, *kept], key=lambda r: r["length"])
    positions = sorted([*position_rows, *old_positions], key=lambda r: (r["length"], r["position"]))
    return by_length, positions, sorted(lengths), context


def completed(row: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A stored row of the tokens this evaluation scored (`rows`) with the columns rows stored before them
    lack: precision fp32 (every result before eval.precision was), the variant of the file it was read
    from, and bpb = loss x N / (ln 2 x bytes), the same N tokens covering the same bytes: its loss times
    this evaluation's bpb / loss."""
    row = {**row, "precision": row.get("precision") or "fp32", "variant": row.get("variant") or rows[0]["variant"]}
    if "bpb" not in row and isinstance(row.get("loss"), float) and rows[0]["loss"] > 0:
        row["bpb"] = row["loss"] * rows[0]["bpb"] / rows[0]["loss"]
    return row


def lacks_columns(row: dict[str, Any]) -> list[str]:
    """The columns of LENGTH_COLUMNS a row lacks (a stored row that completed() could not complete)."""
    return [c for c in LENGTH_COLUMNS if c not in row]


def note_dropped_lengths(stored: list[dict[str, Any]], rows: list[dict[str, Any]], replace: bool) -> None:
    """Say which stored lengths of the variant (`stored`) this evaluation's result drops: those it does
    not score that were scored over other tokens (a result holds one token count), or lack a column
    completed() cannot fill, or, with --replace, any."""
    tokens, scored = rows[0]["tokens"], {r["length"] for r in rows}
    if not replace:
        dated = [completed(r, rows) for r in stored if r["length"] not in scored and r.get("tokens") == tokens]
        dated = [r for r in dated if lacks_columns(r)]
        if dated:
            missing = ", ".join(sorted({c for r in dated for c in lacks_columns(r)}))
            lengths = ", ".join(str(length) for length in sorted({r["length"] for r in dated}))
            print_note(f"dropped the stored lengths {lengths} of this variant (stored before its {missing} column): "
                       f"score them again with eval.tokens={tokens} to keep them beside these")
    dropped = [r for r in stored if r["length"] not in scored and (replace or r.get("tokens") != tokens)]
    if not dropped:
        return
    counts = ", ".join(f"{int(t):,}" for t in sorted({r.get("tokens", 0) for r in dropped}))
    why = "--replace" if replace else f"scored over {counts} tokens, not this evaluation's {tokens:,}"
    lengths = ", ".join(str(length) for length in sorted({r["length"] for r in dropped}))
    print_note(f"dropped the stored lengths {lengths} of this variant ({why}): a result holds one token count; "
               f"score them again with eval.tokens={tokens} to keep them beside these")


def result_title(run_dir: Path, scheme: str, what: str, train_len: int, variant: str) -> str:
    """The title of an evaluation's table and figures: the run, the scheme, what was scored, the
    training length and the variant (unless default)."""
    return f"{run_title(run_dir, scheme)}  {what}train L={train_len}" + ("" if variant == DEFAULT_VARIANT else f"  [{variant}]")


def report_result(run_dir: Path, console, log, table, line: str, log_results: Callable[..., None], variant: str,
                  write: Callable[[], list[Path]]) -> list[Path]:
    """The end of an evaluation of one run (eval-length, eval-task): print its table, write its
    files, record `line` in relpos.log, add the variant's results to the dir's W&B run and name the
    files written; returns their paths."""
    console.print(table)
    paths = write()
    log.info(line)
    publish(run_dir, lambda run, d: log_results(run, d, [variant]))
    console.print("wrote " + ", ".join(str(p) for p in paths))
    return paths


def evaluate_and_report(run_dir: Path, overrides: list[str], console, replace: bool = False) -> list[Path]:
    """eval-length for one run: score (with a progress bar), print the table, write files, log to
    relpos.log and W&B; returns the paths. A stored result of the variant is never replaced by a
    less thorough one (fewer tokens: refused; fewer lengths: its other lengths kept; no context use:
    its context columns kept) unless `replace`."""
    cfg = load_eval_config(run_dir, overrides)
    fmt = plot_format(cfg)  # a bad plots.format fails before the scoring
    if not replace:
        check_not_less_thorough(run_dir, variant_tag(variant_settings(cfg.eval)), int(cfg.eval.tokens))
    with recorded_writer(run_dir, "eval-length") as log:
        label = f"eval {Path(run_dir).resolve().name}"
        cfg, rows, position_rows = in_worker(
            lambda: evaluate_run(run_dir, overrides, lambda total: progress_bar(console, label, total, "passes")))
        try:  # read once, after the scoring: another process may have written it meanwhile
            stored = stored_eval_length(run_dir, rows[0]["variant"])
        except RelposError:
            if not replace:
                raise
            stored = []  # unreadable: --replace overwrites it
        note_dropped_lengths(stored, rows, replace)
        if not replace:
            rows, position_rows, kept, context = with_stored_lengths(run_dir, stored, rows, position_rows)
            if kept:
                print_note(f"kept the stored lengths {', '.join(map(str, kept))} (same tokens) that this evaluation "
                           f"did not score (--replace drops them)")
            if context:
                print_note(f"kept the stored context use (eval.context_use) of lengths {', '.join(map(str, context))} "
                           f"(same tokens) that this evaluation did not compute (--replace drops it)")
        variant = rows[0]["variant"]
        title = result_title(run_dir, cfg.pos.name, "", cfg.train.seq_len, variant)
        line = (f"eval-length {variant} ({protocol_label(rows[0])}, {rows[0]['tokens']:,} tokens): "
                + ", ".join(f"ppl@{r['length']} {r['ppl']:.4f}" for r in rows))
        return report_result(run_dir, console, log, length_table(rows, title, cfg.train.seq_len), line, log_eval_length, variant,
                             lambda: write_length_report(run_dir, rows, position_rows, title, cfg.train.seq_len, fmt))
