"""torchrun DDP and gradient accumulation: N processes x A micro-steps is the same run as one process
(losses and weights to ~1e-5 in fp32 on CPU, gloo), rank 0 alone writes, resume crosses world sizes."""

import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO, TINY, final_weights, metrics, run_cli, trained_run
from relpos_cli.errors import RelposError
from relpos_cli.model import build_model
from relpos_cli.config import apply_overrides, conf_dir
from relpos_cli.positions import scheme_names

RUN = [*TINY, "train.steps=6", "train.batch_size=8", "train.log_every=1", "train.eval_every=3", "device=cpu",
       "pos=alibi"]


def torchrun(*args: str, nproc: int = 2, cwd=REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "relpos_cli", "train", *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"torchrun exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def assert_same_run(a, b, tol=1e-5):
    rows_a, rows_b = metrics(a), metrics(b)
    assert [r["step"] for r in rows_a] == [r["step"] for r in rows_b]  # each step logged exactly once
    for ra, rb in zip(rows_a, rows_b):
        assert ra["loss"] == pytest.approx(rb["loss"], abs=tol), ra["step"]
        assert ra.get("val_loss", 0) == pytest.approx(rb.get("val_loss", 0), abs=tol), ra["step"]
    wa, wb = final_weights(a), final_weights(b)
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=tol, rtol=0, msg=name)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return trained_run(tmp_path_factory, *RUN)


def test_grad_accum_is_the_same_run(single, tmp_path):
    run_cli("train", *RUN, "train.grad_accum=4", f"hydra.run.dir={tmp_path}")
    assert_same_run(single, tmp_path)


def test_two_processes_are_the_same_run_as_one(single, tmp_path):
    run_dir = tmp_path / "ddp"
    out = torchrun(*RUN, "train.grad_accum=2", f"hydra.run.dir={run_dir}")
    assert_same_run(single, run_dir)
    assert "x 2 processes" in out.stdout
    assert out.stdout.count("run dir:") == 1  # rank 0 alone reports (and writes)
    # one writer: every step once in metrics.jsonl, one Hydra log
    assert len(metrics(run_dir)) == 6 and (run_dir / ".hydra" / "config.yaml").is_file()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL DDP needs 2 GPUs")
def test_two_gpus_with_nccl_match_one_gpu(tmp_path):
    """On CUDA in fp32 (TF32 off): the NCCL path, one GPU per rank, is the same run as one GPU."""
    cuda = [*RUN, "device=cuda", "train.precision=fp32"]
    run_cli("train", *cuda, f"hydra.run.dir={tmp_path / 'one'}")
    torchrun(*cuda, f"hydra.run.dir={tmp_path / 'two'}")
    assert_same_run(tmp_path / "one", tmp_path / "two", tol=1e-4)


def test_resume_under_ddp_from_a_single_process_checkpoint(single, tmp_path):
    """Stop a 1-process run after step 4 (its periodic checkpoint), resume it with 2 processes."""
    run_dir = tmp_path / "run"
    run_cli("train", *RUN, "train.ckpt_every=4", f"hydra.run.dir={run_dir}")
    (run_dir / "checkpoint.pt").unlink()  # as if killed after the step-4 checkpoint
    torchrun(f"resume={run_dir}")
    assert_same_run(single, run_dir)


def test_torchrun_without_a_run_dir_makes_one_run_dir(tmp_path):
    torchrun(*RUN, "train.steps=2", cwd=tmp_path)
    runs = [p for p in (tmp_path / "outputs").glob("*/*") if p.is_dir() and p.parent.name != "latest"]
    assert len(runs) == 1 and runs[0].name.endswith("_alibi"), runs
    assert (runs[0] / "checkpoint.pt").is_file() and (tmp_path / "outputs" / "latest").resolve() == runs[0].resolve()


def test_only_train_runs_under_torchrun(tmp_path):
    proc = run_cli("sweep", "pos=alibi", cwd=tmp_path, check=False, env={"WORLD_SIZE": "2", "RANK": "0"})
    assert proc.returncode == 2 and "only `relpos train`" in proc.stderr and not (tmp_path / "outputs").exists()


def test_a_batch_that_does_not_split_is_a_clear_error(tmp_path):
    proc = run_cli("train", *RUN, "train.batch_size=6", "train.grad_accum=4", f"hydra.run.dir={tmp_path}", check=False)
    assert proc.returncode == 2 and "must divide into" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("name", scheme_names())
def test_every_parameter_gets_a_gradient(name):
    """DDP (find_unused_parameters=False) needs every trainable parameter to take part in the loss."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(conf_dir() / "config.yaml")
    cfg = OmegaConf.merge(cfg, {"model": OmegaConf.load(conf_dir() / "model" / "tiny.yaml"),
                                "pos": OmegaConf.load(conf_dir() / "pos" / f"{name}.yaml"),
                                "train": OmegaConf.load(conf_dir() / "train" / "default.yaml")})
    cfg = apply_overrides(cfg, ["train.seq_len=16"])
    torch.manual_seed(0)
    model = build_model(cfg, 256)
    tokens = torch.randint(0, 256, (2, 17))
    model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, missing


def test_a_rank_that_finds_another_gone_at_the_end_stops_in_one_line(monkeypatch):
    """Rank 0 stopped on its own error (a full disk writing checkpoint.pt, said in its one line);
    rank 1, done, met gloo's "Connection closed by peer" in the last barrier: a traceback."""
    from relpos_cli import distributed

    destroyed = []

    def barrier():
        raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:10987")

    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed.dist, "barrier", barrier)
    monkeypatch.setattr(distributed.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(distributed.dist, "destroy_process_group", lambda: destroyed.append(True))
    with pytest.raises(RelposError, match="rank 1: another process of the run stopped before the end"):
        distributed.teardown(finished=True)
    assert destroyed == [True]  # the group is left all the same
