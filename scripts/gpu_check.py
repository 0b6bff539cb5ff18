"""The prepared GPU check (issue 39 item 6): training throughput, long-evaluation time and memory, and
the CUDA tests, measured in one process per part and merged into one JSON file, from which
scripts/gpu_report.py writes docs/results/gpu.md. scripts/gpu_check.sh runs it on a bare GPU machine.

    PYTHONPATH=$PWD python scripts/gpu_check.py --part train --json gpu.json --deadline-s 240
    PYTHONPATH=$PWD python scripts/gpu_check.py --part tests --json gpu.json --deadline-s 100
    PYTHONPATH=$PWD python scripts/gpu_check.py --part eval  --json gpu.json --deadline-s 400
    PYTHONPATH=$PWD python scripts/gpu_check.py --part all --dry-run --json /tmp/gpu.json   # CPU, tiny shapes

train: tokens/s of one AdamW step loop (scripts/bench.py's trainer, bench's 125M GPU config, bf16
autocast, TF32) for every registered scheme with model.attn_backend=auto, each one with a fused Triton
kernel also with attn_backend=fused right after (and RoPE again with its rotation by PyTorch's ops instead
of its kernel: rotation_by_torch_ops), and x-transformers (attn_flash=True for none, rope, alibi;
its default attention for t5, which refuses flash with T5's bias). NoPE is timed first, its warm loop
timed again after every later item (`none_beside`: NoPE right before and right after each, the baseline
of that item's ratio), and NoPE built afresh after the schemes with a goal (`none_again`); x-transformers
and the schemes without a goal come last (`by_goal`).
profile: where a training step's time goes, for NoPE and the schemes of PROFILED (or --schemes): the
step's wall time (unprofiled, as train times it) against the time the GPU was busy with kernels (the
gap is the GPU waiting on the host: launches, Python, syncs), that busy time by kind of kernel
(attention, matrix products, optimizer, the rest) and the kernels that took most of it, from
torch.profiler over --profile-steps steps after the warmup.
compile: train.compile's default per backend (issue 39 item 4): tokens/s of the train part's loop with
the loss eager, under torch.compile (compile_training_loss, as train.compile runs it) and under its
mode "reduce-overhead" (the step replayed as CUDA graphs: the remedy for a step bound by its host, which
the profile part measures), in turn per scheme of COMPILED (or --schemes), and the seconds the compiled
first steps took (the compile).
eval: model.token_losses on one window of 16384 and 65536 tokens in bf16 (eval_autocast) and 16384
in fp32 (no TF32), the same 125M model untrained: first call (any compile included) and second call,
and the peak CUDA memory allocated over both. One setting at a time, NoPE first.
kernels: scripts/bench_kernels.py (each fused kernel at its own launch settings and at other tiles and
warp counts, against SDPA, at the training shape and one 16k window), its figures merged under "kernels".
launch: the host's time per call of each fused kernel (relpos_cli/kernels), forward without grad and
forward + backward, at a shape so small that the GPU finishes each kernel before the host has launched
the next, against an ATen op and SDPA at the same shape; and where a rotation's launch spends it
(cProfile, triton's functions included). What a training step bound by its host (profile's wall - busy)
pays per fused call.
tests: `python -m pytest -q` on the CUDA-relevant test files (spread over workers with pytest-xdist when
it is installed), with Triton's and inductor's caches in a temporary folder so that the parts after it
still meet first calls; passed/failed counts.

Every measurement is written to the JSON as soon as it is taken (so a killed run keeps what it
measured), and every registered scheme has its key in each table from the start (null until measured).
--deadline-s: the part stops cleanly before that many seconds, recording the rest as skipped; one
model's measurement is also cut off (SIGALRM) at --item-limit-s or the deadline, whichever is first.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import importlib.util
import json
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

from bench_kernels import EARLY_STOPPING
from gpu_report import TRAIN_GOALS

REPO = Path(__file__).resolve().parents[1]
PARTS = ("tests", "train", "profile", "compile", "eval", "kernels", "launch")  # the order of --part all
SCHEME_PARTS = ("train", "profile", "compile", "eval")  # the parts --schemes narrows (kernels and launch time their own)

TINY_CFG = dict(d_model=32, n_layers=1, n_heads=2, seq_len=64, batch=2, vocab=256)
# nominal eval settings (the JSON's keys) -> the length measured; --dry-run maps 16384 -> 64, 65536 -> 128
EVAL_SETTINGS = (("bf16", 16384), ("bf16", 65536), ("fp32", 16384))
DRY_LENGTHS = {16384: 64, 65536: 128}
XT_FLASH = ("none", "rope", "alibi")  # x-transformers with attn_flash=True
XT_DEFAULT = ("t5",)  # x-transformers refuses attn_flash with T5's relative position bias
# profiled by default (--schemes picks others): NoPE, RoPE and ALiBi, whose only cost over NoPE is the rotation
# or the bias, and a scheme of each other path (a distance table with a gradient, a token difference, no
# softmax, a per-query table); a model took about 12 s on an H200 (its build, warmup and steps)
PROFILED = ("none", "rope", "alibi", "t5", "fox", "stickbreaking", "cope")
# timed eager and compiled by default: NoPE and a scheme per path auto takes (flex's formula, the distance
# kernel with a gradient, a kernel that is no softmax), the two whose step the first profile found bound by the
# host first; RoPE (SDPA with a rotation) last: train.compile made it 1.58x faster at 786a2a4 (issue 39)
COMPILED = ("none", "alibi", "t5", "stickbreaking", "rope")
# the compile part's settings of the loss, as train.compile takes them: eager, torch.compile's default mode, and
# its mode replaying CUDA graphs
COMPILE_MODES = {"eager": False, "compiled": True, "cudagraphs": "reduce-overhead"}
# a kernel's kind, by its name: the first pattern that matches (CUDA kernels' names; the fused kernels are
# relpos_cli/kernels' Triton functions, flex's are inductor's templates, SDPA's flash or cuDNN's)
KERNEL_KINDS = (
    ("attention", re.compile(r"flash|fmha|sdpa|attention|attn|cudnn::fusion|triton_tem_fused|_(distance|fox|stick|cope|"
                             r"shaw|dape|fire)_(forward|backward)", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|matmul|wgmma|splitk|aten::(addmm|mm|bmm|linear)$", re.I)),
    ("optimizer", re.compile(r"multi_tensor_apply|adam|foreach", re.I)),
)
# one model's measurement is cut off after this: past it the goals (first call < 10 s, a few times NoPE's
# time) are missed anyway, and the rest of the part's budget is worth more
ITEM_LIMITS = {"train": 45.0, "profile": 45.0, "compile": 90.0, "eval": 30.0}
TEST_FILES = ("tests/test_kernels_*.py", "tests/test_extension_flex.py", "tests/test_score_formula.py", "tests/test_compile_graph.py",
              "tests/test_attention.py")
# compiling every kernel without running it (minutes of one core) tells a GPU nothing its CUDA tests do not
NOT_ON_GPU = ("tests/test_kernels_compile.py",)
# seconds a child process cut off at the deadline gets to write its summary after SIGINT, before SIGKILL
INTERRUPT_GRACE_S = 5.0
CHILD_START_S = 10.0  # a child Python's start before its own clock runs: torch's import, CUDA's initialisation


class ItemTimeout(Exception):
    pass


class Deadline:
    """The part's time budget: `left()` seconds remain before the clean stop."""

    def __init__(self, seconds: float, reserve: float):
        self.start = time.monotonic()
        self.end = self.start + seconds
        self.reserve = reserve  # kept free at the end: writing the JSON, freeing the GPU

    def left(self) -> float:
        return self.end - self.reserve - time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise ItemTimeout in this (main) thread after `seconds`. A CUDA synchronize in progress is not
    interrupted: the exception comes when it returns."""

    def expired(signum: int, frame: Any) -> None:
        raise ItemTimeout(f"cut off after {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def commit() -> str:
    """$RELPOS_COMMIT when set (a device's copy may carry a stale .git), else git rev-parse HEAD (+ "-dirty"
    when tracked files differ), else "unknown"."""
    if named := os.environ.get("RELPOS_COMMIT"):
        return named
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def load(path: Path) -> dict:
    if path.exists():
        try:
            data = json.loads(path.read_text())
            if isinstance(data, dict):
                return data
        except json.JSONDecodeError:
            pass
        path.replace(path.with_suffix(path.suffix + ".unreadable"))  # kept, not merged into
    return {}


def save(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


class Check:
    """One part's run: the JSON it merges into, its deadline, the device and the dry-run shapes."""

    def __init__(self, args: argparse.Namespace, part: str):
        import torch

        self.torch = torch
        self.args, self.part, self.path = args, part, args.json
        self.dry = args.dry_run
        self.device = torch.device("cpu" if self.dry else "cuda")
        self.deadline = Deadline(args.deadline_s, 0 if self.dry else 5)
        self.item_limit = args.item_limit_s or ITEM_LIMITS.get(part, 120)
        self.data = load(self.path)
        self.stopped: str | None = None
        name = "cpu (dry run)" if self.dry else torch.cuda.get_device_name(0)
        if self.data.get("commit") != commit():
            self.data.pop("commit_note", None)  # written by hand about the commit it names, not this one
        self.data.update({"device": name, "torch": torch.__version__, "commit": commit(), "dry_run": self.dry})
        parts = self.data.setdefault("parts", {})
        parts[part] = {"commit": self.data["commit"], "device": name, "torch": torch.__version__, "dry_run": self.dry,
                       "started_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                       "deadline_s": args.deadline_s, "wall_s": None, "status": "running",
                       "schemes": args.schemes if part in SCHEME_PARTS else None}
        from relpos_cli.attention import fused_kernel
        from relpos_cli.positions import build_scheme, scheme_names
        from relpos_cli.positions.base import ModelShape

        # --schemes: a subset (NoPE always: every ratio is to it); the rest stay unmeasured
        self.schemes = [n for n in scheme_names() if not args.schemes or n in args.schemes or n == "none"]
        shape = ModelShape(32, 2, 1, 64)
        # schemes whose declaration calls for a fused Triton kernel: timed with auto and with fused
        self.fused = [n for n in self.schemes if fused_kernel(build_scheme({"name": n}, shape))]
        self.data["schemes"] = {n: {"bias": bool(build_scheme({"name": n}, shape).uses_score_bias)} for n in self.schemes}
        goals = [n for n in TRAIN_GOALS if n in self.schemes]
        self.schemes_with_goals = ["none"] + sorted(goals, key=lambda n: not self.data["schemes"][n]["bias"])
        self.save()

    def save(self) -> None:
        self.data["parts"][self.part]["wall_s"] = round(self.deadline.elapsed(), 1)
        save(self.path, self.data)

    def finish(self) -> None:
        self.data["parts"][self.part]["status"] = self.stopped or "done"
        self.save()

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def free(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()
            self.torch.cuda.empty_cache()
        self.torch._dynamo.reset()  # each model compiles afresh, as in its own process

    def measure(self, fn: Callable[[], Any], minimum: float) -> tuple[Any, str | None]:
        """fn() under the item limit: (its result, None), or (None, why not). Refused (not started)
        when fewer than `minimum` seconds are left; after that every later item is refused too. A
        fault that leaves the CUDA context unusable (an illegal memory access, which CUDA reports at the
        next synchronisation) is recorded against this item and stops the part: every later item is
        refused, and the part's JSON keeps what it measured."""
        if self.stopped or self.deadline.left() < minimum:
            self.stopped = self.stopped or f"stopped at the deadline ({self.args.deadline_s:.0f} s)"
            return None, "skipped: deadline" if "deadline" in self.stopped else f"skipped, {self.stopped}"
        result, error = None, None
        try:
            with time_limit(min(self.item_limit, self.deadline.left())):
                result = fn()
        except ItemTimeout as e:
            error = f"timeout: {e}"
        except Exception as e:  # noqa: BLE001 -- an OOM, a compile failure, a refused backend: recorded, go on
            if self.args.verbose:
                traceback.print_exc()
            error = first_line(e)
        try:
            self.free()
        except Exception as e:  # noqa: BLE001 -- the CUDA context is lost: nothing after it can run
            self.stopped = f"stopped: the CUDA context was lost ({first_line(e)})"
            return None, error or first_line(e)
        return result, error


def by_goal(check: Check) -> list[str]:
    """The order models are measured in, so that a deadline cuts what matters least: NoPE (the baseline),
    the schemes with a score bias and a goal (gpu_report's), the other schemes with a goal, then the rest."""
    return check.schemes_with_goals + [s for s in check.schemes if s not in check.schemes_with_goals]


def auto_runs_fused(check: Check, scheme: str, shape: tuple[int, int, int, int], training: bool,
                    precision: str = "bf16") -> bool:
    """Whether model.attn_backend=auto resolves to the fused kernel for attention of this (B, H, T, Dh)
    in this precision (bf16: q in bfloat16, as under autocast; fp32): its run would time the same
    code as the `fused` one, which is then not run again."""
    import torch

    from relpos_cli.attention import resolve_backend
    from relpos_cli.positions import build_scheme
    from relpos_cli.positions.base import ModelShape

    _, H, T, Dh = shape
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    q = torch.empty(shape, device=check.device, dtype=dtype, requires_grad=training)
    with torch.set_grad_enabled(training):
        return resolve_backend("auto", build_scheme({"name": scheme}, ModelShape(H * Dh, H, 1, T)), q) == "fused"


# ---------------------------------------------------------------- train


def training_setup(check: Check) -> tuple[dict, bool, str]:
    """What the training parts (train, profile, compile) share: the model config (bench's GPU config,
    TINY_CFG on the dry run), whether to train under bf16 autocast (on CUDA, as relpos trains; fp32 on
    the CPU dry run, where bf16 is slow), and that precision's label; TF32 matmuls on CUDA."""
    import torch
    from bench import GPU_CFG

    if check.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    amp = not check.dry
    return TINY_CFG if check.dry else GPU_CFG, amp, "bf16 autocast, TF32" if amp else "fp32"


def warmed_up(check: Check, build: Callable[[], Any], cfg: dict, amp: bool, warmup: int,
              compile: bool | str = False) -> tuple[Callable[[int], float], float]:
    """The model build() makes (seed 0, on the device) in bench.trainer's loop, its `warmup` steps run,
    where the compiles happen (flex, the fused kernels, and the loss's as train.compile=`compile` compiles
    it): (run(n) -> tokens/s of n steps, the warmup's seconds)."""
    import torch
    from bench import trainer

    torch.manual_seed(0)
    with check.device:  # initialised where it trains (125M parameters initialise slowly on the CPU)
        model = build()
    run = trainer(model, cfg, check.device, amp, compile)
    start = time.perf_counter()
    run(warmup)
    return run, time.perf_counter() - start


def rotation_by_torch_ops() -> contextlib.AbstractContextManager:
    """RoPE rotates q and k by PyTorch's ops, as before its kernel (kernels.rotary_embedding), for as long
    as the block runs: the train part times RoPE both ways, one after the other (RoPE trained at 0.73-0.79x
    NoPE before the kernel and 0.61x in the first run with it; which of the two is faster is that table)."""
    from unittest import mock

    from relpos_cli.positions import rope

    return mock.patch.object(rope, "rotary_runs_fused", lambda *args: False)


def train_part(check: Check) -> None:
    import torch
    from bench import relpos_model, xt_model

    a = check.args
    cfg, amp, precision = training_setup(check)
    warmup, steps, rounds = (1, 1, 1) if check.dry else (a.warmup, a.steps, a.rounds)
    train = check.data["train"] = {
        "config": cfg, "precision": precision, "warmup": warmup, "steps": steps,
        "rounds": rounds,
        "tokens_per_s": dict.fromkeys(check.schemes), "tokens_per_s_fused": dict.fromkeys(check.fused),
        "tokens_per_s_rotation_by_torch_ops": dict.fromkeys(["rope"] if "rope" in check.schemes else []),
        "x_transformers_flash": dict.fromkeys(XT_FLASH), "x_transformers": dict.fromkeys(XT_DEFAULT),
        "none_again": None, "none_beside": {}, "errors": {}, "seconds": {},
        "walks_stop_early": list(EARLY_STOPPING),  # untrained weights stop them early (gpu_report notes it)
    }
    try:
        import x_transformers  # noqa: F401

        have_xt = True
    except ImportError:
        have_xt = False

    def best(run: Callable[[int], float]) -> float:
        return round(max(run(steps) for _ in range(rounds)), 1)

    # NoPE's warm loop, kept beside every model timed after it and timed again after each: its rate drifts
    # over a part (the card's clocks, the host), 23% between NoPE's first and last build on one H200, so
    # each item's ratio is against NoPE's timings right before and after it (train["none_beside"])
    reference: list[Callable[[int], float]] = []

    def timed(build: Callable[[], torch.nn.Module], keep: bool = False) -> float:
        run, _ = warmed_up(check, build, cfg, amp, warmup)
        if keep:
            reference.append(run)
        return best(run)

    items: list[tuple[str, str, Callable[[], torch.nn.Module]]] = []  # (table, key, build)
    head_dim = cfg["d_model"] // cfg["n_heads"]
    attention_shape = (cfg["batch"], cfg["n_heads"], cfg["seq_len"], head_dim)
    train["fused_is_auto"] = [s for s in check.fused if auto_runs_fused(check, s, attention_shape, training=True)]
    for s in by_goal(check):
        items.append(("tokens_per_s", s, lambda s=s: relpos_model(cfg, s)))
        if s in check.fused and s not in train["fused_is_auto"]:
            items.append(("tokens_per_s_fused", s, lambda s=s: relpos_model(cfg, s, backend="fused")))
        if s == "rope":
            items.append(("tokens_per_s_rotation_by_torch_ops", s, lambda: relpos_model(cfg, "rope")))
        if s == check.schemes_with_goals[-1]:
            # NoPE again closes what the goals need (a drift check); the comparisons below are extra
            items.append(("none_again", "none", lambda: relpos_model(cfg, "none")))
            for x in (x for x in XT_FLASH if x in check.schemes):
                items.append(("x_transformers_flash", x, lambda x=x: xt_model(cfg, x, flash=True)))
            for x in (x for x in XT_DEFAULT if x in check.schemes):
                items.append(("x_transformers", x, lambda x=x: xt_model(cfg, x, flash=False)))

    minimum = 0 if check.dry else a.min_item_s
    nope_before = None  # NoPE's latest timing on its warm loop
    for table, key, build in items:
        label = key if table == "tokens_per_s" else f"{table}.{key}" if table != "none_again" else "none_again"
        if table.startswith("x_transformers") and not have_xt:
            train["errors"][label] = "x-transformers is not installed"
            continue
        start = time.monotonic()
        first_nope = table == "tokens_per_s" and key == "none"
        with rotation_by_torch_ops() if table == "tokens_per_s_rotation_by_torch_ops" else contextlib.nullcontext():
            rate, error = check.measure(lambda: timed(build, keep=first_nope), minimum)
        train["seconds"][label] = round(time.monotonic() - start, 1)
        if first_nope:
            nope_before = rate
        elif reference and rate:
            nope_after, _ = check.measure(lambda: best(reference[0]), 0)
            train["none_beside"][label] = [nope_before, nope_after]
            nope_before = nope_after
        if table == "none_again":
            train["none_again"] = rate
        else:
            train[table][key] = rate
        if table == "tokens_per_s" and key in train["fused_is_auto"]:
            train["tokens_per_s_fused"][key] = rate  # one measurement: auto ran the kernel
        if error:
            train["errors"][label] = error
        print(f"train {label}: " + (f"{rate:,.0f} tokens/s" if rate else error), flush=True)
        check.save()


# ---------------------------------------------------------------- profile


def kernel_kind(name: str) -> str:
    return next((kind for kind, pattern in KERNEL_KINDS if pattern.search(name)), "other")


def step_profile(averages: Any, steps: int, on_gpu: bool, top: int) -> dict:
    """From torch.profiler's key_averages over `steps` steps: the kernels' busy time per step, by kind and
    the `top` kernels (on the CPU dry run: the operators' own CPU time, standing in for kernels), and
    on the GPU the `top` host events by their own CPU time (host_top)."""
    from torch.autograd import DeviceType

    wanted = DeviceType.CUDA if on_gpu else DeviceType.CPU
    rows = []
    for event in averages:
        # a user annotation (the optimizer's record_function span) also shows as a CUDA event spanning
        # the kernels it launched: counted, they would be counted twice
        if getattr(event, "device_type", None) != wanted or getattr(event, "is_user_annotation", False):
            continue
        us = event.self_device_time_total if on_gpu else event.self_cpu_time_total
        if us > 0:
            rows.append((event.key, event.count, us))
    rows.sort(key=lambda r: -r[2])
    kinds = dict.fromkeys([kind for kind, _ in KERNEL_KINDS] + ["other"], 0.0)
    for name, _, us in rows:
        kinds[kernel_kind(name)] += us / 1000 / steps
    # the host's side of the same steps (on the GPU): the operators and CUDA runtime and driver calls
    # (launches, allocations, syncs) by their own CPU time, timed by the profiler rather than cProfile
    host_rows = sorted(((event.key, event.count, event.self_cpu_time_total) for event in averages
                        if getattr(event, "device_type", None) == DeviceType.CPU and event.self_cpu_time_total > 0),
                       key=lambda r: -r[2]) if on_gpu else []
    return {"busy_ms_per_step": round(sum(us for _, _, us in rows) / 1000 / steps, 3),
            "kinds_ms_per_step": {kind: round(ms, 3) for kind, ms in kinds.items()},
            "top": [{"name": name[:160], "kind": kernel_kind(name), "calls_per_step": round(count / steps, 2),
                     "ms_per_step": round(us / 1000 / steps, 3)} for name, count, us in rows[:top]],
            "host_top": [{"name": name[:160], "calls_per_step": round(count / steps, 2),
                          "ms_per_step": round(us / 1000 / steps, 3)} for name, count, us in host_rows[:top]]}


def host_profile(step: Callable[[], Any], on_gpu: bool, top: int) -> dict:
    """Where one step's host time goes, for the time the GPU waits: the step under cProfile (the
    relpos functions by cumulative seconds, their callees included, and every function by its own),
    then the step again with torch's CUDA sync check on, each synchronizing call's warning counted by
    the line that made it (a sync stalls the GPU's queue until the host has launched again; the autograd
    engine runs the backward on a thread of its own and replays its warnings at the line that called
    backward)."""
    import cProfile
    import pstats
    import warnings

    import torch

    profiler = cProfile.Profile()
    profiler.runcall(step)
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive calls, own s, cumulative s, callers)

    def rows(entries: list, column: int) -> list[dict]:
        return [{"function": f"{Path(file).name}:{line}:{name}" if line else name, "calls": calls,
                 "ms": round(1000 * times[column], 3)}
                for (file, line, name), (calls, times) in entries[:top]]

    entries = [(key, (value[1], value[2:4])) for key, value in stats.items()]
    relpos = sorted((e for e in entries if "relpos_cli" in e[0][0]), key=lambda e: -e[1][1][1])
    own = sorted(entries, key=lambda e: -e[1][1][0])
    syncs: dict[str, int] = {}
    if on_gpu:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        for w in caught:
            if "synchroniz" in str(w.message):
                where = f"{Path(w.filename).name}:{w.lineno}"
                syncs[where] = syncs.get(where, 0) + 1
    return {"relpos_cumulative": rows(relpos, 1), "own": rows(own, 0), "syncs": syncs}


