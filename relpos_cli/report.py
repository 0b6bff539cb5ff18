"""Perplexity-versus-length results: rich table in the terminal; CSV, JSON and PNG in the run dir.

The default eval variant writes eval_length.{csv,json,png} and eval_positions.{csv,png}; any other
variant (see evaluate.variant_settings) writes the same names with `.<variant tag>` before the suffix.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from rich.table import Table

from relpos_cli.atomic import atomic_write_text
from relpos_cli.evaluate import DEFAULT_VARIANT

LENGTH_COLUMNS = ["length", "tokens", "loss", "ppl", "bpb", "ppl_ratio", "protocol", "stride", "variant"]
# eval.context_use=true (evaluate.context_use): the same later targets under windows of L and of L_train
CONTEXT_COLUMNS = ["context_tokens", "context_loss", "context_loss_train_window", "context_gain"]
POSITION_COLUMNS = ["length", "position", "loss", "count", "protocol", "stride", "variant"]


def protocol_label(row: dict[str, Any]) -> str:
    return row["protocol"] if row["protocol"] == "nonoverlapping" else f"{row['protocol']} stride={row['stride']}"


def length_table(rows: list[dict[str, Any]], title: str, train_len: int) -> Table:
    context = "context_gain" in rows[0]
    table = Table(title=title, title_justify="left")
    names = ["length", "tokens", "loss (nats)", "ppl", "bpb", f"ppl ÷ ppl@{train_len}", "protocol"]
    if context:
        names += [f"context gain vs windows of {train_len} (nats, on tokens)"]
    for name in names:
        table.add_column(name, justify="left" if name == "protocol" else "right")
    for r in rows:
        marker = " (train)" if r["length"] == train_len else ""
        table.add_row(
            f"{r['length']}{marker}", f"{r['tokens']:,}", f"{r['loss']:.4f}", f"{r['ppl']:.3f}", f"{r['bpb']:.4f}",
            f"{r['ppl_ratio']:.2f}x", protocol_label(r), *([f"{r['context_gain']:+.4f} on {r['context_tokens']:,}"] if context else []),
        )
    return table


def rows_to_csv(rows: list[dict[str, Any]], columns: list[str]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def report_path(run_dir: Path, stem: str, variant: str, suffix: str) -> Path:
    tag = "" if variant == DEFAULT_VARIANT else f".{variant}"
    return Path(run_dir) / f"{stem}{tag}{suffix}"


def variant_columns(rows: list[dict[str, Any]]) -> list[str]:
    return [k for k in rows[0] if k.startswith("eval.")]


def write_length_report(
    run_dir: Path, rows: list[dict[str, Any]], position_rows: list[dict[str, Any]], title: str, train_len: int
) -> list[Path]:
    """CSV + JSON of both tables and their two plots; returns the paths written."""
    from relpos_cli.plots import plot_length, plot_positions

    variant = rows[0]["variant"]
    extra = variant_columns(rows)
    paths = {
        "length_csv": report_path(run_dir, "eval_length", variant, ".csv"),
        "length_json": report_path(run_dir, "eval_length", variant, ".json"),
        "positions_csv": report_path(run_dir, "eval_positions", variant, ".csv"),
        "length_png": report_path(run_dir, "eval_length", variant, ".png"),
        "positions_png": report_path(run_dir, "eval_positions", variant, ".png"),
    }
    plot_length(paths["length_png"], rows, title, train_len)
    plot_positions(paths["positions_png"], position_rows, title, train_len)
    atomic_write_text(paths["positions_csv"], rows_to_csv(position_rows, POSITION_COLUMNS + extra))
    context = CONTEXT_COLUMNS if "context_gain" in rows[0] else []
    atomic_write_text(paths["length_csv"], rows_to_csv(rows, LENGTH_COLUMNS + context + extra))
    atomic_write_text(paths["length_json"], json.dumps(rows, indent=2))  # last: compare reads it
    return list(paths.values())


def evaluate_and_report(run_dir: Path, overrides: list[str], console) -> list[Path]:
    """eval-length for one run: score, print the table, write files, log to W&B; returns the paths."""
    from omegaconf import OmegaConf

    from relpos_cli.evaluate import evaluate_run
    from relpos_cli.tracking import log_table

    cfg, rows, position_rows = evaluate_run(run_dir, overrides)
    variant = rows[0]["variant"]
    title = f"{run_dir}  pos={cfg.pos.name}  train L={cfg.train.seq_len}" + ("" if variant == DEFAULT_VARIANT else f"  [{variant}]")
    console.print(length_table(rows, title, cfg.train.seq_len))
    paths = write_length_report(run_dir, rows, position_rows, title, cfg.train.seq_len)
    key = "eval_length" if variant == DEFAULT_VARIANT else f"eval_length.{variant}"
    images = {f"{p.stem}": p for p in paths if p.suffix == ".png"}
    log_table(run_dir, OmegaConf.to_container(cfg, resolve=True), "eval", key, rows, "length", "ppl", images=images)
    console.print("wrote " + ", ".join(str(p) for p in paths))
    return paths
