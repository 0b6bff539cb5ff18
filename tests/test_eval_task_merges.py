"""Findings of a review by use of eval-task and compare --metric accuracy: the Wilson bounds exact at
k = 0 and k = n, eval.rope_scaling.factor=longest named by its number (one file per scaled model), and
compare's bold within one task's rows."""

import json

import pytest

from conftest import TINY, run_in_process
from relpos_cli.compare import run_compare
from relpos_cli.intervals import wilson
from test_eval_task import _console, fake_task_run

pytestmark = pytest.mark.usefixtures("in_temp_cwd")  # in-process runs point outputs/latest at their run dir


def test_wilson_bounds_are_exactly_0_and_1_at_none_and_all_correct():
    """centre - half at k = 0 and centre + half at k = n are 0 and 1 exactly; rounding left 5.6e-17 (0 of
    3) and 0.9999999999999999 (29 of 29) in eval_task.csv and compare_accuracy.json."""
    for n in range(1, 300):
        assert wilson(0, n)[0] == 0.0, n
        assert wilson(n, n)[1] == 1.0, n
        assert 0.0 < wilson(0, n)[1] < 1.0 and 0.0 < wilson(n, n)[0] < 1.0


@pytest.fixture(scope="module")
def rope_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("rope") / "run"
    code, _, err = run_in_process("train", *TINY, "train.seq_len=112", "device=cpu", "task=passkey",
                                  "task.val_examples=4", f"hydra.run.dir={run}")
    assert code == 0, err
    return run


def test_factor_longest_is_named_by_its_number_so_two_longest_lengths_never_merge(rope_run):
    """factor=longest over [112, 224] is YaRN at factor 2, over [112, 896] at factor 8: two models. Both
    were written to eval_task.rope_scaling.factor=longest,...json and merged (with_stored kept the 224
    cells scored at factor 2 beside the 112 and 896 cells scored at factor 8, one effective length over
    both). Named by the number, as eval-length names it, each is its own file, the same as the number given."""
    common = ["task.samples=1", "task.depths=[0.5]", "eval.rope_scaling.type=yarn"]
    for lengths, factor in (("[112,224]", 2), ("[112,896]", 8)):
        code, out, err = run_in_process("eval-task", str(rope_run), *common, f"task.eval_lengths={lengths}",
                                        "eval.rope_scaling.factor=longest")
        assert code == 0, err
        assert "kept" not in " ".join((out + err).split())  # nothing of the other factor merged in
        path = rope_run / f"eval_task.rope_scaling.factor={factor},rope_scaling.type=yarn.json"
        payload = json.loads(path.read_text())
        assert [r["length"] for r in payload["lengths"]] == json.loads(lengths)
        assert payload["eval_methods"]["rope_scaling.factor"] == factor
    assert not list(rope_run.glob("eval_task.*longest*"))
    # the number given directly is the same variant and the same numbers
    stored = json.loads((rope_run / "eval_task.rope_scaling.factor=2,rope_scaling.type=yarn.json").read_text())
    code, _, err = run_in_process("eval-task", str(rope_run), *common, "task.eval_lengths=[112,224]",
                                  "eval.rope_scaling.factor=2", "--replace")
    assert code == 0, err
    again = json.loads((rope_run / "eval_task.rope_scaling.factor=2,rope_scaling.type=yarn.json").read_text())
    assert [(r["length"], r["correct"]) for r in again["lengths"]] == [(r["length"], r["correct"]) for r in stored["lengths"]]


def test_compare_bolds_only_among_the_rows_of_one_task(tmp_path):
    """Runs of two tasks in one table: flip_flop at 0.95 (n = 200) is no better than copy at 0.10, they are
    other tasks; it was bold. Among one task's rows the bold stays (two copy schemes apart)."""
    fake_task_run(tmp_path / "sweep" / "flip", "rope", 0, [1.0, 0.95, 0.9], samples=200, task_name="flip_flop")
    fake_task_run(tmp_path / "sweep" / "copy", "rope", 0, [1.0, 0.10, 0.0], samples=200)
    run_compare([tmp_path / "sweep"], [], tmp_path / "out", False, "accuracy", _console())
    md = (tmp_path / "out" / "compare_accuracy.md").read_text()
    assert "**" not in md.split("\n\n")[1], md  # the table: no bold across tasks
    fake_task_run(tmp_path / "sweep" / "copy_alibi", "alibi", 0, [1.0, 0.9, 0.5], samples=200)
    run_compare([tmp_path / "sweep"], [], tmp_path / "out", False, "accuracy", _console())
    rows = {line.split(" | ")[0].lstrip("| "): line for line in
            (tmp_path / "out" / "compare_accuracy.md").read_text().splitlines() if line.startswith("| ")}
    copy_alibi = next(line for label, line in rows.items() if "alibi" in label)
    assert copy_alibi.count("**") == 4, rows  # 0.9 vs 0.1 at 256, 0.5 vs 0.0 at 512: bold over the copy rope row
    flip = next(line for line in rows.values() if "flip_flop" in line)
    assert "**" not in flip


