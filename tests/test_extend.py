"""Extending a trained run: init_from (fine-tune from a parent's final weights)."""

import shutil

import pytest
import torch
from omegaconf import OmegaConf

from conftest import TINY, final_weights, metrics, run_in_process
from relpos_cli.checkpoint import load_config, load_trained_model
from relpos_cli.data import load_token_data
from relpos_cli.train import WindowSampler

pytestmark = pytest.mark.usefixtures("in_temp_cwd")
PARENT = [*TINY, "train.steps=6", "device=cpu", "pos=rope"]
CHILD = ["train.seq_len=64", "train.steps=8", "train.batch_size=4", "train.log_every=1", "train.val_batches=1",
         "train.ckpt_every=4", "wandb.mode=disabled", "device=cpu"]


def train(*args):
    code, out, err = run_in_process("train", *args)
    assert code == 0, err
    return out


@pytest.fixture(scope="module")
def parent(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("parent") / "run"
    train(*PARENT, f"hydra.run.dir={run_dir}")
    return run_dir


@pytest.fixture(scope="module")
def child(parent, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("child") / "run"
    train(f"init_from={parent}", *CHILD, f"hydra.run.dir={run_dir}")
    return run_dir


def test_child_starts_from_the_parents_exact_weights(parent, child):
    """Step 1 of the child is the parent's final model on the child's first batch."""
    _, model = load_trained_model(parent, torch.device("cpu"))
    cfg = load_config(child)
    data = load_token_data(OmegaConf.to_container(cfg.data, resolve=True))
    x, y = WindowSampler(data.train, 64, 4, cfg.seed, torch.device("cpu"))()
    model.train()
    assert metrics(child)[0]["loss"] == model.loss(x, y).item()
    assert cfg.init_from == str(parent) and cfg.model.d_model == 32  # model=tiny came from the parent
    assert cfg.train.seq_len == 64 and metrics(child)[0]["step"] == 1


@pytest.mark.parametrize("kept", ["periodic", "none"])
def test_a_child_resumes_bitwise(child, tmp_path, kept):
    """A child killed after its step-4 checkpoint (or before any) resumes into the same run."""
    copy = tmp_path / "copy"
    shutil.copytree(child, copy)
    (copy / "checkpoint.pt").unlink()
    if kept == "none":
        shutil.rmtree(copy / "checkpoints")
    train(f"resume={copy}")
    assert [m["loss"] for m in metrics(copy)] == [m["loss"] for m in metrics(child)]
    want, got = final_weights(child), final_weights(copy)
    assert all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize("override, message", [
    ("model.d_model=64", "model.d_model=64 but the parent has model.d_model=32"),
    ("model=small", "model.d_model=192 but the parent has model.d_model=32"),
    ("pos=alibi", "pos=alibi but the parent has pos=rope"),
    ("pos.base=500", "pos.base=500 but the parent has pos.base=10000.0"),
])
def test_changing_the_model_or_the_scheme_is_a_one_line_error(parent, tmp_path, override, message):
    code, _, err = run_in_process("train", f"init_from={parent}", override, *CHILD, f"hydra.run.dir={tmp_path / 'c'}")
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_a_parent_that_is_missing_or_unfinished_is_a_one_line_error(parent, tmp_path):
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    shutil.copy(parent / "config.yaml", unfinished)
    for missing, message in [(tmp_path / "nowhere", "run dir not found"), (unfinished, "has no checkpoint.pt")]:
        code, _, err = run_in_process("train", f"init_from={missing}", *CHILD, f"hydra.run.dir={tmp_path / 'c'}")
        assert code == 2 and f"init_from={missing}: " in err and message in err and len(err.strip().splitlines()) == 1


def test_compare_shows_parent_and_child_side_by_side(parent, child, tmp_path):
    code, out, err = run_in_process("compare", str(parent), str(child), "eval.lengths=[32,64]", "eval.tokens=256",
                                    "--out", str(tmp_path / "cmp"))
    assert code == 0, err
    table = (tmp_path / "cmp" / "compare.md").read_text()
    assert "| init_from=null, " in table and "| init_from=run, " in table and "seq_len=64" in table
