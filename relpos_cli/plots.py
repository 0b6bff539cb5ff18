"""PNG plots (matplotlib, headless Agg backend): ppl vs length, loss vs position, compare lines."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np

from relpos_cli.atomic import atomic_write_bytes

POSITION_BINS = 64  # log-spaced bins: single positions at long lengths hold too few windows to read


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt, *plt.subplots(figsize=(7, 4.5), dpi=120)


def _save(plt, fig, path: Path) -> None:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def _log_y_if_wide(ax, values) -> None:
    """Perplexities past the training length can grow 100x: a log axis keeps the good ones readable."""
    low, high = min(values), max(values)
    if low > 0 and high / low > 10:
        ax.set_yscale("log")


def _mark_train_lengths(ax, train_lengths: set[int]) -> None:
    for i, t in enumerate(sorted(train_lengths)):
        ax.axvline(t, color="grey", linestyle=":", linewidth=1, label="train length" if i == 0 else None)


def _subtitle(rows: list[dict[str, Any]]) -> str:
    r = rows[0]
    stride = "stride=L" if r["protocol"] == "nonoverlapping" else f"stride={r['stride']}"
    tokens = r["tokens"] if "tokens" in r else sum(x["count"] for x in rows if x["length"] == r["length"])
    return f"{r['protocol']}, {stride}, {tokens:,} tokens"


def plot_length(path: Path, rows: list[dict[str, Any]], title: str, train_len: int) -> None:
    plt, fig, ax = _figure()
    ax.plot([r["length"] for r in rows], [r["ppl"] for r in rows], marker="o")
    _mark_train_lengths(ax, {train_len})
    _log_y_if_wide(ax, [r["ppl"] for r in rows])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("evaluation length (tokens)")
    ax.set_ylabel("perplexity")
    ax.set_title(f"{title}\n{_subtitle(rows)}", fontsize=9)
    ax.legend(fontsize=8)
    _save(plt, fig, path)


def binned_positions(position_rows: list[dict[str, Any]], length: int) -> tuple[np.ndarray, np.ndarray]:
    """Count-weighted mean loss in log-spaced position bins: (bin centre positions, losses)."""
    rows = [r for r in position_rows if r["length"] == length]
    pos = np.array([r["position"] for r in rows], dtype=np.float64)
    loss = np.array([r["loss"] for r in rows])
    count = np.array([r["count"] for r in rows], dtype=np.float64)
    edges = np.unique(np.geomspace(1, length + 1, POSITION_BINS + 1).astype(np.int64)) - 1
    which = np.clip(np.searchsorted(edges, pos, side="right") - 1, 0, len(edges) - 1)
    weight = np.bincount(which, count, minlength=len(edges))
    total = np.bincount(which, loss * count, minlength=len(edges))
    centre = np.bincount(which, pos * count, minlength=len(edges))
    keep = weight > 0
    return centre[keep] / weight[keep], total[keep] / weight[keep]


def plot_positions(path: Path, position_rows: list[dict[str, Any]], title: str, train_len: int) -> None:
    plt, fig, ax = _figure()
    for length in sorted({r["length"] for r in position_rows}):
        x, y = binned_positions(position_rows, length)
        ax.plot(x + 1, y, label=f"L={length}")
    _mark_train_lengths(ax, {train_len})
    ax.set_xscale("log", base=2)
    ax.set_xlabel("position in window + 1 (log-spaced bins)")
    ax.set_ylabel("mean loss (nats)")
    ax.set_title(f"{title}\n{_subtitle(position_rows)}", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    _save(plt, fig, path)


def plot_compare(path: Path, groups: list[dict[str, Any]], metric: str, title: str, train_lengths: set[int],
                 hlines: list[float] = ()) -> None:
    """One line per configuration (mean over seeds) with a mean ± std band; hlines (thresholds) dashed."""
    plt, fig, ax = _figure()
    for g in groups:
        cells = [(int(l), c) for l, c in g["cells"].items()]
        x = np.array([l for l, _ in cells])
        mean = np.array([c["mean"] for _, c in cells])
        std = np.array([c["std"] or 0.0 for _, c in cells])  # None: a single run
        (line,) = ax.plot(x, mean, marker="o", label=g["label"])
        ax.fill_between(x, mean - std, mean + std, color=line.get_color(), alpha=0.2)
    for y in hlines:
        ax.axhline(y, color="red", linestyle="--", linewidth=1)
    _mark_train_lengths(ax, train_lengths)
    _log_y_if_wide(ax, [c["mean"] for g in groups for c in g["cells"].values()])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("evaluation length (tokens)")
    ax.set_ylabel(metric)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    _save(plt, fig, path)


def _threshold_subtitle(rows: list[dict[str, Any]], per: str) -> str:
    r = rows[0]
    return f"effective length {r['effective_length']} (accuracy >= {r['threshold']:g}), {r['samples']} examples per {per}"


def plot_accuracy(path: Path, per_length: list[dict[str, Any]], cells: list[dict[str, Any]], title: str) -> None:
    """Accuracy vs eval length: one line (over all depths), thin lines per depth, the threshold dashed."""
    plt, fig, ax = _figure()
    for depth in sorted({c["depth"] for c in cells}):
        rows = [c for c in cells if c["depth"] == depth]
        ax.plot([c["length"] for c in rows], [c["accuracy"] for c in rows], linewidth=0.8, alpha=0.6,
                label=f"depth {depth:g}")
    ax.plot([r["length"] for r in per_length], [r["accuracy"] for r in per_length], marker="o", color="black",
            label="all depths" if cells else per_length[0]["task"])
    ax.axhline(per_length[0]["threshold"], color="red", linestyle="--", linewidth=1, label="threshold")
    _mark_train_lengths(ax, {per_length[0]["train_len"]})
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.03, 1.03)
    ax.set_xlabel("evaluation length (tokens)")
    ax.set_ylabel("exact-match accuracy")
    ax.set_title(f"{title}\n{_threshold_subtitle(per_length, 'length')}", fontsize=9)
    ax.legend(fontsize=7)
    _save(plt, fig, path)


def plot_depth_heatmap(path: Path, cells: list[dict[str, Any]], title: str) -> None:
    """The needle-in-a-haystack picture: accuracy per (depth, length) cell, values written in."""
    plt, fig, ax = _figure()
    lengths = sorted({c["length"] for c in cells})
    depths = sorted({c["depth"] for c in cells})
    grid = np.array([[next(c["accuracy"] for c in cells if c["length"] == l and c["depth"] == d) for l in lengths]
                     for d in depths])  # (depths, lengths)
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    for i in range(len(depths)):
        for j in range(len(lengths)):
            ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(lengths)), [str(l) for l in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_xlabel("evaluation length (tokens); train length " + str(cells[0]["train_len"]))
    ax.set_ylabel("needle depth (0 = first, 1 = last)")
    fig.colorbar(image, ax=ax, label="exact-match accuracy")
    ax.set_title(f"{title}\n{_threshold_subtitle(cells, 'cell')}", fontsize=9)
    _save(plt, fig, path)