def profile_part(check: Check) -> None:
    from bench import relpos_model
    from torch.profiler import ProfilerActivity, profile

    a = check.args
    cfg, amp, precision = training_setup(check)
    warmup, steps = (1, 1) if check.dry else (a.warmup, a.profile_steps)
    schemes = [s for s in by_goal(check) if a.schemes or s in PROFILED]
    prof = check.data["profile"] = {
        "config": cfg, "precision": precision, "warmup": warmup, "steps": steps,
        "what": "one model.attn_backend=auto training step (scripts/bench.py's trainer): wall time unprofiled, "
                "kernel time under torch.profiler", "schemes": dict.fromkeys(schemes), "errors": {}}
    on_gpu = check.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])

    def measured(scheme: str) -> dict:
        run, _ = warmed_up(check, lambda: relpos_model(cfg, scheme), cfg, amp, warmup)  # the compiles: not profiled
        rate = run(steps)
        with profile(activities=activities) as profiler:
            run(steps)
        row = {"wall_ms_per_step": round(1000 * cfg["batch"] * cfg["seq_len"] / rate, 3),
               **step_profile(profiler.key_averages(), steps, on_gpu, a.profile_top)}
        row["busy_share"] = round(row["busy_ms_per_step"] / row["wall_ms_per_step"], 3)
        row["host"] = host_profile(functools.partial(run, 1), on_gpu, a.profile_top)
        return row

    minimum = 0 if check.dry else a.min_item_s
    for scheme in schemes:
        row, error = check.measure(lambda: measured(scheme), minimum)
        prof["schemes"][scheme] = row
        if error:
            prof["errors"][scheme] = error
        print(f"profile {scheme}: " + (f"{row['wall_ms_per_step']:.1f} ms a step, kernels busy {row['busy_ms_per_step']:.1f} ms "
                                       f"({', '.join(f'{k} {v:.1f}' for k, v in row['kinds_ms_per_step'].items())})"
                                       if row else error), flush=True)
        check.save()


