"""relpos compare groups the seeds of one configuration into one row whatever its figures' format,
inspect settings or training housekeeping (each train key it leaves out is checked to leave the
trained weights bitwise the same), and evaluates runs whose stored result lacks the eval lengths or
tokens the command line asks for (listing them with --no-evaluate) and shows the lengths asked."""

import io
import json
import shutil
import statistics
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from rich.console import Console

from conftest import TINY, final_weights, run_in_process
from relpos_cli.compare import group_runs, run_compare
from relpos_cli.runs import IGNORED_PREFIXES, find_runs, read_run
from test_compare import LENGTHS, make_run

pytestmark = pytest.mark.usefixtures("in_temp_cwd")  # in-process runs point outputs/latest: not in the checkout

# a run whose housekeeping all happens during training: validated every step (a draw from a training
# generator there would move every later step), checkpointed every other step; dropout, so a draw
# from torch's global generator shows too
BASE = [*TINY, "train.steps=5", "model.dropout=0.1", "train.eval_every=1", "train.val_batches=1",
        "train.ckpt_every=2", "train.keep_checkpoints=2", "train.log_every=2", "device=cpu",
        "eval.lengths=[32]", "eval.tokens=64"]
# another value of each train key compare leaves out
OTHER_VALUE = {"train.log_every": 1, "train.eval_every": 0, "train.val_batches": 3, "train.ckpt_every": 0,
               "train.keep_checkpoints": 1}


def train(tmp_path_factory, *overrides: str):
    run_dir = tmp_path_factory.mktemp("run") / "run"
    code, _, err = run_in_process("train", *BASE, *overrides, f"hydra.run.dir={run_dir}")
    assert code == 0, err
    return run_dir


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    return train(tmp_path_factory)


def test_every_train_key_compare_leaves_out_leaves_the_weights_bitwise_the_same(base_run, tmp_path_factory):
    ignored = [k for k in IGNORED_PREFIXES if k.startswith("train.")]
    assert sorted(ignored) == sorted(OTHER_VALUE)  # a train key newly left out needs its check here
    base = final_weights(base_run)
    for key in ignored:
        other = final_weights(train(tmp_path_factory, f"{key}={OTHER_VALUE[key]}"))
        assert base.keys() == other.keys()
        assert all(torch.equal(base[name], other[name]) for name in base), key
    # the check can fail: another seed trains other weights
    other = final_weights(train(tmp_path_factory, "seed=1"))
    assert not all(torch.equal(base[name], other[name]) for name in base)


# a passkey run validated every step, trained with randomized positions so that
# task.eval_positions=randomized is a setting it takes
TASK_BASE = ["task=passkey", "train.steps=2", "train.seq_len=128", "train.randomized_positions=256", "train.eval_every=1"]
TASK_OTHER_VALUE = {"task.eval_lengths": "[128,256]", "task.samples": 3, "task.threshold": 0.5, "task.seed": 7,
                    "task.val_examples": 5, "task.eval_positions": "randomized", "task.depths": "[0.0,1.0]"}


def test_every_task_key_compare_leaves_out_leaves_the_weights_bitwise_the_same(tmp_path_factory):
    ignored = [k for k in IGNORED_PREFIXES if k.startswith("task.")]
    assert sorted(ignored) == sorted(TASK_OTHER_VALUE)  # a task key newly left out needs its check here
    base = final_weights(train(tmp_path_factory, *TASK_BASE))
    for key in ignored:
        other = final_weights(train(tmp_path_factory, *TASK_BASE, f"{key}={TASK_OTHER_VALUE[key]}"))
        assert all(torch.equal(base[name], other[name]) for name in base), key
    # the check can fail: another mix of the task trains other weights
    other = final_weights(train(tmp_path_factory, *TASK_BASE, "task.mix=0.5"))
    assert not all(torch.equal(base[name], other[name]) for name in base)


def with_settings(run_dir, **settings):
    """The fabricated run's config.yaml with dotted keys set."""
    cfg = OmegaConf.load(run_dir / "config.yaml")
    for key, value in settings.items():
        OmegaConf.update(cfg, key, value)
    OmegaConf.save(cfg, run_dir / "config.yaml")


