"""Training on tasks, `relpos eval-task`, `relpos compare --metric accuracy` and `relpos sweep` over
task runs, end to end on tiny runs; bitwise resume of task runs; one-line errors."""

import csv
import json

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from conftest import TINY, final_weights, metrics, run_cli
from relpos_cli.compare import run_compare
from relpos_cli.config import conf_dir
from relpos_cli.errors import RelposError
from test_errors import assert_one_clear_line, relpos

pytestmark = pytest.mark.usefixtures("in_temp_cwd")  # in-process runs point outputs/latest at their run dir

TASK_TINY = [*TINY, "train.seq_len=112", "device=cpu"]  # passkey's fixed parts take 104 byte tokens
EVAL_SMALL = ["task.samples=2", "task.eval_lengths=[112,224]"]


def read_csv(path):
    return list(csv.DictReader(path.open()))


@pytest.fixture(scope="module")
def task_sweep(tmp_path_factory):
    """A sweep over the four tasks (rope): training, eval-task and compare --metric accuracy run by `relpos sweep`."""
    sweep = tmp_path_factory.mktemp("tasks") / "sweep"
    # choice(2): Hydra composes a sweep's base config before it picks a task, so a plain task.samples=2
    # would meet task=none; a one-value sweep is applied per job
    out = run_cli("sweep", *TASK_TINY, "task=passkey,assoc_recall,copy,flip_flop", "task.samples=choice(2)",
                  "task.eval_lengths=choice([112,448])", "task.val_examples=choice(4)", f"hydra.sweep.dir={sweep}").stdout
    return sweep, out


def test_a_tiny_run_trains_on_each_task_and_the_sweep_evaluates_and_compares_them(task_sweep):
    sweep, out = task_sweep
    runs = sorted(p.parent for p in sweep.glob("*/checkpoint.pt"))
    assert len(runs) == 4
    for run in runs:
        task = OmegaConf.load(run / "config.yaml").task.name
        last = metrics(run)[-1]  # a task alone: val_loss is the answer loss of the validation examples
        assert last["step"] == 4 and last["val_loss"] > 0 and "val_task_loss" not in last
        names = ["eval_task.csv", "eval_task.json", "eval_task.png"] + (["eval_task_heatmap.png"] if task == "passkey" else [])
        assert sorted(p.name for p in run.glob("eval_task*")) == sorted(names), run
        assert not list(run.glob("eval_length*"))  # trained on a task alone: no perplexity to measure
        rows = read_csv(run / "eval_task.csv")
        lengths = [112, 448]
        per_length = [r for r in rows if r["depth"] in ("", "all")]
        assert [int(r["length"]) for r in per_length] == lengths and {r["task"] for r in rows} == {task}
        assert {r["threshold"] for r in rows} == {"0.9"} and len({r["effective_length"] for r in rows}) == 1
        if task == "passkey":  # 5 depths x 2 lengths, 2 examples each; the per-length rows add them up
            cells = [r for r in rows if r["depth"] not in ("", "all")]
            assert len(cells) == 10 and {r["samples"] for r in cells} == {"2"} and {r["samples"] for r in per_length} == {"10"}
            for r in per_length:
                same = [c for c in cells if c["length"] == r["length"]]
                assert int(r["correct"]) == sum(int(c["correct"]) for c in same)
        payload = json.loads((run / "eval_task.json").read_text())
        assert payload["variant"] == "default" and payload["effective_length"] == int(rows[0]["effective_length"])
    report = json.loads((sweep / "compare_accuracy.json").read_text())
    assert sorted(g["task"] for g in report["groups"]) == ["assoc_recall", "copy", "flip_flop", "passkey"]
    assert all(set(g["cells"]) == {str(l) for l in lengths} for g in report["groups"])
    assert (sweep / "compare_accuracy.png").is_file() and "effective length" in (sweep / "compare_accuracy.md").read_text()
    assert not (sweep / "compare.csv").exists()  # no language-model run in this sweep