# ---------------------------------------------------------------- compile


def compile_part(check: Check) -> None:
    from bench import relpos_model

    a = check.args
    cfg, amp, precision = training_setup(check)
    warmup, steps, rounds = (1, 1, 1) if check.dry else (a.warmup, a.steps, a.rounds)
    schemes = by_goal(check) if a.schemes else list(COMPILED)  # COMPILED's order: what matters most first
    part = check.data["compile"] = {
        "config": cfg, "precision": precision, "warmup": warmup, "steps": steps,
        "rounds": rounds, "what": "the train part's loop, model.attn_backend=auto, the loss eager, under torch.compile "
                                  "(train.compile) and under its mode reduce-overhead (CUDA graphs)",
        "tokens_per_s": {s: dict.fromkeys(COMPILE_MODES) for s in schemes},
        "warmup_seconds": {s: dict.fromkeys(COMPILE_MODES) for s in schemes}, "errors": {},
        "modes": a.compile_modes}

    def timed(scheme: str, mode: str) -> tuple[float, float]:
        run, warm = warmed_up(check, lambda: relpos_model(cfg, scheme), cfg, amp, warmup, COMPILE_MODES[mode])
        return round(max(run(steps) for _ in range(rounds)), 1), round(warm, 1)

    minimum = 0 if check.dry else a.min_item_s
    for scheme in schemes:
        for mode in a.compile_modes:
            result, error = check.measure(lambda: timed(scheme, mode), minimum)
            if result:
                part["tokens_per_s"][scheme][mode], part["warmup_seconds"][scheme][mode] = result
            else:
                part["errors"][f"{scheme} {mode}"] = error
            print(f"compile {scheme} {mode}: " + (f"{result[0]:,.0f} tokens/s (warmup {result[1]:.1f} s)" if result else error),
                  flush=True)
            check.save()


