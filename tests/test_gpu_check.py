"""The prepared GPU check (scripts/gpu_check.py, gpu_report.py) end to end on CPU: its --dry-run (tiny
shapes) for every part into tmp_path, then the report on that JSON. Checks the JSON's shape (every
registered scheme in each table, issue 39 item 6), the merge of parts run separately, and that the
report names every scheme. No figure is checked: a dry run's numbers mean nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from relpos_cli.positions import scheme_names

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from gpu_check import (  # noqa: E402
    INTERRUPT_GRACE_S, PROFILED, Check, Deadline, ItemTimeout, kernel_kind, pytest_counts, pytest_results, run_to_deadline,
    step_profile, time_limit)


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, str(REPO / "scripts" / script), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def dry(tmp_path_factory) -> tuple[dict, str, Path]:
    """Parts run as gpu_check.sh runs them, in two invocations merging into one JSON: (JSON, report, path)."""
    path = tmp_path_factory.mktemp("gpu") / "gpu.json"
    for parts in ("train,tests,profile", "eval,kernels,launch"):
        proc = run("gpu_check.py", "--part", parts, "--dry-run", "--json", str(path))
        assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run("gpu_report.py", str(path), "--out", str(path.with_suffix(".md")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(path.read_text()), path.with_suffix(".md").read_text(), path


def test_the_json_has_every_registered_scheme_in_each_table(dry):
    data, _, _ = dry
    schemes = set(scheme_names())
    assert {"device", "torch", "commit"} <= set(data)
    assert set(data["train"]["tokens_per_s"]) == schemes
    assert set(data["train"]["x_transformers_flash"]) == {"none", "rope", "alibi"}
    assert set(data["train"]["x_transformers"]) == {"t5"}
    assert isinstance(data["train"]["tokens_per_s_rotation_by_torch_ops"]["rope"], float)
    assert set(data["train"]["tokens_per_s_fused"]) == {"alibi", "t5", "kerple_log", "kerple_power", "sandwich", "fire",
                                                         "shaw", "fox", "stickbreaking", "cope", "dape"}
    tables = {("bf16", "16384"), ("bf16", "65536"), ("fp32", "16384")}
    assert {(p, n) for p in ("bf16", "fp32") for n in data["eval"][p]} == tables
    for precision, length in tables:
        table = data["eval"][precision][length]
        assert set(table) == schemes
        for scheme, entry in table.items():
            assert {"seconds", "first_seconds", "peak_mib"} <= set(entry), (precision, length, scheme)
            assert "error" not in entry, (precision, length, scheme, entry)
        for scheme in ("t5", "fire", "shaw", "fox", "stickbreaking", "cope", "dape"):
            assert table[scheme]["fused"]["backend"] == "fused"
    # every relpos model trained (x-transformers is in the dev extra; without it its rows say so)
    assert all(isinstance(v, (int, float)) for v in data["train"]["tokens_per_s"].values()), data["train"]["errors"]
    assert data["tests"]["status"] == "skipped (dry run)"


def test_the_kernels_part_times_every_kernel_at_its_own_settings(dry):
    from bench_kernels import EVALUATION_ONLY

    data, report, _ = dry
    kernels = data["kernels"]
    assert kernels["status"] == "exit 0", kernels["tail"]
    assert set(kernels["sdpa"]) == {"train", "eval"}
    for scheme, row in kernels["kernels"].items():
        for phase in ("eval",) if scheme in EVALUATION_ONLY else ("train", "eval"):
            assert isinstance(row[phase]["own"], float), (scheme, phase, row[phase])
    assert "| t5 (distance_attention) | train (" in report and "| dape (dape_attention) | eval (" in report


def test_the_launch_part_times_every_fused_kernel_both_ways_beside_an_aten_op(dry):
    """The host's time per call: the ATen baseline, SDPA, the rotation and each kernel of bench_kernels'
    schemes that train (not EVALUATION_ONLY's) without grad and with its backward, all timed; the
    rotation's calls profiled; the page's table."""
    from bench_kernels import EVALUATION_ONLY, SCHEMES

    data, report, _ = dry
    timed = data["launch"]["us_per_call"]
    kernels = [label for label in timed if label.endswith(")") and "(" in label]
    assert sorted(label.split("(")[1].rstrip(")") for label in kernels) == sorted(set(SCHEMES) - set(EVALUATION_ONLY))
    assert all(f"{label}, with backward" in timed for label in kernels + ["sdpa", "rotary_embedding", "rotary_embedding_pair"])
    assert all(isinstance(us, float) and us > 0 for us in timed.values()), data["launch"]["errors"]
    assert data["launch"]["rotary_profile"]["own_us_per_call"]
    assert "| aten add | " in report and "| rotary_embedding, with backward | " in report


def test_parts_run_separately_merge_into_one_file(dry):
    data, _, _ = dry
    assert set(data["parts"]) == {"train", "tests", "profile", "eval", "kernels", "launch"}
    assert all(p["status"] == "done" and p["dry_run"] and p["wall_s"] is not None for p in data["parts"].values())


def test_the_report_names_every_scheme_and_marks_the_goals(dry):
    _, report, _ = dry
    assert "DRY RUN" in report
    for scheme in scheme_names():
        assert f"| {scheme} |" in report, scheme
    for heading in ("## Goals", "## Training throughput", "### bf16, 16,384 tokens", "### bf16, 65,536 tokens",
                    "### fp32, 16,384 tokens", "## Fused kernels over launch settings", "## CUDA tests"):
        assert heading in report
    assert "| train dape >= 0.3x NoPE |" in report
    assert "| train t5 relpos >= 2.0x x-transformers (default attention) |" in report
    assert "eval bf16 65536 stickbreaking (fused): second call <= 2.0x NoPE" in report
    assert "| CUDA tests: none failed | – | not measured |" in report
    assert "RoPE rotating q and k by PyTorch's ops instead of its kernel" in report


def test_nope_is_timed_beside_every_later_training_item(dry):
    """The train part times NoPE's warm loop again after each item: every item after NoPE's first has
    (NoPE right before, NoPE right after), and each item's `before` is the previous item's `after`."""
    data, _, _ = dry
    train = data["train"]
    timed = [label for label in train["seconds"] if label != "none" and label not in train["errors"]]
    assert timed and set(train["none_beside"]) == set(timed)
    pairs = list(train["none_beside"].values())
    assert all(isinstance(x, float) and x > 0 for pair in pairs for x in pair)
    assert pairs[0][0] == train["tokens_per_s"]["none"]
    assert all(a[1] == b[0] for a, b in zip(pairs, pairs[1:]))


def test_the_report_takes_each_ratio_against_nope_timed_beside_it(tmp_path):
    """NoPE drifting from 200 to 80 tokens/s over the part: ALiBi's 90, timed between NoPE's 100 and 80,
    is 1.00x NoPE (goal met), not 0.45x of NoPE's first timing; relpos against x-transformers divides the
    two NoPE-relative rates. Without `none_beside` (JSON written before it) NoPE's first timing is used."""
    train = {"config": {}, "tokens_per_s": {"none": 200.0, "alibi": 90.0}, "tokens_per_s_fused": {},
             "x_transformers_flash": {"alibi": 40.0}, "x_transformers": {},
             "none_beside": {"alibi": [100.0, 80.0], "x_transformers_flash.alibi": [80.0, 20.0]}, "errors": {}}
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"device": "card", "torch": "t", "commit": "c", "train": train}))
    proc = run("gpu_report.py", str(path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    page = path.with_suffix(".md").read_text()
    assert "| alibi | 90 | 1.00x | ≥ 0.85x: met |" in page
    assert "| alibi | 90 | 40 | attn_flash=True | 1.25x | ≥ 1.5x: **not met** |" in page  # (90/90) / (40/50)
    assert "20 to 200 tokens/s (900% apart)" in page
    del train["none_beside"]
    path.write_text(json.dumps({"device": "card", "torch": "t", "commit": "c", "train": train}))
    assert run("gpu_report.py", str(path)).returncode == 0
    page = path.with_suffix(".md").read_text()
    assert "| alibi | 90 | 0.45x | ≥ 0.85x: **not met** |" in page
    assert "| alibi | 90 | 40 | attn_flash=True | 2.25x | ≥ 1.5x: met |" in page


def test_the_profile_part_splits_each_step_into_kernel_kinds(dry):
    data, report, _ = dry
    profile = data["profile"]
    assert list(profile["schemes"]) == [s for s in profile["schemes"] if s in PROFILED] and "none" in profile["schemes"]
    for scheme, row in profile["schemes"].items():
        assert row is not None, (scheme, profile["errors"])
        assert set(row["kinds_ms_per_step"]) == {"attention", "matmul", "optimizer", "other"}
        # the kinds split the busy time, and the top kernels are some of it, longest first
        assert sum(row["kinds_ms_per_step"].values()) == pytest.approx(row["busy_ms_per_step"], abs=0.01)
        times = [k["ms_per_step"] for k in row["top"]]
        assert times == sorted(times, reverse=True) and sum(times) <= row["busy_ms_per_step"] + 0.01
        assert row["busy_share"] == pytest.approx(row["busy_ms_per_step"] / row["wall_ms_per_step"], abs=1e-3)
        # the host's side: the loss's Python under cProfile, its relpos callers by cumulative time
        assert any(f["function"].startswith("model.py:") and f["function"].endswith(":loss")
                   for f in row["host"]["relpos_cumulative"]), row["host"]
        assert row["host"]["syncs"] == {}  # (no CUDA, nothing to check)
        # a user annotation spans the kernels it launched (the optimizer's step): not a kernel, never counted
        assert not [k["name"] for k in row["top"] if k["name"].startswith("Optimizer.")], row["top"]
    # on the CPU dry run the operators stand in for kernels: SDPA's attention and the matrix products are named
    assert profile["schemes"]["none"]["kinds_ms_per_step"]["attention"] > 0
    assert profile["schemes"]["none"]["kinds_ms_per_step"]["matmul"] > 0
    assert "## Where a training step's time goes" in report and "| t5 |" in report.split("## Where")[1]
    assert "| t5 | none | `model.py:" in report  # the host table


def test_a_gpu_profile_splits_kernels_from_the_hosts_own_time():
    """On the GPU the kernels (CUDA events) make the busy time and the host's events (CPU, own time) are
    listed apart, longest first, per step; a user annotation spanning kernels counts in neither."""
    from torch.autograd import DeviceType

    def event(key, device, count, cpu_us=0.0, gpu_us=0.0, annotation=False):
        return SimpleNamespace(key=key, device_type=device, count=count, self_cpu_time_total=cpu_us,
                               self_device_time_total=gpu_us, is_user_annotation=annotation)

    averages = [event("_distance_backward_kv", DeviceType.CUDA, 24, gpu_us=6000.0),
                event("nvjet_sm90_gemm", DeviceType.CUDA, 74, gpu_us=3000.0),
                event("Optimizer.step#AdamW.step", DeviceType.CUDA, 2, gpu_us=9000.0, annotation=True),
                event("cuLaunchKernelEx", DeviceType.CPU, 96, cpu_us=800.0),
                event("aten::empty", DeviceType.CPU, 120, cpu_us=200.0),
                event("cudaLaunchKernel", DeviceType.CPU, 300, cpu_us=1200.0)]
    row = step_profile(averages, steps=2, on_gpu=True, top=2)
    assert row["busy_ms_per_step"] == pytest.approx(4.5)
    assert row["kinds_ms_per_step"]["attention"] == pytest.approx(3.0)
    assert [e["name"] for e in row["host_top"]] == ["cudaLaunchKernel", "cuLaunchKernelEx"]
    assert row["host_top"][1] == {"name": "cuLaunchKernelEx", "calls_per_step": 48, "ms_per_step": 0.4}
    assert step_profile(averages, steps=2, on_gpu=False, top=2)["host_top"] == []


def test_the_report_lists_the_hosts_timed_events_per_scheme(tmp_path):
    row = {"wall_ms_per_step": 40.0, "busy_ms_per_step": 20.0, "busy_share": 0.5,
           "kinds_ms_per_step": {"attention": 2.0, "matmul": 8.0, "optimizer": 3.0, "other": 7.0}, "top": [],
           "host_top": [{"name": "cuLaunchKernelEx", "calls_per_step": 48, "ms_per_step": 9.5}]}
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"device": "card", "torch": "t", "commit": "c",
                                "profile": {"schemes": {"none": {**row, "host_top": []}, "rope": row}}}))
    assert run("gpu_report.py", str(path)).returncode == 0
    page = path.with_suffix(".md").read_text()
    assert "| rope | `cuLaunchKernelEx` 9.50 (48) |" in page and "| none | `" not in page.split("as torch.profiler timed")[1]


