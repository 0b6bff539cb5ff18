"""train.compile's torch.compile modes: reduce-overhead and max-autotune replay the step as CUDA graphs,
refused where relpos has not made them safe, with the gradients kept in stable tensors across
micro-steps (a replay would overwrite a gradient left in the graphs' memory pool)."""

from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf

from relpos_cli.distributed import Ranks
from relpos_cli.errors import RelposError
from relpos_cli.model import build_model
from relpos_cli.train import check_cuda_graphs, training_step


def micro_batches(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens = torch.randint(0, 50, (2, 2, 17), generator=torch.Generator().manual_seed(seed))
    return [(rows[:, :-1], rows[:, 1:]) for rows in tokens]


def test_stable_gradients_train_as_dropped_ones_and_stay_the_same_tensors():
    """Two steps of two micro-steps: the same losses, gradient norms and weights whether the gradients
    are dropped each step or zeroed in place, and in place each parameter keeps one gradient tensor."""
    cfg = {"model": {"d_model": 32, "n_layers": 2, "n_heads": 2}, "train": {"seq_len": 16}, "pos": {"name": "alibi"}}
    torch.manual_seed(0)
    dropped = build_model(cfg, 50)
    stable = copy.deepcopy(dropped)
    optimizers = {id(m): torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (dropped, stable)}
    first_grads = None
    for step in range(2):
        batches = micro_batches(step)
        expected = training_step(dropped, optimizers[id(dropped)], batches, 1.0)
        got = training_step(stable, optimizers[id(stable)], batches, 1.0, stable_grads=True)
        assert float(got[0]) == pytest.approx(float(expected[0]), rel=1e-6)
        assert float(got[1]) == pytest.approx(float(expected[1]), rel=1e-6)
        grads = [p.grad for p in stable.parameters()]
        assert all(g is not None for g in grads)
        if first_grads is None:
            first_grads = grads
        else:
            assert all(a is b for a, b in zip(grads, first_grads))
    for a, b in zip(dropped.parameters(), stable.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def train_section(**overrides):
    return OmegaConf.create({"compile": False, "length_schedule": "fixed", **overrides})


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_cuda_graphs_are_refused_under_several_processes_and_varying_lengths(mode):
    with pytest.raises(RelposError, match=f"train.compile={mode} \\(CUDA graphs\\) is not supported under several"):
        check_cuda_graphs(train_section(compile=mode), Ranks(rank=0, world_size=2))
    with pytest.raises(RelposError, match=f"train.compile={mode} records a CUDA graph per batch length, and "
                                          f"train.length_schedule=uniform varies it"):
        check_cuda_graphs(train_section(compile=mode, length_schedule="uniform"), Ranks())
    check_cuda_graphs(train_section(compile=mode), Ranks())


@pytest.mark.parametrize("mode", [False, True, "default", "max-autotune-no-cudagraphs"])
def test_modes_without_cuda_graphs_are_not_refused(mode):
    check_cuda_graphs(train_section(compile=mode, length_schedule="curriculum"), Ranks(rank=1, world_size=2))


def test_a_refused_cuda_graph_run_is_one_line_and_writes_no_config(tmp_path):
    from conftest import TINY, run_cli

    run = tmp_path / "run"
    proc = run_cli("train", *TINY, "train.compile=reduce-overhead", "train.length_schedule=uniform",
                   "train.min_seq_len=8", f"hydra.run.dir={run}", check=False)
    assert proc.returncode != 0
    assert "train.compile=reduce-overhead records a CUDA graph per batch length" in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr
    assert not (run / "config.yaml").exists()


@pytest.mark.slow
def test_reduce_overhead_with_micro_steps_gives_the_eager_losses(tmp_path, monkeypatch):
    """`train.compile=reduce-overhead train.grad_accum=2` on the CPU: compiled as train.compile=true (the note
    says so), the gradients kept stable, and the eager run's losses."""
    from conftest import TINY, metrics, run_cli

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    env = {"RELPOS_CACHE": str(tmp_path / "cache")}
    losses, output = {}, {}
    for compiled in ("false", "reduce-overhead"):
        run = tmp_path / compiled
        proc = run_cli("train", *TINY, "pos=alibi", "train.log_every=1", "train.grad_accum=2",
                       f"train.compile={compiled}", f"hydra.run.dir={run}", env=env)
        losses[compiled] = [m["loss"] for m in metrics(run) if "loss" in m]
        output[compiled] = proc.stdout
    assert len(losses["false"]) == 4
    assert losses["reduce-overhead"] == pytest.approx(losses["false"], rel=1e-4)
    assert "train.compile=reduce-overhead replays CUDA graphs on CUDA only; on cpu it compiles" in output["reduce-overhead"]
    assert "replays CUDA graphs" not in output["false"]
