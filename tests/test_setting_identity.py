"""One setting, one identity: a number given as 2 or as 2.0 names the same eval variant (one file,
one compare row) and the same configuration, wherever settings are told apart."""

from __future__ import annotations

import json

import pytest

from conftest import run_in_process, tiny_trained
from relpos_cli.config import canonical_numbers
from relpos_cli.compare import group_runs
from relpos_cli.runs import Run, differing_keys

pytestmark = pytest.mark.usefixtures("in_temp_cwd")


@pytest.fixture(scope="module")
def rope_run(tmp_path_factory):
    return tiny_trained(tmp_path_factory, "pos=rope")


def test_a_factor_given_as_int_or_float_is_one_variant(rope_run):
    for factor in ("2", "2.0"):
        code, _, err = run_in_process("eval-length", str(rope_run), "eval.lengths=[64]", "eval.tokens=64",
                                      "eval.rope_scaling.type=linear", f"eval.rope_scaling.factor={factor}")
        assert code == 0, err
    files = sorted(p.name for p in rope_run.glob("eval_length.*.json"))
    assert files == ["eval_length.rope_scaling.factor=2,rope_scaling.type=linear.json"]
    rows = json.loads((rope_run / files[0]).read_text())
    assert {r["eval.rope_scaling.factor"] for r in rows} == {2}


def test_compare_groups_runs_by_value_not_spelling(tmp_path):
    """Two runs whose configs say pos.scaling.factor 2 and 2.0 are one configuration (one row, no
    label part); 2.5 is another."""
    def run(factor, seed):
        config = {"pos": {"name": "rope", "scaling": {"factor": factor}}, "seed": seed}
        rows = [{"length": 32, "tokens": 64, "ppl": 10.0 + seed, "protocol": "nonoverlapping", "stride": 32}]
        return Run(tmp_path / f"{factor}-{seed}", config, {"default": rows})

    groups = group_runs([run(2, 0), run(2.0, 1)])
    assert len(groups) == 1 and groups[0]["cells"][32]["n"] == 2
    assert len(group_runs([run(2, 0), run(2.5, 1)])) == 2


def test_canonical_numbers_reads_integral_floats_as_ints_in_lists_too():
    assert canonical_numbers({"a": 2.0, "b": [0.0, 0.5, 1.0], "c": True, "d": "2.0"}) == \
        {"a": 2, "b": [0, 0.5, 1], "c": True, "d": "2.0"}
    assert differing_keys([canonical_numbers({"x": 2}), canonical_numbers({"x": 2.0})]) == []
