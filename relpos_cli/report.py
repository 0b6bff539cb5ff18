"""Perplexity-versus-length results: rich table in the terminal, CSV and JSON in the run dir."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from rich.table import Table

from relpos_cli.atomic import atomic_write_text

LENGTH_COLUMNS = ["length", "tokens", "loss", "ppl", "ppl_ratio", "protocol"]


def length_table(rows: list[dict[str, Any]], title: str, train_len: int) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("length", justify="right")
    table.add_column("tokens", justify="right")
    table.add_column("loss (nats)", justify="right")
    table.add_column("ppl", justify="right")
    table.add_column(f"ppl ÷ ppl@{train_len}", justify="right")
    for r in rows:
        marker = " (train)" if r["length"] == train_len else ""
        table.add_row(
            f"{r['length']}{marker}", f"{r['tokens']:,}", f"{r['loss']:.4f}", f"{r['ppl']:.3f}", f"{r['ppl_ratio']:.2f}x"
        )
    return table


def rows_to_csv(rows: list[dict[str, Any]], columns: list[str]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def write_length_report(run_dir: Path, rows: list[dict[str, Any]]) -> list[Path]:
    csv_path, json_path = Path(run_dir) / "eval_length.csv", Path(run_dir) / "eval_length.json"
    atomic_write_text(csv_path, rows_to_csv(rows, LENGTH_COLUMNS))
    atomic_write_text(json_path, json.dumps(rows, indent=2))
    return [csv_path, json_path]