def test_eval_task_variants_other_tasks_and_zero_shot(task_sweep, tmp_path):
    sweep, _ = task_sweep
    run = next(p.parent for p in sweep.glob("*/checkpoint.pt") if "task=copy" in p.parent.name)
    # another task than the run's: its own files, named by the variant
    code, out, err = relpos("eval-task", str(run), "task=flip_flop", *EVAL_SMALL, "task.p_write=0.3")
    assert code == 0, err
    assert (run / "eval_task.task=flip_flop,p_write=0.3.csv").is_file()
    # what only selects cells or counts (eval lengths, samples, threshold) writes the default files;
    # the stored length this evaluation does not score (448, from the sweep) is kept
    code, _, err = relpos("eval-task", str(run), *EVAL_SMALL, "task.threshold=0.0")
    assert code == 0, err
    rows = read_csv(run / "eval_task.csv")
    assert [r["length"] for r in rows] == ["112", "224", "448"] and {r["effective_length"] for r in rows} == {"448"}


def test_compare_accuracy_evaluates_what_is_missing_and_joins_perplexity(tmp_path):
    run = tmp_path / "mixed"
    code, _, err = relpos("train", *TASK_TINY, "task=assoc_recall", "task.mix=0.5", "task.val_examples=4",
                          f"hydra.run.dir={run}")
    assert code == 0, err
    assert all("val_task_loss" in m for m in metrics(run) if "val_loss" in m)
    code, _, err = relpos("eval-length", str(run), "eval.lengths=[112]", "eval.tokens=448")
    assert code == 0, err
    code, out, err = relpos("compare", str(run), "--metric", "accuracy", *EVAL_SMALL, "--out", str(tmp_path / "cmp"))
    assert code == 0, err
    assert (run / "eval_task.json").is_file()  # evaluated first
    row = read_csv(tmp_path / "cmp" / "compare_accuracy.csv")[0]
    assert row["112_n"] == "1" and float(row["ppl112_mean"]) > 1 and "224_mean" in row


def test_task_runs_resume_bitwise(tmp_path):
    """A run resumed from its step-3 checkpoint (as after a kill there) equals the uninterrupted one:
    the task sampler's state (and, mixed, the language-model sampler's) lives in the checkpoint."""
    for name, extra in (("passkey", []), ("flip_flop", ["task.mix=0.5"])):
        run = tmp_path / name
        args = [*TASK_TINY, f"task={name}", *extra, "task.val_examples=4", "train.steps=6", "train.log_every=1",
                "train.ckpt_every=3", "train.eval_every=3"]
        code, _, err = relpos("train", *args, f"hydra.run.dir={run}")
        assert code == 0, err
        want, want_weights = metrics(run), final_weights(run)
        (run / "checkpoint.pt").unlink()
        code, _, err = relpos("train", f"resume={run}")
        assert code == 0, err
        got = metrics(run)
        assert [m["step"] for m in got] == list(range(1, 7))
        keys = ("loss", "val_loss", "val_task_loss")
        assert [[m.get(k) for k in keys] for m in got] == [[m.get(k) for k in keys] for m in want]
        assert all(torch.equal(want_weights[k], v) for k, v in final_weights(run).items())


@pytest.mark.parametrize("overrides, fragments", [
    (["task=nope"], ["unknown task 'nope'; choose one of: assoc_recall, common_words, copy, flip_flop, frequent_words, "
                     "niah, niah_multikey_1"]),
    (["task=passkey", "train.seq_len=64"], ["train.seq_len=64 is too short for task=passkey: its fixed parts take 104 tokens"]),
    (["task=passkey", "task.depths=[0,2]"], ["task.depths must hold numbers in [0, 1], got [0, 2]"]),
    (["task=copy", "task.mix=1.5"], ["task.mix must be a number in [0, 1], got 1.5"]),
    (["task=copy", "task.mix=0.01"], ["task.mix=0.01 gives 0 task rows of train.batch_size=4"]),
    (["task=copy", "task.digits=4"], ["unknown config key 'task.digits'"]),
    (["task.mix=0.5"], ["unknown config key 'task.mix'"]),
])
def test_bad_task_settings_for_training_are_one_clear_line(tmp_path, overrides, fragments):
    code, _, err = relpos("train", *TASK_TINY, *overrides, f"hydra.run.dir={tmp_path / 'run'}")
    assert_one_clear_line(code, err, *fragments)


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("lm") / "run"
    code, _, err = relpos("train", *TASK_TINY, f"hydra.run.dir={run}")
    assert code == 0, err
    return run


