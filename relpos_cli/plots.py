"""Figures (matplotlib, headless Agg backend): ppl vs length, loss vs position, compare lines.

Every figure is written in `plots.format` (png, pdf or svg; the path's suffix says which), titled by
run name and scheme rather than by the path a user typed.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from relpos_cli.atomic import atomic_write_bytes
from relpos_cli.errors import RelposError
from relpos_cli.results import FORMATS, protocol_label

POSITION_BINS = 64  # log-spaced bins: single positions at long lengths hold too few windows to read


def plot_format(cfg: Mapping[str, Any]) -> str:
    """plots.format of a config (png for runs saved before the key existed), checked."""
    fmt = (cfg.get("plots") or {}).get("format", "png")
    if fmt not in FORMATS:
        raise RelposError(f"plots.format={fmt!r}; choose one of: {', '.join(FORMATS)}")
    return fmt


def run_title(run_dir: Path, scheme: str) -> str:
    """What a figure or table is about: the run dir's own name (outputs/latest resolved) and its scheme."""
    return f"{Path(run_dir).resolve().name}  pos={scheme}"


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _figure():
    return pyplot().subplots(figsize=(7, 4.5), dpi=120)


def figure_bytes(fig, fmt: str) -> bytes:
    """The figure in fmt, cropped to what it draws (legends placed outside the axes included); closed."""
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, bbox_inches="tight", dpi=fig.dpi)
    pyplot().close(fig)
    return buf.getvalue()


def _save(fig, path: Path) -> None:
    atomic_write_bytes(path, figure_bytes(fig, Path(path).suffix.lstrip(".")))


def _log_y_if_wide(ax, values) -> None:
    """Perplexities past the training length can grow 100x: a log axis keeps the good ones readable.
    A linear axis writes its values whole (102.93, not 0.03 with +1.029e2 above the axis)."""
    from matplotlib.ticker import ScalarFormatter

    low, high = min(values), max(values)
    if low > 0 and high / low > 10:
        ax.set_yscale("log")
    elif isinstance(ax.yaxis.get_major_formatter(), ScalarFormatter):
        ax.yaxis.get_major_formatter().set_useOffset(False)


def _mark_train_lengths(ax, train_lengths: set[int]) -> None:
    for i, t in enumerate(sorted(train_lengths)):
        ax.axvline(t, color="grey", linestyle=":", linewidth=1, label="train length" if i == 0 else None)


def lengths_double(lengths) -> bool:
    """Whether each length is at least about twice the one before (128, 256, 512, ...): such a grid
    reads evenly on a log axis; a linear grid (128, 256, 384, 512: 1x..4x) reads evenly on a linear one."""
    ticks = sorted(set(lengths))
    return all(b >= 1.9 * a for a, b in zip(ticks, ticks[1:]))


def _length_axis(ax, lengths) -> None:
    """Lengths on a log2 axis where they double, else a linear one; labelled with the lengths themselves
    (128, 256, ...), not powers of two."""
    ticks = sorted(set(lengths))
    if lengths_double(ticks):
        ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("evaluation length (tokens)")


def _subtitle(rows: list[dict[str, Any]]) -> str:
    """How the rows were scored, as the tables say it (precision included), and over how many tokens."""
    r = rows[0]
    tokens = r["tokens"] if "tokens" in r else sum(x["count"] for x in rows if x["length"] == r["length"])
    return f"{protocol_label(r)}, {tokens:,} tokens"


def plot_length(path: Path, rows: list[dict[str, Any]], title: str, train_len: int) -> None:
    fig, ax = _figure()
    ax.plot([r["length"] for r in rows], [r["ppl"] for r in rows], marker="o")
    _mark_train_lengths(ax, {train_len})
    _log_y_if_wide(ax, [r["ppl"] for r in rows])
    _length_axis(ax, [r["length"] for r in rows])
    ax.set_ylabel("perplexity")
    ax.set_title(f"{title}\n{_subtitle(rows)}", fontsize=9)
    ax.legend(fontsize=8)
    _save(fig, path)


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
    fig, ax = _figure()
    for length in sorted({r["length"] for r in position_rows}):
        x, y = binned_positions(position_rows, length)
        ax.plot(x + 1, y, label=f"L={length}")
    _mark_train_lengths(ax, {train_len})
    ax.set_xscale("log", base=2)
    ax.set_xlabel("position in window + 1 (log-spaced bins)")
    ax.set_ylabel("mean loss (nats)")
    ax.set_title(f"{title}\n{_subtitle(position_rows)}", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0, frameon=False)
    _save(fig, path)


