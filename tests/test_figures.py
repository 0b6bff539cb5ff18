"""Figures for papers: titled by run name and scheme, legends of only the keys that differ and beside
the lines, one colour scale per inspect layer with nothing overlapping, plots.format=png|pdf|svg."""

import re

import pytest
import torch

from conftest import TINY, run_in_process
from relpos_cli.compare import group_runs
from relpos_cli.runs import find_runs, read_run
from relpos_cli.inspect import heatmaps, position_logits
from relpos_cli.plots import compare_figure, pyplot
from relpos_cli.positions import build_scheme
from relpos_cli.positions.base import ModelShape
from test_compare import make_run

pytestmark = pytest.mark.usefixtures("in_temp_cwd")


def svg_texts(path) -> list[str]:
    """The text a matplotlib SVG draws: each text element is preceded by a comment holding it."""
    return [t.strip() for t in re.findall(r"<!-- (.*?) -->", path.read_text(), flags=re.S)]


def boxes_overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_figures_are_titled_by_run_and_scheme_in_the_configured_format(tiny_run, tmp_path):
    run_dir = tiny_run
    latest = tmp_path / "latest"  # the path a user types
    latest.symlink_to(run_dir, target_is_directory=True)
    variant = ["eval.protocol=sliding", "eval.stride=32"]  # files of their own: other tests' eval_length.* stay
    code, _, err = run_in_process("eval-length", str(latest), *variant, "eval.lengths=[32,64]", "eval.tokens=256",
                                  "plots.format=svg")
    assert code == 0, err
    svg = run_dir / "eval_length.protocol=sliding,stride=32.svg"
    title = next(t for t in svg_texts(svg) if "pos=" in t)
    assert title.startswith(f"{run_dir.name}  pos=alibi") and "latest" not in title
    # how the numbers were scored, as the table's caption says it: the precision too (fp32 on this CPU)
    assert any("sliding stride=32, fp32, " in t and " tokens" in t for t in svg_texts(svg))
    assert any("sliding stride=32, fp32, " in t for t in svg_texts(svg.with_name(svg.name.replace("eval_length", "eval_positions"))))
    code, _, err = run_in_process("eval-length", str(run_dir), *variant, "eval.lengths=[32]", "eval.tokens=256",
                                  "plots.format=pdf")
    assert code == 0 and svg.with_suffix(".pdf").read_bytes().startswith(b"%PDF")


@pytest.mark.parametrize("command", ["train", "eval-length"])
def test_a_bad_plot_format_is_one_clear_line(tiny_run, tmp_path, command):
    target = [*TINY, f"hydra.run.dir={tmp_path / 'run'}"] if command == "train" else [str(tiny_run)]
    code, _, err = run_in_process(command, *target, "plots.format=jpg")
    assert code == 2 and err.strip().splitlines() == ["error: plots.format='jpg'; choose one of: png, pdf, svg"]


def test_compare_legend_names_only_the_keys_that_differ_beside_the_lines(tmp_path):
    for i, (pos, seq_len) in enumerate([("rope", 128), ("alibi", 128), ("alibi", 256)]):
        make_run(tmp_path / "sweep" / f"run{i}", pos, 0, seq_len, [4.0 + i, 5.0, 6.0])
    groups = group_runs([read_run(p) for p in find_runs(tmp_path / "sweep")])
    fig = compare_figure(groups, "ppl", "title", {128, 256}, legend_title=", ".join(groups[0]["label_keys"]))
    ax = fig.axes[0]
    legend = ax.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["alibi, seq_len=128", "alibi, seq_len=256",
                                                          "rope, seq_len=128", "train length"]
    assert legend.get_title().get_text() == "pos.name, train.seq_len"
    renderer = fig.canvas.get_renderer()
    assert not boxes_overlap(legend.get_window_extent(renderer), ax.get_window_extent(renderer))
    pyplot().close(fig)


def test_inspect_heatmaps_share_one_colour_scale_per_layer_and_nothing_overlaps():
    torch.manual_seed(0)
    scheme = build_scheme({"name": "alibi"}, ModelShape(d_model=48, n_heads=6, n_layers=1, train_seq_len=32))
    logits = position_logits(scheme, 0, 24)  # slopes 1/2 ... 1/256: the heads differ by up to 128x
    fig = heatmaps(logits, list(range(6)), "title")
    images = [im for ax in fig.axes for im in ax.get_images()]
    assert len(images) == 6 and len({im.get_clim() for im in images}) == 1
    assert images[0].get_clim() == (float(logits.min()), float(logits.max()))
    # ALiBi's maps are scaled copies of each other: on one scale per head they would look the same;
    # on the layer's scale the steep heads are darker
    shade = [float(im.norm(im.get_array()).mean()) for im in images]
    assert max(shade) - min(shade) > 0.3
    colorbars = [ax for ax in fig.axes if not ax.get_images()]
    assert len(colorbars) == 1  # one colour bar for the layer

    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    panels = [ax.get_tightbbox(renderer) for ax in fig.axes]  # titles, tick and axis labels, the colour bar
    for i, a in enumerate(panels):
        for b in panels[i + 1:]:
            assert not boxes_overlap(a, b)
    suptitle = fig._suptitle.get_window_extent(renderer)
    assert not any(boxes_overlap(suptitle, p) for p in panels)
    pyplot().close(fig)


def test_an_accuracy_figure_s_band_is_its_table_s_wilson_interval():
    """The band drew mean ± std over seeds (up to 1.07 for an accuracy) where the table gives the 95%
    Wilson interval over the pooled answers."""
    cells = {128: {"mean": 0.83, "std": 0.24, "n": 2, "ci_low": 0.74, "ci_high": 0.89},
             256: {"mean": 0.5, "std": 0.3, "n": 2, "ci_low": 0.4, "ci_high": 0.6}}
    fig = compare_figure([{"label": "alibi", "cells": cells}], "accuracy", "title", {128})
    (band,) = fig.axes[0].collections
    ys = band.get_paths()[0].vertices[:, 1]
    assert ys.min() == pytest.approx(0.4) and ys.max() == pytest.approx(0.89)
    pyplot().close(fig)