@pytest.mark.parametrize("overrides, fragments", [
    ([], ["trained without a task: name one, e.g. task=passkey"]),
    (["task=passkey", "train.steps=5"], ["relpos eval-task takes only task, task.*", "not 'train.steps=5'"]),
    (["task=passkey", "eval.lengths=[64]"], ["not 'eval.lengths=[64]'"]),
    (["task=none"], ["trained without a task"]),
    (["task=nope"], ["unknown task 'nope'"]),
    (["task=passkey", "task.eval_lengths=[64]"], ["eval length 64 (task.eval_lengths) is too short for task=passkey"]),
    (["task=passkey", "task.samples=0"], ["task.samples must be an integer >= 1, got 0"]),
    (["task=passkey", "task.nope=1"], ["unknown config key 'task.nope'"]),
    (["task=passkey", "eval.max_tokens_per_batch=0"], ["eval.max_tokens_per_batch must be positive"]),
    (["task=passkey", "task.eval_positions=shuffled"], ["task.eval_positions must be one of sequential, randomized, got 'shuffled'"]),
    (["task=passkey", "task.eval_positions=randomized"], ["task.eval_positions=randomized draws positions like train.randomized_positions",
                                                          "use task.eval_positions=sequential"]),
])
def test_bad_eval_task_input_is_one_clear_line(lm_run, overrides, fragments):
    code, _, err = relpos("eval-task", str(lm_run), *overrides)
    assert_one_clear_line(code, err, *fragments)


def constant_model(run_dir, token: int):
    """The run's model made to predict `token` at every position, whatever it reads: the final norm
    outputs a fixed vector (weight 0) that only the tied embedding row of `token` points along."""
    from relpos_cli.checkpoint import load_trained_model

    def load(run, device, cfg=None):
        cfg, model = load_trained_model(run, device, cfg)
        with torch.no_grad():
            direction = torch.zeros(model.tok_emb.weight.shape[1])
            direction[0] = 10.0
            model.tok_emb.weight[token] = direction  # also the LM head's row (tied)
            model.norm.weight.zero_()
            model.norm.bias.copy_(direction)  # logit 100 for `token`, |e . direction| < 2 for the others
        return cfg, model

    return load


def flip_flop_answers(text: str) -> list[int]:
    """The right answer of every read in a flip-flop text, found by running its instructions as the task
    defines them (space-separated `w<bit>` writes, `i<bit>` ignores, `r` reads then its answer bit; a
    read answers the latest write), whatever bit the example put after the read."""
    answers, written = [], None
    for instruction in text.split():
        op, bit = instruction[0], int(instruction[1:])
        assert op in "wir" and bit in (0, 1), instruction
        if op == "r":
            assert written is not None, "a read before any write"
            answers.append(written)
        elif op == "w":
            written = bit
    return answers


def test_flip_flop_answers_runs_the_instructions():
    assert flip_flop_answers("  w1 i0 r1 w0 i1 r0 r0") == [1, 0, 0]
    assert flip_flop_answers("w0 i1 w1 i0 r0") == [1]  # the answer the text gives is not trusted


