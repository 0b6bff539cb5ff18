"""The training loop's fixes of issue 41: the lr logged is the one the step used, every training
window can be drawn, outputs/latest points at a run from the start of its training (and after a
resume), resume= on an imported run says it has nothing to resume, and settings that change
nothing are refused in one line."""

from __future__ import annotations

import math
import re
import signal
import time

import numpy as np
import pytest
import torch

from conftest import TINY, metrics, run_in_process
from relpos_cli.errors import RelposError
from relpos_cli.train import WindowSampler


def test_metrics_log_the_lr_each_step_used(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    lr, warmup, steps, min_ratio = 1e-3, 4, 6, 0.1
    code, _, err = run_in_process("train", *TINY, f"train.steps={steps}", f"train.warmup_steps={warmup}",
                                  f"train.lr={lr}", f"train.min_lr_ratio={min_ratio}", "train.log_every=1",
                                  "pos=alibi", "device=cpu", f"hydra.run.dir={run_dir}")
    assert code == 0, err

    def used(step: int) -> float:
        """Step `step` (from 1) of linear warmup over `warmup` steps, then cosine to lr * min_ratio."""
        if step <= warmup:
            return lr * step / warmup
        progress = (step - 1 - warmup) / (steps - warmup)
        return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    logged = [row["lr"] for row in metrics(run_dir)]
    assert logged[:3] == pytest.approx([2.5e-4, 5e-4, 7.5e-4])  # the numbers
    assert logged == pytest.approx([used(s) for s in range(1, steps + 1)])


def test_a_warmup_longer_than_the_run_is_said_with_the_lr_it_peaks_at(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_in_process("train", *TINY, "train.steps=2", "train.warmup_steps=8", "train.lr=4e-3",
                                    "pos=none", "device=cpu", f"hydra.run.dir={tmp_path / 'run'}")
    assert code == 0, err
    note = " ".join((out + err).split())
    assert "train.warmup_steps=8 > train.steps=2" in note and "peaks at 0.001, not train.lr=0.004" in note
    assert max(row["lr"] for row in metrics(tmp_path / "run")) == pytest.approx(1e-3)  # the note's figure


def test_a_validation_split_of_exactly_seq_len_tokens_is_refused_as_too_few():
    from relpos_cli.train import validation_windows

    assert validation_windows(np.arange(9), 8, 4).shape == (1, 9)  # seq_len + 1 tokens: one window
    with pytest.raises(RelposError, match=r"has 8 tokens, too few for one window of train.seq_len=8 \(\+1"):
        validation_windows(np.arange(8), 8, 4)  # it said "8 tokens, fewer than train.seq_len=8"


def test_every_training_window_can_be_drawn():
    seq_len, windows = 8, 3
    tokens = np.arange(seq_len + windows)  # windows of seq_len + 1 tokens start at 0, 1, 2
    sampler = WindowSampler(tokens, seq_len, batch_size=16, seed=0, device=torch.device("cpu"))
    starts = set()
    for _ in range(20):
        x, y = sampler()
        assert torch.equal(y, x + 1)  # y is x shifted by one, inside the array
        starts |= set(x[:, 0].tolist())
    assert starts == set(range(windows))

    one = WindowSampler(np.arange(seq_len + 1), seq_len, batch_size=4, seed=0, device=torch.device("cpu"))
    assert one()[0][:, 0].tolist() == [0, 0, 0, 0]  # just long enough: its one window
    with pytest.raises(RelposError, match="too few for train.seq_len=8"):
        WindowSampler(np.arange(seq_len), seq_len, batch_size=4, seed=0, device=torch.device("cpu"))


def test_outputs_latest_points_at_a_run_as_it_trains_and_after_a_resume(tmp_path, monkeypatch):
    """The README's `relpos train ... && relpos eval-length outputs/latest` after a SIGTERM and a resume."""
    from test_resume import start

    monkeypatch.chdir(tmp_path)
    latest = tmp_path / "outputs" / "latest"
    # the run dir is Hydra's default, outputs/<date>/<time>_alibi, as for the README's main job
    proc = start("train", *TINY, "train.steps=600", "train.ckpt_every=10", "train.log_every=100", "pos=alibi",
                 "device=cpu", cwd=tmp_path)
    deadline = time.monotonic() + 120
    while not list((tmp_path / "outputs").glob("*/*/checkpoints/step_*.pt")) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.005)
    run_dir = next((tmp_path / "outputs").glob("*/*/checkpoints/step_*.pt")).parents[1]
    assert latest.resolve() == run_dir.resolve(), "outputs/latest must point at the run while it trains"
    assert proc.poll() is None, "the run finished before it could be stopped"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM and "resume with: relpos train resume=" in " ".join(err.split())
    assert latest.resolve() == run_dir.resolve()

    latest.unlink()  # as if another run had started since and taken it
    code, _, err = run_in_process("train", f"resume={run_dir.relative_to(tmp_path)}")
    assert code == 0, err
    assert (run_dir / "checkpoint.pt").is_file() and latest.resolve() == run_dir.resolve()
    code, _, err = run_in_process("eval-length", "outputs/latest", "eval.lengths=[32]", "eval.tokens=256")
    assert code == 0, err


def test_resume_of_an_imported_run_says_it_holds_no_training_state(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from test_import import data_args, save_tiny_llama

    from relpos_cli.importing import import_checkpoint

    monkeypatch.chdir(tmp_path)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def main():\n    return 1\n" * 400)
    run = import_checkpoint(str(save_tiny_llama(tmp_path / "llama")), tmp_path / "imported", data_args(corpus))
    before = sorted((p.name, p.stat().st_mtime_ns) for p in run.rglob("*"))
    code, out, err = run_in_process("train", f"resume={run}")
    assert code == 2 and "already finished" not in out
    line = " ".join(err.split())
    assert "is an imported run (relpos import): it holds no training state to resume" in line
    assert f"init_from={run}" in line and "Traceback" not in err and len(err.strip().splitlines()) <= 2
    assert sorted((p.name, p.stat().st_mtime_ns) for p in run.rglob("*")) == before  # nothing written into it
    assert not (tmp_path / "outputs" / "latest").exists()


def composed(*overrides: str):
    from hydra import compose, initialize_config_dir

    from relpos_cli.config import conf_dir

    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        return compose("config", overrides=["model=tiny", "train.seq_len=32", *overrides])


@pytest.mark.parametrize("overrides, message", [
    (["model.sliding_window=16", "model.sliding_layers=[]"], "model.sliding_layers=[] puts model.sliding_window=16 on no layer"),
    (["train.position_skip=32"], "train.position_skip=32 equals train.seq_len: every batch would still get positions 0..31"),
    (["train.randomized_positions=32"], "train.randomized_positions=32 equals train.seq_len"),
    (["train.length_schedule=uniform", "train.min_seq_len=32"], "train.min_seq_len=train.seq_len=32 gives every batch 32"),
    (["train.length_schedule=curriculum", "train.min_seq_len=32"], "train.length_schedule=curriculum with"),
])
def test_settings_that_change_nothing_are_refused(overrides, message):
    from relpos_cli.config import validate_run_config
    from relpos_cli.settings import check_settings_take_effect

    cfg = composed(*overrides)
    validate_run_config(cfg)  # in range: a run saved with it still evaluates
    with pytest.raises(RelposError, match=re.escape(message)) as refused:
        check_settings_take_effect(cfg)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("overrides", [
    ["model.sliding_window=16", "model.sliding_layers=[1]"],
    ["model.sliding_window=16"],
    ["train.position_skip=33"],
    ["train.randomized_positions=64"],
    ["train.position_skip=32", "train.length_schedule=uniform"],  # shorter batches do skip
    ["train.randomized_positions=32", "train.length_schedule=curriculum"],
    ["train.length_schedule=uniform", "train.min_seq_len=31"],
])
def test_settings_that_change_something_are_accepted(overrides):
    from relpos_cli.settings import check_settings_take_effect

    check_settings_take_effect(composed(*overrides))


def test_train_refuses_a_window_on_no_layer_in_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    code, _, err = run_in_process("train", *TINY, "pos=alibi", "model.sliding_window=16", "model.sliding_layers=[]",
                                  f"hydra.run.dir={run_dir}")
    assert code == 2 and "on no layer" in err and "Traceback" not in err
    assert not (run_dir / "config.yaml").exists() and not (tmp_path / "outputs" / "latest").exists()


def test_a_run_takes_outputs_latest_back_when_it_ends(tmp_path, monkeypatch):
    """A run started in another shell meanwhile took outputs/latest: `train && eval-length outputs/latest`
    still evaluates the run that just ended."""
    from relpos_cli.rundir import point_latest_at
    from relpos_cli.train import Trainer

    monkeypatch.chdir(tmp_path)
    other = tmp_path / "other-run"
    other.mkdir()
    evaluate = Trainer.evaluate

    def evaluate_as_another_run_starts(self):
        point_latest_at(other)
        return evaluate(self)

    monkeypatch.setattr(Trainer, "evaluate", evaluate_as_another_run_starts)
    run_dir = tmp_path / "run"
    code, _, err = run_in_process("train", *TINY, "pos=alibi", f"hydra.run.dir={run_dir}")
    assert code == 0, err
    assert (tmp_path / "outputs" / "latest").resolve() == run_dir.resolve()