def test_seeds_differing_only_in_housekeeping_are_one_row(tmp_path):
    ppls = {0: [10.0, 20.0, 40.0], 1: [12.0, 21.0, 44.0], 2: [14.0, 25.0, 42.0]}
    settings = {0: {}, 1: {"plots.format": "svg", "train.log_every": 5, "inspect.length": 32},
                2: {"train.eval_every": 50, "train.val_batches": 2, "train.ckpt_every": 10, "train.keep_checkpoints": 1,
                    "task.samples": 50, "task.seed": 3}}
    for seed, values in ppls.items():
        make_run(tmp_path / "runs" / f"rope{seed}", "rope", seed, 128, values)
        with_settings(tmp_path / "runs" / f"rope{seed}", **settings[seed])
    make_run(tmp_path / "runs" / "alibi", "alibi", 0, 128, [30.0, 30.0, 30.0])
    make_run(tmp_path / "runs" / "rope_lr", "rope", 0, 128, [9.0, 9.0, 9.0])  # trained otherwise: its own row
    with_settings(tmp_path / "runs" / "rope_lr", **{"train.lr": 1e-3})

    groups = group_runs([read_run(p) for p in find_runs(tmp_path / "runs")])
    rope = [g for g in groups if g["config"]["pos.name"] == "rope" and g["config"]["train.lr"] == 3e-3]
    assert len(groups) == 3 and len(rope) == 1
    assert groups[0]["label_keys"] == ["pos.name", "train.lr"]
    for j, length in enumerate(LENGTHS):
        seeds = [values[j] for values in ppls.values()]
        mean, std = sum(seeds) / 3, statistics.stdev(seeds)
        half = 4.3027 * std / 3**0.5  # Student's t, 97.5%, 2 degrees of freedom (a statistics table)
        assert rope[0]["cells"][length] == {"mean": pytest.approx(mean), "n": 3, "std": pytest.approx(std),
                                            "mean_interval": pytest.approx((mean - half, mean + half))}


@pytest.fixture
def stored(tmp_path):
    """Two fabricated runs evaluated at LENGTHS (128, 256, 512) over 1,024 tokens, fewer than their
    configs' eval.tokens (`relpos eval-length RUN eval.tokens=1024`, on purpose); they cannot be evaluated again."""
    for seed in (0, 1):
        make_run(tmp_path / "sweep" / f"rope{seed}", "rope", seed, 128, [10.0 + seed, 20.0, 40.0])
        with_settings(tmp_path / "sweep" / f"rope{seed}", **{"eval.tokens": 4096})
    return tmp_path / "sweep"


def compare_report(path, overrides, out):
    run_compare([path], overrides, out, False, "ppl", Console(file=io.StringIO(), width=250))
    return json.loads((out / "compare.json").read_text())


@pytest.mark.parametrize("asked", [["eval.lengths=[128,256,1024]"], ["eval.tokens=2048"],
                                   ["eval.lengths=[128,256,1024]", "eval.tokens=1024"]])
def test_a_stored_result_short_of_the_lengths_or_tokens_asked_is_not_used(stored, tmp_path, asked):
    with pytest.raises(Exception, match="not evaluated as asked") as caught:
        compare_report(stored, asked, tmp_path / "out")
    assert str(caught.value).count("not evaluated as asked") == 2
    assert ("length 1024 missing" in str(caught.value)) == ("eval.lengths=[128,256,1024]" in asked)
    assert ("length 512 over 1,024 of 2,048 tokens" in str(caught.value)) == ("eval.tokens=2048" in asked)


def test_the_lengths_asked_are_the_columns_and_more_tokens_than_asked_serve(stored, tmp_path):
    report = compare_report(stored, ["eval.lengths=[256]", "eval.tokens=512"], tmp_path / "out")
    assert report["failed"] == []
    (group,) = report["groups"]
    assert sorted(group["cells"]) == ["128", "256"]  # the train length is always evaluated
    assert group["tokens"] == [1024] and group["cells"]["128"]["mean"] == pytest.approx(10.5)
    # the run's own eval settings ask for nothing: every stored length is shown, none is evaluated again
    report = compare_report(stored, [], tmp_path / "defaults")
    assert report["failed"] == [] and sorted(report["groups"][0]["cells"], key=int) == ["128", "256", "512"]