def test_a_language_model_run_is_scored_zero_shot(lm_run, monkeypatch):
    """Zero-shot flip-flop with a model that always predicts "1": each read is correct exactly when its
    right answer is 1, so every length's counts are the reads, and the reads whose latest write is 1, of
    the examples that length holds, recounted here from their bytes (the byte tokenizer's ids) by
    running the instructions, not from the generator's answers or spans. Mutations checked, each
    fails: reading the logits at the answer tokens instead of the tokens before them (exact_matches'
    start - 1 : end - 1); a length's accuracy as correct / samples; the generator answering a read
    with the first write instead of the latest."""
    from relpos_cli import eval_task
    from relpos_cli.tasks import build_task, task_settings
    from relpos_cli.tasks.base import Encoder
    from relpos_cli.tasks.examples import cell_examples
    from relpos_cli.tokenizers import ByteTokenizer

    one = int(Encoder(ByteTokenizer())("1")[0])
    monkeypatch.setattr(eval_task, "load_trained_model", constant_model(lm_run, one))
    code, _, err = relpos("eval-task", str(lm_run), "task=flip_flop", "task.samples=3", "task.eval_lengths=[112,224]")
    assert code == 0, err
    rows = read_csv(lm_run / "eval_task.task=flip_flop.csv")
    assert [int(r["length"]) for r in rows] == [112, 224]
    cfg = OmegaConf.to_container(OmegaConf.load(conf_dir() / "task" / "flip_flop.yaml"))
    task = build_task(task_settings({**cfg, "samples": 3}), Encoder(ByteTokenizer()))
    for row in rows:
        examples = list(cell_examples(task, cfg["seed"], int(row["length"]), None, 3))  # the examples scored
        assert [len(ex.input_ids) for ex in examples] == [int(row["length"])] * 3
        answers = [a for ex in examples for a in flip_flop_answers(bytes(ex.input_ids.tolist()).decode("ascii"))]
        ones = answers.count(1)
        assert (int(row["correct"]), int(row["answers"])) == (ones, len(answers))
        assert float(row["accuracy"]) == pytest.approx(ones / len(answers))
        assert 0 < ones < len(answers)  # neither all right nor all wrong: the count means something


def test_exact_match_is_greedy_decoding(lm_run):
    """exact_matches (one teacher-forced pass) against greedy decoding written out token by token:
    answers that are the model's own greedy continuation count as correct, the same with one token
    changed (first, middle or last) as wrong, several answers per example included. Mutation
    checked: scoring the logits at the answer tokens instead of the tokens before them fails."""
    from relpos_cli.checkpoint import load_trained_model
    from relpos_cli.eval_task import exact_matches

    _, model = load_trained_model(lm_run, torch.device("cpu"))
    model.eval()
    torch.manual_seed(0)
    prompts = torch.randint(0, 256, (4, 40))

    @torch.no_grad()
    def greedy(prefix: torch.Tensor, n: int) -> torch.Tensor:
        for _ in range(n):  # the whole prefix again at every step: no cache, nothing shared with the scorer
            prefix = torch.cat([prefix, model(prefix[None])[0, -1].argmax()[None]])
        return prefix

    rows, spans, expected = [], [], []
    for row, prompt in enumerate(prompts):
        changed = row % 4  # 0: none, 1: answer 1's first token, 2: answer 2's middle one, 3: answer 2's last
        first = greedy(prompt, 6)  # answer 1: 6 tokens after the prompt
        if changed == 1:  # before answer 2 is decoded, so answer 2 stays the greedy one after it
            first[40] = (first[40] + 1) % 256
        example = greedy(torch.cat([first, torch.tensor([32, 32])]), 5)  # two spaces, answer 2: 5 tokens
        where = {2: 50, 3: 52}.get(changed)
        if where is not None:
            example[where] = (example[where] + 1) % 256
        rows.append(example)
        spans.append([(40, 46), (48, 53)])
        expected.append([changed != 1, changed not in (2, 3)])
    assert exact_matches(model, torch.stack(rows), spans) == expected