def test_lengths_past_a_learned_table_stay_left_out_after_a_narrower_evaluation(tmp_path):
    """A learned table of 200 positions: the default evaluation leaves 224..1792 out. A later one at
    task.eval_lengths=[112,150] wrote left_out [] over it, so compare (--no-evaluate) called the run
    'evaluated at fewer lengths, depths or samples than asked' (and compare without it evaluated it again
    for nothing), though it holds every length the run can score."""
    run = tmp_path / "learned"
    code, _, err = run_in_process("train", *TINY, "train.seq_len=112", "device=cpu", "task=passkey", "task.val_examples=4",
                                  "pos=learned", "pos.max_positions=200", f"hydra.run.dir={run}")
    assert code == 0, err
    ask = ["task.samples=1", "task.depths=[0.5]"]
    assert run_in_process("eval-task", str(run), *ask)[0] == 0
    assert json.loads((run / "eval_task.json").read_text())["left_out"] == [224, 448, 896, 1792]
    assert run_in_process("eval-task", str(run), *ask, "task.eval_lengths=[112,150]")[0] == 0
    payload = json.loads((run / "eval_task.json").read_text())
    assert [r["length"] for r in payload["lengths"]] == [112, 150] and payload["left_out"] == [224, 448, 896, 1792]
    written = run_compare([run], ask, tmp_path / "out", False, "accuracy", _console())
    report = json.loads((tmp_path / "out" / "compare_accuracy.json").read_text())
    assert written and report["failed"] == [] and set(report["groups"][0]["cells"]) == {"112"}


def drawn_first(run, name: str, length: int, depth=None) -> str:
    """The fingerprint of the first example of the cell, drawn here with the run's tokenizer."""
    from omegaconf import OmegaConf

    from relpos_cli.config import conf_dir
    from relpos_cli.data import corpus_tokenizer, load_token_data
    from relpos_cli.tasks import build_task, task_settings
    from relpos_cli.tasks.base import Encoder
    from relpos_cli.tasks.examples import cell_examples, fingerprint

    data_cfg = OmegaConf.to_container(OmegaConf.load(run / "config.yaml").data, resolve=True)
    data = load_token_data(data_cfg)
    settings = task_settings(OmegaConf.to_container(OmegaConf.load(conf_dir() / "task" / f"{name}.yaml")))
    task = build_task(settings, Encoder(corpus_tokenizer(data_cfg, data), data.validation))
    ex = next(cell_examples(task, settings.seed, length, depth, 1))
    return fingerprint(ex.input_ids, *zip(*ex.answer_spans))


def test_a_stored_result_scored_on_other_examples_is_not_merged_into(rope_run):
    """Each scored length stores the fingerprint of its first example, as drawn here, kept through a merge
    (224: the second evaluation scores 112, its training length, and 336). A stored length that would be
    kept but whose examples changed since (how a task writes them changed: here its fingerprint edited)
    refuses the merge in one line, naming --replace and the lengths to score; the stored file is left as
    it was. One that the evaluation scores again is replaced, not refused. --replace scores them anew.
    Fails with the fingerprints not compared (the edited length merged in) or not kept through the merge."""
    common = ["task=copy", "task.samples=2"]
    for lengths, replace in (("[224]", ["--replace"]), ("[336]", [])):  # the second merges with the first
        code, _, err = run_in_process("eval-task", str(rope_run), *common, f"task.eval_lengths={lengths}", *replace)
        assert code == 0, err
    [path] = rope_run.glob("eval_task.task=copy*.json")
    stored = json.loads(path.read_text())
    assert [(r["length"], r["first_example"]) for r in stored["lengths"]] == [
        (length, drawn_first(rope_run, "copy", length)) for length in (112, 224, 336)]

    for row in stored["lengths"][:2]:
        row["first_example"] = "0" * 16  # the 112 and 224 examples as an older relpos drew them
    path.write_text(json.dumps(stored, indent=2))
    before = path.read_bytes()
    code, out, err = run_in_process("eval-task", str(rope_run), *common, "task.eval_lengths=[448]")
    message = " ".join((out + err).split())
    assert code != 0 and "Traceback" not in err
    assert "lengths 224 scored on other examples" in message, message  # 112 is scored again
    assert "--replace task.eval_lengths=[112,224,336,448]" in message
    assert path.read_bytes() == before
    code, _, err = run_in_process("eval-task", str(rope_run), *common, "task.eval_lengths=[224,336,448]", "--replace")
    assert code == 0, err
    assert [r["length"] for r in json.loads(path.read_text())["lengths"]] == [112, 224, 336, 448]


def test_passkey_cells_store_their_first_example_and_keep_it_through_a_merge(rope_run):
    """Passkey's units are its (length, depth) cells: each keeps the fingerprint of its own first example."""
    common = ["task.samples=1", "task.depths=[0.25,0.75]"]
    for lengths, replace in (("[112]", ["--replace"]), ("[224]", [])):  # the first: no other test's cells
        code, _, err = run_in_process("eval-task", str(rope_run), *common, f"task.eval_lengths={lengths}", *replace)
        assert code == 0, err
    payload = json.loads((rope_run / "eval_task.json").read_text())
    assert [(c["length"], c["depth"], c["first_example"]) for c in payload["cells"]] == [
        (length, depth, drawn_first(rope_run, "passkey", length, depth)) for length in (112, 224) for depth in (0.25, 0.75)]
