"""A run that diverges but ends finite (train.on_nan=skip at lr=1e3: losses of ~3e9 nats, whose
perplexity is beyond a float) trains, evaluates and compares without a crash; its skipped-step count
survives a resume; train.on_nan=stop names the value that was non-finite; compare counts each run dir
once and skips a run whose config.yaml does not parse; inspect calls a cut-short config.yaml incomplete;
a job requeued before its first checkpoint starts its run afresh."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from conftest import TINY, metrics, run_in_process
from test_errors import assert_one_clear_line

pytestmark = pytest.mark.usefixtures("in_temp_cwd")  # in-process runs point outputs/latest: not in the checkout

# steps from 3 on overflow the gradient norm and are skipped; the model still ends finite
DIVERGING = [*TINY, "train.steps=8", "train.log_every=1", "train.ckpt_every=4", "train.lr=1e3", "train.warmup_steps=0",
             "device=cpu"]
LARGEST_EXP = math.log(torch.finfo(torch.float64).max)  # ~709.78: exp of a larger loss is no float


@pytest.fixture(scope="module")
def diverged(in_temp_cwd, tmp_path_factory):
    """The run, trained uninterrupted: (run dir, exit code, stdout, stderr, what outputs/latest then points at)."""
    run_dir = tmp_path_factory.mktemp("diverged") / "run"
    code, out, err = run_in_process("train", *DIVERGING, "train.on_nan=skip", f"hydra.run.dir={run_dir}")
    return run_dir, code, out, err, Path("outputs/latest").resolve()


@pytest.fixture(scope="module")
def evaluated(diverged, tmp_path_factory):
    """A copy of the diverged run, evaluated at its train length and twice it."""
    run_dir = tmp_path_factory.mktemp("evaluated") / "run"
    shutil.copytree(diverged[0], run_dir)
    code, _, err = run_in_process("eval-length", str(run_dir), "eval.lengths=[32,64]", "eval.tokens=256")
    assert code == 0, err
    return run_dir


def test_a_diverged_run_with_a_finite_loss_finishes_as_a_result(diverged):
    run_dir, code, out, err, latest = diverged
    assert code == 0, err
    assert metrics(run_dir)[-1]["val_loss"] > LARGEST_EXP  # the case: finite, its exp beyond a float
    assert (run_dir / "checkpoint.pt").is_file() and not (run_dir / "failed.json").exists()
    assert latest == run_dir.resolve()
    assert "(ppl inf)" in out


def test_a_failure_after_the_final_checkpoint_would_be_written_leaves_none(tmp_path, monkeypatch):
    """Whatever fails in the run's last line fails before checkpoint.pt: never both it and failed.json."""
    import relpos_cli.train

    def fail(loss):
        raise RuntimeError("summary failed")

    monkeypatch.setattr(relpos_cli.train, "perplexity", fail)
    run_dir = tmp_path / "run"
    with pytest.raises(RuntimeError, match="summary failed"):
        run_in_process("train", *TINY, f"hydra.run.dir={run_dir}")
    assert (run_dir / "failed.json").is_file() and not (run_dir / "checkpoint.pt").exists()


def test_its_perplexity_is_stored_as_inf_and_its_ratio_from_the_losses(evaluated):
    rows = json.loads((evaluated / "eval_length.json").read_text())  # json reads Infinity back as inf
    assert [r["length"] for r in rows] == [32, 64]
    assert all(r["loss"] > LARGEST_EXP and r["ppl"] == math.inf for r in rows)
    assert rows[0]["ppl_ratio"] == 1.0
    # ppl / ppl@train would be inf / inf = nan; from the losses it is exp(their difference)
    ratio, log_ratio = rows[1]["ppl_ratio"], rows[1]["loss"] - rows[0]["loss"]
    if abs(log_ratio) < LARGEST_EXP:
        assert math.log(ratio) == pytest.approx(log_ratio)
    else:
        assert (ratio == math.inf) if log_ratio > 0 else (ratio < 1e-300)
    csv_ppl = [line.split(",")[3] for line in (evaluated / "eval_length.csv").read_text().splitlines()[1:]]
    assert csv_ppl == ["inf", "inf"]


@pytest.fixture
def sweep(evaluated, tmp_path):
    """Two seeds of the diverged configuration (copies of the evaluated run)."""
    for seed in ("a", "b"):
        shutil.copytree(evaluated, tmp_path / "sweep" / seed)
    (tmp_path / "link").symlink_to(tmp_path / "sweep")
    return tmp_path / "sweep"


def compare(tmp_path, *paths):
    """`relpos compare PATHS --no-evaluate` -> (exit code, stderr, compare.json)."""
    code, _, err = run_in_process("compare", *map(str, paths), "--no-evaluate", "--out", str(tmp_path / "out"))
    report = json.loads((tmp_path / "out" / "compare.json").read_text()) if code == 0 else None
    return code, err, report


