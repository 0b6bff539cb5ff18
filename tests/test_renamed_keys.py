"""Renamed config keys keep working: eval.window.{size,sinks,max_distance} (W was `size` there and
`window` in eval.self_extend and eval.rerope) are now eval.sinks.{window,count,max_distance}. An old
key on the command line is rewritten with a one-line note; a run saved with the old section loads."""

from __future__ import annotations

import json

import pytest
import yaml

from conftest import run_in_process, tiny_trained
from relpos_cli.checkpoint import load_config
from relpos_cli.renamed import renamed_overrides

pytestmark = pytest.mark.usefixtures("in_temp_cwd")


def test_old_keys_are_rewritten_with_their_prefixes_and_values():
    assert renamed_overrides(["eval.window.size=64", "+eval.window.sinks=4", "eval.window.max_distance=9",
                              "eval.rerope.window=8", "outputs/run=1"], note=False) == \
        ["eval.sinks.window=64", "+eval.sinks.count=4", "eval.sinks.max_distance=9", "eval.rerope.window=8", "outputs/run=1"]


@pytest.fixture(scope="module")
def alibi_run(tmp_path_factory):
    return tiny_trained(tmp_path_factory, "pos=alibi")


def test_old_keys_on_the_command_line_evaluate_the_new_variant_with_a_note(alibi_run):
    code, out, err = run_in_process("eval-length", str(alibi_run), "eval.lengths=[64]", "eval.tokens=64",
                                    "eval.window.sinks=2", "eval.window.size=16")
    assert code == 0, err
    assert "eval.window.size is now called eval.sinks.window" in out + err
    assert "eval.window.sinks is now called eval.sinks.count" in out + err
    rows = json.loads((alibi_run / "eval_length.sinks.count=2,sinks.window=16.json").read_text())
    assert rows[0]["eval.sinks.window"] == 16 and rows[0]["eval.sinks.count"] == 2


def test_a_run_saved_with_the_old_section_loads_under_the_new_names(alibi_run, tmp_path):
    saved = yaml.safe_load((alibi_run / "config.yaml").read_text())
    old = dict(saved)
    old["eval"] = {k: v for k, v in saved["eval"].items() if k != "sinks"}
    old["eval"]["window"] = {"sinks": 3, "size": 32, "max_distance": None}
    run = tmp_path / "old"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(old))
    cfg = load_config(run)
    assert "window" not in cfg.eval
    assert cfg.eval.sinks.count == 3 and cfg.eval.sinks.window == 32 and cfg.eval.sinks.max_distance is None