# ---------------------------------------------------------------- eval


def eval_part(check: Check) -> None:
    import torch
    from bench import GPU_CFG

    from relpos_cli.model import Transformer
    from relpos_cli.positions.base import ModelShape
    from relpos_cli.precision import eval_autocast

    cfg = TINY_CFG if check.dry else GPU_CFG
    device = check.device
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # as eval-length: no TF32
    ev = check.data["eval"] = {"config": {k: cfg[k] for k in ("d_model", "n_layers", "n_heads", "vocab")} |
                               {"train_seq_len": cfg["seq_len"], "batch": 1},
                               "what": "model.token_losses on one window, no grad, untrained weights",
                               "walks_stop_early": list(EARLY_STOPPING)}
    for precision, nominal in EVAL_SETTINGS:
        ev.setdefault(precision, {})[str(nominal)] = dict.fromkeys(check.schemes)

    def build(scheme: str, length: int, backend: str) -> torch.nn.Module:
        shape = ModelShape(cfg["d_model"], cfg["n_heads"], cfg["n_layers"], cfg["seq_len"])
        pos: dict[str, Any] = {"name": scheme}
        if scheme == "learned":
            pos["max_positions"] = max(4096, length)  # a table that reaches the length (never trained there)
        torch.manual_seed(0)
        with device:
            model = Transformer(cfg["vocab"], shape, pos, mlp_ratio=4, attn_backend=backend)
        return model.to(device).eval()

    def peak_mib() -> float:
        if device.type == "cuda":
            return torch.cuda.max_memory_allocated() / 2**20
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # dry run: the process's RSS, no meaning

    def run(scheme: str, precision: str, length: int, backend: str) -> dict:
        model = build(scheme, length, backend)
        tokens = torch.randint(0, cfg["vocab"], (1, length + 1), device=device, generator=torch.Generator(device).manual_seed(0))
        model_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        seconds, finite = [], True
        for _ in range(2):
            check.sync()
            start = time.perf_counter()
            with torch.no_grad(), eval_autocast(device, precision):
                losses = model.token_losses(tokens[:, :-1], tokens[:, 1:])
            check.sync()
            seconds.append(time.perf_counter() - start)
            finite = finite and bool(torch.isfinite(losses).all())
        out = {"seconds": round(seconds[1], 4), "first_seconds": round(seconds[0], 4), "peak_mib": round(peak_mib(), 1),
               "model_mib": round(model_mib, 1), "length": length, "backend": backend, "finite": finite}
        del model, tokens, losses
        return out

    minimum = 0 if check.dry else check.args.min_item_s
    for precision, nominal in EVAL_SETTINGS:
        length = DRY_LENGTHS[nominal] if check.dry else nominal
        table = ev[precision][str(nominal)]
        head_dim = cfg["d_model"] // cfg["n_heads"]
        fused_is_auto = [s for s in check.fused
                         if auto_runs_fused(check, s, (1, cfg["n_heads"], length, head_dim), False, precision)]
        ev.setdefault("fused_is_auto", {})[f"{precision} {nominal}"] = fused_is_auto
        jobs = [(s, b) for s in by_goal(check) for b in ("auto", "fused")
                if b == "auto" or (s in check.fused and s not in fused_is_auto)]
        for scheme, backend in jobs:
            start = time.monotonic()
            row, error = check.measure(lambda: run(scheme, precision, length, backend), minimum)
            row = row or {"seconds": None, "first_seconds": None, "peak_mib": None, "length": length, "backend": backend,
                          "error": error, "wall_s": round(time.monotonic() - start, 1)}
            if backend == "fused":
                entry = table[scheme] if isinstance(table[scheme], dict) else {"seconds": None, "first_seconds": None,
                                                                               "peak_mib": None}
                entry["fused"] = row
                table[scheme] = entry
            else:
                table[scheme] = row
                if scheme in fused_is_auto:
                    row["fused"] = dict(row)  # one measurement: auto ran the kernel
            what = f"{row['seconds']:.3f} s (first {row['first_seconds']:.2f} s), {row['peak_mib']:,.0f} MiB" \
                if row["seconds"] is not None else row["error"]
            print(f"eval {precision} {nominal} {scheme} {backend}: {what}", flush=True)
            check.save()


