"""eval-length's stored results (docs/faults.md, "An evaluation never replaces a more thorough
result"): factor=longest checked as its number, context-use columns merged with rows without them,
rows stored before a column existed, unreadable result files, default values given explicitly, and
what eval.allow_changed_data records in the CSVs. In-process, on one tiny rope run copied per test."""

import csv
import json
import shutil

import pytest

from conftest import run_in_process as relpos
from conftest import tiny_trained
from relpos_cli.config import default_group
from relpos_cli.evaluate import variant_settings
from relpos_cli.results import variant_tag
from test_errors import assert_one_clear_line

pytestmark = pytest.mark.usefixtures("in_temp_cwd")  # in-process runs point outputs/latest: not in the checkout

NTK_LONGEST = ["eval.protocol=sliding", "eval.stride=16", "eval.rope_scaling.type=ntk", "eval.rope_scaling.factor=longest"]
NTK_TAG = "protocol=sliding,rope_scaling.factor=3,rope_scaling.type=ntk,stride=16"  # longest: 96 / 32
SLIDING = ["eval.protocol=sliding", "eval.stride=8", "eval.tokens=200"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return tiny_trained(tmp_path_factory, "pos=rope")


@pytest.fixture
def run(trained, tmp_path):
    return shutil.copytree(trained, tmp_path / "run")


def read_csv(path):
    return list(csv.DictReader(path.open()))


def test_longest_factor_is_checked_and_compared_as_its_number(run, tmp_path):
    code, _, err = relpos("eval-length", str(run), "eval.lengths=[64,96]", "eval.tokens=300", *NTK_LONGEST)
    assert code == 0, err
    stored = (run / f"eval_length.{NTK_TAG}.json").read_text()
    code, _, err = relpos("eval-length", str(run), "eval.lengths=[96]", "eval.tokens=200", *NTK_LONGEST)
    assert_one_clear_line(code, err, "holds a result over 300 tokens", "--replace")
    assert (run / f"eval_length.{NTK_TAG}.json").read_text() == stored
    # compare finds the stored factor=3 variant (--no-evaluate: not "not evaluated")
    code, _, err = relpos("compare", str(run), "--no-evaluate", "eval.lengths=[64,96]", *NTK_LONGEST,
                          "--out", str(tmp_path / "cmp"))
    assert code == 0, err
    assert [r["variant"] for r in read_csv(tmp_path / "cmp" / "compare.csv")] == [NTK_TAG]


def test_context_columns_of_some_rows_are_kept_and_blank_in_the_others(run):
    variant = run / "eval_length.protocol=sliding,stride=8.csv"
    code, _, err = relpos("eval-length", str(run), "eval.lengths=[16]", *SLIDING, "eval.context_use=true")
    assert code == 0, err
    with_context = {r["length"]: r for r in read_csv(variant)}
    code, out, err = relpos("eval-length", str(run), "eval.lengths=[64]", *SLIDING)  # 16 kept, 32 scored again
    assert code == 0, err
    rows = {r["length"]: r for r in read_csv(variant)}
    assert rows["16"]["context_gain"] == with_context["16"]["context_gain"] and rows["64"]["context_gain"] == ""
    assert rows["32"]["context_gain"] == with_context["32"]["context_gain"] and "context gain" in out
    # the same lengths scored again without context_use keep their stored context columns
    code, _, err = relpos("eval-length", str(run), "eval.lengths=[16,64]", *SLIDING)
    assert code == 0, err
    assert "kept the stored context use" in err
    assert {r["length"]: r["context_gain"] for r in read_csv(variant)} == {k: r["context_gain"] for k, r in rows.items()}
    # a stored length without them kept beside new ones with them: its columns blank, not the columns dropped
    other = run / "eval_length.protocol=sliding,stride=16.csv"
    code, _, err = relpos("eval-length", str(run), "eval.lengths=[16]", "eval.protocol=sliding", "eval.stride=16",
                          "eval.tokens=200")
    assert code == 0, err
    code, out, err = relpos("eval-length", str(run), "eval.lengths=[64]", "eval.protocol=sliding", "eval.stride=16",
                            "eval.tokens=200", "eval.context_use=true")
    assert code == 0, err
    rows = {r["length"]: r for r in read_csv(other)}
    assert rows["16"]["context_gain"] == "" and rows["64"]["context_gain"] != "" and "context gain" in out


@pytest.mark.parametrize("content", ["[{\"length\": 16, \"tok", "null"])
def test_an_unreadable_result_stops_its_own_variant_only(run, content):
    code, _, err = relpos("eval-length", str(run), "eval.lengths=[16]", "eval.tokens=64")
    assert code == 0, err
    (run / "eval_length.json").write_text(content)
    code, _, err = relpos("eval-length", str(run), "eval.lengths=[64]", "eval.tokens=64", "eval.protocol=sliding",
                          "eval.stride=8")
    assert code == 0, err
    code, _, err = relpos("eval-length", str(run), "eval.lengths=[64]", "eval.tokens=64")
    assert_one_clear_line(code, err, str(run / "eval_length.json"), "unreadable", "--replace")
    assert code == 2 and (run / "eval_length.json").read_text() == content
    code, _, err = relpos("eval-length", str(run), "eval.lengths=[64]", "eval.tokens=64", "--replace")
    assert code == 0, err
    assert [r["length"] for r in json.loads((run / "eval_length.json").read_text())] == [32, 64]


@pytest.mark.parametrize("method, value", [("sinks.count", 0), ("rerope.slope", 0.0)])
def test_a_default_given_explicitly_is_the_default_variant(method, value):
    section = method.split(".")[0]
    plain = default_group("eval")
    plain[section].window = 8
    explicit = default_group("eval")
    explicit[section].window = 8
    explicit[section][method.split(".")[1]] = value
    assert variant_tag(variant_settings(explicit)) == variant_tag(variant_settings(plain)) == f"{section}.window=8"


def test_lengths_a_result_over_other_tokens_drops_are_named(run):
    """A quick evaluation over more tokens replaced the stored result whole, its other lengths gone
    without a word (compare then showed them at n=1). The training length (32) is always scored."""
    assert relpos("eval-length", str(run), "eval.lengths=[32,64,96]", "eval.tokens=128")[0] == 0
    code, out, err = relpos("eval-length", str(run), "eval.lengths=[64]", "eval.tokens=256")
    assert code == 0
    assert "dropped the stored lengths 96 of this variant (scored over 128 tokens, not this evaluation's 256)" in err
    assert [r["length"] for r in json.loads((run / "eval_length.json").read_text())] == [32, 64]
    # the same tokens keep them, and say so instead
    code, out, err = relpos("eval-length", str(run), "eval.lengths=[96]", "eval.tokens=256")
    assert code == 0 and "dropped the stored" not in err and "kept the stored lengths 64" in err


def test_lengths_stored_before_bpb_are_kept_with_the_bpb_their_tokens_give(run):
    """A result stored before bpb (or precision) existed, and another length scored over the same
    tokens: the stored rows were kept as they were, and the table's f"{r['bpb']}" raised KeyError
    after the scoring (a traceback, nothing written). The same tokens cover the same bytes, so a kept
    row's bpb is its loss x bpb / loss of this evaluation; rows lacking precision are fp32's; a row
    lacking a column nothing can give back is dropped, and said to be."""
    assert relpos("eval-length", str(run), "eval.lengths=[16,48,64]", "eval.tokens=128")[0] == 0
    path = run / "eval_length.json"
    rows = json.loads(path.read_text())
    bpb = {r["length"]: r["bpb"] for r in rows}
    dated = [{k: v for k, v in r.items() if k not in ("bpb", "precision") and (r["length"] != 48 or k != "ppl_ratio")}
             if r["length"] in (16, 48) else {k: v for k, v in r.items() if k != "precision"} for r in rows]
    path.write_text(json.dumps(dated))
    code, out, err = relpos("eval-length", str(run), "eval.lengths=[96]", "eval.tokens=128")
    assert code == 0, err
    assert "the stored lengths 16 predate bpb" in err and "kept the stored lengths 16, 64" in err
    assert "dropped the stored lengths 48 of this variant (stored before its ppl_ratio column)" in err
    stored = {r["length"]: r for r in json.loads(path.read_text())}
    assert sorted(stored) == [16, 32, 64, 96]
    assert stored[16]["bpb"] == pytest.approx(bpb[16], rel=1e-12) and stored[64]["bpb"] == bpb[64]
    assert all(r["precision"] == "fp32" for r in stored.values())
    assert [r["precision"] for r in read_csv(run / "eval_length.csv")] == ["fp32"] * 4


def test_what_changed_in_the_data_is_in_the_csvs_as_in_the_json(run):
    """eval.allow_changed_data records what changed (data_changed) in the JSON rows; the CSVs left
    the column out (eval-task's CSV has it), so a result read from the CSV did not say it."""
    data = json.loads((run / "data.json").read_text())
    data["tokens"]["validation"]["sha256"] = "0" * 64
    (run / "data.json").write_text(json.dumps(data))
    code, _, err = relpos("eval-length", str(run), "eval.lengths=[16]", "eval.tokens=64", "eval.allow_changed_data=true")
    assert code == 0, err
    (json_path,) = run.glob("eval_length.*.json")
    (csv_path,) = run.glob("eval_length.*.csv")
    (positions,) = run.glob("eval_positions.*.csv")
    changed = json.loads(json_path.read_text())[0]["data_changed"]
    assert "validation tokens differ (other ids, the same" in changed  # not "475,250 -> 475,250 tokens"
    assert {r["data_changed"] for r in read_csv(csv_path)} == {changed}
    assert {r["data_changed"] for r in read_csv(positions)} == {changed}


def test_the_progress_bar_counts_context_use_passes(run, monkeypatch):
    """eval.context_use scores each length twice more (windows of L and of L_train); the bar's total
    and its advances counted only the plain passes, so it stood full while those ran. Every forward
    pass is counted now, and L = L_train's two identical scorings are one."""
    from contextlib import contextmanager

    from relpos_cli.evaluate import evaluate_run
    from relpos_cli.model import Transformer

    forwards, counts = [], {"done": 0}
    token_losses = Transformer.token_losses
    monkeypatch.setattr(Transformer, "token_losses", lambda self, *a, **k: forwards.append(1) or token_losses(self, *a, **k))

    @contextmanager
    def progress(total):
        counts["total"] = total
        yield lambda n=1: counts.__setitem__("done", counts["done"] + n)

    _, rows, _ = evaluate_run(run, ["eval.lengths=[16,64]", "eval.tokens=256", "eval.protocol=sliding", "eval.stride=16",
                                    "eval.context_use=true", "eval.max_tokens_per_batch=64"], progress)
    assert counts["total"] == counts["done"] == len(forwards)
    # 256 targets, 64 tokens a pass. 16: 16 windows of 16 (4 a pass), context 14 of 16 and 14 of 32 (2 a pass);
    # 32 (the training length): 15 windows, context 14 of 32 once; 64: 13 windows (1 a pass), context 12 of 64, 12 of 32
    assert len(forwards) == (4 + 4 + 7) + (8 + 7) + (13 + 12 + 6)
    assert next(r for r in rows if r["length"] == 32)["context_gain"] == 0.0

