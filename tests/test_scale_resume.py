"""Training's end and resume against an uninterrupted run of the same config: a stop signal while the
final checkpoint.pt is written, a config.yaml edited between stop and resume."""

import os
import signal
import shutil

import pytest
import torch

from conftest import TINY, final_weights, metrics, run_in_process
from test_errors import assert_one_clear_line

pytestmark = pytest.mark.usefixtures("in_temp_cwd")  # in-process runs point outputs/latest: not in the checkout

RUN = [*TINY, "train.steps=6", "train.log_every=1", "train.ckpt_every=2", "device=cpu", "pos=alibi"]


@pytest.fixture(scope="module")
def reference(in_temp_cwd, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    code, _, err = run_in_process("train", *RUN, f"hydra.run.dir={run_dir}")
    assert code == 0, err
    return run_dir


def test_a_stop_signal_while_the_final_checkpoint_is_written_lets_the_run_finish(reference, tmp_path, monkeypatch):
    """Ctrl-C once all steps are taken used to abort the write of checkpoint.pt: the run lost every
    step since its last periodic checkpoint (all of them with train.ckpt_every=0)."""
    import relpos_cli.train as train

    write = train.save_checkpoint

    def interrupted_write(run_dir, state):
        os.kill(os.getpid(), signal.SIGINT)  # handled before the next bytecode: inside the write
        write(run_dir, state)

    monkeypatch.setattr(train, "save_checkpoint", interrupted_write)
    code, _, err = run_in_process("train", *RUN, f"hydra.run.dir={tmp_path}")
    assert code == 0, err
    want, got = final_weights(reference), final_weights(tmp_path)
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert [m["loss"] for m in metrics(tmp_path)] == [m["loss"] for m in metrics(reference)]


def edited_copy(run_dir, tmp_path, old: str, new: str, finished: bool = False):
    """A copy of the run stopped after its step-4 checkpoint (or finished), its config.yaml line `old` made `new`."""
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    if not finished:
        (copy / "checkpoint.pt").unlink()
    text = (copy / "config.yaml").read_text()
    assert text.count(f"\n{old}\n") == 1
    (copy / "config.yaml").write_text(text.replace(f"\n{old}\n", f"\n{new}\n"))
    return copy


@pytest.mark.parametrize("old, new, finished", [
    ("  lr: 0.003", "  lr: 0.03", False),  # trained on at the checkpoint's lr, recorded as 0.03
    ("  steps: 6", "  steps: 10", False),  # the cosine schedule moved under a run half-way through it
    ("  steps: 6", "  steps: 10", True),  # was: "already finished (10 steps)"
    ("seed: 0", "seed: 1", False),
])
def test_resume_refuses_a_config_yaml_edited_since_the_checkpoint(reference, tmp_path, old, new, finished):
    copy = edited_copy(reference, tmp_path, old, new, finished)
    before = {p.name: p.read_bytes() for p in copy.iterdir() if p.is_file()}
    code, _, err = run_in_process("train", f"resume={copy}")
    key = {"lr": "train.lr", "steps": "train.steps", "seed": "seed"}[old.split(":")[0].strip()]
    assert_one_clear_line(code, err, f"{copy / 'config.yaml'} was edited since", key)
    after = {p.name: p.read_bytes() for p in copy.iterdir() if p.is_file() and p.name != "relpos.log"}
    assert after == {k: v for k, v in before.items() if k != "relpos.log"}  # nothing trained, nothing rewritten


def test_resume_takes_an_edited_log_every_and_device(reference, tmp_path):
    """How often a run logs and where it trains change nothing it computes: the resumed run is the same run."""
    copy = edited_copy(reference, tmp_path, "  log_every: 1", "  log_every: 2")
    config = copy / "config.yaml"
    config.write_text(config.read_text().replace("\ndevice: cpu\n", "\ndevice: auto\n"))
    code, _, err = run_in_process("train", f"resume={copy}")
    assert code == 0, err
    want, got = final_weights(reference), final_weights(copy)
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert [m["step"] for m in metrics(copy)] == [1, 2, 3, 4, 6]  # every step up to 4, then every other one


def test_resume_drops_the_temp_files_a_kill_left_in_the_run_dir(reference, tmp_path):
    """A kill while checkpoint.pt (or metrics.jsonl) was written leaves its temp file beside it, as large as
    the checkpoint; only those under checkpoints/ were removed."""
    copy = tmp_path / "copy"
    shutil.copytree(reference, copy)
    (copy / "checkpoint.pt").rename(copy / ".checkpoint.pt.k1ll3d0.tmp")  # as atomic_writer names it
    (copy / ".metrics.jsonl.k1ll3d0.tmp").write_text('{"step": 1')
    code, _, err = run_in_process("train", f"resume={copy}")
    assert code == 0, err
    assert not list(copy.glob(".*.tmp")) and (copy / "checkpoint.pt").is_file()


def cut_that_torch_reads_as_an_os_error(path) -> int | None:
    """A length to truncate the checkpoint to at which torch.load raises OSError (EINVAL from its zip reader,
    no file named), as it does for some cut points; None if this torch raises none."""
    data = path.read_bytes()
    probe = path.with_name("probe.pt")
    for length in range(len(data) // 64, len(data) // 2, len(data) // 256):
        probe.write_bytes(data[:length])
        try:
            torch.load(probe, weights_only=False)
        except OSError:
            return length
        except Exception:
            pass
    return None


def test_a_checkpoint_truncated_where_torch_says_invalid_argument_is_passed_over(reference, tmp_path):
    """Was `error: Invalid argument`, naming no file, and no fall back to the intact periodic checkpoint."""
    copy = tmp_path / "copy"
    shutil.copytree(reference, copy)
    length = cut_that_torch_reads_as_an_os_error(copy / "checkpoint.pt")
    if length is None:
        pytest.skip("this torch reads no truncated checkpoint as an OSError")
    with open(copy / "checkpoint.pt", "r+b") as f:
        f.truncate(length)
    code, _, err = run_in_process("train", f"resume={copy}")
    assert code == 0, err
    assert f"{copy / 'checkpoint.pt'}: corrupt checkpoint" in " ".join(err.split())
    want, got = final_weights(reference), final_weights(copy)
    assert all(torch.equal(want[k], got[k]) for k in want)
