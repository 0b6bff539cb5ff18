"""eval-length and eval-task under eval.self_extend / rerope / window: variants with their own files,
compare side by side, and bad settings as one line with nothing written."""

import csv
import json

import pytest

from conftest import TINY
from test_errors import assert_one_clear_line, relpos

pytestmark = pytest.mark.usefixtures("in_temp_cwd")  # in-process runs point outputs/latest: not in the checkout

RUN = [*TINY, "train.seq_len=112", "device=cpu", "eval.lengths=[112,224]", "eval.tokens=448"]
PASSKEY = ["task=passkey", "task.samples=2", "task.eval_lengths=[112,224]", "task.depths=[0,1]"]
METHODS = {
    "self_extend.group=2,self_extend.window=32": ["eval.self_extend.group=2", "eval.self_extend.window=32"],
    "rerope.slope=0.25,rerope.window=32": ["eval.rerope.window=32", "eval.rerope.slope=0.25"],
    "sinks.count=4,sinks.max_distance=112,sinks.window=64": ["eval.sinks.count=4", "eval.sinks.window=64",
                                                           "eval.sinks.max_distance=112"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    sweep = tmp_path_factory.mktemp("ext")
    out = {}
    for pos in ("rope", "alibi"):
        out[pos] = sweep / pos
        code, _, err = relpos("train", *RUN, f"pos={pos}", f"hydra.run.dir={out[pos]}")
        assert code == 0, err
    return out


def read_csv(path):
    return list(csv.DictReader(path.open()))


def test_each_method_is_a_variant_of_eval_length_and_eval_task(runs, tmp_path):
    run = runs["rope"]
    assert relpos("eval-length", str(run))[0] == 0
    for tag, overrides in METHODS.items():
        code, _, err = relpos("eval-length", str(run), *overrides)
        assert code == 0, err
        rows = read_csv(run / f"eval_length.{tag}.csv")
        assert [r["variant"] for r in rows] == [tag, tag] and [r["length"] for r in rows] == ["112", "224"]
        code, _, err = relpos("eval-task", str(run), *PASSKEY, *overrides)
        assert code == 0, err
        payload = json.loads((run / f"eval_task.task=passkey,{tag}.json").read_text())
        assert payload["variant"] == f"task=passkey,{tag}"
        assert all(f"eval.{overrides[0].split('=')[0].removeprefix('eval.')}" in r for r in payload["lengths"])
    default = read_csv(run / "eval_length.csv")
    self_extend = read_csv(run / f"eval_length.{next(iter(METHODS))}.csv")
    assert self_extend[1]["loss"] != default[1]["loss"]  # 224 tokens reach past the 32-token window
    # compare shows every variant of the run side by side
    code, _, err = relpos("compare", str(run), "--out", str(tmp_path / "cmp"))
    assert code == 0, err
    variants = [r["variant"] for r in read_csv(tmp_path / "cmp" / "compare.csv")]
    assert sorted(variants) == sorted([*METHODS, "default"])
    # and, for accuracy, the requested task setting beside its stored results under each method
    code, _, err = relpos("compare", str(run), "--metric", "accuracy", *PASSKEY, "--out", str(tmp_path / "acc"))
    assert code == 0, err
    variants = [r["variant"] for r in read_csv(tmp_path / "acc" / "compare_accuracy.csv")]
    assert sorted(variants) == sorted(["task=passkey", *(f"task=passkey,{tag}" for tag in METHODS)])


def test_a_window_covering_the_length_scores_as_the_default(runs):
    run = runs["alibi"]
    assert relpos("eval-length", str(run))[0] == 0
    code, _, err = relpos("eval-length", str(run), "eval.sinks.count=4", "eval.sinks.window=224")
    assert code == 0, err
    plain = read_csv(run / "eval_length.csv")
    windowed = read_csv(run / "eval_length.sinks.count=4,sinks.window=224.csv")
    assert [float(r["loss"]) for r in windowed] == pytest.approx([float(r["loss"]) for r in plain], rel=1e-5)


@pytest.mark.parametrize("pos, overrides, fragments", [
    ("rope", ["eval.self_extend.group=0", "eval.self_extend.window=8"], ["eval.self_extend.group must be >= 1, got 0"]),
    ("rope", ["eval.self_extend.group=2", "eval.self_extend.window=0"], ["eval.self_extend.window must be >= 1, got 0"]),
    ("rope", ["eval.self_extend.group=2"], ["eval.self_extend needs both group and window"]),
    ("rope", ["eval.rerope.window=0"], ["eval.rerope.window must be >= 1, got 0"]),
    ("rope", ["eval.rerope.window=8", "eval.rerope.slope=1.5"], ["eval.rerope.slope must be in [0, 1], got 1.5"]),
    ("rope", ["eval.rerope.window=8", "eval.rerope.slope=-0.1"], ["eval.rerope.slope must be in [0, 1], got -0.1"]),
    ("rope", ["eval.rerope.slope=0.5"], ["eval.rerope.slope=0.5 needs eval.rerope.window"]),
    ("rope", ["eval.rerope.window=16777217"], ["eval.rerope.window=16777217 is past what pos=rope can represent"]),
    ("rope", ["eval.sinks.window=4", "eval.sinks.count=5"], ["eval.sinks.count must be in [0, 4] (at most eval.sinks.window), got 5"]),
    ("rope", ["eval.sinks.window=0"], ["eval.sinks.window must be >= 1, got 0"]),
    ("rope", ["eval.sinks.count=4"], ["eval.sinks.count and eval.sinks.max_distance need eval.sinks.window"]),
    ("rope", ["eval.sinks.window=8", "eval.sinks.max_distance=0"], ["eval.sinks.max_distance must be >= 1, got 0"]),
    ("rope", ["eval.self_extend.group=two", "eval.self_extend.window=8"], ["eval.self_extend.group must be an integer or null"]),
    ("rope", ["eval.rerope.window=8", "eval.sinks.window=8"], ["eval.rerope and eval.sinks are separate methods"]),
    ("rope", ["eval.rerope.window=8", "eval.rope_scaling.type=yarn"], ["on top of eval.rope_scaling.type=yarn"]),
    ("alibi", ["eval.rerope.window=8"], ["eval.rerope gives (query, key) pairs other rotation distances", "pos=alibi does not"]),
    ("alibi", ["eval.self_extend.group=2", "eval.self_extend.window=8"], ["pos=alibi does not"]),
    ("alibi", ["eval.rope_scaling.type=yarn"], ["eval.rope_scaling applies to schemes that rotate q and k", "pos=alibi does not"]),
])
@pytest.mark.parametrize("command", ["eval-length", "eval-task"])
def test_bad_settings_are_one_line_and_write_nothing(runs, pos, overrides, fragments, command):
    run = runs[pos]
    before = sorted(p.name for p in run.iterdir())
    extra = PASSKEY if command == "eval-task" else []
    code, _, err = relpos(command, str(run), *extra, *overrides)
    assert_one_clear_line(code, err, *fragments)
    assert sorted(p.name for p in run.iterdir()) == before


def test_eval_task_refuses_a_method_with_randomized_positions(tmp_path):
    run = tmp_path / "run"
    code, _, err = relpos("train", *RUN, "pos=rope", "train.randomized_positions=256", f"hydra.run.dir={run}")
    assert code == 0, err
    code, _, err = relpos("eval-task", str(run), *PASSKEY, "task.eval_positions=randomized", "eval.rerope.window=8")
    assert_one_clear_line(code, err, "assume positions 0..L-1", "task.eval_positions=sequential")


def test_method_variants_reach_wandb_like_the_scalings(tmp_path):
    """The offline W&B run holds each method's perplexities and accuracies under its variant prefix."""
    import wandb

    from conftest import run_in_process
    from wandb_records import OfflineRun

    run = tmp_path / "run"
    offline = [*RUN[:-1], "eval.tokens=224", "wandb.mode=offline", "pos=rope"]
    method = ["eval.sinks.count=2", "eval.sinks.window=16"]
    for args in (["train", *offline, f"hydra.run.dir={run}"], ["eval-length", str(run), *method],
                 ["eval-task", str(run), *PASSKEY, *method]):
        code, out, err = run_in_process(*[a for a in args if a != "wandb.mode=disabled"])
        assert code == 0, out + err
    wandb.teardown()
    (offline_dir,) = (run / "wandb").glob("offline-run-*")
    logged = OfflineRun(offline_dir)
    tag = "sinks.count=2,sinks.window=16"
    rows = read_csv(run / f"eval_length.{tag}.csv")
    assert logged.summary[f"eval.{tag}/ppl@224"] == pytest.approx(float(rows[-1]["ppl"]))
    accuracy = json.loads((run / f"eval_task.task=passkey,{tag}.json").read_text())["lengths"][-1]["accuracy"]
    assert logged.summary[f"eval_task.task=passkey,{tag}/accuracy@224"] == accuracy


def test_eval_task_resolves_factor_longest_as_eval_length_does(runs):
    """eval.rope_scaling.factor=longest is one factor, max(task lengths) / train length, at every
    length: eval-task scores it as the same fixed number would (it used to crash on float('longest');
    mutation checked: without its fix_rope_factor call this raises)."""
    run = runs["rope"]
    results = {}
    for factor in ("longest", "2.0"):  # 224 / 112
        code, _, err = relpos("eval-task", str(run), *PASSKEY, "eval.rope_scaling.type=yarn",
                              f"eval.rope_scaling.factor={factor}")
        assert code == 0, err
        # named by its number, as eval-length names it (2.0 and 2: one variant): longest is that variant
        payload = json.loads((run / "eval_task.task=passkey,rope_scaling.factor=2,rope_scaling.type=yarn.json").read_text())
        results[factor] = [(r["length"], r["correct"]) for r in payload["lengths"]]
    assert results["longest"] == results["2.0"]


def test_compare_accuracy_shows_a_stored_rope_scaling_with_factor_auto(runs, tmp_path):
    """A YaRN result stored with factor auto is tagged `rope_scaling.factor=auto_per_length`; compare
    must replay that as factor=auto to find it (before: the tag was refused as a factor, and the YaRN
    row was silently left out of the accuracy table)."""
    run = runs["rope"]
    for extra in ([], ["eval.rope_scaling.type=yarn"]):
        code, _, err = relpos("eval-task", str(run), *PASSKEY, *extra)
        assert code == 0, err
    code, _, err = relpos("compare", str(run), "--metric", "accuracy", *PASSKEY, "--out", str(tmp_path / "acc"))
    assert code == 0, err
    variants = {r["variant"] for r in read_csv(tmp_path / "acc" / "compare_accuracy.csv")}
    assert "task=passkey,rope_scaling.factor=auto_per_length,rope_scaling.type=yarn" in variants
