"""An imported model with a learned position table (GPT-2: n_positions) is evaluated with no lengths
given: the default eval lengths past its table are left out with a note, not refused; lengths the
user names past it are refused in one line."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

from conftest import run_in_process

transformers = pytest.importorskip("transformers")
from test_import import byte_level_tokenizer  # noqa: E402

pytestmark = pytest.mark.usefixtures("in_temp_cwd")
TABLE = 128  # the GPT-2's n_positions: its training length once imported


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory) -> Path:
    import torch

    root = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=300, n_positions=TABLE, n_embd=32, n_layer=1, n_head=2)
    transformers.GPT2LMHeadModel(config).save_pretrained(root / "hf")
    byte_level_tokenizer().save_pretrained(root / "hf")
    corpus = root / "corpus.txt"
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    corpus.write_text("".join(p.read_text(errors="replace") for p in sorted(stdlib.glob("*.py"))[:10]))
    code, _, err = run_in_process("import", str(root / "hf"), str(root / "run"), "data=text_files", f"data.files=[{corpus}]")
    assert code == 0, err
    return root / "run"


def test_eval_length_leaves_default_lengths_past_the_table_out(gpt2_run):
    code, out, err = run_in_process("eval-length", str(gpt2_run), "eval.tokens=512")
    assert code == 0, err
    rows = json.loads((gpt2_run / "eval_length.json").read_text())
    assert [r["length"] for r in rows] == [TABLE]  # the default lengths 256..2048 are past 128 positions
    assert "eval lengths 256, 512, 1024, 2048 left out: pos=learned has a table of 128 positions" in err + out


def test_eval_length_refuses_a_named_length_past_the_table(gpt2_run):
    code, out, err = run_in_process("eval-length", str(gpt2_run), "eval.lengths=[64,256]", "eval.tokens=512")
    assert code != 0
    assert "pos=learned has a table of 128 positions; length 256 is past it" in err
    assert "Traceback" not in err + out and len(err.strip().splitlines()) == 1


def test_eval_task_leaves_default_lengths_past_the_table_out(gpt2_run):
    code, out, err = run_in_process("eval-task", str(gpt2_run), "task=flip_flop", "task.samples=2")
    assert code == 0, err
    payload = json.loads(next(gpt2_run.glob("eval_task*.json")).read_text())
    assert [r["length"] for r in payload["lengths"]] == [TABLE]
    assert payload["left_out"] == [256, 512, 1024, 2048]  # 1x..16x the training length 128
    assert "left out: pos=learned has a table of 128 positions" in err + out
    code, out, err = run_in_process("eval-task", str(gpt2_run), "task=flip_flop", "task.samples=2",
                                    "task.eval_lengths=[128,512]")
    assert code != 0 and "length 512 is past it" in err and "Traceback" not in err + out
