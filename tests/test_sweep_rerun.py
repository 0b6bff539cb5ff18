"""A sweep into a dir that already holds runs, with the basic launcher and with the local one (joblib
workers, where a job's outcome never reached the sweep's process): the exit code and the closing
message name this sweep's own jobs that were refused or failed, and why; a hint names only files
that exist; runs of other sweeps in the dir are compared but never counted as this sweep's failures.

Before: re-running a sweep into a copy of its dir exited 0 under the local launcher although every
job was refused, and exited 1 under the basic one with "4 sweep job(s) failed (see failed.json in
each)" and no failed.json anywhere; a `relpos sweep` into a dir where `relpos train -m` had added runs
counted those runs (not evaluated) as its own failed jobs.
"""

import json
import shutil
from pathlib import Path

import pytest

from conftest import TINY, run_cli, tree_state

EVAL = ["eval.lengths=[32]", "eval.tokens=128"]
LAUNCHERS = {"basic": ["hydra/launcher=basic"], "local": ["hydra/launcher=local", "hydra.launcher.n_jobs=2"]}


def sweep(sweep_dir: Path, *overrides: str, cwd: Path):
    return run_cli("sweep", *TINY, *EVAL, *overrides, f"hydra.sweep.dir={sweep_dir}", cwd=cwd, check=False)


def error_text(proc) -> str:
    return " ".join(proc.stderr.split())  # rich wraps long lines


def files(run: Path) -> dict:
    """The state of every file under a run dir (a refusal takes and drops the dir's lock, which
    touches the dir itself)."""
    return {name: state for name, state in tree_state(run).items() if name != "."}


def run_dirs(sweep_dir: Path) -> list[Path]:
    return sorted(p for p in sweep_dir.iterdir() if p.is_dir() and p.name[0].isdigit())


@pytest.fixture(scope="module")
def first_sweep(tmp_path_factory) -> Path:
    """A finished two-job sweep (both runs trained and evaluated)."""
    base = tmp_path_factory.mktemp("first")
    proc = sweep(base / "sweep", "pos=none,rope", cwd=base)
    assert proc.returncode == 0, proc.stderr
    return base / "sweep"


def copy_of(first_sweep: Path, to: Path) -> Path:
    """The bug report's copy: the run dirs and multirun.yaml, not the comparison."""
    to.mkdir()
    for run in run_dirs(first_sweep):
        shutil.copytree(run, to / run.name)
    shutil.copy(first_sweep / "multirun.yaml", to)
    return to


@pytest.fixture(scope="module")
def shared_with_another_sweep(first_sweep, tmp_path_factory) -> Path:
    """A copy of the first sweep's dir to which `relpos train -m` added two runs of its own, trained and
    never evaluated: built once for both launchers, each test sweeping into a copy of it."""
    base = tmp_path_factory.mktemp("shared")
    shared = copy_of(first_sweep, base / "shared")
    other = run_cli("train", "-m", *TINY, "train.steps=2", "pos=alibi,t5", f"hydra.sweep.dir={shared}", cwd=base,
                    check=False)
    assert other.returncode == 0, other.stderr
    return shared


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_rerun_into_a_dir_holding_its_runs_exits_1_naming_each_refused_job(first_sweep, tmp_path, launcher):
    again = copy_of(first_sweep, tmp_path / "again")
    runs = run_dirs(again)
    before = {run: files(run) for run in runs}
    proc = sweep(again, "pos=none,rope", *LAUNCHERS[launcher], cwd=tmp_path)
    err = error_text(proc)
    assert proc.returncode == 1 and "Traceback" not in err, err
    summary = err[err.index("2 sweep job(s) refused, their run dirs left as they were:"):]
    for run in runs:
        assert f"{run} already holds a run; continue it with resume={run}" in summary
    assert "failed" not in err  # no job failed, and no failed.json exists to point at
    assert not list(again.glob("*/failed.json"))
    assert {run: files(run) for run in runs} == before
    assert not list(again.glob(".relpos-job-problems.*")), "the jobs' records are removed once read"


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_runs_another_sweep_added_to_the_dir_are_compared_but_never_counted_as_failed(shared_with_another_sweep,
                                                                                      tmp_path, launcher):
    shared = tmp_path / "shared"
    shutil.copytree(shared_with_another_sweep, shared)
    theirs = set(run_dirs(shared))
    proc = sweep(shared, "pos=learned", "pos.max_positions=16,64", *LAUNCHERS[launcher], cwd=tmp_path)
    err = error_text(proc)
    assert proc.returncode == 1 and "Traceback" not in err, err
    (failed,) = shared.glob("*pos.max_positions=16*")  # shorter than train.seq_len: fails at once
    assert f"1 sweep job(s) failed (see failed.json in each): {failed}" in err
    assert (failed / "failed.json").is_file()
    for run in theirs:
        assert str(run) not in err, f"another sweep's run was reported: {run}"
    assert "refused" not in err and "sweep job(s)" not in err.replace("1 sweep job(s) failed", "")
    compared = json.loads((shared / "compare.json").read_text())
    assert {g["label"] for g in compared["groups"]} == {"none", "rope", "learned"}  # every evaluated run in the dir


def test_the_failed_json_hint_names_only_run_dirs_that_hold_one(tmp_path, capsys):
    """failed.json is written on a best-effort basis (a full disk, a read-only dir): a job without one is listed
    with its error instead, and a job that trained but was not evaluated is not sent looking for it."""
    from relpos_cli.jobs import FAILED, NOT_EVALUATED, JobProblem, exit_if_failed

    marked, unmarked, trained = (tmp_path / name for name in ("marked", "unmarked", "trained"))
    for run in (marked, unmarked, trained):
        run.mkdir()
    (marked / "failed.json").write_text("{}")
    with pytest.raises(SystemExit) as stop:
        exit_if_failed([JobProblem(str(marked), FAILED, "boom"), JobProblem(str(unmarked), FAILED, "disk full"),
                        JobProblem(str(trained), NOT_EVALUATED, "out of memory")])
    err = " ".join(capsys.readouterr().err.split())
    assert stop.value.code == 1
    assert f"1 sweep job(s) failed (see failed.json in each): {marked}" in err
    assert f"1 sweep job(s) failed: {unmarked}: disk full" in err
    assert f"{trained}: out of memory" in err and err.count("failed.json") == 1
