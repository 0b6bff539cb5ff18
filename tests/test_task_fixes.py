"""Fixes to the tasks, eval-task and compare --metric accuracy: NaN task settings refused in one
line, a RULER configuration named by its yaml recognised as the run's own by its settings, bold
only above every other row, the caption's examples per length after a merge, and the worked
examples of vt and cwe written exactly as NVIDIA/RULER writes them."""

import json
import re
import shutil
from collections import Counter

import pytest
from omegaconf import OmegaConf

from conftest import run_in_process as relpos
from relpos_cli.compare_accuracy import bold_lengths
from relpos_cli.config import conf_dir
from relpos_cli.eval_task import accuracy_table, load_task_eval_config
from relpos_cli.intervals import wilson
from relpos_cli.tasks import build_task, task_settings, variable_tracking
from relpos_cli.tasks.base import Encoder
from relpos_cli.tasks.examples import cell_examples
from relpos_cli.tokenizers import ByteTokenizer
from test_errors import assert_one_clear_line

pytestmark = pytest.mark.usefixtures("in_temp_cwd")  # in-process runs point outputs/latest: not in the checkout


def task_yaml(name: str) -> dict:
    return OmegaConf.to_container(OmegaConf.load(conf_dir() / "task" / f"{name}.yaml"))


def run_trained_on(tiny_run, tmp_path, name: str, seq_len: int):
    """A copy of the tiny run whose config says it trained on conf/task/<name>.yaml at seq_len: all
    eval-task reads of what it trained on (its weights stay a language model's)."""
    run = shutil.copytree(tiny_run, tmp_path / name)
    cfg = OmegaConf.load(run / "config.yaml")
    cfg.task = task_yaml(name)
    cfg.train.seq_len = seq_len
    OmegaConf.save(cfg, run / "config.yaml")
    return run


# ---- NaN (and inf) task settings ------------------------------------------------------------------

PASSKEY = ["task=passkey", "task.samples=1", "task.eval_lengths=[112]"]


@pytest.fixture(scope="module")
def evaluated_run(tiny_run, tmp_path_factory):
    """A copy of the tiny run with a stored passkey result, which a refused call must leave alone."""
    run = shutil.copytree(tiny_run, tmp_path_factory.mktemp("evaluated") / "run")
    code, _, err = relpos("eval-task", str(run), *PASSKEY)
    assert code == 0, err
    return run


@pytest.mark.parametrize("overrides, message", [
    ([*PASSKEY, "task.threshold=nan"], "task.threshold must be a number in [0, 1], got nan"),
    ([*PASSKEY, "task.threshold=inf"], "task.threshold must be a number in [0, 1], got inf"),
    ([*PASSKEY, "task.depths=[nan]"], "task.depths must hold numbers in [0, 1], got [nan]"),
    (["task=flip_flop", "task.samples=1", "task.p_write=nan"], "task.p_write must be a number in [0, 1], got nan"),
    (["task=flip_flop", "task.samples=1", "task.p_read=nan"], "task.p_read must be a number in [0, 1], got nan"),
    (["task=assoc_recall", "task.samples=1", "task.power_a=nan"], "task.power_a must be a number in [0, 1], got nan"),
    (["task=frequent_words", "task.samples=1", "task.alpha=nan"], "task.alpha must be a number in [1, 10], got nan"),
])
def test_nan_task_settings_are_refused_in_one_line_and_write_nothing(evaluated_run, tmp_path, overrides, message):
    """NaN compares False with both bounds, so it passed every range check: task.threshold=nan
    overwrote the stored result with the longest length as effective at 0% accuracy; the others
    ended in tracebacks."""
    run = shutil.copytree(evaluated_run, tmp_path / "run")
    before = {p.name: p.read_bytes() for p in run.glob("eval_task*")}
    code, _, err = relpos("eval-task", str(run), *overrides)
    assert_one_clear_line(code, err, message)
    assert code == 2
    assert {p.name: p.read_bytes() for p in run.glob("eval_task*")} == before