def test_randomized_eval_positions_follow_the_runs_range_and_repeat_exactly(tmp_path):
    """Ruoss et al.'s test protocol: per example a sorted draw from [0, train.randomized_positions)."""
    run = tmp_path / "run"
    code, _, err = relpos("train", *TASK_TINY, "task=passkey", "train.randomized_positions=256", f"hydra.run.dir={run}")
    assert code == 0, err
    randomized = ["task.eval_positions=randomized", *EVAL_SMALL]
    assert relpos("eval-task", str(run), *randomized)[0] == 0
    first = read_csv(run / "eval_task.eval_positions=randomized.csv")
    assert [r["task.eval_positions"] for r in first] == ["randomized"] * len(first)
    assert relpos("eval-task", str(run), *randomized)[0] == 0
    assert read_csv(run / "eval_task.eval_positions=randomized.csv") == first
    code, _, err = relpos("eval-task", str(run), "task.eval_positions=randomized", "task.eval_lengths=[112,448]")
    assert_one_clear_line(code, err, "draws 448 positions from the run's train.randomized_positions=256")


# ---- compare --metric accuracy on fabricated results ---------------------------------------------


def fake_task_run(path, pos, seed, accuracies, lengths=(128, 256, 512), ppls=None, samples=20, task_name="copy"):
    """A run dir as eval-task leaves it, with made-up accuracies (and eval-length perplexities)."""
    path.mkdir(parents=True)
    task = OmegaConf.to_container(OmegaConf.load(conf_dir() / "task" / f"{task_name}.yaml"))
    task.update(samples=samples, eval_lengths=list(lengths))
    cfg = {"pos": {"name": pos}, "seed": seed, "train": {"seq_len": lengths[0]}, "task": task,
           "data": {"source": "stdlib", "tokenizer": "bytes", "cache_dir": str(path)}, "wandb": {"mode": "disabled"},
           "device": "cpu"}
    OmegaConf.save(OmegaConf.create(cfg), path / "config.yaml")
    (path / "checkpoint.pt").write_bytes(b"never loaded: compare runs --no-evaluate")
    rows = [{"task": task_name, "length": l, "depth": None, "accuracy": a, "correct": round(a * samples), "answers": samples,
             "samples": samples} for l, a in zip(lengths, accuracies)]
    payload = {"task": task_name, "variant": "default", "settings": task, "lengths": rows, "cells": []}
    (path / "eval_task.json").write_text(json.dumps(payload))
    if ppls:
        (path / "eval_length.json").write_text(json.dumps([
            {"length": l, "tokens": 1024, "loss": float(np.log(p)), "ppl": p, "protocol": "nonoverlapping", "stride": l,
             "variant": "default"} for l, p in zip(lengths, ppls)]))


