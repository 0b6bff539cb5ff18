"""The benchmark scripts and results_page.py as a researcher uses them to publish numbers: the figures
they write are the ones they measure, under the name they are written with, and a bad argument is one
line before anything runs.

Found by a hidden try; each test failed before its fix:
- bench_pretrained.py took each child's peak RSS from wait4's ru_maxrss, which Linux floors at the
  parent's high-water mark (carried over the exec): every row read >= the parent's peak (the parity
  check loads both models there), so docs/pretrained.md's "peak RSS relpos" was 1,596 MiB at every
  length;
- bench_pretrained.py reused a --work's tokens.pt made for shorter lengths: a longer --lengths was
  scored on the tokens there were and reported under the length asked;
- results_page.py wrote the sweep dir as it was spelled (a page from `sw` and from `/abs/sw` differed)
  and `.` as "under `/`";
- bench_stability.py's max() passed over a NaN loss after step 11 (a skipped non-finite step was no
  spike), and --steps 10 or fewer ended in a traceback;
- bench.py, bench_eval.py, bench_tasks.py ended bad arguments in tracebacks (or after the run, or, for
  bench_eval --backends --backend-list nope, timed another path under that name); bench_tasks.py wrote
  no JSON though docs/performance.md says each benchmark does.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO

SCRIPTS = REPO / "scripts"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def script(name: str, *args: str, cwd: Path | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", COLUMNS="200")
    return subprocess.run([sys.executable, str(SCRIPTS / f"{name}.py"), *args], cwd=cwd or REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


# ---- bench_pretrained.py ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    """A random 2-layer Llama with a byte-level BPE tokenizer, saved as a Hugging Face dir."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    transformers.logging.set_verbosity_error()
    eos = "<|endoftext|>"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["def main():\n    return 1\n" * 50], trainers.BpeTrainer(
        vocab_size=290, special_tokens=[eos], show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128, eos_token_id=tokenizer.eos_token_id))
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def vm_hwm_mib() -> float:
    return int(re.search(r"VmHWM:\s*(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="Linux's /proc: where wait4's figure is floored")
def test_bench_pretrained_peak_rss_is_the_childs_own_not_the_parents(tiny_llama, tmp_path):
    bench = load("bench_pretrained")
    torch.save(torch.arange(64) % 300, tmp_path / "tokens.pt")
    ballast = bytearray(1024 * 1024 * 1024)  # this (parent) process's peak: >= 1 GiB above its start
    ballast[::4096] = b"\1" * len(ballast[::4096])
    floor = vm_hwm_mib()
    del ballast
    row = bench.measure("relpos", 64, tmp_path, tiny_llama, 1)
    # the child imports torch and loads a 2-layer model: a few hundred MiB, never the parent's GiB
    assert 0 < row["peak_rss_mib"] < floor - 512, (row, floor)


def test_bench_pretrained_refills_a_kept_work_dir_too_short_for_the_lengths(tiny_llama, tmp_path):
    bench = load("bench_pretrained")
    work = tmp_path / "work"
    work.mkdir()
    first = argparse.Namespace(model_dir=str(tiny_llama), gguf=None, lengths=[16], parity_tokens=0)
    bench.prepare(first, work)
    short = len(torch.load(work / "tokens.pt"))
    longer = argparse.Namespace(model_dir=str(tiny_llama), gguf=None, lengths=[short + 1000], parity_tokens=0)
    bench.prepare(longer, work)  # the same --work, as docs/pretrained.md's two commands share /tmp/smolbench
    assert len(torch.load(work / "tokens.pt")) > short + 1000
    torch.save(torch.arange(10), work / "tokens.pt")  # a child asked for more than the file holds refuses
    with pytest.raises(SystemExit, match="holds 10 tokens, fewer than 64"):
        bench.child("relpos", 64, work, tiny_llama, 1)


# ---- results_page.py -----------------------------------------------------------------------------

def synthetic_sweep(root: Path) -> Path:
    """A sweep dir as results_page reads it: provenance.json, a run, a compare.md newer than its evaluation."""
    sweep = root / "my-sweep"
    run = sweep / "0_pos=alibi"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("pos:\n  name: alibi\n")
    (run / "checkpoint.pt").write_bytes(b"")
    (run / "eval_length.json").write_text("[]")
    os.utime(run / "eval_length.json", (1, 1))
    (sweep / "compare.md").write_text("relpos compare: ppl\n\n| configuration | ppl@32 |\n|---|---|\n| alibi | 4.0 (n=1) |\n")
    (sweep / "provenance.json").write_text(json.dumps({
        "commands": ["relpos sweep pos=alibi"], "commit": "a" * 40, "dirty": False, "relpos": "0.1.0",
        "torch": "2.13.0", "machine": "2-core CPU (x)", "threads": "1", "started": "2026-01-01T00:00:00Z",
        "finished": "2026-01-01T00:01:00Z", "exit_code": 0}))
    return sweep


def test_results_page_is_the_same_bytes_however_the_dir_is_spelled(tmp_path):
    sweep = synthetic_sweep(tmp_path)
    pages = []
    for i, (cwd, given) in enumerate(((REPO, str(sweep)), (tmp_path, "my-sweep"), (sweep, "."), (sweep / "0_pos=alibi", ".."))):
        out = tmp_path / f"page{i}.md"
        proc = script("results_page", given, "--out", str(out), "--title", "T", cwd=cwd)
        assert proc.returncode == 0, proc.stderr
        pages.append(out.read_text())
    assert pages[1:] == pages[:1] * 3
    assert "| runs | 1 under `my-sweep/` |" in pages[0]


# ---- bench_stability.py --------------------------------------------------------------------------

def test_bench_stability_a_nan_loss_after_step_10_is_a_spike():
    bench = load("bench_stability")
    from relpos_cli.model import Transformer
    from relpos_cli.positions.base import ModelShape

    torch.manual_seed(0)
    model = Transformer(64, ModelShape(16, 2, 1, 8), {"name": "none"}, 2)
    calls, loss = [0], model.loss

    def loss_with_a_nan(x, y, **kw):  # step 13's loss is NaN (its update skipped); every other is finite
        calls[0] += 1
        out = loss(x, y, **kw)
        return out * float("nan") if calls[0] == 13 else out

    model.loss = loss_with_a_nan
    data = argparse.Namespace(train=np.arange(4096) % 64)
    train = dict(weight_decay=0.1, lr=1e-3, betas=[0.9, 0.95], warmup_steps=2, min_lr_ratio=0.1, seq_len=8,
                 batch_size=2, grad_clip=1.0)
    result = bench.train_one(model, data, 0, 20, train, torch.arange(64).reshape(4, 16) % 64)
    assert math.isnan(result["losses"][12]) and result["nonfinite_steps"] == 1
    assert result["spike"] and math.isnan(result["max_after_10"])


def test_bench_stability_too_few_steps_is_one_line():
    proc = script("bench_stability", "--corpora", "stdlib", "--impls", "relpos", "--steps", "10")
    assert proc.returncode != 0 and proc.stderr.strip().splitlines() == [
        "error: --steps must be more than 10 (the spike check reads the losses after step 10)"], proc.stderr


# ---- bad arguments: one line, before anything runs -----------------------------------------------

@pytest.mark.parametrize("name, args, error", [
    ("bench", ["--schemes", "none,nope"], "bench: --schemes: unknown scheme nope; choose from "),
    ("bench", ["--steps", "0"], "bench: --steps must be at least 1, got 0"),
    ("bench", ["--rounds", "0"], "bench: --rounds must be at least 1, got 0"),
    ("bench", ["--json", "missing/b.json"], "bench: --json missing/b.json: no directory"),  # under the test's cwd
    ("bench_eval", ["--backends", "--lengths", "64", "--schemes", "alibi", "--backend-list", "sdpa,nope"],
     "bench_eval: --backend-list: nope cannot be timed here"),
    ("bench_eval", ["--backends", "--lengths", "0"], "bench_eval: --length and --lengths must be positive"),
    ("bench_eval", ["--backends", "--lengths", "x"], "bench_eval: --lengths takes comma-separated integers, got x"),
    ("bench_eval", ["--backends", "--schemes", "nope"], "bench_eval: --schemes: unknown scheme nope"),
    ("bench_tasks", ["--tasks", "nope"], "bench_tasks: --tasks: unknown task nope; choose from "),
    ("bench_tasks", ["--schemes", "nope"], "bench_tasks: --schemes: unknown scheme nope"),
    ("bench_tasks", ["--samples", "0"], "bench_tasks: --samples must be positive, got 0"),
])
def test_bad_arguments_are_one_line(name, args, error, tmp_path):
    proc = script(name, *args, cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1 and lines[0].startswith(error), proc.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []  # no JSON, nothing half-written


def test_bench_tasks_writes_the_json_of_the_rows_it_prints(tmp_path):
    out = tmp_path / "t.json"
    proc = script("bench_tasks", "--threads", "1", "--schemes", "none,alibi", "--tasks", "passkey", "--train-len", "32",
                  "--samples", "2", "--model", "tiny", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    printed = [line.split() for line in proc.stdout.splitlines() if line.split()[:1] in (["none"], ["alibi"])]
    assert [(r["scheme"], r["task"], r["length"], r["examples"]) for r in rows] == \
        [(p[0], p[1], int(p[2]), int(p[3])) for p in printed] == [("none", "passkey", 512, 2), ("alibi", "passkey", 512, 2)]
    for r, p in zip(rows, printed):
        assert f"{r['score_s']:.2f}" == p[6] and f"{r['tokens_per_s']:,.0f}" == p[8]
