"""eval-task stores each length as soon as it is scored (eval_task.StoredSoFar): a stop (Ctrl-C, kill,
the GPU script's time limit) used to lose every finished length ("nothing was written"). Now the
lengths scored are merged with the stored result as the final write merges them, the stop says which
lengths were kept and where, and a rerun gives the numbers one uninterrupted evaluation gives.

In-process, the stop is raised where the second or third length would be scored, as the signal
handler raises it (interrupt._stop); one test sends a real SIGINT while the scoring thread is inside
its first write. The scoring is scripted (right at lengths up to 224, then by the answer's parity) so
the stored numbers differ between lengths: the tiny model gets nothing right anywhere.

Mutation checked, each fails here: no interim write (evaluate_task never calling `scored`); the interim
write replacing the stored result instead of merging it (StoredSoFar.write's with_stored dropped); the
interim rows' intervals and effective length not recomputed over the rows held (_so_far returning the
rows as they are); `stop` not waiting for a write under way (the lock not taken); `stop` keeping the
old message; the final write not recorded (StoredSoFar.written)."""

import csv
import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO
from conftest import run_in_process as relpos
from relpos_cli import eval_task
from relpos_cli.compare import run_compare
from relpos_cli.errors import RelposError
from relpos_cli.interrupt import _stop
from relpos_cli.intervals import wilson
from test_errors import assert_one_clear_line
from test_task_faults import copy_of, passkey_run  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("in_temp_cwd")  # in-process runs point outputs/latest at their run dir
ASKED = ["task.samples=2", "task.eval_lengths=[112,224,448]", "task.depths=[0,1]"]
SCORE_LENGTH, REPORT_RESULT = eval_task._score_length, eval_task.report_result
REST = "to score the rest, run eval-task again with task.eval_lengths=[{}] (as it was, it scores every length again)"


def scripted_matches(model, input_ids, spans, positions=None):
    """Every answer right at lengths up to 224, at longer ones those whose tokens sum to an even number:
    the same mixed accuracies in every evaluation (effective length 224, learned)."""
    return [[input_ids.shape[1] <= 224 or int(input_ids[row, start:end].sum()) % 2 == 0 for start, end in s]
            for row, s in enumerate(spans)]


@pytest.fixture(autouse=True)
def scripted_answers(monkeypatch):
    monkeypatch.setattr(eval_task, "exact_matches", scripted_matches)


def stop_at(monkeypatch, length, sig=signal.SIGINT):
    """The evaluation stopped as `sig` stops it (the handler's Interrupted) where `length` would be scored."""
    def scoring(model, dataset, first_cell, at, *rest):
        if at == length:
            _stop(sig, None)
        return SCORE_LENGTH(model, dataset, first_cell, at, *rest)

    monkeypatch.setattr(eval_task, "_score_length", scoring)


def stored(run):
    return json.loads((run / "eval_task.json").read_text())


def units(payload):
    """(length, depth, correct, answers, samples) of every stored row and cell."""
    return [(u["length"], u["depth"], u["correct"], u["answers"], u["samples"])
            for u in payload["lengths"] + payload["cells"]]


def nothing_pending(run):
    return not list(run.glob(".*.tmp")) and not (run / ".relpos.pid").exists()