def test_nan_mix_is_refused_before_training(tmp_path):
    run = tmp_path / "run"
    code, _, err = relpos("train", "model=tiny", "train.steps=2", "train.seq_len=112", "task=passkey", "task.mix=nan",
                          "device=cpu", f"hydra.run.dir={run}")
    assert_one_clear_line(code, err, "task.mix must be a number in [0, 1], got nan")
    assert not (run / "checkpoint.pt").exists()


# ---- which configuration is the run's own ---------------------------------------------------------

NIAH = ["task.samples=1", "task.eval_lengths=[384]", "task.depths=[0.5]"]


def test_naming_the_configuration_a_run_trained_on_scores_its_own_task(tiny_run, tmp_path):
    """task=niah_single_1 on a run trained on it was compared by name with the saved task.name
    (niah): scored as another task, in files of their own, without the NOT LEARNED flag."""
    run = run_trained_on(tiny_run, tmp_path, "niah_single_1", 384)
    code, out, err = relpos("eval-task", str(run), "task=niah_single_1", *NIAH)
    assert code == 0, err
    assert "NOT LEARNED" in out  # an 8-step language model does not answer a 7-digit needle
    result = json.loads((run / "eval_task.json").read_text())  # the default variant's files
    assert result["variant"] == "default" and result["learned"] is False
    assert not list(run.glob("eval_task.task=*"))


def test_a_configuration_with_other_settings_is_another_task_whatever_its_name(tiny_run, tmp_path):
    """task=niah (niah_single_1's settings) on a run trained on niah_multikey_1 was scored with the
    run's own multikey settings under the default variant."""
    run = run_trained_on(tiny_run, tmp_path, "niah_multikey_1", 1024)
    ev = load_task_eval_config(run, ["task=niah", *NIAH])
    assert (ev.variant, ev.own_task) == ("task=niah", False)
    assert (ev.settings.generator["keys"], ev.settings.generator["haystack"]) == (1, "noise")  # niah.yaml's
    for same in ([], ["task=niah_multikey_1"]):
        ev = load_task_eval_config(run, [*same, *NIAH])
        assert (ev.variant, ev.own_task) == ("default", True)
        assert (ev.settings.generator["keys"], ev.settings.generator["haystack"]) == (4, "essay")


# ---- compare's bold -------------------------------------------------------------------------------


def cell(mean: float, correct: int, answers: int) -> dict:
    low, high = wilson(correct, answers)
    return {"mean": mean, "ci_low": low, "ci_high": high}


def test_bold_needs_an_interval_above_every_other_row_not_just_the_runner_up():
    a, b = cell(0.75, 45, 60), cell(0.5, 30, 60)  # 45/60: [0.63, 0.84]; 30/60: [0.38, 0.62]
    c = cell(0.45, 9, 20)  # a lower mean over fewer answers: [0.26, 0.66], which reaches into a's
    assert bold_lengths([{"cells": {128: a}}, {"cells": {128: b}}]) == {128: a}
    assert bold_lengths([{"cells": {128: a}}, {"cells": {128: b}}, {"cells": {128: c}}]) == {}
    best = cell(0.9, 54, 60)  # [0.80, 0.95]: above all three
    assert bold_lengths([{"cells": {128: best}}, {"cells": {128: b}}, {"cells": {128: c}}]) == {128: best}


# ---- the caption after a merge with a stored result -----------------------------------------------