def test_compare_evaluates_a_run_on_the_lengths_and_tokens_asked(base_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    code, _, err = run_in_process("eval-length", str(run))  # the run's own eval settings: length 32 over 64 tokens
    assert code == 0, err
    assert {(r["length"], r["tokens"]) for r in json.loads((run / "eval_length.json").read_text())} == {(32, 64)}
    out = tmp_path / "out"
    run_compare([run], ["eval.lengths=[16,32]", "eval.tokens=128"], out, True, "ppl", Console(file=io.StringIO(), width=250))
    rows = json.loads((run / "eval_length.json").read_text())
    assert {(r["length"], r["tokens"]) for r in rows} == {(16, 128), (32, 128)}
    (group,) = json.loads((out / "compare.json").read_text())["groups"]
    assert group["tokens"] == [128]
    assert {int(l): c["mean"] for l, c in group["cells"].items()} == {r["length"]: r["ppl"] for r in rows}


def test_the_csv_writes_token_counts_as_numbers():
    """compare.csv's tokens read "4,096" (text to a spreadsheet or pandas); the table keeps the commas."""
    import csv
    import io

    from relpos_cli.compare import compare_csv

    cell = {"mean": 10.0, "std": None, "n": 1}
    groups = [{"label": "rope", "variant": "default", "protocol": "nonoverlapping", "tokens": [4096], "train_len": 128,
               "cells": {128: cell}},
              {"label": "alibi", "variant": "default", "protocol": "nonoverlapping", "tokens": [4096, 8192],
               "train_len": 128, "cells": {128: cell}}]
    rows = list(csv.DictReader(io.StringIO(compare_csv(groups))))
    assert [r["tokens"] for r in rows] == ["4096", "4096; 8192"]
    assert int(rows[0]["tokens"]) == 4096


def test_fine_tuned_runs_are_grouped_by_what_their_parents_were_not_where(tmp_path):
    """init_from is compared as the parent's settings where they differ from the child's: children of
    parents that differ only in their seed are one row; a parent trained otherwise (its steps) makes a
    row of its own, labelled by that difference; a parent that is gone (or loops back to its child) is
    compared by its path. Mutation checked: comparing init_from by its path gives four child rows."""
    parents = tmp_path / "parents"
    for seed in (0, 1):
        make_run(parents / f"p{seed}", "rope", seed, 64, [5.0, 9.0, 20.0])
    make_run(parents / "longer", "rope", 0, 64, [4.0, 8.0, 19.0])
    with_settings(parents / "longer", **{"train.steps": 1200})
    children = tmp_path / "children"
    for name, parent, seed in (("c0", "p0", 0), ("c1", "p1", 1), ("c_longer", "longer", 0), ("c_gone", "gone", 0)):
        make_run(children / name, "rope", seed, 256, [4.5, 4.4, 4.6])
        with_settings(children / name, init_from=str(parents / parent))
    make_run(tmp_path / "loop" / "a", "rope", 0, 256, [4.5, 4.4, 4.6])  # a -> b -> a
    make_run(tmp_path / "loop" / "b", "rope", 0, 256, [4.5, 4.4, 4.6])
    with_settings(tmp_path / "loop" / "a", init_from=str(tmp_path / "loop" / "b"))
    with_settings(tmp_path / "loop" / "b", init_from=str(tmp_path / "loop" / "a"))

    groups = group_runs([read_run(p) for p in find_runs(children)])
    by_runs = {tuple(sorted(Path(r).name for r in g["runs"])): g for g in groups}
    assert sorted(by_runs) == [("c0", "c1"), ("c_gone",), ("c_longer",)]
    assert by_runs["c0", "c1"]["config"]["init_from"] == {"train.seq_len": 64}  # the parents' seeds are no difference
    assert by_runs["c_longer",]["config"]["init_from"] == {"train.seq_len": 64, "train.steps": 1200}
    assert "steps=1200" in by_runs["c_longer",]["label"]
    assert by_runs["c_gone",]["config"]["init_from"] == str(parents / "gone")

    loop = group_runs([read_run(p) for p in find_runs(tmp_path / "loop")])  # returns: the loop is followed once
    assert sorted(json.dumps(g["config"]["init_from"], sort_keys=True) for g in loop) == sorted(
        json.dumps({"init_from": str(tmp_path / "loop" / other)}) for other in "ab")