# ---------------------------------------------------------------- tests


PROGRESS = re.compile(r"^([.FEsxX]+)\s*(\[\s*\d+%\])?$")  # a -q progress line: "..F.s  [ 40%]"
# a -v outcome line, printed as each test ends: "[gw3] [ 40%] FAILED tests/a.py::t" under pytest-xdist,
# "tests/a.py::t FAILED  [ 40%]" without it; an id may hold spaces ("test_rows[about a half]")
OUTCOME = re.compile(r"^(?:\[gw\d+\] \[\s*\d+%\] (?P<a>PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) (?P<id>\S.*?)\s*$"
                     r"|(?P<id2>\S+::.*?) (?P<b>PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)(?:\s+\[\s*\d+%\])?\s*$)")
SUMMARY = re.compile(r"^=*\s*(\d+ \w+.*) in [\d.]+s")  # "3 failed, 40 passed, 2 skipped in 61.20s (0:01:01)"
COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")


def pytest_counts(output: str) -> dict:
    """passed/failed/skipped/errors from pytest -q's output: its summary line, or, when it was cut off
    before one, the progress characters so far (complete: False)."""
    lines = output.splitlines()
    summary = [m.group(1) for line in lines if (m := SUMMARY.match(line))]
    if summary:
        found = {kind.rstrip("s") if kind.startswith("error") else kind: int(n) for n, kind in COUNT.findall(summary[-1])}
        return {"passed": found.get("passed", 0), "failed": found.get("failed", 0), "skipped": found.get("skipped", 0),
                "errors": found.get("error", 0), "complete": True}
    outcomes = [outcome for _, outcome in test_outcomes(lines)]
    if outcomes:
        return {"passed": outcomes.count("PASSED"), "failed": outcomes.count("FAILED"),
                "skipped": outcomes.count("SKIPPED"), "errors": outcomes.count("ERROR"), "complete": False}
    dots = "".join(m.group(1) for line in lines if (m := PROGRESS.match(line)))
    return {"passed": dots.count("."), "failed": dots.count("F"), "skipped": dots.count("s"), "errors": dots.count("E"),
            "complete": False}


