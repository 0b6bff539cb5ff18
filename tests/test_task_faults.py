"""Bad inputs and faults on the newest commands (eval-task, compare --metric accuracy, sample,
init_from, the task sweep): each a one-line error or the right behaviour, nothing half-written or
replaced by a less thorough result. In-process where a process of its own is not the point."""

import json
import os
import shutil

import pytest
from omegaconf import OmegaConf

from conftest import TINY
from test_errors import assert_one_clear_line, relpos
from test_eval_task import TASK_TINY

pytestmark = pytest.mark.usefixtures("in_temp_cwd")  # in-process runs point outputs/latest: not in the checkout
SMALL = ["task.samples=2", "task.eval_lengths=[112,224]", "task.depths=[0,1]"]


@pytest.fixture(scope="module")
def passkey_run(tmp_path_factory):
    """A tiny alibi run trained on passkey at 112 tokens (it learns nothing in 4 steps)."""
    run = tmp_path_factory.mktemp("passkey") / "run"
    code, _, err = relpos("train", *TASK_TINY, "task=passkey", "pos=alibi", f"hydra.run.dir={run}")
    assert code == 0, err
    return run


def copy_of(run, tmp_path):
    """A copy of a shared run for a test that writes into it."""
    return shutil.copytree(run, tmp_path / run.name)


def eval_files(run):
    """The run's evaluation files and when each was last written: the shared run may already hold
    some (other tests evaluate it), so a refused command is checked to have added or touched none."""
    return {p.name: p.stat().st_mtime_ns for p in run.glob("eval_*")}


@pytest.mark.parametrize("pos", [["pos=alibi"], ["pos=learned", "pos.max_positions=64"]])
def test_init_from_a_run_of_another_scheme_than_the_default(tmp_path, pos):
    """The default scheme's keys (rope's pos.scaling) used to leak into an alibi or learned parent's:
    `relpos train init_from=<alibi run>` failed with "pos.scaling applies to schemes that rotate q
    and k" though no scaling was given."""
    parent = tmp_path / "parent"
    assert relpos("train", *TINY, "train.steps=2", *pos, f"hydra.run.dir={parent}")[0] == 0
    child = tmp_path / "child"
    code, _, err = relpos("train", *TINY, "train.steps=2", f"init_from={parent}", f"hydra.run.dir={child}")
    assert code == 0, err
    assert OmegaConf.load(child / "config.yaml").pos == OmegaConf.load(parent / "config.yaml").pos
    # scaling named on the command line is still refused for a scheme that does not rotate
    code, _, err = relpos("train", *TINY, "train.steps=2", f"init_from={parent}", "pos.scaling.type=yarn",
                          f"hydra.run.dir={tmp_path / 'scaled'}")
    assert_one_clear_line(code, err, "pos.scaling applies to schemes that rotate q and k")


def test_an_empty_init_from_is_refused_not_read_as_no_parent(tmp_path):
    """`init_from=$PARENT` with PARENT unset used to train a fresh default model for hours."""
    code, _, err = relpos("train", *TINY, "init_from=", f"hydra.run.dir={tmp_path / 'run'}")
    assert_one_clear_line(code, err, "init_from is empty: give a run dir")
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


def test_a_checkpoint_that_does_not_fit_its_config_is_one_line(tiny_run, tmp_path):
    run = copy_of(tiny_run, tmp_path)
    cfg = OmegaConf.load(run / "config.yaml")
    cfg.model.d_model = 2 * cfg.model.d_model
    OmegaConf.save(cfg, run / "config.yaml")
    before = eval_files(run)
    child = ["train", f"init_from={run}", "train.steps=2", "train.seq_len=32", f"hydra.run.dir={tmp_path / 'c'}"]
    for command in (["eval-task", str(run), "task=copy", "task.samples=1"], ["eval-length", str(run), "eval.lengths=[32]"],
                    ["sample", str(run), "-n", "2"], child):
        code, _, err = relpos(*command)
        assert_one_clear_line(code, err, f"{run / 'checkpoint.pt'} does not fit the model {run / 'config.yaml'} describes",
                              "size mismatch for")
    assert eval_files(run) == before


