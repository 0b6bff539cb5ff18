"""The prepared GPU check (scripts/gpu_check.py, gpu_report.py) end to end on CPU: its --dry-run (tiny
shapes) for every part into tmp_path, then the report on that JSON. Checks the JSON's shape (every
registered scheme in each table, issue 39 item 6), the merge of parts run separately, and that the
report names every scheme. No figure is checked: a dry run's numbers mean nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from relpos_cli.positions import scheme_names

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from gpu_check import ItemTimeout, pytest_counts, time_limit  # noqa: E402


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, str(REPO / "scripts" / script), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def dry(tmp_path_factory) -> tuple[dict, str, Path]:
    """Parts run as gpu_check.sh runs them, in two invocations merging into one JSON: (JSON, report, path)."""
    path = tmp_path_factory.mktemp("gpu") / "gpu.json"
    for parts in ("train,tests", "eval,kernels"):
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
    data, report, _ = dry
    kernels = data["kernels"]
    assert kernels["status"] == "exit 0", kernels["tail"]
    assert set(kernels["sdpa"]) == {"train", "eval"}
    for scheme, row in kernels["kernels"].items():
        for phase in ("train", "eval"):
            assert isinstance(row[phase]["own"], float), (scheme, phase, row[phase])
    assert "| t5 (distance_attention) | train (" in report and "| dape (dape_attention) | eval (" in report


def test_parts_run_separately_merge_into_one_file(dry):
    data, _, _ = dry
    assert set(data["parts"]) == {"train", "tests", "eval", "kernels"}
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
