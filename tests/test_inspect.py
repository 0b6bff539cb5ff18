"""`relpos inspect`: the position term and the causal-mask asymmetry on cases whose answer is known."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import TINY, run_cli, run_in_process
from relpos_cli.errors import RelposError
from relpos_cli.inspect import (asymmetry, attention_logits, content_sample, inspect_scheme, position_logits,
                                reinit_scheme_parameters, softmax_maps)
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


def test_a_fresh_scheme_is_built_for_the_positions_training_reaches(tmp_path):
    """`relpos inspect` builds the scheme a run of these settings would train: with PoSE's
    train.position_skip=512 at seq_len 128, YaRN's factor auto is 4, where inspect built it for 128
    alone and refused it as scaling nothing."""
    run_cli("inspect", "pos=rope", "pos.scaling.type=yarn", "train.position_skip=512", "model=tiny", "inspect.length=16",
            "inspect.layers=[0]", "wandb.mode=disabled", f"hydra.run.dir={tmp_path / 'fresh'}")


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
@pytest.mark.usefixtures("in_temp_cwd")  # in-process runs point outputs/latest: not in the checkout
def test_bad_inspect_settings_are_one_line_errors(tmp_path, override, message):
    """inspect.length=30000 met the OOM killer (or a 78-line traceback from a failed allocation);
    inspect.heads=[] a ZeroDivisionError in matplotlib, inspect.layers=[] a StopIteration. Mutation
    checked: without check_inspect_settings' memory check the first two cases end in a failed
    allocation (sizes far past any machine, so it fails fast rather than swaps), raised into the test.
    In-process: a subprocess a case took 2.5 s."""
    run_dir = tmp_path / "run"
    code, _, err = run_in_process("inspect", "pos=rope", *TINY, override, f"hydra.run.dir={run_dir}")
    assert code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1 and not (run_dir / "inspect").exists()


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


# ---- a bias of q and k is drawn at random content, not at zero (CoPE's and Shaw's were all 0) ---------

@torch.no_grad()
def content_bias_by_formula(name, built, q, k, layer, length):
    """The bias each scheme's paper defines, one (head, i, j) at a time, at one query q[h] and one key
    k[h] per head (Dh,) used at every position -> (H, L, L)."""
    H, Dh = q.shape
    out = torch.zeros(H, length, length)
    for h in range(H):
        z = float(q[h] @ k[h]) / math.sqrt(Dh)  # q_i . k_j / sqrt(d), the same for every pair
        for i in range(length):
            for j in range(length):
                if name == "cope":  # q_i . e[p_ij], p_ij = sum_{t=j..i} sigmoid(z) (0 keys for j > i), clamped
                    p = min(max(i - j + 1, 0) / (1 + math.exp(-z)), built.max_positions - 1)
                    e = built.pos_emb[layer]
                    low, w = math.floor(p), p - math.floor(p)
                    out[h, i, j] = q[h] @ (e[low] * (1 - w) + e[math.ceil(p)] * w)
                elif name == "shaw":  # q_i . r[clip(j - i, -K, K)] / sqrt(d), rows -K..K
                    K = built.max_distance
                    out[h, i, j] = q[h] @ built.table[layer, min(max(j - i, -K), K) + K] / math.sqrt(Dh)
                elif name == "stickbreaking":  # log prod_{l=j..i-1} (1 - sigmoid(z)) over keys j < i
                    out[h, i, j] = -(i - j) * math.log1p(math.exp(z)) if j < i else -math.inf
                elif name == "fox":  # zero layer input: each token forgets log sigmoid(b_h)
                    out[h, i, j] = (i - j) * math.log(1 / (1 + math.exp(-float(built.gates[layer].bias[h]))))
    if name == "dape":  # B + W2 leaky(W1 [A; B] + b1) + b2 per pair, A_h = z_h, B the base's bias
        first, _, last = built.mlps[layer]
        A = torch.einsum("hd,hd->h", q, k) / math.sqrt(Dh)
        B = built.base.score_bias(layer, q[None, :, None], k[None, :, None], torch.arange(length)).expand(H, length, length)
        for i in range(length):
            for j in range(length):
                hidden = F.leaky_relu(first.weight @ torch.cat([A, B[:, i, j]]) + first.bias, 0.01)
                out[:, i, j] = B[:, i, j] + last.weight @ hidden + last.bias
    return out


def test_content_sample_is_one_seeded_normal_query_and_key_per_head():
    q, k = content_sample(SHAPE, L)
    assert q.shape == k.shape == (1, SHAPE.n_heads, L, SHAPE.head_dim)
    assert (q == q[:, :, :1]).all() and (k == k[:, :, :1]).all()  # the same content at every position
    assert not torch.equal(q[0, 0, 0], q[0, 1, 0]) and not torch.equal(q, k)  # heads and q/k differ
    again = content_sample(SHAPE, L)
    assert torch.equal(q, again[0]) and torch.equal(k, again[1])  # deterministic
    draws = torch.cat([content_sample(SHAPE, 1, seed)[0].flatten() for seed in range(50)])  # N(0, 1)
    assert abs(float(draws.mean())) < 0.1 and abs(float(draws.std()) - 1) < 0.1


@pytest.mark.parametrize("name", ["cope", "shaw", "stickbreaking", "dape", "fox"])
def test_position_term_of_a_content_bias_is_its_formula_at_the_drawn_content(name):
    """A fresh `relpos inspect pos=cope` showed position_logits exactly 0 everywhere (asymmetry 0,
    blank pictures): the term was taken at zero q and k, and CoPE's q . e[p] (Shaw's q . r) is then 0
    whatever the table. Now every bias of q and k is taken at content_sample's q and k; FoX, whose
    bias reads the layer input, at a zero input (its gate biases alone). Mutation checked: with the
    zero q and k back, cope, shaw, stickbreaking and dape fail."""
    built = scheme(name)
    layer = 1
    q, k = (t[0, :, 0] for t in content_sample(SHAPE, L))  # (H, Dh) each
    expected = content_bias_by_formula(name, built, q, k, layer, L)
    torch.testing.assert_close(position_logits(built, layer, L), expected, atol=1e-4, rtol=1e-4)
    if name in ("cope", "shaw"):
        assert (expected.abs().amax(dim=(1, 2)) > 0.1).all()  # every head shows its table


def test_fresh_inspect_of_cope_shows_its_table_and_says_how(tmp_path):
    """The bug as a user met it: `relpos inspect pos=cope` reported asymmetry 0.0000 for every head.
    Mutation checked: with zero q and k the asymmetries are 0."""
    run = tmp_path / "fresh"
    out = run_cli("inspect", "pos=cope", "model=tiny", "inspect.layers=[0]", "inspect.length=16", "wandb.mode=disabled",
                  f"hydra.run.dir={run}").stdout
    record = json.loads((run / "inspect" / "symmetry.json").read_text())
    assert all(a > 0.1 for a in record["layers"]["0"]["position_logits"])
    drawn = "q, k ~ N(0, 1), seed 0: one per head, the same at every position"
    assert record["position_content"] == drawn
    assert f"bias at {drawn}" in (run / "inspect" / "inspect.md").read_text()
    assert f"position: the position-only term at {drawn};" in " ".join(out.split())  # the table's caption

    # the same run dir again, in svg and for layer 0 only: the png figures of the first go (next test)
    run_cli("inspect", "pos=cope", "model=tiny", "inspect.layers=[0]", "inspect.length=16", "plots.format=svg",
            "wandb.mode=disabled", f"hydra.run.dir={run}")
    assert sorted(p.name for p in (run / "inspect").iterdir()) == [
        "distance_layer0.svg", "inspect.md", "position_logits_layer0.svg", "symmetry.json"]


# ---- an inspect replaces the previous inspect's figures (stale ones went to W&B as current) -------------

class FakeRun:
    def __init__(self):
        self.keys = []

    def log(self, values):
        self.keys += list(values)


def test_an_inspect_replaces_the_previous_inspects_figures(tmp_path):
    """`relpos inspect RUN` then `relpos inspect RUN inspect.layers=[1]` (or plots.format=svg) left the
    first call's other figures in RUN/inspect, unlisted in inspect.md and uploaded to W&B as current.
    Now the folder holds exactly the latest inspect's files, and whatever else a user put there, and
    W&B gets the figures symmetry.json names. Mutation checked: without remove_stale_figures the
    layer-0 and png figures stay; with log_inspect uploading the folder, the user's my_layer0.png goes
    up too (and, not being an image, fails the upload)."""
    from relpos_cli.tracking import log_inspect

    torch.manual_seed(0)
    model = Transformer(64, SHAPE, {"name": "alibi"}, block=BlockOptions(mlp_hidden=64))
    tokens = torch.randint(0, 64, (12,))
    folder = tmp_path / "inspect"

    def inspect(fmt, **settings):
        inspect_scheme(model.scheme, tmp_path, {"length": 12, "heads": [0], **settings}, model, tokens, fmt=fmt)
        listed = [line.split("](")[0].removeprefix("| [") for line in (folder / "inspect.md").read_text().splitlines()
                  if line.startswith("| [")]
        return listed

    kinds = ("position_logits", "distance", "attention_bidirectional", "attention_causal")
    first = inspect("png", layers=None)
    assert sorted(first) == sorted([f"{k}_layer{n}.png" for k in kinds for n in (0, 1)] + ["symmetry.json"])
    mine = ["notes.txt", "distance_layer0.png.bak", "my_layer0.png", "position_logits_layer0.jpg"]
    for name in mine:
        (folder / name).write_text("the user's")

    second = inspect("png", layers=[1])
    assert sorted(second) == sorted([f"{k}_layer1.png" for k in kinds] + ["symmetry.json"])
    assert sorted(p.name for p in folder.iterdir()) == sorted([*second, "inspect.md", *mine])
    run = FakeRun()
    log_inspect(run, tmp_path)
    assert sorted(run.keys) == sorted(["inspect/symmetry", *(f"inspect/{k}_layer1" for k in kinds)])  # not the user's png

    third = inspect("svg", layers=[0])
    assert sorted(third) == sorted([f"{k}_layer0.svg" for k in kinds] + ["symmetry.json"])
    assert sorted(p.name for p in folder.iterdir()) == sorted([*third, "inspect.md", *mine])
    assert all((folder / name).read_text() == "the user's" for name in mine)