def test_a_truncated_config_that_still_parses_is_one_line(tiny_run, tmp_path):
    """Cut at a line break, config.yaml is valid YAML; today's defaults used to fill the rest, so
    eval-length scored a model of default settings and eval-task said it trained without a task."""
    run = copy_of(tiny_run, tmp_path)
    lines = (run / "config.yaml").read_text().splitlines(keepends=True)
    (run / "config.yaml").write_text("".join(lines[: len(lines) // 3]))
    before = eval_files(run)
    for command in (["eval-task", str(run), "task=copy"], ["eval-length", str(run)], ["sample", str(run)],
                    ["train", f"resume={run}"], ["train", *TINY, f"init_from={run}", f"hydra.run.dir={tmp_path / 'c'}"]):
        code, _, err = relpos(*command)
        assert_one_clear_line(code, err, f"{run / 'config.yaml'} is incomplete", "wandb")
    assert eval_files(run) == before


@pytest.mark.parametrize("overrides, fragments", [
    # training-only keys used to be accepted and recorded in the results, changing nothing
    (["task.mix=0.5"], ["task.mix is a training setting", "drop it"]),
    (["task.val_examples=3"], ["task.val_examples is a training setting"]),
    # a repeated depth scored the same seeded examples twice, counted as independent ones
    (["task.depths=[0.5,0.5]"], ["task.depths holds 0.5 more than once"]),
    # the run's own task: it did train on one
    (["task=none"], ["task=none is language modelling, which eval-length measures", "choose one of: assoc_recall"]),
    # absurd lengths: numpy's allocation error and an int overflow used to be tracebacks
    (["task.eval_lengths=[2147483647]"], ["need about", "GiB, more than this machine's", "lower task.eval_lengths"]),
    (["task.eval_lengths=[100000000000000000000000]"], ["task.eval_lengths must be at most 2147483647 (2^31 - 1)"]),
])
def test_bad_eval_task_input_on_a_task_run_is_one_clear_line(passkey_run, overrides, fragments):
    code, _, err = relpos("eval-task", str(passkey_run), *overrides)
    assert_one_clear_line(code, err, *fragments)
    assert not list(passkey_run.glob("eval_task*"))


def test_a_task_longer_than_the_training_length_scores_the_lengths_that_fit(tiny_run, tmp_path):
    """A run trained at 32 tokens scored zero-shot on passkey (104 tokens at least): the training
    length and 64, which eval-task adds itself, are left out with a note; it used to blame
    "eval length 32 (task.eval_lengths)", a length the user never named."""
    run = copy_of(tiny_run, tmp_path)
    code, _, err = relpos("eval-task", str(run), "task=passkey", "task.samples=1", "task.depths=[0]")
    assert code == 0, err
    assert "eval lengths 32, 64 (multiples of the training length 32) left out" in " ".join(err.split())
    payload = json.loads((run / "eval_task.task=passkey.json").read_text())
    assert [r["length"] for r in payload["lengths"]] == [128, 256, 512] and payload["left_out"] == [32, 64]
    assert payload["learned"] is None  # scored zero-shot: learning is not the question
    code, _, err = relpos("eval-task", str(run), "task=passkey", "task.eval_lengths=[64]")  # named: its own error
    assert_one_clear_line(code, err, "eval length 64 (task.eval_lengths) is too short for task=passkey")
    code, _, err = relpos("compare", str(run), "--metric", "accuracy", "task=passkey", "task.samples=1",
                          "task.depths=[0]", "--no-evaluate", "--out", str(tmp_path))
    assert code == 0, err  # the stored result answers the request: the left-out lengths are not missing


def test_a_run_that_did_not_learn_its_task_is_marked(passkey_run, tmp_path):
    """Accuracy at the training length below the threshold: eval-task's table and files and
    compare's say "not learned", so long-length columns are not read as length generalization."""
    from test_eval_task import fake_task_run

    run = copy_of(passkey_run, tmp_path)
    code, out, err = relpos("eval-task", str(run), *SMALL)
    assert code == 0, err
    assert "NOT LEARNED: accuracy at the training length is below the threshold" in " ".join(out.split())
    payload = json.loads((run / "eval_task.json").read_text())
    assert payload["learned"] is False and {r["learned"] for r in payload["lengths"] + payload["cells"]} == {False}
    assert "learned" in (run / "eval_task.csv").read_text().splitlines()[0].split(",")

    # fabricated results: one seed failed at its training length (128) but not beyond, one learned
    sweep = tmp_path / "sweep"
    fake_task_run(sweep / "a0", "alibi", 0, [0.5, 1.0, 1.0])
    fake_task_run(sweep / "a1", "alibi", 1, [1.0, 0.2, 0.0])
    fake_task_run(sweep / "r0", "rope", 0, [0.95, 0.95, 0.95])
    code, out, err = relpos("compare", str(sweep), "--metric", "accuracy", "--no-evaluate", "--out", str(tmp_path))
    assert code == 0, err
    groups = {g["config"]["pos.name"]: g for g in json.loads((tmp_path / "compare_accuracy.json").read_text())["groups"]}
    assert groups["alibi"]["seed_learned"] == [False, True] and groups["alibi"]["not_learned"] == 1
    assert groups["rope"]["not_learned"] == 0 and "not learned" not in groups["rope"]["label"]
    for text in ((tmp_path / "compare_accuracy.md").read_text(), (tmp_path / "compare_accuracy.csv").read_text(),
                 " ".join(out.split())):
        assert "alibi (not learned: 1/2 seeds)" in text


def _units(run, name="eval_task.json"):
    payload = json.loads((run / name).read_text())
    return {(c["length"], c["depth"]): (c["samples"], c["correct"]) for c in payload["cells"]}, payload


def test_an_evaluation_never_replaces_a_more_thorough_result(passkey_run, tmp_path):
    """`relpos compare RUN --metric accuracy task.samples=2` used to evaluate a run holding a
    3-sample result again and overwrite it with the 2-sample one. Now stored cells with more
    examples are used as they are, and an eval-task that scores fewer keeps them (--replace
    overwrites)."""
    run = copy_of(passkey_run, tmp_path)
    assert relpos("eval-task", str(run), *SMALL, "task.samples=3")[0] == 0
    thorough, _ = _units(run)
    assert {s for s, _ in thorough.values()} == {3} and len(thorough) == 4
    before = (run / "eval_task.json").read_bytes()
    for samples in ("task.samples=2", "task.samples=3"):
        code, _, err = relpos("compare", str(run), "--metric", "accuracy", *SMALL, samples, "--out", str(tmp_path))
        assert code == 0, err
        assert (run / "eval_task.json").read_bytes() == before  # used as stored: not evaluated again
    report = json.loads((tmp_path / "compare_accuracy.json").read_text())
    assert report["groups"][0]["samples"] == 3 and not report["failed"]

    code, _, err = relpos("eval-task", str(run), *SMALL, "task.samples=1")
    assert code == 0 and "kept 4 (length, depth) cells of the stored result" in " ".join(err.split())
    assert _units(run)[0] == thorough
    code, _, err = relpos("eval-task", str(run), "task.samples=1", "task.eval_lengths=[448]", "task.depths=[0.5]")
    assert code == 0, err
    merged, payload = _units(run)
    assert {k: v for k, v in merged.items() if k in thorough} == thorough and merged[(448, 0.5)][0] == 1
    per_length = {r["length"]: r for r in payload["lengths"]}  # summed again over the merged cells
    assert per_length[112]["samples"] == 6 + 1 and per_length[448]["samples"] == 1  # 112: 2 kept cells + a new one
    assert per_length[224]["correct"] == sum(c for (l, _), (_, c) in merged.items() if l == 224)

    code, _, err = relpos("eval-task", str(run), *SMALL, "task.samples=1", "--replace")
    assert code == 0, err
    assert {s for s, _ in _units(run)[0].values()} == {1} and len(_units(run)[0]) == 4


def test_eval_length_never_replaces_a_result_over_more_tokens(tiny_run, tmp_path):
    run = copy_of(tiny_run, tmp_path)
    assert relpos("eval-length", str(run), "eval.lengths=[32,64]", "eval.tokens=512")[0] == 0
    stored = json.loads((run / "eval_length.json").read_text())
    files = {p.name: p.read_bytes() for p in run.glob("eval_*")}
    code, _, err = relpos("eval-length", str(run), "eval.lengths=[32,64]", "eval.tokens=256")
    assert_one_clear_line(code, err, "eval_length.json holds a result over 512 tokens", "eval.tokens=256",
                          "--replace to overwrite it")
    assert {p.name: p.read_bytes() for p in run.glob("eval_*")} == files
    code, _, err = relpos("eval-length", str(run), "eval.lengths=[32]", "eval.tokens=512")  # fewer lengths
    assert code == 0 and "kept the stored lengths 64" in err
    rows = json.loads((run / "eval_length.json").read_text())
    assert [r["length"] for r in rows] == [32, 64] and rows[1] == stored[1]
    positions = (run / "eval_positions.csv").read_text().splitlines()
    assert len(positions) == 1 + 32 + 64
    assert relpos("eval-length", str(run), "eval.lengths=[32]", "eval.tokens=256", "--replace")[0] == 0
    assert [(r["length"], r["tokens"]) for r in json.loads((run / "eval_length.json").read_text())] == [(32, 256)]


@pytest.mark.parametrize("overrides, fragments", [
    # an automatic factor of 1: nothing scaled, and nothing said
    (["pos.scaling.type=yarn"], ["pos.scaling.type=yarn with factor auto = train.seq_len / original_length = 32 / 32 = 1",
                                 "scales nothing"]),
    (["pos.scaling.type=linear", "train.seq_len=16", "pos.scaling.original_length=32"], ["16 / 32 = 1 scales nothing"]),
    # options that only matter under another type are still checked
    (["pos.scaling.beta_fast=-3"], ["pos.scaling.beta_fast=-3; give a finite positive number"]),
    (["pos.scaling.factor=0.5"], ["pos.scaling.factor=0.5 is below 1"]),
    (["pos.scaling.attention_factor=0"], ["pos.scaling.attention_factor=0; give a finite positive number or null"]),
    (["pos.scaling.beta_fast=1", "pos.scaling.beta_slow=4"], ["pos.scaling.beta_fast=1 must be above pos.scaling.beta_slow=4"]),
    (["eval.rope_scaling.beta_slow=0"], ["eval.rope_scaling.beta_slow=0"]),
    (["eval.rope_scaling.factor=0.25"], ["eval.rope_scaling.factor=0.25 is below 1"]),
])
def test_scaling_settings_that_change_nothing_or_cannot_be_are_one_clear_line(tmp_path, overrides, fragments):
    code, _, err = relpos("train", *TINY, "pos=rope", *overrides, f"hydra.run.dir={tmp_path / 'run'}")
    assert_one_clear_line(code, err, *fragments)


def test_scaling_from_a_shorter_original_length_still_trains(tmp_path):
    code, _, err = relpos("train", *TINY, "train.steps=1", "pos=rope", "pos.scaling.type=yarn",
                          "pos.scaling.original_length=16", f"hydra.run.dir={tmp_path / 'run'}")
    assert code == 0, err
    code, _, err = relpos("eval-length", str(tmp_path / "run"), "eval.rope_scaling.beta_slow=0", "eval.lengths=[32]")
    assert_one_clear_line(code, err, "eval.rope_scaling.beta_slow=0")


def test_a_run_dir_another_process_holds_is_refused_and_compare_lists_it(passkey_run, tmp_path):
    """The run dir's lock is an flock on its own open file: held here, another holder is refused as
    one from another process would be (tests/test_task_signals.py does it with a real process)."""
    from relpos_cli.rundir import run_dir_lock

    run = copy_of(passkey_run, tmp_path)
    with run_dir_lock(run, "eval-task"):
        code, _, err = relpos("eval-task", str(run), *SMALL)
        assert_one_clear_line(code, err, f"{run} is in use by another relpos process (PID {os.getpid()}, relpos eval-task)")
        code, out, err = relpos("compare", str(run), "--metric", "accuracy", *SMALL, "--out", str(tmp_path))
        assert_one_clear_line(code, err, "no evaluated runs to compare", "is in use by another relpos process")
    assert not list(run.glob("eval_task*")) and not list(tmp_path.glob("compare_accuracy*"))
    assert relpos("eval-task", str(run), *SMALL)[0] == 0  # free again