def test_outcomes(lines: list[str]) -> list[tuple[str, str]]:
    """(test id, outcome) of every -v outcome line."""
    return [(m["id"] or m["id2"], m["a"] or m["b"]) for line in lines if (m := OUTCOME.match(line))]


def pytest_results(status: str, output: str) -> dict:
    """The tests' entries from pytest's status and output: its counts (complete only when pytest ran to
    its end: interrupted at the deadline it still prints a summary, of what ran), failures and tail."""
    counts = pytest_counts(output) if output else {}
    if counts:
        counts["complete"] = counts["complete"] and status.startswith("exit")
    lines = output.splitlines()
    failures = [line for line in lines if line.startswith(("FAILED ", "ERROR "))]
    if not failures:  # cut off before pytest's own summary (12 xdist workers may outlast the grace before SIGKILL):
        # the failures as they were reported, one -v line each
        failures = [f"{outcome} {test}" for test, outcome in test_outcomes(lines) if outcome in ("FAILED", "ERROR")]
    failures = failures[:50]
    return {**counts, "failures": failures, "tail": output[-3000:]}


def run_child(command: list[str], timeout: float, env: dict[str, str] | None = None,
              cwd: Path = REPO) -> tuple[int | None, str]:
    """command in a process group of its own for at most `timeout` seconds -> (its exit code, None when cut
    off; its output). Cut off, the group is interrupted (pytest then prints its summary of what ran, relpos
    stops in one line) and killed INTERRUPT_GRACE_S later: nothing it started outlives it (pytest-xdist's
    workers, left running, would load the GPU under the next measurements)."""
    with subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        code: int | None = None
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                stdout, stderr = proc.communicate(timeout=INTERRUPT_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                stdout, stderr = proc.communicate()
        with contextlib.suppress(ProcessLookupError):  # a grandchild that outlived its parent's own exit
            os.killpg(proc.pid, signal.SIGKILL)
    return code, (stdout or "") + (stderr or "")


def run_to_deadline(check: Check, command: list[str], env: dict[str, str] | None = None) -> tuple[str, str, float]:
    """command in a child process (run_child) until the part's deadline, the checkout on its PYTHONPATH
    (after the caller's), compiled kernels unless this is a dry run, `env` added -> (status, its output,
    seconds). A run cut off at the deadline stops the part; none is started with fewer than --min-item-s
    seconds left for it."""
    limit = check.deadline.left() - INTERRUPT_GRACE_S
    if limit < check.args.min_item_s:
        check.stopped = f"stopped at the deadline ({check.args.deadline_s:.0f} s)"
        return "skipped: deadline", "", 0.0
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [full_env.get("PYTHONPATH"), str(REPO)]))
    if not check.dry:
        full_env.pop("TRITON_INTERPRET", None)
    full_env.update(env or {})
    start = time.monotonic()
    code, output = run_child(command, limit, full_env)
    if code is None:
        check.stopped = "stopped at the deadline"
    status = f"exit {code}" if code is not None else f"timeout after {limit:.0f} s (the deadline)"
    return status, output, round(time.monotonic() - start, 1)


