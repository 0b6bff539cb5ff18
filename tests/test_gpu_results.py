"""scripts/gpu_results.sh --dry-run end to end on CPU (tiny): a tiny trained RoPE run stands in for SmolLM2,
2 RULER configurations x every eval-time method x 2 lengths, samples 2; then the tasks part (2 schemes, 1
seed, tiny training). Checks the stored eval-task files, the log, that a second call skips what is stored,
and that each page names every configuration/scheme and method and gives each cell n and an interval."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path


from conftest import REPO, run_cli

sys.path.insert(0, str(REPO / "scripts"))
import gpu_results  # noqa: E402

CELL = re.compile(r"\d\.\d\d \[\d\.\d\d, \d\.\d\d\] n=\d+")


def dry(*args: str, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OUT": str(out), "PYTHONPATH": str(REPO)}
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_results.sh"), "--dry-run", *args], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc


def table_rows(page: str, first: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in page.splitlines()
            if line.startswith(f"| {first}")]


def test_dry_run_fills_both_pages_and_resumes(tmp_path):
    run = tmp_path / "run"
    run_cli("train", "model=tiny", "train.steps=2", "train.batch_size=2", "train.seq_len=64", "train.val_batches=1",
            "wandb.mode=disabled", "pos=rope", f"hydra.run.dir={run}", cwd=tmp_path)
    store, out = tmp_path / "store", tmp_path / "out"
    out.mkdir()
    dry("--part", "ruler", "--run", str(run), "--store", str(store), out=out)
    configs, methods = gpu_results.DRY["configs"], gpu_results.DRY["methods"]
    assert len(list((store / "smollm2-ruler").glob("eval_task.task=*.json"))) == len(configs) * len(methods)
    page = (store / "smollm2-ruler.md").read_text()
    assert page.startswith("# DRY RUN")
    for length in gpu_results.DRY["lengths"]:
        assert f"## {length:,} tokens" in page
    header = table_rows(page, "configuration")[0]
    assert header[1:] == [gpu_results.LABELS[m] for m in methods]
    for config in configs:
        rows = table_rows(page, config)
        assert len(rows) == len(gpu_results.DRY["lengths"])
        assert all(CELL.fullmatch(c) and c.endswith("n=10") for row in rows for c in row[1:]), rows
    assert f"Cells measured: {2 * len(configs) * len(methods)} of {2 * len(configs) * len(methods)}." in page

    log = json.loads((store / "gpu_results.json").read_text())
    items = log["sessions"][-1]["items"]
    assert [i["status"] for i in items] == ["done"] * (len(configs) * len(methods)) and log["sessions"][-1]["dry_run"]
    proc = dry("--part", "ruler", "--run", str(run), "--store", str(store), out=out)  # all stored: nothing runs
    assert "ruler niah" not in proc.stdout
    assert json.loads((store / "gpu_results.json").read_text())["sessions"][-1]["items"] == []

    dry("--part", "tasks", "--store", str(store), "--work", str(tmp_path / "work"), out=out)
    page = (store / "tasks-gpu.md").read_text()
    for scheme in gpu_results.DRY["schemes"]:
        (row,) = table_rows(page, scheme)
        assert len(row) == 3 and all(CELL.match(c) and c.endswith("seeds 0") for c in row[1:]), row
        assert (store / "tasks-gpu" / f"passkey-{scheme}-seed0" / "eval_task.json").is_file()
    assert not list((store / "tasks-gpu").rglob("checkpoint.pt"))
    for name in ("gpu_results.json", "smollm2-ruler.md", "tasks-gpu.md", "smollm2-ruler", "tasks-gpu"):
        assert (out / "results" / name).exists()


def test_dry_run_refuses_the_committed_store():
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_results.py"), "--dry-run", "--pages-only"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "outside docs/results" in proc.stderr
