"""eval.precision: auto scores in bf16 autocast on CUDA and fp32 on CPU; every row, file name and
caption says which. bf16 and fp32 perplexities of a trained run agree within 1% (bf16 keeps 8 bits
of mantissa: logits to ~0.4%, the loss summed in fp64 from fp32 cross-entropies)."""

from __future__ import annotations

import json

import pytest

from conftest import run_in_process, tiny_trained

pytestmark = pytest.mark.usefixtures("in_temp_cwd")
LENGTHS = ["eval.lengths=[32,64]", "eval.tokens=1024"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return tiny_trained(tmp_path_factory, "train.steps=60", "pos=alibi")


def test_bf16_and_fp32_perplexities_agree_within_one_percent(trained):
    code, out, err = run_in_process("eval-length", str(trained), *LENGTHS)  # auto on CPU: fp32, the default variant
    assert code == 0, err
    assert "nonoverlapping, fp32" in out
    code, out, err = run_in_process("eval-length", str(trained), *LENGTHS, "eval.precision=bf16")
    assert code == 0, err
    assert "nonoverlapping, bf16" in out
    fp32 = json.loads((trained / "eval_length.json").read_text())
    bf16 = json.loads((trained / "eval_length.precision=bf16.json").read_text())
    assert {r["precision"] for r in fp32} == {"fp32"} and {r["precision"] for r in bf16} == {"bf16"}
    assert "precision" in (trained / "eval_length.precision=bf16.csv").read_text().splitlines()[0].split(",")
    for a, b in zip(fp32, bf16):
        assert a["length"] == b["length"]
        assert b["ppl"] == pytest.approx(a["ppl"], rel=0.01)
    assert any(a["ppl"] != b["ppl"] for a, b in zip(fp32, bf16))  # bf16 did run: not the fp32 numbers again


def test_fp32_named_is_the_default_variant_on_cpu(trained):
    code, _, err = run_in_process("eval-length", str(trained), *LENGTHS, "eval.precision=fp32")
    assert code == 0, err
    assert not list(trained.glob("eval_length.precision=fp32*"))


def test_eval_task_says_its_precision(trained):
    code, _, err = run_in_process("eval-task", str(trained), "task=flip_flop", "task.eval_lengths=[32]", "task.samples=4",
                                  "eval.precision=bf16")
    assert code == 0, err
    payload = json.loads((trained / "eval_task.task=flip_flop,precision=bf16.json").read_text())
    assert {r["precision"] for r in payload["lengths"]} == {"bf16"}


@pytest.mark.parametrize("bad", ["eval.precision=fp16", "eval.precision=true"])
def test_a_bad_precision_is_one_line(trained, bad):
    code, out, err = run_in_process("eval-length", str(trained), *LENGTHS, bad)
    assert code != 0 and "eval.precision" in err and "Traceback" not in out + err
