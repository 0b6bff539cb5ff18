"""scripts/bench_kernels.py end to end on CPU: its --dry-run (Triton's interpreter, tiny shapes) writes a
figure for SDPA and for every launch setting of every kernel in both phases (its own tiles, then tiles
and warps given; FIRE's kernel past its threshold in evaluation only), each kernel fed what its scheme
hands it (attention.fused_call); an unknown scheme is refused in one line. No figure is judged: a dry
run's numbers mean nothing."""

from __future__ import annotations

import json

import pytest

from triton_setup import NO_TRITON  # first: the interpreter chosen before triton is imported (the kernel tests need it)

pytest.importorskip("triton", reason=NO_TRITON)

from relpos_cli.positions import scheme_names  # noqa: E402
from test_gpu_check import run  # noqa: E402


def test_the_dry_run_times_every_kernel_at_every_setting(tmp_path):
    path = tmp_path / "k.json"
    proc = run("bench_kernels.py", "--dry-run", "--json", str(path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(path.read_text())
    assert data["dry_run"] and set(data["sdpa"]) == {"train", "eval"}
    kernels = {name: row["kernel"] for name, row in data["kernels"].items()}
    assert kernels == {"alibi": "linear_distance_attention", "t5": "distance_attention", "fox": "forgetting_attention",
                       "stickbreaking": "stickbreaking_attention", "cope": "cope_attention", "dape": "dape_attention",
                       "shaw": "shaw_attention", "fire": "fire_attention"}
    assert "train" not in data["kernels"]["fire"]  # it trains on the distance kernel's table, as t5
    for name, row in data["kernels"].items():
        full_walk = ["own, full walk"] if name in ("stickbreaking", "cope") else []
        for phase in ("eval",) if name == "fire" else ("train", "eval"):
            assert list(row[phase]) == ["own", *full_walk, "16x16 w4", "32x16 w2"], (name, phase)
            assert all(isinstance(ms, float) and ms > 0 for ms in row[phase].values()), (name, phase, row[phase])


def test_the_full_walk_inputs_never_stop_a_walk_at_16k():
    """Stick-breaking's walk stops at a stick spent of 110 and CoPE's at a count of P - 1 = 63 (their
    defaults): on never_stopping's logits, at the bench's 16k window, neither is reached by any query."""
    import math

    import torch
    from bench_kernels import SHAPES, never_stopping

    T, Dh = SHAPES["eval"][2], SHAPES["eval"][3]
    q, k, _ = never_stopping((1, 2, 256, Dh))
    logits = q @ k.transpose(-1, -2) / math.sqrt(Dh)
    assert -6.5 < logits.min() and logits.max() < -5.5
    worst = logits.max()
    assert T * torch.nn.functional.softplus(worst) < 110 and T * torch.sigmoid(worst) < 63


def test_a_scheme_unknown_or_without_a_kernel_is_refused_in_one_line(tmp_path):
    for schemes, error in (("alibi,nope", "unknown scheme nope; choose from " + ", ".join(scheme_names())),
                           ("alibi,rope", "pos=rope has no fused kernel")):
        proc = run("bench_kernels.py", "--dry-run", "--json", str(tmp_path / "k.json"), "--schemes", schemes)
        assert proc.returncode != 0 and proc.stderr.strip().splitlines() == [f"bench_kernels: {error}"]
        assert not (tmp_path / "k.json").exists()
