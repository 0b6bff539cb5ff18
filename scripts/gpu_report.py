"""docs/results/gpu.md from the prepared GPU check's JSON (scripts/gpu_check.py): training tokens/s
and the ratio to NoPE, relpos against x-transformers, evaluation time (second and first call) and
peak memory with ratios to NoPE, where a training step's time goes (torch.profiler), train.compile
against eager, the fused kernels over launch settings, the CUDA tests, and each of issue 39's goals
marked met, not met or not measured. Standard library only.

    python scripts/gpu_report.py docs/results/gpu.json                  # writes docs/results/gpu.md
    python scripts/gpu_report.py gpu.json --out /tmp/gpu.md
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from bench_kernels import FULL_WALK

REPO = Path(__file__).resolve().parents[1]

# training tokens/s against NoPE's, at least
TRAIN_GOALS = {**dict.fromkeys(["alibi", "t5", "shaw", "kerple_log", "kerple_power", "sandwich", "fire", "fox", "p_rope",
                                "xpos", "rope"], 0.85),
               **dict.fromkeys(["stickbreaking", "cope"], 0.5), "dape": 0.3}
# relpos's tokens/s against x-transformers' (the table, at least)
XT_GOALS = {"rope": ("x_transformers_flash", 1.5), "alibi": ("x_transformers_flash", 1.5), "t5": ("x_transformers", 2.0)}
SPECIAL_EVAL = {"fox": 1.2, "stickbreaking": 2.0, "cope": 2.0, "dape": 3.5}  # second-call time against NoPE's, at most
BIAS_EVAL = 1.2  # every other scheme with a score bias
PEAK_GOAL, FIRST_CALL_GOAL = 1.3, 10.0
GOAL_SETTINGS = (("bf16", "16384"), ("bf16", "65536"))
SETTINGS = (("bf16", "16384"), ("bf16", "65536"), ("fp32", "16384"))
MET, NOT_MET, NOT_MEASURED = "met", "**not met**", "not measured"


def ratio(a: Any, b: Any) -> float | None:
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0 else None


def fmt(x: Any, spec: str = ",.0f", unit: str = "") -> str:
    return f"{x:{spec}}{unit}" if isinstance(x, (int, float)) and not isinstance(x, bool) else "–"


def at_least(value: float | None, goal: float) -> str:
    return NOT_MEASURED if value is None else MET if value >= goal else NOT_MET


def at_most(value: float | None, goal: float) -> str:
    return NOT_MEASURED if value is None else MET if value <= goal else NOT_MET


def eval_time_goals(data: dict) -> dict[str, float]:
    """scheme -> the most its second call may take against NoPE's: the special cases, and 1.2x for
    every other scheme whose attention has a score bias (the JSON's `schemes`, from the registry)."""
    schemes = data.get("schemes", {})
    goals = {n: BIAS_EVAL for n, info in schemes.items() if info.get("bias") and n not in SPECIAL_EVAL}
    return {**goals, **{n: g for n, g in SPECIAL_EVAL.items() if not schemes or n in schemes}}


def untrained(scheme: str, goal: str, part: dict) -> str:
    """A goal as measured: a kernel whose walk stops where the weights let it (the part's `walks_stop_early`,
    bench_kernels.EARLY_STOPPING when it ran; parts from before the early stop have none) is timed by the
    train and eval parts on untrained weights, which stop it early."""
    return f"{goal}, untrained weights (its walk stops early)" if scheme in part.get("walks_stop_early", ()) else goal


def scheme_list(data: dict) -> list[str]:
    names = set(data.get("schemes", {})) | set(data.get("train", {}).get("tokens_per_s", {}))
    return ["none"] + sorted(names - {"none"}) if "none" in names else sorted(names)


class Report:
    def __init__(self, data: dict, source: str = "docs/results/gpu.json"):
        self.data = data
        self.source = source  # the JSON, as the page names it
        self.lines: list[str] = []
        self.goals: list[tuple[str, str, str]] = []  # (goal, measured, status)

    def add(self, *lines: str) -> None:
        self.lines.extend(lines)

    def goal(self, what: str, measured: str, status: str) -> str:
        self.goals.append((what, measured, status))
        return status

    # ------------------------------------------------------------ training

    def train(self) -> list[str]:
        out: list[str] = ["## Training throughput", ""]
        train = self.data.get("train")
        if not train:
            return out + ["Not measured (the train part has not run)."]
        cfg = train.get("config", {})
        out.append(f"One AdamW loop (`scripts/bench.py`'s trainer): d_model {cfg.get('d_model')}, {cfg.get('n_layers')} "
                   f"layers, {cfg.get('n_heads')} heads, seq {cfg.get('seq_len')}, batch {cfg.get('batch')}, vocab "
                   f"{cfg.get('vocab')}, {train.get('precision')}; {train.get('warmup')} untimed steps (compiles), then "
                   f"the best of {train.get('rounds')} rounds of {train.get('steps')} steps. `model.attn_backend=auto`; "
                   f"`fused`: the Triton kernels.")
        out.append("")
        tps, fused = train.get("tokens_per_s", {}), train.get("tokens_per_s_fused", {})
        base = tps.get("none")
        beside_all = train.get("none_beside", {})

        def nope(label: str) -> float | None:
            """NoPE's tokens/s that the item `label` is compared with: the mean of NoPE's timings right
            before and after it (`none_beside`), or NoPE's first timing where the JSON has none."""
            pair = [x for x in beside_all.get(label) or [] if isinstance(x, (int, float))]
            return sum(pair) / len(pair) if pair else base

        def vs_nope(label: str, rate: Any) -> float | None:
            return ratio(rate, nope(label))

        timings = [x for pair in beside_all.values() for x in pair if isinstance(x, (int, float))]
        if isinstance(base, (int, float)) and timings:
            low, high = min(timings + [base]), max(timings + [base])
            out += [f"NoPE's loop, kept warm, timed first ({base:,.0f} tokens/s) and again after each of the {len(beside_all)} "
                    f"later items: {low:,.0f} to {high:,.0f} tokens/s ({high / low - 1:.0%} apart). Each ratio is against "
                    f"the mean of NoPE's timings right before and after its item.", ""]
        again = train.get("none_again")
        if isinstance(base, (int, float)) and isinstance(again, (int, float)):
            out += [f"NoPE timed first ({base:,.0f} tokens/s) and, built afresh, again after the schemes with a goal "
                    f"({again:,.0f}): {again / base - 1:+.1%} drift over the part"
                    + ("." if timings else "; ratios use the first."), ""]
        out += ["| scheme | tokens/s | vs NoPE | goal | `fused` tokens/s | `fused` vs NoPE | goal (`fused`) |",
                "|---|---:|---:|---|---:|---:|---|"]
        for s in scheme_list(self.data):
            r = vs_nope(s, tps.get(s))
            goal = TRAIN_GOALS.get(s)
            status = self.goal(untrained(s, f"train {s} >= {goal}x NoPE", train), fmt(r, ".2f", "x"), at_least(r, goal)) if goal else ""
            cells = [s, fmt(tps.get(s)), fmt(r, ".2f", "x"), f"≥ {goal}x: {status}" if goal else ""]
            if s in fused:
                rf = vs_nope(s if s in train.get("fused_is_auto", []) else f"tokens_per_s_fused.{s}", fused.get(s))
                fstatus = self.goal(untrained(s, f"train {s} (fused) >= {goal}x NoPE", train), fmt(rf, ".2f", "x"),
                                    at_least(rf, goal)) if goal else ""
                cells += [fmt(fused.get(s)), fmt(rf, ".2f", "x"), f"≥ {goal}x: {fstatus}" if goal else ""]
            else:
                cells += ["", "", ""]
            out.append("| " + " | ".join(cells) + " |")
        if train.get("fused_is_auto"):
            out += ["", f"`auto` ran the fused kernel for {', '.join(train['fused_is_auto'])}: one run fills both columns."]
        if "rope" in train.get("tokens_per_s_rotation_by_torch_ops", {}):
            torch_ops = train["tokens_per_s_rotation_by_torch_ops"]["rope"]
            out += ["", f"RoPE rotating q and k by PyTorch's ops instead of its kernel (`kernels.rotary_embedding`), timed "
                        f"right after it: {fmt(torch_ops)} tokens/s "
                        f"({fmt(vs_nope('tokens_per_s_rotation_by_torch_ops.rope', torch_ops), '.2f', 'x')} NoPE), "
                        f"against {fmt(tps.get('rope'))} ({fmt(vs_nope('rope', tps.get('rope')), '.2f', 'x')}) with the kernel."]
        out += ["", "relpos against x-transformers (`attn_flash=True` where it accepts it; it refuses flash with T5's bias)"
                    + ("; the ratio is of each one's tokens/s against NoPE's timed beside it:" if timings else ":"), "",
                "| scheme | relpos tokens/s | x-transformers tokens/s | x-transformers setting | relpos / x-transformers | goal |",
                "|---|---:|---:|---|---:|---|"]
        xt_rows = [(s, "x_transformers_flash", "attn_flash=True") for s in train.get("x_transformers_flash", {})]
        xt_rows += [(s, "x_transformers", "default attention") for s in train.get("x_transformers", {})]
        for s, table, setting in xt_rows:
            theirs = train.get(table, {}).get(s)
            r = ratio(vs_nope(s, tps.get(s)), vs_nope(f"{table}.{s}", theirs))
            goal_table, goal = XT_GOALS.get(s, (None, None))
            status = ""
            if goal and goal_table == table:
                status = f"≥ {goal}x: " + self.goal(f"train {s} relpos >= {goal}x x-transformers ({setting})",
                                                     fmt(r, ".2f", "x"), at_least(r, goal))
            out.append(f"| {s} | {fmt(tps.get(s))} | {fmt(theirs)} | {setting} | {fmt(r, '.2f', 'x')} | {status} |")
        if train.get("errors"):
            out += ["", "Not measured or failed:", ""] + [f"- `{k}`: {v}" for k, v in train["errors"].items()]
        return out

    # ------------------------------------------------------------ evaluation

    def eval(self) -> list[str]:
        out: list[str] = ["## Evaluation: time and memory", ""]
        ev = self.data.get("eval")
        if not ev:
            return out + ["Not measured (the eval part has not run)."]
        cfg = ev.get("config", {})
        out += [f"`model.token_losses` on one window (batch 1), no grad, untrained weights: d_model {cfg.get('d_model')}, "
                f"{cfg.get('n_layers')} layers, {cfg.get('n_heads')} heads, vocab {cfg.get('vocab')}. Second call: the time "
                f"a later batch takes; first call: compiling included (flex; the fused kernels), each model compiled "
                f"afresh (dynamo reset) but the on-disk kernel cache shared, and a Triton kernel compiled once per part "
                f"(the first model to call it pays). Peak: CUDA memory allocated over both calls, "
                f"weights included. bf16 is `eval_autocast(device, \"bf16\")`, fp32 no autocast and no TF32.", ""]
        if ev.get("note"):
            out += [f"In this run, {ev['note']}.", ""]
        time_goals = eval_time_goals(self.data)
        for precision, length in SETTINGS:
            table = ev.get(precision, {}).get(length)
            out += [f"### {precision}, {int(length):,} tokens", ""]
            if not table:
                out += ["Not measured.", ""]
                continue
            base = table.get("none") or {}
            out += ["| scheme | backend | second call | vs NoPE | first call | peak MiB | vs NoPE | finite | goals |",
                    "|---|---|---:|---:|---:|---:|---:|---|---|"]
            goal_setting = (precision, length) in GOAL_SETTINGS
            for s in scheme_list(self.data):
                entry = table.get(s) or {}
                rows = [(s, entry)]
                if isinstance(entry.get("fused"), dict):
                    rows.append((f"{s} (fused)", entry["fused"]))
                for label, row in rows:
                    rt, rp = ratio(row.get("seconds"), base.get("seconds")), ratio(row.get("peak_mib"), base.get("peak_mib"))
                    goals = []
                    if goal_setting and s in time_goals:
                        where = f"eval {precision} {length} {label}"
                        g = time_goals[s]
                        goals.append(f"time ≤ {g}x: " + self.goal(untrained(s, f"{where}: second call <= {g}x NoPE", ev),
                                                                   fmt(rt, ".2f", "x"), at_most(rt, g)))
                        goals.append(f"peak ≤ {PEAK_GOAL}x: " + self.goal(f"{where}: peak <= {PEAK_GOAL}x NoPE", fmt(rp, ".2f", "x"),
                                                                          at_most(rp, PEAK_GOAL)))
                        first = row.get("first_seconds")
                        goals.append(f"first < {FIRST_CALL_GOAL:.0f} s: " + self.goal(
                            f"{where}: first call < {FIRST_CALL_GOAL:.0f} s", fmt(first, ".1f", " s"),
                            NOT_MEASURED if first is None else MET if first < FIRST_CALL_GOAL else NOT_MET))
                    error = row.get("error")
                    finite = "" if row.get("finite") is None else "yes" if row["finite"] else "**no**"
                    out.append(f"| {label} | {row.get('backend', '–')} | {fmt(row.get('seconds'), '.3f', ' s')} | "
                               f"{fmt(rt, '.2f', 'x')} | {fmt(row.get('first_seconds'), '.2f', ' s')} | "
                               f"{fmt(row.get('peak_mib'))} | {fmt(rp, '.2f', 'x')} | {finite} | "
                               f"{'; '.join(goals)}{' ' + error if error else ''} |")
            if same := ev.get("fused_is_auto", {}).get(f"{precision} {length}"):
                out += ["", f"`auto` ran the fused kernel for {', '.join(same)}: one run fills both rows."]
            out.append("")
        return out

    # ------------------------------------------------------------ tests

    def tests(self) -> list[str]:
        out: list[str] = ["## CUDA tests", ""]
        t = self.data.get("tests")
        if not t:
            return out + ["Not run (the tests part has not run)."]
        out += [f"`{t.get('command')}`: {t.get('status')}", ""]
        if t.get("note"):
            out += [t["note"][0].upper() + t["note"][1:] + ".", ""]
        if t.get("passed") is not None:
            cut = t.get("complete") is False
            bad = t["failed"] + t["errors"]
            out += [f"{t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped, {t['errors']} errors "
                    f"in {fmt(t.get('seconds'), '.0f', ' s')}" + (" (cut off before the end: the counts so far)." if cut else "."), ""]
            self.goal("CUDA tests: none failed", f"{t['failed']} failed, {t['errors']} errors" + (" (cut off)" if cut else ""),
                      NOT_MET if bad else NOT_MEASURED if cut else MET)
        else:
            self.goal("CUDA tests: none failed", "–", NOT_MEASURED)
        out += [f"- `{line}`" for line in t.get("failures", [])]
        return out

    # ------------------------------------------------------------ profile

    def profile(self) -> list[str]:
        """Each profiled scheme's training step: its wall time, the time kernels kept the GPU busy (the
        rest the GPU waited on the host) by kind, both against NoPE's; then each one's longest kernels."""
        out: list[str] = ["## Where a training step's time goes", ""]
        p = self.data.get("profile")
        if not p:
            return out + ["Not run (the profile part has not run)."]
        rows = {s: r for s, r in (p.get("schemes") or {}).items() if isinstance(r, dict)}
        kinds = list(next(iter(rows.values()))["kinds_ms_per_step"]) if rows else []
        base = rows.get("none") or {}
        out += [f"{p.get('what')}; {p.get('precision')}, {p.get('steps')} steps after {p.get('warmup')}, config "
                f"{p.get('config')}. busy: the kernels' time; wall - busy: the GPU waiting on the host (Python, "
                f"launches, syncs). ms a step.", "",
                "| scheme | wall | vs NoPE | busy | busy / wall | " + " | ".join(kinds) + " | over NoPE: wall / busy |",
                "|---|---:|---:|---:|---:|" + "---:|" * len(kinds) + "---|"]
        for scheme, r in (p.get("schemes") or {}).items():
            if scheme not in rows:
                out.append(f"| {scheme} | {(p.get('errors') or {}).get(scheme, 'not measured')} |")
                continue
            extra = (f"{r['wall_ms_per_step'] - base['wall_ms_per_step']:+.1f} / "
                     f"{r['busy_ms_per_step'] - base['busy_ms_per_step']:+.1f}") if base and scheme != "none" else "–"
            out.append(f"| {scheme} | {fmt(r['wall_ms_per_step'], '.1f')} | "
                       f"{fmt(ratio(r['wall_ms_per_step'], base.get('wall_ms_per_step')), '.2f', 'x')} | "
                       f"{fmt(r['busy_ms_per_step'], '.1f')} | {fmt(r.get('busy_share'), '.0%')} | " +
                       " | ".join(fmt(r["kinds_ms_per_step"].get(k), ".1f") for k in kinds) + f" | {extra} |")
        out += ["", "The longest kernels (ms a step, calls a step):", "", "| scheme | kernel | kind | ms | calls |",
                "|---|---|---|---:|---:|"]
        for scheme, r in rows.items():
            for k in r.get("top", []):
                name = k["name"].replace("|", "\\|")
                out.append(f"| {scheme} | `{name[:90]}` | {k['kind']} | {fmt(k['ms_per_step'], '.2f')} | "
                           f"{fmt(k['calls_per_step'], 'g')} |")
        out += ["", "The host's side of one step (under cProfile, which slows Python: compare schemes, not "
                "milliseconds): the synchronizing calls torch's CUDA sync check warned of, by the line that made "
                "them (the timing loop's own synchronize, in bench.py, may be among them; one in the backward is "
                "named by the line that called backward); the relpos functions with the most cumulative time; the "
                "functions with the most time of their own.", "", "| scheme | syncs | relpos, cumulative ms | own ms |", "|---|---|---|---|"]
        for scheme, r in rows.items():
            host = r.get("host")
            if not host:  # a JSON from before the host's side was recorded
                out.append(f"| {scheme} | not measured | | |")
                continue
            syncs = ", ".join(f"`{where}` x{n}" for where, n in (host.get("syncs") or {}).items()) or "none"
            cumulative = "; ".join(f"`{f['function']}` {f['ms']:.1f}" for f in host.get("relpos_cumulative", [])[:6])
            own = "; ".join(f"`{f['function'][:60]}` {f['ms']:.1f}" for f in host.get("own", [])[:6])
            out.append(f"| {scheme} | {syncs} | {cumulative.replace('|', '/')} | {own.replace('|', '/')} |")
        timed_host = {scheme: r["host_top"] for scheme, r in rows.items() if r.get("host_top")}
        if timed_host:
            out += ["", "The host's side as torch.profiler timed it, the same steps as the kernels above: the operators "
                    "and the CUDA runtime and driver calls (launches, allocations, syncs) with the most CPU time of "
                    "their own, ms a step (calls a step).", "", "| scheme | host events |", "|---|---|"]
            for scheme, events in timed_host.items():
                listed = "; ".join(f"`{e['name'][:60]}` {e['ms_per_step']:.2f} ({e['calls_per_step']:g})" for e in events[:8])
                out.append(f"| {scheme} | {listed.replace('|', '/')} |")
        return out

    # ------------------------------------------------------------ compile

    def compiled(self) -> list[str]:
        """Each timed scheme's tokens/s with the loss eager, compiled (train.compile) and compiled as CUDA
        graphs (mode reduce-overhead), and the ratios."""
        out: list[str] = ["## train.compile against eager", ""]
        c = self.data.get("compile")
        if not c:
            return out + ["Not run (the compile part has not run)."]
        out += [f"{c.get('what')}; {c.get('precision')}, {c.get('warmup')} untimed steps (the compile: their seconds "
                f"below), then the best of {c.get('rounds')} rounds of {c.get('steps')} steps."
                + (f" Timed: {', '.join(c['modes'])} only." if c.get("modes") and len(c["modes"]) < 3 else ""), "",
                "| scheme | eager tokens/s | compiled tokens/s | CUDA graphs tokens/s | compiled / eager | "
                "CUDA graphs / eager | compiled vs NoPE compiled | CUDA graphs vs NoPE's | compile s | with graphs s |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        rates = c.get("tokens_per_s") or {}
        none = rates.get("none") or {}
        for scheme, r in rates.items():
            warm = (c.get("warmup_seconds") or {}).get(scheme) or {}
            out.append(f"| {scheme} | {fmt(r.get('eager'))} | {fmt(r.get('compiled'))} | {fmt(r.get('cudagraphs'))} | "
                       f"{fmt(ratio(r.get('compiled'), r.get('eager')), '.2f', 'x')} | "
                       f"{fmt(ratio(r.get('cudagraphs'), r.get('eager')), '.2f', 'x')} | "
                       f"{fmt(ratio(r.get('compiled'), none.get('compiled')), '.2f', 'x')} | "
                       f"{fmt(ratio(r.get('cudagraphs'), none.get('cudagraphs')), '.2f', 'x')} | "
                       f"{fmt(warm.get('compiled'), '.1f')} | {fmt(warm.get('cudagraphs'), '.1f')} |")
        if c.get("errors"):
            out += ["", "Not measured or failed:", ""] + [f"- `{k}`: {v}" for k, v in c["errors"].items()]
        return out

    # ------------------------------------------------------------ kernels

    def kernels(self) -> list[str]:
        """Each fused kernel's time at its own launch settings and at the fastest setting timed, against
        SDPA without a bias (scripts/bench_kernels.py's figures: a timed setting is a number, a failed
        one its error)."""
        out: list[str] = ["## Fused kernels over launch settings", ""]
        k = self.data.get("kernels")
        if not k:
            return out + ["Not run (the kernels part has not run)."]
        out += [f"`{k.get('command')}`: {k.get('status')}; {k.get('what') or ''}", ""]
        shapes = k.get("shapes") or {}
        out += ["| scheme (kernel) | phase (B, H, T, Dh) | SDPA ms | own ms | own / SDPA | fastest | ms | failed | "
                "full walk ms | full walk / SDPA |", "|---|---|---:|---:|---:|---|---:|---:|---:|---:|"]
        for scheme, row in (k.get("kernels") or {}).items():
            for phase, timed in row.items():
                if phase == "kernel" or not isinstance(timed, dict):
                    continue
                full_walk = timed.get(FULL_WALK)
                settings = {label: ms for label, ms in timed.items() if label != FULL_WALK}
                numbers = {label: ms for label, ms in settings.items() if isinstance(ms, (int, float))}
                best = min(numbers, key=numbers.get) if numbers else None
                sdpa = (k.get("sdpa") or {}).get(phase)
                shape = shapes.get(phase) or {}
                walked = full_walk if isinstance(full_walk, (int, float)) else None
                out.append(f"| {scheme} ({row.get('kernel')}) | {phase} ({', '.join(str(v) for v in shape.values())}) | "
                           f"{fmt(sdpa, '.3f')} | {fmt(numbers.get('own'), '.3f')} | {fmt(ratio(numbers.get('own'), sdpa), '.2f', 'x')} | "
                           f"{best or '–'} | {fmt(numbers.get(best), '.3f')} | {len(settings) - len(numbers)} | "
                           f"{'failed' if full_walk is not None and walked is None else fmt(walked, '.3f')} | "
                           f"{fmt(ratio(walked, sdpa), '.2f', 'x')} |")
        if any(FULL_WALK in timed for row in (k.get("kernels") or {}).values() for timed in row.values()
               if isinstance(timed, dict)):
            out += ["", "Stick-breaking's and CoPE's walks stop once every query of a tile has spent its stick or "
                    "counted to its cap, which the drawn logits (N(0, 1)) reach within about 160 keys: `own` is "
                    "that case. `full walk`: the same kernel at its own settings on logits near -6, where the walk "
                    "never stops. A trained model costs between the two, as its weights say."]
        return out

    # ------------------------------------------------------------ launch

    def launch(self) -> list[str]:
        """The host's microseconds per call of each fused kernel against an ATen op's, and where a
        rotation's launch spends them."""
        out: list[str] = ["## The host's time per kernel call", ""]
        launch = self.data.get("launch")
        if not launch:
            return out + ["Not run (the launch part has not run)."]
        timed = launch.get("us_per_call") or {}
        aten = timed.get("aten add")
        out += [f"{launch.get('what')}; {launch.get('dtype')}, shape {launch.get('shape')}, {launch.get('calls')} calls "
                f"an item. A training step calls each attention kernel once a layer, forward and backward.", "", "| call | µs a call | vs an ATen op |", "|---|---:|---:|"]
        for label, us in timed.items():
            shown = fmt(us, ".1f") if us is not None else (launch.get("errors") or {}).get(label, "not measured")
            out.append(f"| {label} | {shown} | {fmt(ratio(us, aten), '.1f', 'x')} |")
        profiled = (launch.get("rotary_profile") or {}).get("own_us_per_call") or {}
        if profiled:
            out += ["", f"{launch['rotary_profile'].get('what')}:", "",
                    "; ".join(f"`{name[:70]}` {us:.1f}" for name, us in profiled.items()).replace("|", "/")]
        return out

    # ------------------------------------------------------------ the page

    def render(self) -> str:
        d = self.data
        body = (self.train() + [""] + self.profile() + [""] + self.compiled() + [""] + self.eval() + [""] + self.kernels()
                + [""] + self.launch() + [""] + self.tests())
        head = ["# relpos on a GPU: the prepared check", "",
                f"<!-- generated by scripts/gpu_report.py from {self.source} (scripts/gpu_check.py); do not edit -->", ""]
        if d.get("dry_run") or any(p.get("dry_run") for p in d.get("parts", {}).values()):
            head += ["**DRY RUN: CPU, tiny shapes. These numbers test the pipeline; they are not measurements.**", ""]
        head += [f"Card: {d.get('device', '?')}; torch {d.get('torch', '?')}; commit `{d.get('commit', '?')}` "
                 f"(the last part written). How to run it: [docs/gpu.md](../gpu.md#the-prepared-check).", ""]
        if d.get("commit_note"):
            head += [f"Commit: {d['commit_note']}.", ""]
        head += [
                 "| part | commit | card | torch | started (UTC) | wall | status |", "|---|---|---|---|---|---:|---|"]
        for name, p in d.get("parts", {}).items():
            head.append(f"| {name} | `{str(p.get('commit'))[:12]}` | {p.get('device')} | {p.get('torch')} | {p.get('started_utc') or '–'} | "
                        f"{fmt(p.get('wall_s'), '.0f', ' s')} | {p.get('status')} |")
        subsets = {name: p["schemes"] for name, p in d.get("parts", {}).items() if p.get("schemes")}
        if subsets:
            head += ["", "Parts run on a subset of the schemes (NoPE always; the others not measured): " +
                     "; ".join(f"{name}: {', '.join(schemes)}" for name, schemes in subsets.items()) + "."]
        commits = {p.get("commit") for p in d.get("parts", {}).values()}
        if len(commits) > 1:
            head += ["", "The parts ran at different commits: compare within a part."]
        counts = {s: sum(1 for g in self.goals if g[2] == s) for s in (MET, NOT_MET, NOT_MEASURED)}
        goals = ["", "## Goals (issue 39)", "",
                 f"{counts[MET]} met, {counts[NOT_MET]} not met, {counts[NOT_MEASURED]} not measured. Ratios are within one "
                 f"run (one part, one card).", "", "| goal | measured | status |", "|---|---:|---|"]
        goals += [f"| {g} | {m} | {s} |" for g, m, s in self.goals]
        if any("untrained weights" in g for g, _, _ in self.goals):
            goals += ["", "Untrained weights: stick-breaking's and CoPE's kernels stop walking the keys once every query "
                      "of a tile has spent its stick or counted to its cap, which logits near 0 reach within about 160 "
                      "keys; a trained model's logits decide where its walk stops. The fused kernels part times both "
                      "ends (`own` and `full walk`)."]
        return "\n".join(head + goals + [""] + body).rstrip() + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", type=Path, nargs="?", default=REPO / "docs" / "results" / "gpu.json")
    ap.add_argument("--out", type=Path, default=None, help="default: gpu.md beside the JSON")
    args = ap.parse_args()
    data = json.loads(args.json.read_text())
    out = args.out or args.json.with_suffix(".md")
    source = args.json.resolve()
    text = Report(data, str(source.relative_to(REPO)) if source.is_relative_to(REPO) else args.json.name).render()
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