def test_compare_shows_inf_means_of_several_seeds(sweep, tmp_path):
    code, err, report = compare(tmp_path, sweep)
    assert code == 0, err
    (group,) = report["groups"]
    assert {l: (c["mean"], c["n"]) for l, c in group["cells"].items()} == {"32": (math.inf, 2), "64": (math.inf, 2)}
    assert all(math.isnan(c["std"]) for c in group["cells"].values())


@pytest.mark.parametrize("again", ["sweep", "link", "sweep/a"])
def test_compare_counts_a_run_named_twice_once(sweep, tmp_path, again):
    code, err, report = compare(tmp_path, sweep, tmp_path / again)
    assert code == 0, err
    (group,) = report["groups"]
    assert sorted(group["runs"]) == [str(sweep / "a"), str(sweep / "b")]
    assert all(c["n"] == 2 for c in group["cells"].values())
    assert "counted once" in err


def test_compare_skips_a_run_whose_config_does_not_parse(sweep, tmp_path):
    config = sweep / "b" / "config.yaml"
    config.write_text(config.read_text()[:300])  # cut mid-key, as a full disk leaves it
    with pytest.raises(Exception):
        OmegaConf.load(config)  # the case: it does not parse
    code, err, report = compare(tmp_path, sweep)
    assert code == 0, err
    assert [c["n"] for c in report["groups"][0]["cells"].values()] == [1, 1]
    (failed,) = report["failed"]
    assert failed["run"] == str(sweep / "b") and failed["reason"].startswith(f"{config}: unreadable config (")


def test_inspect_calls_a_cut_short_config_incomplete(evaluated, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(evaluated, run_dir)
    config = run_dir / "config.yaml"
    config.write_text(config.read_text().split("\ndata:")[0] + "\n")  # cut at a line before data: it still parses
    assert "data" not in OmegaConf.load(config)
    code, _, err = run_in_process("inspect", str(run_dir))
    assert_one_clear_line(code, err, f"{config} is incomplete", "Restore it")


def test_skipped_steps_count_on_after_a_resume(diverged, tmp_path):
    """Resumed from its step-4 checkpoint (as after a kill there), the run logs what the uninterrupted one did."""
    reference = diverged[0]
    want = metrics(reference)
    assert want[3]["step"] == 4 and want[3]["skipped_steps"] > 0  # the checkpoint comes after skipped steps
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    (run_dir / "checkpoint.pt").unlink()
    code, _, err = run_in_process("train", f"resume={run_dir}")
    assert code == 0, err
    without_timing = lambda rows: [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows]  # noqa: E731
    assert without_timing(metrics(run_dir)) == without_timing(want)


def test_a_checkpoint_saved_before_the_count_resumes_counting_from_zero(diverged, tmp_path):
    reference = diverged[0]
    want = {r["step"]: r.get("skipped_steps", 0) for r in metrics(reference)}
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    (run_dir / "checkpoint.pt").unlink()
    periodic = run_dir / "checkpoints" / "step_00000004.pt"
    state = torch.load(periodic, weights_only=False)
    del state["skipped_steps"]
    torch.save(state, periodic)
    code, _, err = run_in_process("train", f"resume={run_dir}")
    assert code == 0, err
    got = {r["step"]: r.get("skipped_steps", 0) for r in metrics(run_dir) if r["step"] > 4}
    assert got == {step: want[step] - want[4] for step in range(5, 9)}


def test_on_nan_stop_names_the_value_that_was_not_finite(diverged, tmp_path):
    """The skip run shows the first non-finite step's loss was finite: its gradient norm was not."""
    rows = metrics(diverged[0])
    first = next(r for r in rows if r.get("skipped_steps"))
    assert math.isfinite(first["loss"])
    code, _, err = run_in_process("train", *DIVERGING, f"hydra.run.dir={tmp_path / 'run'}")
    assert_one_clear_line(code, err, f"non-finite gradient norm (inf) at step {first['step']};", "last good checkpoint")
    assert "loss" not in err


def test_a_job_requeued_before_its_first_checkpoint_starts_its_run_afresh(tmp_path):
    """SLURM's time-limit signal while the job loads its data marks the run dir requeued.json with no
    checkpoint yet. The requeued job resumed nothing as a "resume": it skipped a fresh run's steps, so
    a fine-tune (init_from) trained relpos's default scheme instead of its parent's, and no data.json
    was written. It must start as it first did."""
    from relpos_cli.requeue import MARKER
    from relpos_cli.rundir import LOCK_FILE

    parent = tmp_path / "parent"
    code, _, err = run_in_process("train", *TINY, "pos=alibi", f"hydra.run.dir={parent}")
    assert code == 0, err
    child = tmp_path / "child"
    child.mkdir()
    (child / LOCK_FILE).touch()  # what the first attempt left: its lock, and the mark the signal wrote
    (child / MARKER).write_text(json.dumps({"signal": "SIGUSR2", "time": 0.0}))
    code, _, err = run_in_process("train", *TINY, f"init_from={parent}", f"hydra.run.dir={child}")
    assert code == 0, err
    assert OmegaConf.load(child / "config.yaml").pos.name == "alibi"  # the parent's scheme, inherited
    assert (child / "data.json").is_file() and not (child / MARKER).exists()