def test_rope_rotates_by_torch_ops_inside_the_switch_and_by_its_kernel_outside(monkeypatch):
    """The train part's second RoPE row times the rotation without its kernel: inside rotation_by_torch_ops
    apply_rotary takes PyTorch's ops even where the kernel would run (faked here: CPU has no kernel run),
    and after it the kernel again."""
    import torch

    from gpu_check import rotation_by_torch_ops
    from relpos_cli.positions import rope

    launched = []
    monkeypatch.setattr(rope, "rotary_runs_fused", lambda *args: True)
    monkeypatch.setattr(rope.kernels, "rotary_embedding", lambda x, cos, sin: launched.append(1) or x)
    x, cos, sin = torch.randn(1, 2, 5, 4), torch.randn(5, 4), torch.randn(5, 4)
    with rotation_by_torch_ops():
        torch.testing.assert_close(rope.apply_rotary(x, cos, sin), x * cos + rope.rotate_half(x) * sin)
    assert launched == []
    rope.apply_rotary(x, cos, sin)
    assert launched == [1]


@pytest.mark.parametrize("name, kind", [
    # kernel names as an H100 profile of torch 2.11 (SDPA, cuBLAS, AdamW's foreach) and of inductor write them
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, cutlass::bfloat16_t>>",
     "attention"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<64>>", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64_4x1x1_kernel0_0", "attention"),
    ("triton_tem_fused_0", "attention"),  # FlexAttention's template
    ("void cudnn::fusion::compute_dot_do_o_specialized<true, 128, 128, 64, 8, 64, 64, __nv_bfloat16>", "attention"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas",
     "matmul"),
    ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NTN", "matmul"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::TensorListMetadata<4>, "
     "at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4>>", "optimizer"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&)>", "other"),
    ("triton_poi_fused__to_copy_add_mul_0", "other"),
    ("_rotary", "other"),  # RoPE's rotation is not attention's time
])
def test_kernel_kinds_follow_the_names_a_gpu_profile_gives(name, kind):
    assert kernel_kind(name) == kind