def test_compare_accuracy_on_fabricated_results(tmp_path):
    acc = {("rope", 0): [1.0, 0.95, 0.2], ("rope", 1): [1.0, 0.85, 0.0], ("rope", 2): [0.9, 0.92, 0.95],
           ("alibi", 0): [1.0, 1.0, 0.5], ("alibi", 1): [0.7, 1.0, 1.0]}
    for (pos, seed), a in acc.items():
        fake_task_run(tmp_path / "sweep" / f"{pos}{seed}", pos, seed, a, ppls=[3.0 + seed, 4.0, 5.0] if pos == "alibi" else None)
    fake_task_run(tmp_path / "sweep" / "fewer_samples", "t5", 0, [1, 1, 1], samples=5)
    written = run_compare([tmp_path / "sweep"], ["task.samples=20"], tmp_path / "out", False, "accuracy", _console())
    assert [p.name for p in written] == [f"compare_accuracy{s}" for s in (".csv", ".md", ".json", ".png")]
    report = json.loads((tmp_path / "out" / "compare_accuracy.json").read_text())
    groups = {g["config"]["pos.name"]: g for g in report["groups"]}
    rope = np.array([acc[("rope", s)] for s in range(3)])  # (seeds, lengths)
    for j, l in enumerate(("128", "256", "512")):
        cell = groups["rope"]["cells"][l]
        assert cell["mean"] == pytest.approx(rope[:, j].mean()) and cell["std"] == pytest.approx(rope[:, j].std(ddof=1))
        assert cell["reached"] == int((rope[:, j] >= 0.9).sum()) and cell["n"] == 3
    assert groups["rope"]["seed_effective"] == [256, 128, 512] and groups["rope"]["effective_length"] == 256  # means .97 .91 .38
    assert groups["alibi"]["seed_effective"] == [256, 0] and groups["alibi"]["effective_length"] == 0  # means .85 1 .75
    assert groups["alibi"]["ppl_cells"]["128"]["mean"] == pytest.approx(3.5) and groups["rope"]["ppl_cells"] == {}
    failed = {r["run"].rsplit("/", 1)[1]: r["reason"] for r in report["failed"]}
    assert list(failed) == ["fewer_samples"]
    assert "evaluated on copy (default) at fewer lengths, depths or samples than asked" in failed["fewer_samples"]
    assert failed["fewer_samples"].endswith(f"run `relpos eval-task {tmp_path / 'sweep' / 'fewer_samples'} task.samples=20`")
    # the threshold is applied to the stored accuracies: no new evaluation needed
    run_compare([tmp_path / "sweep"], ["task.threshold=0.5"], tmp_path / "out", False, "accuracy", _console())
    report = json.loads((tmp_path / "out" / "compare_accuracy.json").read_text())
    groups = {g["config"]["pos.name"]: g for g in report["groups"]}
    assert groups["alibi"]["effective_length"] == 512 and groups["rope"]["cells"]["512"]["reached"] == 1
    assert groups["t5"]["samples"] == 5 and groups["t5"]["effective_length"] == 512  # its own 5 samples, as stored
    md = (tmp_path / "out" / "compare_accuracy.md").read_text()
    assert "ppl@128" in md and ">= 0.5" in md


def test_compare_accuracy_names_each_row_s_task_once(tmp_path):
    """Runs trained on two tasks: the label (task.name differs) already names the task; the terminal
    row added it again (`rope, copy (not learned), copy`)."""
    fake_task_run(tmp_path / "sweep" / "copy", "rope", 0, [0.5, 0.2, 0.1])
    fake_task_run(tmp_path / "sweep" / "flip", "rope", 0, [1.0, 0.9, 0.1], task_name="flip_flop")
    console = _console()
    run_compare([tmp_path / "sweep"], [], tmp_path / "out", False, "accuracy", console)
    text = console.file.getvalue()
    assert "copy (not learned)" in text and "flip_flop" in text
    assert "copy (not learned), copy" not in text and "flip_flop, flip_flop" not in text


def test_compare_accuracy_draws_its_figure_in_plots_format(tmp_path):
    """Mutation checked: writing compare_accuracy.png whatever plots.format says (as before) fails here."""
    fake_task_run(tmp_path / "sweep" / "a", "rope", 0, [1.0, 0.5, 0.0])
    written = run_compare([tmp_path / "sweep"], ["plots.format=svg"], tmp_path / "out", False, "accuracy", _console())
    assert [p.name for p in written] == [f"compare_accuracy{s}" for s in (".csv", ".md", ".json", ".svg")]
    assert (tmp_path / "out" / "compare_accuracy.svg").read_text().lstrip().startswith("<?xml")
    assert not (tmp_path / "out" / "compare_accuracy.png").exists()
    with pytest.raises(RelposError, match="plots.format='gif'; choose one of"):
        run_compare([tmp_path / "sweep"], ["plots.format=gif"], tmp_path / "out2", False, "accuracy", _console())


def test_compare_accuracy_without_task_runs_says_what_to_name(tmp_path):
    run = tmp_path / "lm"
    fake_task_run(run, "rope", 0, [1, 1, 1])
    cfg = OmegaConf.load(run / "config.yaml")
    cfg.task = {"name": "none"}
    OmegaConf.save(cfg, run / "config.yaml")
    with pytest.raises(RelposError, match="no run here trained on a task: name the task"):
        run_compare([run], [], tmp_path, False, "accuracy", _console())


def _console():
    import io

    from rich.console import Console

    return Console(file=io.StringIO(), width=250)