@pytest.fixture(scope="module")
def uninterrupted(passkey_run, tmp_path_factory):
    """What one uninterrupted evaluation of ASKED stores: (JSON payload, CSV text)."""
    run = copy_of(passkey_run, tmp_path_factory.mktemp("whole"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(eval_task, "exact_matches", scripted_matches)
        code, _, err = relpos("eval-task", str(run), *ASKED)
    assert code == 0, err
    return stored(run), (run / "eval_task.csv").read_text()


def test_a_stop_keeps_the_lengths_scored_and_a_rerun_gives_the_uninterrupted_result(
        passkey_run, uninterrupted, tmp_path, monkeypatch):
    whole, whole_csv = uninterrupted
    run = copy_of(passkey_run, tmp_path)
    with monkeypatch.context() as patch:
        stop_at(patch, 112)  # before any length is stored: as before
        code, _, err = relpos("eval-task", str(run), *ASKED)
        assert_one_clear_line(code, err, "SIGINT: stopped; nothing was written")
        assert not list(run.glob("eval_task*")) and nothing_pending(run)

        stop_at(patch, 224)
        code, _, err = relpos("eval-task", str(run), *ASKED)
    assert code == 130
    json_path = run / "eval_task.json"
    assert err.strip() == f"error: SIGINT: stopped; lengths 112 kept in {json_path}; {REST.format('224,448')}"
    assert "eval-task: error: SIGINT: stopped; lengths 112 kept in" in (run / "relpos.log").read_text()
    assert sorted(p.name for p in run.glob("eval_task*")) == ["eval_task.csv", "eval_task.json"]  # plots: final only
    assert nothing_pending(run)
    partial = stored(run)
    assert units(partial) == [u for u in units(whole) if u[0] == 112]  # the first length, as the whole run scores it
    for r in partial["lengths"] + partial["cells"]:  # its own intervals, effective length over what it holds
        assert (r["ci_low"], r["ci_high"]) == wilson(r["correct"], r["answers"]) and r["answers"] > 0
        assert (r["effective_length"], r["effective_length_lower"], r["learned"]) == (112, 0, True)
    assert (partial["effective_length"], partial["learned"], partial["left_out"]) == (112, True, [])
    assert whole["effective_length"] == 224  # the whole result's is another
    rows = list(csv.DictReader(io.StringIO((run / "eval_task.csv").read_text())))
    assert [(int(r["length"]), r["depth"], int(r["correct"])) for r in rows] == \
        [(length, str(depth), correct) for length, depth, correct, *_ in units(partial)]

    code, _, err = relpos("eval-task", str(run), *ASKED)  # the same command again
    assert code == 0, err
    assert stored(run) == whole and (run / "eval_task.csv").read_text() == whole_csv
    assert "kept" not in err  # nothing of the interim file counted as a stored result kept


def test_the_rest_named_by_the_stop_completes_the_result(passkey_run, uninterrupted, tmp_path, monkeypatch):
    """The narrower rerun the message suggests scores only the rest (and the training length) and
    stores what the whole evaluation stores: the time a time limit cut off is not spent again."""
    whole, _ = uninterrupted
    run = copy_of(passkey_run, tmp_path)
    with monkeypatch.context() as patch:
        stop_at(patch, 448, signal.SIGTERM)
        code, _, err = relpos("eval-task", str(run), *ASKED)
    assert code == 128 + signal.SIGTERM
    json_path = run / "eval_task.json"
    assert err.strip() == f"error: SIGTERM: stopped; lengths 112, 224 kept in {json_path}; {REST.format(448)}"
    code, _, err = relpos("eval-task", str(run), *ASKED[:-2], "task.eval_lengths=[448]", ASKED[-1])
    assert code == 0, err
    assert "kept 2 (length, depth) cells of the stored result" in " ".join(err.split())  # 224's: not scored again
    again = stored(run)
    assert units(again) == units(whole)
    assert [r[k] for r in again["lengths"] for k in ("ci_low", "effective_length", "learned")] == \
        [r[k] for r in whole["lengths"] for k in ("ci_low", "effective_length", "learned")]
    assert again["left_out"] == whole["left_out"] == []


def test_a_stop_after_the_final_write_names_every_length(passkey_run, tmp_path, monkeypatch):
    """Stopped while the result is logged (relpos.log, W&B) after its files are written: not "nothing
    was written"."""
    run = copy_of(passkey_run, tmp_path)

    def stopped_after(*args):
        REPORT_RESULT(*args)
        _stop(signal.SIGHUP, None)

    monkeypatch.setattr(eval_task, "report_result", stopped_after)
    code, _, err = relpos("eval-task", str(run), *ASKED)
    assert code == 128 + signal.SIGHUP
    # the last line: matplotlib's first font cache in a process may log to a stream an earlier in-process run closed
    json_path = run / "eval_task.json"
    assert err.strip().splitlines()[-1] == f"error: SIGHUP: stopped; lengths 112, 224, 448 kept in {json_path}"
    assert [r["length"] for r in stored(run)["lengths"]] == [112, 224, 448] and (run / "eval_task.png").is_file()


def test_an_interim_write_keeps_a_more_thorough_stored_length(passkey_run, tmp_path, monkeypatch):
    """Stored: 112 with 4 examples per depth, 224 and 448 with 1. Stopped before 448, a 2-example
    evaluation stores 224 (more than the stored 1) and keeps 112 (4: more thorough) and 448 (not scored
    yet); a stopped --replace leaves the stored file as it was: it replaces only once it is whole."""
    run = copy_of(passkey_run, tmp_path)
    assert relpos("eval-task", str(run), "task.samples=4", "task.eval_lengths=[112]", "task.depths=[0,1]")[0] == 0
    assert relpos("eval-task", str(run), "task.samples=1", "task.eval_lengths=[224,448]", "task.depths=[0,1]")[0] == 0
    before = {(u[0], u[1]): u[4] for u in units(stored(run))}
    assert before == {(112, "all"): 8, (224, "all"): 2, (448, "all"): 2, (112, 0): 4, (112, 1): 4, (224, 0): 1,
                      (224, 1): 1, (448, 0): 1, (448, 1): 1}
    with monkeypatch.context() as patch:
        stop_at(patch, 448)
        code, _, err = relpos("eval-task", str(run), *ASKED)
        assert_one_clear_line(code, err, "SIGINT: stopped; lengths 112, 224 kept in")
        partial = stored(run)
        assert {(u[0], u[1]): u[4] for u in units(partial)} == {**before, (224, "all"): 4, (224, 0): 2, (224, 1): 2}
        per_length = {r["length"]: r for r in partial["lengths"]}  # summed again from the merged cells
        assert per_length[112]["answers"] == 8 and per_length[448]["answers"] == 2
        assert {r["effective_length"] for r in partial["lengths"] + partial["cells"]} == {partial["effective_length"]}

        code, _, err = relpos("eval-task", str(run), *ASKED, "--replace")
    assert_one_clear_line(code, err, "SIGINT: stopped; nothing was written")
    assert stored(run) == partial


def test_compare_reads_an_interim_file_as_fewer_lengths_than_asked(passkey_run, tmp_path, monkeypatch):
    """compare reads left_out to tell lengths the run cannot score from lengths not scored: an interim
    file leaves out none, so the lengths not scored yet are missing, not skipped; the lengths it holds
    are compared."""
    from rich.console import Console

    run = copy_of(passkey_run, tmp_path)
    with monkeypatch.context() as patch:
        stop_at(patch, 224)
        assert relpos("eval-task", str(run), *ASKED)[0] == 130
    partial = stored(run)
    console = Console(file=io.StringIO(), width=250)
    with pytest.raises(RelposError, match="at fewer lengths, depths or samples than asked; run `relpos eval-task"):
        run_compare([run], ASKED, tmp_path / "all", False, "accuracy", console)
    narrower = [*ASKED[:-2], "task.eval_lengths=[112]", ASKED[-1]]
    run_compare([run], narrower, tmp_path / "first", False, "accuracy", console)
    group, = json.loads((tmp_path / "first" / "compare_accuracy.json").read_text())["groups"]
    assert list(group["cells"]) == ["112"] and group["cells"]["112"]["mean"] == partial["lengths"][0]["accuracy"]


# `relpos ARGS` whose first write of a length scored stalls at its fsync (its temp file written, not renamed)
STALLED_WRITE = """
import os, pathlib, sys, threading, time
from relpos_cli import eval_task
marker, inside = pathlib.Path(sys.argv.pop(1)), threading.local()
real_files, real_fsync = eval_task.write_task_files, os.fsync
def files(*args):
    inside.writing = True
    try:
        real_files(*args)
    finally:
        inside.writing = False
def stalled(fd):
    if getattr(inside, "writing", False) and not marker.exists():
        marker.touch()
        time.sleep(3)
    real_fsync(fd)
eval_task.write_task_files, os.fsync = files, stalled
from relpos_cli.cli import main
sys.argv[0] = "relpos"
main()
"""


def test_sigint_mid_write_waits_for_the_write_and_names_what_it_holds(passkey_run, tmp_path):
    """The scoring thread writes while the main thread takes the signal: the stop waits for the write
    under way (the run dir still locked), so the JSON is whole, no temp file is left, and the message
    names the length it holds; the process then exits with the scoring thread still running."""
    run, marker = copy_of(passkey_run, tmp_path), tmp_path / "writing"
    proc = subprocess.Popen([sys.executable, "-c", STALLED_WRITE, str(marker), "eval-task", str(run), *ASKED],
                            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), proc.communicate()
    assert list(run.glob(".eval_task*.tmp"))  # mid-write
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    json_path = run / "eval_task.json"
    assert err.strip() == f"error: SIGINT: stopped; lengths 112 kept in {json_path}; {REST.format('224,448')}"
    assert [r["length"] for r in stored(run)["lengths"]] == [112] and nothing_pending(run)