def test_every_fused_attention_kernel_counts_as_attention():
    """Each Triton kernel relpos_cli/kernels launches for attention (a forward or backward entry point), read
    off the sources, so that a kernel added or renamed is not filed under `other`."""
    import re

    names = [m.group(1) for path in sorted((REPO / "relpos_cli" / "kernels").glob("*.py"))
             for m in re.finditer(r"@triton\.jit\ndef (_\w+_(?:forward|backward)\w*)\(", path.read_text())]
    assert len(names) >= 13, names  # forward and backward of six kernels
    assert [n for n in names if kernel_kind(n) != "attention"] == []

def test_the_compile_part_times_each_scheme_eager_compiled_and_as_cuda_graphs(tmp_path):
    """Eager, train.compile's torch.compile and its mode reduce-overhead (on the CPU dry run a compile
    without graphs: torch replays CUDA graphs on CUDA only)."""
    path = tmp_path / "gpu.json"
    proc = run("gpu_check.py", "--part", "compile", "--dry-run", "--json", str(path), "--schemes", "rope")
    assert proc.returncode == 0, proc.stderr[-3000:]
    part = json.loads(path.read_text())["compile"]
    assert list(part["tokens_per_s"]) == ["none", "rope"] and part["errors"] == {}
    for scheme, rates in part["tokens_per_s"].items():
        assert rates.keys() == {"eager", "compiled", "cudagraphs"} and all(r > 0 for r in rates.values()), scheme
        assert all(part["warmup_seconds"][scheme][mode] > 0 for mode in ("compiled", "cudagraphs")), scheme  # the compiles
    proc = run("gpu_report.py", str(path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    page = path.with_suffix(".md").read_text()
    table = page.split("## train.compile")[1]
    assert "## train.compile against eager" in page and "| rope |" in table and "CUDA graphs / eager" in table


def test_the_compile_part_times_only_the_modes_asked(tmp_path):
    path = tmp_path / "gpu.json"
    proc = run("gpu_check.py", "--part", "compile", "--dry-run", "--json", str(path), "--schemes", "alibi",
               "--compile-modes", "cudagraphs")
    assert proc.returncode == 0, proc.stderr[-3000:]
    part = json.loads(path.read_text())["compile"]
    assert part["modes"] == ["cudagraphs"]
    for scheme in ("none", "alibi"):
        rates = part["tokens_per_s"][scheme]
        assert rates["cudagraphs"] > 0 and rates["eager"] is None and rates["compiled"] is None, scheme
    assert run("gpu_report.py", str(path)).returncode == 0
    assert "Timed: cudagraphs only." in path.with_suffix(".md").read_text()


@pytest.mark.parametrize("modes", ["graphs", "eager,reduce-overhead", ","])
def test_unknown_compile_modes_are_refused_in_one_line(tmp_path, modes):
    proc = run("gpu_check.py", "--part", "compile", "--dry-run", "--json", str(tmp_path / "gpu.json"),
               "--compile-modes", modes)
    assert proc.returncode == 2 and "--compile-modes takes a comma-separated list of eager, compiled, cudagraphs" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "gpu.json").exists()

def test_a_deadline_stops_the_part_cleanly_with_every_key_present(tmp_path):
    path = tmp_path / "gpu.json"
    proc = run("gpu_check.py", "--part", "eval", "--dry-run", "--json", str(path), "--deadline-s", "0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(path.read_text())
    assert data["parts"]["eval"]["status"].startswith("stopped at the deadline")
    table = data["eval"]["bf16"]["16384"]
    assert set(table) == set(scheme_names())
    assert all(entry["seconds"] is None and entry["error"] == "skipped: deadline" for entry in table.values())
    proc = run("gpu_report.py", str(path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "not measured" in path.with_suffix(".md").read_text()


def test_pytest_counts_read_the_summary_or_the_progress_so_far():
    assert pytest_counts("..F.\nFAILED tests/a.py::t - x\n=== 1 failed, 3 passed, 2 skipped, 1 warning in 5.21s ===") == \
        {"passed": 3, "failed": 1, "skipped": 2, "errors": 0, "complete": True}
    assert pytest_counts("2 errors in 0.50s")["errors"] == 2
    assert pytest_counts("....s.F  [ 40%]\n..E") == {"passed": 7, "failed": 1, "skipped": 1, "errors": 1, "complete": False}


def test_one_measurement_is_cut_off_at_its_time_limit():
    import time

    with pytest.raises(ItemTimeout):
        with time_limit(0.05):
            time.sleep(2)
    with time_limit(5):  # a measurement inside its limit is left alone, and the timer is cleared after it
        pass
    time.sleep(0.1)


def test_a_lost_cuda_context_is_recorded_against_its_item_and_stops_the_part():
    """An illegal memory access surfaces at the next synchronisation, the one that frees the item's
    memory (on an H100 at 6f29d3e that ended the profile part in a traceback): the item records it,
    later items are refused without running."""
    def synchronize():
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be ...")

    check = SimpleNamespace(stopped=None, deadline=Deadline(60, 0), item_limit=30,
                            args=SimpleNamespace(verbose=False, deadline_s=60), free=synchronize)
    fault = "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert Check.measure(check, lambda: 1.0, 0) == (None, fault)
    assert check.stopped == f"stopped: the CUDA context was lost ({fault})"
    ran = []
    row, error = Check.measure(check, lambda: ran.append(1), 0)
    assert row is None and error.startswith("skipped, stopped: the CUDA context was lost") and ran == []
    check = SimpleNamespace(stopped=None, deadline=Deadline(60, 0), item_limit=30,
                            args=SimpleNamespace(verbose=False, deadline_s=60), free=lambda: None)
    assert Check.measure(check, lambda: 2.0, 0) == (2.0, None) and check.stopped is None


def cut_off_after(seconds: float) -> SimpleNamespace:
    """The part's state run_to_deadline reads: a deadline that interrupts its child after `seconds`."""
    return SimpleNamespace(deadline=Deadline(seconds + INTERRUPT_GRACE_S, 0), dry=True, stopped=None,
                           args=SimpleNamespace(min_item_s=0, deadline_s=seconds + INTERRUPT_GRACE_S))


def test_a_child_cut_off_at_the_deadline_leaves_no_process_behind(tmp_path):
    # pytest-xdist's workers are the child's children: left running, they would load the GPU under the
    # next part's measurements
    alive = tmp_path / "alive"
    grandchild = f"import pathlib, time; time.sleep(2); pathlib.Path({str(alive)!r}).touch()"
    child = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {grandchild!r}]); time.sleep(60)"
    start = time.monotonic()
    check = cut_off_after(1.0)
    status, _, _ = run_to_deadline(check, [sys.executable, "-c", child])
    assert status.startswith("timeout") and check.stopped
    time.sleep(max(0.0, start + 3.0 - time.monotonic()))
    assert not alive.exists()


def test_pytest_cut_off_at_the_deadline_reports_what_ran(tmp_path):
    (tmp_path / "test_slow.py").write_text("import time\n\ndef test_quick():\n    pass\n\n"
                                           "def test_fails():\n    assert False\n\n"
                                           "def test_slow():\n    time.sleep(60)\n")
    command = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
               str(tmp_path / "test_slow.py")]
    status, output, _ = run_to_deadline(cut_off_after(4.0), command)
    assert status.startswith("timeout")
    results = pytest_results(status, output)
    assert {k: results[k] for k in ("passed", "failed", "skipped", "errors", "complete")} == \
        {"passed": 1, "failed": 1, "skipped": 0, "errors": 0, "complete": False}, output
    assert [line.split(" - ")[0].rsplit("::", 1)[1] for line in results["failures"]] == ["test_fails"]


def test_a_hand_written_commit_note_is_dropped_when_another_commit_writes(tmp_path):
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"commit": "aaaa", "commit_note": "the tree was aaaa, not the stale .git's bbbb",
                                "parts": {}}))
    env = dict(os.environ, RELPOS_COMMIT="cccc")
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--part", "tests", "--dry-run",
                           "--json", str(path)], cwd=REPO, env={**env, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(path.read_text())
    assert data["commit"] == "cccc" and "commit_note" not in data


def test_the_calls_total_bounds_a_parts_deadline(tmp_path):
    # the device kills a command at its limit (600 s at most): a part started late gets what is left
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", OUT=str(tmp_path), GPU_CHECK_TOTAL_S="17")
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--dry-run", "--part", "2"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    eval_part = json.loads((tmp_path / "gpu-dry.json").read_text())["parts"]["eval"]
    assert eval_part["deadline_s"] <= 2 and eval_part["status"].startswith("stopped at the deadline")
    assert (tmp_path / "gpu-dry.md").exists()


def test_a_run_killed_before_its_summary_still_names_its_failures():
    # seen on the H100: 12 xdist workers outlasted the grace after SIGINT, pytest was killed before its short
    # summary, and the report said "6 failed" without naming one
    output = "\n".join([
        "[gw0] [  1%] PASSED tests/test_kernels_cope.py::test_small[1]",
        "[gw3] [  2%] FAILED tests/test_kernels_cope.py::test_cuda_long_sequences[dtype1-0.03-16]",
        "PytestBenchmarkWarning: Benchmarks are automatically disabled because xdist plugin is active.",
        "[gw1] [  3%] SKIPPED tests/test_kernels_dape.py::test_cpu_only",
        "[gw2] [  4%] ERROR tests/test_kernels_distance.py::test_tiles[5]",
        "tests/test_attention.py::test_flex PASSED                      [  5%]",
        "tests/test_attention.py::test_other FAILED                     [  6%]",
        "[gw4] [  7%] FAILED tests/test_kernels_cope.py::test_far_rows[about a half] ",  # ids may hold spaces
        "tests/test_kernels_cope.py::test_far_rows[a quarter of them] FAILED      [  8%]",
    ])
    results = pytest_results("timeout after 115 s (the deadline)", output)
    assert {k: results[k] for k in ("passed", "failed", "skipped", "errors", "complete")} == \
        {"passed": 2, "failed": 4, "skipped": 1, "errors": 1, "complete": False}
    assert results["failures"] == ["FAILED tests/test_kernels_cope.py::test_cuda_long_sequences[dtype1-0.03-16]",
                                   "ERROR tests/test_kernels_distance.py::test_tiles[5]",
                                   "FAILED tests/test_attention.py::test_other",
                                   "FAILED tests/test_kernels_cope.py::test_far_rows[about a half]",
                                   "FAILED tests/test_kernels_cope.py::test_far_rows[a quarter of them]"]


def test_the_tests_part_asks_pytest_for_a_line_per_test(tmp_path, monkeypatch):
    # the parse above needs pytest's -v lines; -q prints none
    import gpu_check

    seen = {}

    def fake_run(check, command, env=None):
        seen["command"] = command
        return "exit 0", "1 passed in 0.1s", 0.1

    monkeypatch.setattr(gpu_check, "run_to_deadline", fake_run)
    check = SimpleNamespace(dry=False, data={}, save=lambda: None)
    gpu_check.tests_part(check)
    assert "-v" in seen["command"] and "-q" not in seen["command"]
    assert check.data["tests"]["passed"] == 1


def test_a_subset_of_schemes_times_those_and_nope_and_says_so(tmp_path):
    """--schemes: NoPE and the named schemes only (x-transformers only where it has a named one), the
    part records the subset and the page says which, but not for a part that times its own (launch);
    a scheme that does not exist is refused before anything is written."""
    path = tmp_path / "subset.json"
    proc = run("gpu_check.py", "--part", "train,eval,launch", "--dry-run", "--json", str(path), "--schemes", "t5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(path.read_text())
    assert set(data["train"]["tokens_per_s"]) == {"none", "t5"}
    assert set(data["eval"]["bf16"]["16384"]) == {"none", "t5"}
    assert data["train"]["x_transformers"]["t5"] and data["train"]["x_transformers_flash"]["alibi"] is None
    assert data["parts"]["train"]["schemes"] == ["t5"] and data["parts"]["launch"]["schemes"] is None
    proc = run("gpu_report.py", str(path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "subset of the schemes (NoPE always; the others not measured): train: t5; eval: t5." in \
        path.with_suffix(".md").read_text()
    for bad in ("t6", ","):
        proc = run("gpu_check.py", "--part", "train", "--dry-run", "--json", str(tmp_path / "bad.json"), "--schemes", bad)
        assert proc.returncode == 2 and "--schemes: unknown scheme" in proc.stderr.splitlines()[-1]
    assert not (tmp_path / "bad.json").exists()
