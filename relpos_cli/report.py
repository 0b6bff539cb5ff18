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
from relpos_cli.results import DEFAULT_VARIANT, eval_results, protocol_label, report_path, rows_to_csv, variant_tag
from relpos_cli.terminal import progress_bar
from relpos_cli.tracking import log_eval_length, publish

LENGTH_COLUMNS = ["length", "tokens", "loss", "ppl", "bpb", "ppl_ratio", "protocol", "stride", "precision", "variant"]
# eval.context_use=true (evaluate.context_use): the same later targets under windows of L and of L_train
CONTEXT_COLUMNS = ["context_tokens", "context_loss", "context_loss_train_window", "context_gain"]
POSITION_COLUMNS = ["length", "position", "loss", "count", "protocol", "stride", "precision", "variant"]


def length_table(rows: list[dict[str, Any]], title: str, train_len: int) -> Table:
    """One row per length; the protocol and token count (the same for every row) in the caption."""
    caption = f"{protocol_label(rows[0])}, {rows[0]['tokens']:,} tokens scored at every length"
    context = "context_gain" in rows[0]
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
                      *([f"{r['context_gain']:+.4f} on {r['context_tokens']:,}"] if context else []))
    return table


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
        "length_csv": report_path(run_dir, "eval_length", variant, ".csv"),
        "length_json": report_path(run_dir, "eval_length", variant, ".json"),
        "positions_csv": report_path(run_dir, "eval_positions", variant, ".csv"),
        "length_figure": report_path(run_dir, "eval_length", variant, f".{fmt}"),
        "positions_figure": report_path(run_dir, "eval_positions", variant, f".{fmt}"),
    }
    plot_length(paths["length_figure"], rows, title, train_len)
    plot_positions(paths["positions_figure"], position_rows, title, train_len)
    atomic_write_text(paths["positions_csv"], rows_to_csv(position_rows, POSITION_COLUMNS + extra))
    context = CONTEXT_COLUMNS if "context_gain" in rows[0] else []
    factor = ["rope_factor"] if "rope_factor" in rows[0] else []  # the RoPE scaling factor each length ran with
    atomic_write_text(paths["length_csv"], rows_to_csv(rows, LENGTH_COLUMNS + factor + context + extra))
    atomic_write_text(paths["length_json"], json.dumps(rows, indent=2))  # last: compare reads it
    return list(paths.values())


def check_not_less_thorough(run_dir: Path, variant: str, tokens: int) -> None:
    """An evaluation never replaces a stored result of its variant scored over more tokens."""
    stored = eval_results(run_dir).get(variant)
    most = max((int(r.get("tokens", 0)) for r in stored or []), default=0)
    if most > tokens:
        name = report_path(run_dir, "eval_length", variant, ".json").name
        raise RelposError(f"{Path(run_dir) / name} holds a result over {most:,} tokens; eval.tokens={tokens} would "
                          f"replace it with a less thorough one: give eval.tokens={most}, or --replace to overwrite it")


def with_stored_lengths(run_dir: Path, rows: list[dict[str, Any]], position_rows: list[dict[str, Any]]
                        ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[int]]:
    """Stored lengths of the same variant, scored over the same tokens, that this evaluation did not
    score: kept (their numbers are what it would have computed). Returns the rows, position rows
    and the lengths kept."""
    stored = eval_results(run_dir).get(rows[0]["variant"]) or []
    scored, tokens = {r["length"] for r in rows}, rows[0]["tokens"]
    kept = [r for r in stored if r["length"] not in scored and r.get("tokens") == tokens]
    if not kept:
        return rows, position_rows, []
    lengths = {r["length"] for r in kept}
    path = report_path(run_dir, "eval_positions", rows[0]["variant"], ".csv")
    try:
        with path.open(newline="") as f:
            old_positions = [{**r, "length": int(r["length"]), "position": int(r["position"]), "loss": float(r["loss"]),
                              "count": int(r["count"]), "stride": int(r["stride"])}
                             for r in csv.DictReader(f) if int(r["length"]) in lengths]
    except (OSError, ValueError, KeyError):  # no per-position rows to keep: the lengths' own rows still are
        old_positions = []
    by_length = sorted([*rows, *kept], key=lambda r: r["length"])
    positions = sorted([*position_rows, *old_positions], key=lambda r: (r["length"], r["position"]))
    return by_length, positions, sorted(lengths)


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
    less thorough one (fewer tokens: refused; fewer lengths: its other lengths kept) unless `replace`."""
    cfg = load_eval_config(run_dir, overrides)
    fmt = plot_format(cfg)  # a bad plots.format fails before the scoring
    if not replace:
        check_not_less_thorough(run_dir, variant_tag(variant_settings(cfg.eval)), int(cfg.eval.tokens))
    with recorded_writer(run_dir, "eval-length") as log:
        label = f"eval {Path(run_dir).resolve().name}"
        cfg, rows, position_rows = in_worker(
            lambda: evaluate_run(run_dir, overrides, lambda total: progress_bar(console, label, total, "passes")))
        if not replace:
            rows, position_rows, kept = with_stored_lengths(run_dir, rows, position_rows)
            if kept:
                print_note(f"kept the stored lengths {', '.join(map(str, kept))} (same tokens) that this evaluation "
                           f"did not score (--replace drops them)")
        variant = rows[0]["variant"]
        title = result_title(run_dir, cfg.pos.name, "", cfg.train.seq_len, variant)
        line = (f"eval-length {variant} ({protocol_label(rows[0])}, {rows[0]['tokens']:,} tokens): "
                + ", ".join(f"ppl@{r['length']} {r['ppl']:.4f}" for r in rows))
        return report_result(run_dir, console, log, length_table(rows, title, cfg.train.seq_len), line, log_eval_length, variant,
                             lambda: write_length_report(run_dir, rows, position_rows, title, cfg.train.seq_len, fmt))