def tests_part(check: Check) -> None:
    # in TEST_FILES' order: the fused kernels (never run compiled yet) first, should the deadline cut the run
    files = [f for pattern in TEST_FILES for f in (str(p.relative_to(REPO)) for p in sorted(REPO.glob(pattern)))
             if f not in NOT_ON_GPU]
    workers = ["-n", str(min(12, os.cpu_count() or 1))] if importlib.util.find_spec("xdist") and not check.dry else []
    # -v: a line per test as it ends, so that a run cut off at the deadline still names its failures; no
    # pytest-benchmark (the device has it): each xdist worker's warning about it buried the output's tail;
    # --durations: a run that ends names its slowest tests (355 took over 195 s on 12 workers at e653e1e);
    # -o addopts=: not pyproject's 2 workers by whole files, made for a 2-core CPU (and an error without xdist)
    command = [sys.executable, "-m", "pytest", "-v", "-rfE", "--durations=15", "-p", "no:cacheprovider", "-p",
               "no:benchmark", "-o", "addopts=", *workers, *files]
    tests = check.data["tests"] = {"command": " ".join(["python", *command[1:]]), "passed": None, "failed": None,
                                   "skipped": None, "errors": None, "seconds": None, "status": None, "failures": [],
                                   "tail": ""}
    if check.dry:
        tests["status"] = "skipped (dry run)"
        check.save()
        print("tests: skipped (dry run)", flush=True)
        return
    with tempfile.TemporaryDirectory(prefix="relpos-gpu-tests-") as caches:
        status, output, tests["seconds"] = run_to_deadline(
            check, command, {"TRITON_CACHE_DIR": f"{caches}/triton", "TORCHINDUCTOR_CACHE_DIR": f"{caches}/inductor"})
    tests["status"] = status
    tests.update(pytest_results(status, output))
    check.save()
    print(output[-3000:], flush=True)


# ---------------------------------------------------------------- kernels


def kernels_part(check: Check) -> None:
    """scripts/bench_kernels.py in its own process until this part's deadline; its JSON (written as it
    goes, so a cut-off run keeps what it timed) merged under "kernels"."""
    # its own deadline before run_to_deadline's interrupt, less its start (torch, CUDA), so that it stops
    # cleanly and writes what it timed
    own_deadline = check.deadline.left() - INTERRUPT_GRACE_S - CHILD_START_S
    with tempfile.TemporaryDirectory(prefix="relpos-gpu-kernels-") as work:
        out = Path(work) / "bench_kernels.json"
        command = [sys.executable, str(REPO / "scripts" / "bench_kernels.py"), "--json", str(out),
                   "--deadline-s", f"{max(own_deadline, 1):.0f}", *(["--dry-run"] if check.dry else [])]
        status, output, seconds = run_to_deadline(check, command)
        timed = json.loads(out.read_text()) if out.exists() else {}
    check.data["kernels"] = {"command": " ".join(["python", *command[1:]]), "status": status,
                             "seconds": seconds, "tail": output[-2000:],
                             **{key: timed.get(key) for key in ("what", "dtype", "shapes", "sdpa", "kernels")}}
    check.save()
    print(output[-3000:], flush=True)


# ---------------------------------------------------------------- launch

LAUNCH_SHAPE = (1, 2, 16, 64)  # (B, H, T, Dh): a few microseconds of GPU work a kernel
LAUNCH_CALLS = 300  # timed calls an item, after LAUNCH_WARMUP (the compiles)
LAUNCH_WARMUP = 3


