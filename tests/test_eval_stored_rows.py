"""eval-length's stored results under use (a hidden try of the evaluation): rows stored before a
column existed merged with a new evaluation, and what eval.allow_changed_data records in the CSVs.
In-process, on one tiny rope run copied per test."""

import csv
import json
import shutil

import pytest

from conftest import run_in_process as relpos
from conftest import tiny_trained

pytestmark = pytest.mark.usefixtures("in_temp_cwd")  # in-process runs point outputs/latest: not in the checkout


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return tiny_trained(tmp_path_factory, "pos=rope")


@pytest.fixture
def run(trained, tmp_path):
    return shutil.copytree(trained, tmp_path / "run")


def read_csv(path):
    return list(csv.DictReader(path.open()))


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

