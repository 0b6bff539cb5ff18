"""The CLI end to end in subprocesses, as a user runs it."""

import csv
import json
import math
import multiprocessing
import os
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from conftest import TINY, run_cli, run_in_process
from relpos_cli.checkpoint import load_config, load_trained_model
from relpos_cli.data import load_token_data, stdlib_files
from relpos_cli.rundir import point_latest_at
from relpos_cli.sample import generate
from relpos_cli.tokenizers import BpeTokenizer


def test_help_on_every_command():
    out = run_cli("--help").stdout
    for command in ("train", "eval-length"):
        assert command in out
        assert "Usage" in run_cli(command, "--help").stdout


def test_help_shows_every_bracket_of_its_docstring():
    """Help is rich markup: a bracket that reads as a tag ([pretrained], [@REVISION], [corpus.txt])
    vanished from `relpos import --help` unless escaped. Every bracket of a command's docstring but
    the style tags must reach its help."""
    import re

    from relpos_cli.cli import app

    for command in app.registered_commands:
        name = command.name or command.callback.__name__.replace("_", "-")
        doc = (command.callback.__doc__ or "").replace("[bold]", "").replace("[/]", "")
        brackets = [b.replace("\\[", "[") for b in re.findall(r"\\?\[[^\]\s]*\]", doc)]
        shown = "".join(run_cli(name, "--help").stdout.split())
        missing = [b for b in brackets if b not in shown]
        assert not missing, (name, missing)


def test_cfg_job_prints_the_composed_config():
    out = run_cli("train", "--cfg", "job", "pos=alibi", "model.n_layers=3").stdout
    assert "name: alibi" in out and "n_layers: 3" in out


def test_train_then_eval_length(tmp_path):
    run_dir = tmp_path / "run"
    out = run_cli("train", "pos=alibi", *TINY, f"hydra.run.dir={run_dir}").stdout
    assert f"run dir: {run_dir}" in " ".join(out.split())
    for name in ("config.yaml", "checkpoint.pt", "metrics.jsonl"):
        assert (run_dir / name).is_file()
    metrics = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [2, 4]
    assert {"step", "loss", "lr", "tokens_per_s"} <= set(metrics[0]) and "val_loss" in metrics[-1]

    out = run_cli("eval-length", str(run_dir), "eval.lengths=[32,64,128]", "eval.tokens=1024").stdout
    assert "ppl" in out
    rows = list(csv.DictReader((run_dir / "eval_length.csv").open()))
    assert [int(r["length"]) for r in rows] == [32, 64, 128]
    assert all(math.isfinite(float(r["ppl"])) and int(r["tokens"]) == 1024 for r in rows)
    assert all(float(r["bpb"]) == pytest.approx(float(r["loss"]) / math.log(2), rel=1e-12) for r in rows)  # 1 byte/token
    assert json.loads((run_dir / "eval_length.json").read_text())[0]["length"] == 32


def test_bpe_train_eval_and_bits_per_byte(tmp_path):
    """data.tokenizer=bpe end to end; bpb divides by the bytes the scored tokens decode to."""
    _, sources = stdlib_files()
    for name, source in zip(("a.txt", "b.txt", "v.txt"), sources[-3:]):  # ASCII: any token slice decodes whole
        (tmp_path / name).write_text(source.read_text(encoding="utf-8")[:8000].encode("ascii", "ignore").decode())
    run_dir = tmp_path / "run"
    data = ["data=text_files", f"data.files=[{tmp_path / 'a.txt'},{tmp_path / 'b.txt'}]",
            f"data.validation_files=[{tmp_path / 'v.txt'}]", "data.tokenizer=bpe", "data.vocab_size=300"]
    run_cli("train", "pos=rope", *TINY, *data, f"hydra.run.dir={run_dir}")
    out = run_cli("eval-length", str(run_dir), "eval.lengths=[32,64]", "eval.tokens=256").stdout
    assert "bpb" in out
    assert torch.load(run_dir / "checkpoint.pt", weights_only=False)["vocab_size"] == 300

    # the run's own data config finds the cached tokens and tokenizer.json
    data = load_token_data(OmegaConf.to_container(load_config(run_dir).data, resolve=True))
    tokenizer = BpeTokenizer.load(data.cache_dir / "tokenizer.json")
    scored_bytes = len(tokenizer.decode(data.validation[1:257]).encode("utf-8"))
    assert scored_bytes > 1.2 * 256  # merges: more than a byte per token
    for r in csv.DictReader((run_dir / "eval_length.csv").open()):
        assert int(r["tokens"]) == 256
        assert float(r["bpb"]) == pytest.approx(float(r["loss"]) * 256 / scored_bytes / math.log(2), rel=1e-9)

    # relpos sample encodes the prompt and decodes the text with the run's BPE
    code, out, err = run_in_process("sample", str(run_dir), "--prompt", "def ", "--max-new-tokens", "8")
    prompt = [tokenizer.eos_id, *tokenizer.encode("def ")]
    assert tokenizer.decode(prompt[1:]) == "def "
    new = list(generate(load_trained_model(run_dir, torch.device("cpu"))[1], prompt, 8, stop_id=tokenizer.eos_id))
    assert code == 0 and out.rstrip("\n") == "def " + tokenizer.decode(new), err


