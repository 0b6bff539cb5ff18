"""Wilson intervals against SciPy's (binomtest(...).proportion_ci(method="wilson")) and the values
the issue quotes (18 of 20: 0.70 to 0.97); the interval of a mean over seeds against SciPy's t."""

import math

import pytest

from relpos_cli.intervals import mean_interval, separated, student_t975, wilson

scipy_stats = pytest.importorskip("scipy.stats")


@pytest.mark.parametrize("correct, n", [(0, 1), (1, 1), (18, 20), (0, 20), (20, 20), (7, 13), (50, 100), (3, 300)])
def test_wilson_matches_scipy(correct, n):
    reference = scipy_stats.binomtest(correct, n).proportion_ci(confidence_level=0.95, method="wilson")
    low, high = wilson(correct, n)
    assert low == pytest.approx(reference.low, abs=1e-12) and high == pytest.approx(reference.high, abs=1e-12)


def test_the_cell_the_issue_quotes():
    low, high = wilson(18, 20)
    assert round(low, 2) == 0.70 and round(high, 2) == 0.97


def test_no_answers_say_nothing_and_impossible_counts_are_refused():
    assert wilson(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        wilson(5, 4)


@pytest.mark.parametrize("df", [1, 2, 3, 9, 29, 30, 31, 40, 60, 120, 1000])
def test_student_t_quantile_matches_scipy(df):
    """Mutation seen failing: the expansion's second-order term dropped (2.0412 at 31 against 2.0395)."""
    assert student_t975(df) == pytest.approx(scipy_stats.t.ppf(0.975, df), abs=2e-4)


def test_the_interval_of_a_mean_over_seeds():
    values = [3.51, 3.55, 3.48]
    mean, std = sum(values) / 3, (sum((v - sum(values) / 3) ** 2 for v in values) / 2) ** 0.5
    reference = scipy_stats.t.interval(0.95, 2, loc=mean, scale=std / math.sqrt(3))
    assert mean_interval(mean, std, 3) == pytest.approx(reference, abs=1e-3)
    assert mean_interval(4.0, None, 1) is None and mean_interval(math.inf, math.nan, 2) is None


def test_separated_needs_no_overlap():
    assert not separated(wilson(19, 20), wilson(17, 20))  # 0.95 and 0.85 at n = 20: not told apart
    assert separated(wilson(190, 200), wilson(150, 200))


# ---- where the intervals show: eval-task's rows, compare's bold ------------------------------------
def test_eval_task_rows_carry_n_and_their_interval(tiny_run, tmp_path, monkeypatch):
    import json
    import shutil

    from conftest import run_in_process

    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    code, out, err = run_in_process("eval-task", str(run), "task=flip_flop", "task.eval_lengths=[32,64]",
                                    "task.samples=10", "task.threshold=0.01")
    assert code == 0, err
    payload = json.loads(next(run.glob("eval_task*.json")).read_text())
    for r in payload["lengths"]:
        reference = scipy_stats.binomtest(r["correct"], r["answers"]).proportion_ci(method="wilson")
        assert (r["ci_low"], r["ci_high"]) == pytest.approx((reference.low, reference.high), abs=1e-12)
    lowers = {r["length"]: r["ci_low"] for r in payload["lengths"]}
    want_lower = 0
    for length in sorted(lowers):  # the effective length of the lower bound, recounted here
        if lowers[length] < 0.01:
            break
        want_lower = length
    assert payload["effective_length_lower"] == want_lower <= payload["effective_length"]
    text = " ".join(out.split())
    assert "95% Wilson interval" in text and "by its lower 95% bound" in text
    header = (next(run.glob("eval_task*.csv"))).read_text().splitlines()[0].split(",")
    assert {"ci_low", "ci_high", "answers", "effective_length_lower"} <= set(header)


def cell(correct: int, n: int) -> dict:
    low, high = wilson(correct, n)
    return {"mean": correct / n, "ci_low": low, "ci_high": high}


def test_compare_bolds_a_best_only_when_its_interval_clears_the_runner_up():
    from relpos_cli.compare_accuracy import bold_lengths

    close = [{"cells": {128: cell(19, 20)}}, {"cells": {128: cell(17, 20)}}]  # 0.95 vs 0.85 at n = 20
    assert bold_lengths(close) == {}
    apart = [{"cells": {128: cell(190, 200), 256: cell(10, 20)}}, {"cells": {128: cell(150, 200)}}]
    assert bold_lengths(apart) == {128: apart[0]["cells"][128]}  # 256: one row only, nothing to beat
