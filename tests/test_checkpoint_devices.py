"""Checkpoints move between GPU and CPU machines: a checkpoint whose tensors were saved on CUDA
evaluates and resumes on a CPU-only machine."""

import json
from unittest import mock

import pytest
import torch

from conftest import TINY, final_weights, run_cli

RUN = [*TINY, "train.steps=4", "train.ckpt_every=2", "device=cpu", "pos=t5"]


def save_as_if_on_cuda(path):
    """Rewrite a checkpoint so that every tensor claims to live on cuda:0, as one written by a GPU run does."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    with mock.patch("torch.serialization.location_tag", lambda storage: "cuda:0"):
        torch.save(state, path)
    if not torch.cuda.is_available():  # the rewritten file really needs a map_location here
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(path, weights_only=False)


def test_a_cuda_checkpoint_evaluates_and_resumes_on_cpu(tmp_path):
    run_cli("train", *RUN, f"hydra.run.dir={tmp_path}")
    reference = final_weights(tmp_path)
    save_as_if_on_cuda(tmp_path / "checkpoint.pt")
    run_cli("eval-length", str(tmp_path), "eval.lengths=[32]", "eval.tokens=256", "device=cpu")
    assert json.loads((tmp_path / "eval_length.json").read_text())[0]["ppl"] > 1

    (tmp_path / "checkpoint.pt").unlink()  # as if killed after the step-2 checkpoint
    save_as_if_on_cuda(next((tmp_path / "checkpoints").glob("step_*2.pt")))
    run_cli("train", f"resume={tmp_path}")
    resumed = final_weights(tmp_path)
    for name, weight in reference.items():
        assert torch.equal(weight, resumed[name]), name