def test_two_scheme_sweep(tmp_path):
    sweep = tmp_path / "sweep"
    run_cli("train", "-m", "pos=rope,t5", *TINY, f"hydra.sweep.dir={sweep}")
    runs = sorted(p.parent for p in sweep.glob("*/checkpoint.pt"))
    assert len(runs) == 2
    names = sorted(json.dumps(p.name) for p in runs)
    assert "pos=rope" in names[0] + names[1] and "pos=t5" in names[0] + names[1]
    run_cli("eval-length", str(sweep), "eval.lengths=[32,64]", "eval.tokens=256")  # a sweep dir evaluates each run
    assert all((r / "eval_length.csv").is_file() for r in runs)


def test_wandb_offline_run_lands_in_the_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    run_cli("train", "pos=none", *TINY[:-1], "wandb.mode=offline", f"hydra.run.dir={run_dir}",
            env={"WANDB_MODE": "offline"})
    assert (run_dir / "wandb_id.txt").is_file()
    assert list((run_dir / "wandb").glob("offline-run-*"))


def test_learned_past_its_table_is_one_clear_line(tmp_path):
    run_dir = tmp_path / "run"
    run_cli("train", "pos=learned", "pos.max_positions=64", *TINY, f"hydra.run.dir={run_dir}")
    proc = run_cli("eval-length", str(run_dir), "eval.lengths=[32,128]", "eval.tokens=256", check=False)
    assert proc.returncode == 2
    assert "pos=learned has a table of 64 positions; length 128 is past it" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_missing_run_dir_is_one_clear_line(tmp_path):
    proc = run_cli("eval-length", str(tmp_path / "nope"), check=False)
    assert proc.returncode == 2 and "run dir not found" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 autocast and TF32 need CUDA")
def test_bf16_training_on_cuda_gives_a_checkpoint_that_loads_on_cpu(tmp_path):
    from relpos_cli.checkpoint import load_trained_model

    run_dir = tmp_path / "run"
    run_cli("train", "pos=alibi", *TINY, "device=cuda", "train.precision=bf16", f"hydra.run.dir={run_dir}")
    _, model = load_trained_model(run_dir, torch.device("cpu"))
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in model.parameters())


def _point_latest_repeatedly(cwd: str, target: str) -> None:
    os.chdir(cwd)
    for _ in range(400):
        point_latest_at(Path(target))


def test_parallel_jobs_point_outputs_latest_without_clashing(tmp_path):
    """Jobs of a parallel sweep (joblib) finish at the same moment, each moving outputs/latest."""
    targets = [tmp_path / f"run{i}" for i in range(4)]
    for t in targets:
        t.mkdir()
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_point_latest_repeatedly, args=(str(tmp_path), str(t))) for t in targets]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * len(procs)
    assert (tmp_path / "outputs" / "latest").resolve() in targets
    assert not list((tmp_path / "outputs").glob(".latest*"))  # no temp link left behind


def test_a_command_other_than_train_under_torchrun_is_refused_once():
    """Every rank runs `relpos eval-length` under torchrun: the refusal is rank 0's line alone."""
    import subprocess
    import sys

    from conftest import REPO

    said = {}
    for rank in ("0", "1"):
        env = {**os.environ, "PYTHONPATH": str(REPO), "WORLD_SIZE": "2", "RANK": rank}
        proc = subprocess.run([sys.executable, "-m", "relpos_cli", "eval-length", "outputs/latest"], env=env,
                              capture_output=True, text=True)
        assert proc.returncode == 2
        said[rank] = proc.stderr
    assert said["0"].startswith("error: relpos eval-length runs in one process") and said["1"] == ""