def test_caption_names_each_lengths_examples_when_they_differ():
    """with_stored keeps a stored length scored with more examples beside new ones scored with
    fewer; the caption used to give the first length's count for all."""
    common = {"threshold": 0.9, "train_len": 112, "effective_length": 0, "effective_length_lower": 0, "learned": None,
              "accuracy": 0.0, "ci_low": 0.0, "ci_high": 0.5, "depth": None}
    rows = [{**common, "length": 112, "samples": 6, "answers": 6}, {**common, "length": 224, "samples": 2, "answers": 2}]
    caption = accuracy_table(rows, [], "t").caption
    assert "examples per length: 6 at 112, 2 at 224" in caption and "6 examples per length" not in caption
    same = [{**r, "samples": 6, "answers": 6} for r in rows]
    assert "6 examples per length" in accuracy_table(same, [], "t").caption
    # a task without needle depths (flip_flop, copy) has no depths to pool over
    assert "under each accuracy its 95% Wilson interval" in " ".join(caption.split())
    with_depths = [{**common, "length": 112, "samples": 2, "answers": 2, "depth": d} for d in (0.0, 1.0)]
    assert "accuracy over all depths its 95% Wilson" in " ".join(accuracy_table(same, with_depths, "t").caption.split())


# ---- RULER's worked examples, written out from NVIDIA/RULER (commit c3f5e3b) ----------------------

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
VT_HEAD = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"


def vt_question(value: str) -> str:
    return (f"\nQuestion: Find all variables that are assigned the value {value} in the text above. Answer: According to "
            f"the chain(s) of variable assignment in the text above, 5 variables are assigned the value {value}, they are: ")


def test_variable_tracking_worked_example_is_rulers_text(monkeypatch):
    """variable_tracking.py: the example is template.format(context="\\n".join(noise lines with the
    chain's lines inserted)) + " " + " ".join(answers) + "\\n", inserted before the question with
    another "\\n". Five noise lines and five chain lines: the lines alternate, a chain line first."""
    drawn = {3: ([["ABC", "DEF", "GHI", "JKL", "MNO"]], ["12345"]), 5: ([["QXWRT", "BHAZM", "CLOUD", "DRIFT", "EMBER"]], ["40712"])}
    monkeypatch.setattr(variable_tracking, "chains", lambda rng, count, hops, letters: drawn[letters])
    task = build_task(task_settings(task_yaml("variable_tracking")), Encoder(ByteTokenizer()))
    text = next(cell_examples(task, 0, task.min_length() + 40, None, 1)).text
    shot = (VT_HEAD + f"VAR ABC = 12345\n{NOISE}\nVAR DEF = VAR ABC \n{NOISE}\nVAR GHI = VAR DEF \n{NOISE}\n"
            f"VAR JKL = VAR GHI \n{NOISE}\nVAR MNO = VAR JKL \n{NOISE}" + vt_question("12345") + " ABC DEF GHI JKL MNO\n" + "\n")
    assert text.startswith(shot + VT_HEAD)
    assert text.endswith(vt_question("40712") + "QXWRT BHAZM CLOUD DRIFT EMBER")


CWE_HEAD = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
            "that appear most often.\n")
CWE_QUESTION = "\nQuestion: What are the 10 most common words in the above list? Answer: The top 10 words that appear most often in the list are:"
LIST = r"((?:\d+\. [a-z]+ )*\d+\. [a-z]+)"


def test_common_words_worked_example_is_rulers_text():
    """common_words_extraction.py: template.format(context=' '.join("i. w")) + ' ' + ' '.join("i. w"
    of the common words), then "\\n" and the question; below 4096 tokens 20 words, 10 of them 3 times."""
    task = build_task(task_settings(task_yaml("common_words")), Encoder(ByteTokenizer()))
    text = next(cell_examples(task, 0, task.min_length() + 40, None, 1)).text.lstrip(" ")  # pads first
    shot = text[: text.index(CWE_HEAD, 1)]
    listed, answered = re.fullmatch(re.escape(CWE_HEAD) + LIST + re.escape(CWE_QUESTION) + " " + LIST + "\n", shot).groups()
    words = [w for w in listed.split() if not w.endswith(".")]
    assert listed == " ".join(f"{i}. {w}" for i, w in enumerate(words, 1))
    answers = [w for w in answered.split() if not w.endswith(".")]
    assert answered == " ".join(f"{i}. {w}" for i, w in enumerate(answers, 1))
    counts = Counter(words)
    assert sorted(answers) == sorted(w for w, n in counts.items() if n == 3) and len(counts) == 20
    assert set(counts.values()) == {1, 3}
