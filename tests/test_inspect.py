"""`relpos inspect`: the position term and the causal-mask asymmetry on cases whose answer is known."""

import json

import pytest
import torch

from conftest import TINY, run_cli
from relpos_cli.errors import RelposError
from relpos_cli.inspect import asymmetry, attention_logits, position_logits, reinit_scheme_parameters, softmax_maps
from relpos_cli.model import BlockOptions, Transformer
from relpos_cli.positions import REGISTRY, build_scheme, scheme_names
from relpos_cli.positions.base import ModelShape

SHAPE = ModelShape(d_model=32, n_heads=4, n_layers=2, train_seq_len=32)
L = 24


def scheme(name, **options):
    torch.manual_seed(0)
    built = build_scheme({"name": name, **options}, SHAPE)
    reinit_scheme_parameters(built, seed=0)  # zero-initialised tables (T5, CoPE) get structure
    return built


def test_asymmetry_measure_on_hand_made_matrices():
    symmetric = torch.tensor([[1.0, 2.0], [2.0, 3.0]])
    assert asymmetry(symmetric) == 0
    assert asymmetry(torch.zeros(3, 3)) == 0
    lower = torch.tensor([[1.0, 0.0], [1.0, 1.0]])  # ||A - A^T|| = sqrt(2), ||A|| = sqrt(3)
    assert torch.isclose(asymmetry(lower), torch.tensor((2 / 3) ** 0.5))


def test_alibi_position_term_is_symmetric_in_distance():
    logits = position_logits(scheme("alibi"), 0, L)  # (H, L, L)
    assert torch.all(asymmetry(logits) < 1e-6)
    assert torch.all(logits.amin(dim=(1, 2)) < 0)  # not trivially symmetric (all zeros)


def test_t5_bidirectional_buckets_are_not_symmetric():
    logits = position_logits(scheme("t5", bidirectional=True), 0, L)
    assert torch.all(asymmetry(logits) > 0.1)


def test_rope_position_term_depends_only_on_the_distance():
    logits = position_logits(scheme("rope"), 0, L)
    shift = 5
    assert torch.allclose(logits[:, shift:, shift:], logits[:, :-shift, :-shift], atol=1e-4)
    assert torch.all(asymmetry(logits) < 1e-5)  # cos(theta (i - j)) is even in i - j


@pytest.mark.parametrize("name", scheme_names())
def test_causal_mask_makes_attention_asymmetric(name):
    logits = position_logits(scheme(name), 0, L)
    _, causal = softmax_maps(logits, REGISTRY[name].normalises)
    assert torch.all(causal.triu(1) == 0)  # no attention to the future
    # > 0.2: a FoX head whose gate bias forgets fast (-1.6 here) attends mostly to its own token, a
    # near-diagonal map, less asymmetric (0.24) than a causal map of a slower decay (> 0.3)
    assert torch.all(asymmetry(causal) > 0.2)


def test_inspect_fresh_and_trained_write_their_files(tmp_path):
    fresh = tmp_path / "fresh"
    out = run_cli("inspect", "pos=t5", "model=tiny", "inspect.length=16", "wandb.mode=disabled", f"hydra.run.dir={fresh}").stdout
    assert "asymmetry" in out.lower()
    record = json.loads((fresh / "inspect" / "symmetry.json").read_text())
    assert set(record["layers"]) == {"0", "1"}
    assert {"position_logits", "position_attention_causal"} <= set(record["layers"]["0"])
    for name in ("position_logits_layer0.png", "distance_layer1.png", "inspect.md"):
        assert (fresh / "inspect" / name).stat().st_size > 0

    run = tmp_path / "run=alibi"  # a name with '=' is still a run dir, as Hydra sweeps name them
    run_cli("train", "pos=alibi", *TINY, f"hydra.run.dir='{run}'")
    run_cli("inspect", str(run), "inspect.length=16", "inspect.layers=[1]")
    record = json.loads((run / "inspect" / "symmetry.json").read_text())
    assert set(record["layers"]) == {"1"}
    entry = record["layers"]["1"]
    assert all(a > 0.3 for a in entry["attention_causal"])
    assert all(a < 1e-6 for a in entry["position_logits"])
    assert (run / "inspect" / "attention_causal_layer1.png").is_file()
    index = (run / "inspect" / "inspect.md").read_text()
    assert "attention_bidirectional_layer1.png" in index and "symmetry.json" in index

    bad = run_cli("inspect", str(run), "inspect.length=1", check=False)
    assert bad.returncode == 2 and "inspect.length must be >= 2, got 1" in bad.stderr and "Traceback" not in bad.stderr