def plot_compare(path: Path, groups: list[dict[str, Any]], metric: str, title: str, train_lengths: set[int],
                 legend_title: str | None = None, hlines: tuple[float, ...] = ()) -> None:
    _save(compare_figure(groups, metric, title, train_lengths, legend_title, hlines), path)


def compare_figure(groups: list[dict[str, Any]], metric: str, title: str, train_lengths: set[int],
                   legend_title: str | None = None, hlines: tuple[float, ...] = ()):
    """One line per configuration (mean over seeds) with a band: the 95% Wilson interval of task
    accuracy cells (over the answers pooled across seeds, as their table gives it), else mean ± std;
    hlines (thresholds) dashed."""
    fig, ax = _figure()
    for g in groups:
        cells = [(int(l), c) for l, c in g["cells"].items()]
        x = np.array([l for l, _ in cells])
        mean = np.array([c["mean"] for _, c in cells])
        if all("ci_low" in c for _, c in cells):
            low, high = np.array([c["ci_low"] for _, c in cells]), np.array([c["ci_high"] for _, c in cells])
        else:
            std = np.array([c["std"] or 0.0 for _, c in cells])  # None: a single run
            low, high = mean - std, mean + std
        (line,) = ax.plot(x, mean, marker="o", label=g["label"])
        ax.fill_between(x, low, high, color=line.get_color(), alpha=0.2)
    for y in hlines:
        ax.axhline(y, color="red", linestyle="--", linewidth=1)
    _mark_train_lengths(ax, train_lengths)
    _log_y_if_wide(ax, [c["mean"] for g in groups for c in g["cells"].values()])
    _length_axis(ax, [int(l) for g in groups for l in g["cells"]])
    ax.set_ylabel(metric)
    ax.set_title(title, fontsize=9)
    # beside the axes, never over the lines: one entry per configuration, named by the keys that differ
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0, frameon=False,
              title=legend_title, title_fontsize=7, alignment="left")
    return fig


def _threshold_subtitle(rows: list[dict[str, Any]], per: str) -> str:
    r = rows[0]
    return f"effective length {r['effective_length']} (accuracy >= {r['threshold']:g}), {r['samples']} examples per {per}"


def plot_accuracy(path: Path, per_length: list[dict[str, Any]], cells: list[dict[str, Any]], title: str) -> None:
    """Accuracy vs eval length: one line (over all depths), thin lines per depth, the threshold dashed."""
    fig, ax = _figure()
    for depth in sorted({c["depth"] for c in cells}):
        rows = [c for c in cells if c["depth"] == depth]
        ax.plot([c["length"] for c in rows], [c["accuracy"] for c in rows], linewidth=0.8, alpha=0.6,
                label=f"depth {depth:g}")
    ax.plot([r["length"] for r in per_length], [r["accuracy"] for r in per_length], marker="o", color="black",
            label="all depths" if cells else per_length[0]["task"])
    ax.axhline(per_length[0]["threshold"], color="red", linestyle="--", linewidth=1, label="threshold")
    _mark_train_lengths(ax, {per_length[0]["train_len"]})
    _length_axis(ax, [r["length"] for r in per_length])
    ax.set_ylim(-0.03, 1.03)
    ax.set_ylabel("exact-match accuracy")
    ax.set_title(f"{title}\n{_threshold_subtitle(per_length, 'length')}", fontsize=9)
    ax.legend(fontsize=7)
    _save(fig, path)


def plot_depth_heatmap(path: Path, cells: list[dict[str, Any]], title: str) -> None:
    """The needle-in-a-haystack picture: accuracy per (depth, length) cell, values written in."""
    fig, ax = _figure()
    lengths = sorted({c["length"] for c in cells})
    depths = sorted({c["depth"] for c in cells})
    # a cell no evaluation scored (results merged from evaluations over other depths) is NaN: left blank
    grid = np.array([[next((c["accuracy"] for c in cells if c["length"] == l and c["depth"] == d), np.nan)
                      for l in lengths] for d in depths])  # (depths, lengths)
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    for i in range(len(depths)):
        for j in range(len(lengths)):
            if not np.isnan(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(lengths)), [str(l) for l in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_xlabel("evaluation length (tokens); train length " + str(cells[0]["train_len"]))
    ax.set_ylabel("needle depth (0 = first, 1 = last)")
    fig.colorbar(image, ax=ax, label="exact-match accuracy")
    ax.set_title(f"{title}\n{_threshold_subtitle(cells, 'cell')}", fontsize=9)
    _save(fig, path)
