"""scripts/count_step_ops.py: the ATen ops, Triton launches and host time of a training step, on CPU. Its
counts show what a forward pass shares between layers: a table the layers share (ALiBi's, Sandwich's,
T5's and KERPLE's with one set of parameters) costs no op per layer more than another scheme on the same
kernel, xPos's rotation no more than RoPE's; and its JSON and errors are what the script says."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def count(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HOME=str(tmp_path))
    return subprocess.run([sys.executable, str(REPO / "scripts" / "count_step_ops.py"), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_layers_that_share_a_table_or_a_rotation_add_no_op_for_it(tmp_path):
    """ops(4 layers) - ops(2 layers): two layers' ops. Every scheme on the distance kernel adds about as
    many, its table computed once a pass (mutations checked: each layer computing its own table, T5's +4
    ops a layer and KERPLE's +11 before pass_distance_table; T5's table copied per call, +1; xPos its
    own decay, +21 a layer)."""
    schemes = "alibi,t5,kerple_log,kerple_power,sandwich,rope,xpos"
    per_layers = {}
    for layers in (2, 4):
        path = tmp_path / f"ops{layers}.json"
        proc = count(tmp_path, "--schemes", schemes, "--layers", str(layers), "--steps", "2", "--json", str(path))
        assert proc.returncode == 0, proc.stderr[-3000:]
        per_layers[layers] = json.loads(path.read_text())
    data = per_layers[4]
    assert data["layers"] == 4 and set(data["ops"]) == set(schemes.split(",")) and all(data["top"].values())
    assert all(ms > 0 for ms in data["host_ms"].values())
    # three Triton launches a layer on the distance kernel (forward, dq's, dk/dv's), none on CPU for the rotation
    assert {s: data["launches"][s] for s in ("alibi", "t5", "rope")} == {"alibi": 12, "t5": 12, "rope": 0}
    two_layers = {s: per_layers[4]["ops"][s] - per_layers[2]["ops"][s] for s in data["ops"]}
    # RoPE's rotation runs as ops on CPU: its two layers add the rotation's ops, xPos no more than RoPE's
    assert two_layers["xpos"] == two_layers["rope"], two_layers
    tables = {s: n for s, n in two_layers.items() if s not in ("rope", "xpos")}
    # one op a layer apart at most: a table with a gradient (T5's, KERPLE's) has each layer's added into it, ALiBi's
    # slopes are viewed as (H, 1) per call, Sandwich's fixed table neither
    assert max(tables.values()) - min(tables.values()) <= 2, tables


def test_bad_arguments_are_one_line(tmp_path):
    for args, message in [(("--schemes", "rope,bogus"), "unknown scheme bogus"), (("--layers", "0"), "--layers"),
                          (("--steps", "0"), "--steps")]:
        proc = count(tmp_path, *args)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
