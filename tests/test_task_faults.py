"""Bad inputs and faults on the newest commands (eval-task, compare --metric accuracy, sample,
init_from, the task sweep): each a one-line error or the right behaviour, nothing half-written or
replaced by a less thorough result. In-process where a process of its own is not the point."""

import json
import shutil

import pytest
from omegaconf import OmegaConf

from conftest import TINY
from test_errors import assert_one_clear_line, relpos
from test_eval_task import TASK_TINY

pytestmark = pytest.mark.usefixtures("in_temp_cwd")  # in-process runs point outputs/latest: not in the checkout
SMALL = ["task.samples=2", "task.eval_lengths=[112,224]", "task.depths=[0,1]"]


@pytest.fixture(scope="module")
def passkey_run(tmp_path_factory):
    """A tiny alibi run trained on passkey at 112 tokens (it learns nothing in 4 steps)."""
    run = tmp_path_factory.mktemp("passkey") / "run"
    code, _, err = relpos("train", *TASK_TINY, "task=passkey", "pos=alibi", f"hydra.run.dir={run}")
    assert code == 0, err
    return run


def copy_of(run, tmp_path):
    """A copy of a shared run for a test that writes into it."""
    return shutil.copytree(run, tmp_path / run.name)


@pytest.mark.parametrize("pos", [["pos=alibi"], ["pos=learned", "pos.max_positions=64"]])
def test_init_from_a_run_of_another_scheme_than_the_default(tmp_path, pos):
    """The default scheme's keys (rope's pos.scaling) used to leak into an alibi or learned parent's:
    `relpos train init_from=<alibi run>` failed with "pos.scaling applies to schemes that rotate q
    and k" though no scaling was given."""
    parent = tmp_path / "parent"
    assert relpos("train", *TINY, "train.steps=2", *pos, f"hydra.run.dir={parent}")[0] == 0
    child = tmp_path / "child"
    code, _, err = relpos("train", *TINY, "train.steps=2", f"init_from={parent}", f"hydra.run.dir={child}")
    assert code == 0, err
    assert OmegaConf.load(child / "config.yaml").pos == OmegaConf.load(parent / "config.yaml").pos
    # scaling named on the command line is still refused for a scheme that does not rotate
    code, _, err = relpos("train", *TINY, "train.steps=2", f"init_from={parent}", "pos.scaling.type=yarn",
                          f"hydra.run.dir={tmp_path / 'scaled'}")
    assert_one_clear_line(code, err, "pos.scaling applies to schemes that rotate q and k")


def test_a_checkpoint_that_does_not_fit_its_config_is_one_line(tiny_run, tmp_path):
    run = copy_of(tiny_run, tmp_path)
    cfg = OmegaConf.load(run / "config.yaml")
    cfg.model.d_model = 2 * cfg.model.d_model
    OmegaConf.save(cfg, run / "config.yaml")
    child = ["train", f"init_from={run}", "train.steps=2", "train.seq_len=32", f"hydra.run.dir={tmp_path / 'c'}"]
    for command in (["eval-task", str(run), "task=copy", "task.samples=1"], ["eval-length", str(run), "eval.lengths=[32]"],
                    ["sample", str(run), "-n", "2"], child):
        code, _, err = relpos(*command)
        assert_one_clear_line(code, err, f"{run / 'checkpoint.pt'} does not fit the model {run / 'config.yaml'} describes",
                              "size mismatch for")
    assert not list(run.glob("eval_*"))


def test_a_truncated_config_that_still_parses_is_one_line(tiny_run, tmp_path):
    """Cut at a line break, config.yaml is valid YAML; today's defaults used to fill the rest, so
    eval-length scored a model of default settings and eval-task said it trained without a task."""
    run = copy_of(tiny_run, tmp_path)
    lines = (run / "config.yaml").read_text().splitlines(keepends=True)
    (run / "config.yaml").write_text("".join(lines[: len(lines) // 3]))
    for command in (["eval-task", str(run), "task=copy"], ["eval-length", str(run)], ["sample", str(run)],
                    ["train", f"resume={run}"], ["train", *TINY, f"init_from={run}", f"hydra.run.dir={tmp_path / 'c'}"]):
        code, _, err = relpos(*command)
        assert_one_clear_line(code, err, f"{run / 'config.yaml'} is incomplete", "wandb")
    assert not list(run.glob("eval_*"))
