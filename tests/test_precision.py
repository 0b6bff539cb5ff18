"""Precision settings stay scoped to the work that asked for them, and a job gives the same numbers
under `relpos train` and inside a sweep, and in a sweep's own evaluation and a later eval-length."""

import json
import warnings

import pytest
import torch

from conftest import TINY, metrics, run_cli, run_in_process
from relpos_cli.precision import autocast

pytestmark = pytest.mark.usefixtures("in_temp_cwd")


def tf32_flags() -> tuple[bool, bool]:
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


@pytest.fixture
def tf32_off():
    saved = tf32_flags()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_tf32_is_on_only_inside_the_training_step_context(tf32_off):
    """CUDA training's context turns TF32 on when entered (every step enters it again) and restores
    the flags found when it is left, also when the step raises. Mutation checked: setting the flags
    when the context is made, as before, fails here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # autocast("cuda") without a GPU: disabled, with a warning
        step = autocast(torch.device("cuda"), "auto")
        assert tf32_flags() == (False, False)
        for _ in range(2):
            with step:
                assert tf32_flags() == (True, True)
            assert tf32_flags() == (False, False)
        with pytest.raises(ValueError), step:
            raise ValueError
        assert tf32_flags() == (False, False)
    assert isinstance(autocast(torch.device("cuda"), "fp32"), type(autocast(torch.device("cpu"), "auto")))


def test_training_leaves_the_global_tf32_flags_as_it_found_them(tf32_off, tmp_path):
    """device=auto: on a CUDA machine this trains on the GPU in bf16 with TF32 steps."""
    code, _, err = run_in_process("train", *TINY, "pos=alibi", f"hydra.run.dir={tmp_path / 'run'}")
    assert code == 0, err
    assert tf32_flags() == (False, False)


def test_a_job_gives_the_same_numbers_alone_and_in_a_sweep_and_its_evaluation_those_of_eval_length(tmp_path):
    """At one thread count (OMP_NUM_THREADS=1 in every process here; device=auto, so the GPU where
    there is one): `relpos train` and the same job inside `relpos sweep` log the same losses bit for
    bit, and the sweep's evaluation, run in the training process, equals a later `relpos eval-length`
    in a fresh process. On CPU this holds with or without TF32; on CUDA it is what scoping TF32 to
    the training step gives (not yet run on a GPU)."""
    env = {"OMP_NUM_THREADS": "1"}
    evaluation = ["eval.lengths=[32,64]", "eval.tokens=256"]
    alone = tmp_path / "alone"
    run_cli("train", *TINY, "pos=alibi", "seed=1", f"hydra.run.dir={alone}", env=env)
    sweep = tmp_path / "sweep"
    run_cli("sweep", *TINY, "pos=alibi,rope", "seed=1", *evaluation, f"hydra.sweep.dir={sweep}", env=env)
    (in_sweep,) = [p.parent for p in sweep.glob("*/checkpoint.pt") if "pos=alibi" in p.parent.name]
    assert [m["loss"] for m in metrics(in_sweep)] == [m["loss"] for m in metrics(alone)]
    assert [m.get("val_loss") for m in metrics(in_sweep)] == [m.get("val_loss") for m in metrics(alone)]
    swept = json.loads((in_sweep / "eval_length.json").read_text())
    run_cli("eval-length", str(in_sweep), *evaluation, env=env)
    again = json.loads((in_sweep / "eval_length.json").read_text())
    assert [(r["length"], r["loss"]) for r in again] == [(r["length"], r["loss"]) for r in swept]