def launch_part(check: Check) -> None:
    """Host microseconds per call (the loop's wall time over its calls, one sync at the end: at this size
    the host is the bottleneck, so that is the host's time a call) of an ATen op, SDPA, the rotation
    kernel (of one tensor, and of q and k in one launch) and each scheme's fused kernel of bench_kernels'
    SCHEMES, without grad and with its backward;
    then cProfile over the rotation's calls, the functions by their own time per call."""
    import cProfile
    import pstats

    import torch
    from bench_kernels import EVALUATION_ONLY, SCHEMES

    from relpos_cli import kernels
    from relpos_cli.attention import fused_inputs, fused_kernel
    from relpos_cli.positions import build_scheme
    from relpos_cli.positions.base import ModelShape

    device, dry = check.device, check.dry
    dtype = torch.float32 if dry else torch.bfloat16
    B, H, T, Dh = LAUNCH_SHAPE if not dry else (1, 2, 16, 16)
    calls = 3 if dry else LAUNCH_CALLS
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, Dh, generator=g).to(device, dtype).requires_grad_() for _ in range(3))
    cos, sin = (torch.randn(T, Dh, generator=g).to(device, dtype) for _ in range(2))
    upstream = torch.randn_like(q)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    timed = check.data["launch"] = {
        "shape": dict(zip("BHTD", (B, H, T, Dh))), "dtype": str(dtype).removeprefix("torch."), "calls": calls,
        "what": "host microseconds per call: the wall time of a loop of calls with one sync at its end, at a "
                "shape whose kernels take the GPU a few microseconds", "us_per_call": {}, "errors": {}}

    def per_call(fn: Callable[[], Any]) -> float:
        for _ in range(LAUNCH_WARMUP):
            fn()
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        return round((time.perf_counter() - start) / calls * 1e6, 1)

    def backward(call: Callable[[], Any]) -> Callable[[], Any]:
        return lambda: call().backward(upstream)

    items: dict[str, Callable[[], Any]] = {
        "aten add": lambda: torch.no_grad()(lambda: q + 1.0)(),
        "sdpa": lambda: torch.no_grad()(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))(),
        "sdpa, with backward": backward(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)),
    }
    if kernels.available(device.type == "cuda") and (not dry or kernels.interpreter_computes(dtype)):
        items["rotary_embedding"] = lambda: torch.no_grad()(lambda: kernels.rotary_embedding(q, cos, sin))()
        items["rotary_embedding, with backward"] = backward(lambda: kernels.rotary_embedding(q, cos, sin))
        # q and k in one launch each way, as a RoPE layer rotates them (the sum: backward reaches both)
        items["rotary_embedding_pair"] = lambda: torch.no_grad()(lambda: kernels.rotary_embedding_pair(q, k, cos, sin, cos, sin))()
        items["rotary_embedding_pair, with backward"] = lambda: torch.autograd.backward(
            kernels.rotary_embedding_pair(q, k, cos, sin, cos, sin), [upstream, upstream])
        for name in (s for s in SCHEMES if s not in EVALUATION_ONLY):  # training's host cost per call
            scheme = build_scheme({"name": name}, ModelShape(H * Dh, H, 1, T)).to(device)
            kernel = fused_kernel(scheme)
            with torch.autocast(device.type, dtype=dtype, enabled=not dry):
                inputs = fused_inputs(scheme, kernel, 0, q, torch.arange(T, device=device),
                                      torch.randn(B, T, H * Dh, generator=g).to(device).requires_grad_())
            # leaves with a gradient where training gives them one (not ALiBi's fixed slopes)
            inputs = [t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t for t in inputs]
            function = getattr(kernels, kernel)
            call = (lambda function=function, inputs=inputs: function(q, k, v, *inputs))
            items[f"{kernel} ({name})"] = lambda call=call: torch.no_grad()(call)()
            items[f"{kernel} ({name}), with backward"] = backward(call)
    for label, fn in items.items():
        us, error = check.measure(lambda fn=fn: per_call(fn), 0 if dry else 5)
        timed["us_per_call"][label] = us
        if error:
            timed["errors"][label] = error
        print(f"launch {label}: {us} us a call" if us is not None else f"launch {label}: {error}", flush=True)
        check.save()
    if "rotary_embedding" in items and timed["us_per_call"].get("rotary_embedding") is not None:
        profiler = cProfile.Profile()
        profiler.runcall(lambda: [items["rotary_embedding"]() for _ in range(calls)])
        sync()
        stats = pstats.Stats(profiler).stats
        own = sorted(((f"{Path(file).name}:{line}:{name}" if line else name, value[2]) for (file, line, name), value
                      in stats.items()), key=lambda r: -r[1])
        timed["rotary_profile"] = {"what": "cProfile over the rotation's calls, without grad: each function's own "
                                           "microseconds per call (cProfile slows Python)",
                                   "own_us_per_call": {name: round(sec / calls * 1e6, 2) for name, sec in own[:15]}}
    check.save()


# ---------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", default="all", help="train, profile, compile, eval, tests, kernels, launch, all, or a comma-separated list")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes (d_model 32, 1 layer, lengths 64/128, 1 step)")
    ap.add_argument("--json", type=Path, default=REPO / "docs" / "results" / "gpu.json", help="merged into, written after each measurement")
    ap.add_argument("--deadline-s", type=float, default=420, help="stop cleanly before this many seconds (each part)")
    ap.add_argument("--item-limit-s", type=float, default=None,
                    help="cut off one model's measurement after this (default: train 45 s, eval 30 s)")
    ap.add_argument("--min-item-s", type=float, default=12, help="start no model with fewer seconds left")
    ap.add_argument("--warmup", type=int, default=3, help="train, profile, compile: untimed steps (compiles) per model")
    ap.add_argument("--steps", type=int, default=6, help="train, compile: timed steps per round")
    ap.add_argument("--rounds", type=int, default=2, help="train, compile: timed rounds per model, best kept")
    ap.add_argument("--profile-steps", type=int, default=3, help="profile: profiled (and unprofiled) steps per model")
    ap.add_argument("--profile-top", type=int, default=12, help="profile: the kernels kept per model, by time")
    ap.add_argument("--verbose", action="store_true", help="print each error's traceback")
    ap.add_argument("--compile-modes", default=",".join(COMPILE_MODES),
                    help=f"compile: the settings timed per scheme (comma-separated, of {', '.join(COMPILE_MODES)})")
    ap.add_argument("--schemes",
                    help="train, profile, compile, eval: only these schemes (comma-separated; NoPE is always timed), e.g. to time one "
                         "kernel's change into a JSON of its own")
    args = ap.parse_args()
    parts = PARTS if args.part == "all" else tuple(args.part.split(","))
    if unknown := [p for p in parts if p not in PARTS]:
        ap.error(f"unknown --part {','.join(unknown)}; choose from {', '.join(PARTS)}, all")
    args.compile_modes = [m for m in args.compile_modes.split(",") if m]
    if not args.compile_modes or (unknown := [m for m in args.compile_modes if m not in COMPILE_MODES]):
        ap.error(f"--compile-modes takes a comma-separated list of {', '.join(COMPILE_MODES)}; got "
                 f"{','.join(args.compile_modes) or 'none'}")
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the fused kernels on CPU; read when triton defines them
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "scripts"))
    if args.schemes is not None:
        from relpos_cli.errors import RelposError
        from relpos_cli.positions import named_schemes

        try:
            args.schemes = named_schemes(args.schemes)
        except RelposError as e:
            ap.error(f"--schemes: {e}")
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device (use --dry-run on CPU)")
    # a warmup step at least: without one the first timed round holds the compiles (flex, Triton, train.compile)
    for name in ("warmup", "steps", "rounds", "profile_steps", "profile_top"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    runners = {"train": train_part, "profile": profile_part, "compile": compile_part, "eval": eval_part,
               "tests": tests_part, "kernels": kernels_part, "launch": launch_part}
    for part in parts:
        check = Check(args, part)
        print(f"== {part} on {check.data['device']}, torch {torch.__version__}, commit {check.data['commit']}", flush=True)
        runners[part](check)
        check.finish()
        print(f"== {part}: {check.data['parts'][part]['status']} in {check.data['parts'][part]['wall_s']} s; JSON: {args.json}",
              flush=True)


if __name__ == "__main__":
    main()