def test_a_sliding_window_layer_shows_its_window():
    """Layer 1 attends within 5 keys (model.sliding_window with sliding_layers=[1]), layer 0 to all:
    the causal maps put weight exactly where each layer's attention can look."""
    torch.manual_seed(0)
    model = Transformer(64, SHAPE, {"name": "rope"}, block=BlockOptions(mlp_hidden=64, sliding_window=5, sliding_layers=(1,)))
    tokens = torch.randint(0, 64, (L,))
    full, windowed = (softmax_maps(logits)[1] for logits in attention_logits(model, tokens))
    distance = torch.arange(L)[:, None] - torch.arange(L)[None, :]
    assert (windowed[:, distance >= 5] == 0).all() and (windowed[:, (distance >= 0) & (distance < 5)] > 0).all()
    assert (full[:, distance >= 0] > 0).all()
    torch.testing.assert_close(windowed.sum(-1), torch.ones(SHAPE.n_heads, L))


# ---- bad inspect.* values (issue 41): one line, before anything is computed or written ----------------

@pytest.mark.parametrize("override, message", [
    ("inspect.length=1000000", "inspect.length=1000000 with inspect.rotary_samples=256 needs about"),
    ("inspect.rotary_samples=100000000000", "lower inspect.rotary_samples"),
    ("inspect.heads=[]", "inspect.heads=[] names no head"),
    ("inspect.layers=[]", "inspect.layers=[] names no layer"),
    ("inspect.heads=[1,1]", "inspect.heads=[1, 1] names a head twice"),
    ("inspect.heads=[9]", "inspect.heads=[9] out of range: the model has 2 heads"),
    ("inspect.length=0", "inspect.length must be >= 2"),
    ("inspect.length=abc", "inspect.length must be an integer"),
    ("inspect.rotary_samples=-3", "inspect.rotary_samples must be positive"),
    ("inspect.sample_offset=-1", "inspect.sample_offset must be >= 0"),
])
def test_bad_inspect_settings_are_one_line_errors(tmp_path, override, message):
    """inspect.length=30000 met the OOM killer (or a 78-line traceback from a failed allocation);
    inspect.heads=[] a ZeroDivisionError in matplotlib, inspect.layers=[] a StopIteration. Mutation
    checked: without check_inspect_settings' memory check the first two cases end in a traceback
    from a failed allocation (sizes far past any machine, so it fails fast rather than swaps)."""
    run_dir = tmp_path / "run"
    proc = run_cli("inspect", "pos=rope", *TINY, override, f"hydra.run.dir={run_dir}", check=False)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (run_dir / "inspect").exists()


def test_the_memory_estimate_counts_what_grows_with_each_setting(monkeypatch):
    """The estimate grows as length^2, with the heads shown and the rotary samples; refused exactly
    above the machine's memory (faked here)."""
    from relpos_cli import inspect as inspecting

    rope, alibi = scheme("rope"), scheme("alibi")
    small = inspecting.inspect_bytes(rope, 100, 4, 256, with_model=False)
    assert inspecting.inspect_bytes(rope, 200, 4, 256, False) > 3.9 * small  # length^2 (the vectors do not grow)
    assert inspecting.inspect_bytes(rope, 100, 4, 256, True) > inspecting.inspect_bytes(rope, 100, 4, 256, False)
    assert inspecting.inspect_bytes(rope, 100, 4, 10**6, False) - small == (10**6 - 256) * 4 * 8 * 4  # H x Dh fp32 each
    assert inspecting.inspect_bytes(alibi, 100, 4, 10**6, False) < small  # no rotation: no products, no vectors
    settings = {"length": 100, "layers": None, "heads": None, "rotary_samples": 256}
    monkeypatch.setattr(inspecting, "machine_memory", lambda: small)
    assert inspecting.check_inspect_settings(rope, settings, False) == (100, [0, 1], [0, 1, 2, 3])
    monkeypatch.setattr(inspecting, "machine_memory", lambda: small - 1)  # one rotary sample would fit
    with pytest.raises(RelposError, match="lower inspect.rotary_samples$"):
        inspecting.check_inspect_settings(rope, settings, False)
    monkeypatch.setattr(inspecting, "machine_memory", lambda: small - 256 * 4 * 8 * 4)  # no number of samples fits
    with pytest.raises(RelposError, match="lower inspect.length$"):
        inspecting.check_inspect_settings(rope, settings, False)
