"""The training loop's fixes of issue 41: the lr logged is the one the step used, every training
window can be drawn, outputs/latest points at a run from the start of its training (and after a
resume), resume= on an imported run says it has nothing to resume, and settings that change
nothing are refused in one line."""

from __future__ import annotations

import math

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
