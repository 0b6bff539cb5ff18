"""Bucket and table options of the schemes: a pair that would silently bucket distances wrongly is
a one-line error, and every pair accepted buckets as T5's reference formula does (issue 41)."""

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from conftest import TINY, run_in_process
from relpos_cli.errors import RelposError
from relpos_cli.positions import build_scheme
from relpos_cli.positions.base import ModelShape
from relpos_cli.positions.t5 import relative_position_bucket

SHAPE = ModelShape(d_model=32, n_heads=2, n_layers=2, train_seq_len=32)


def reference_buckets(relative_position, bidirectional: bool, num_buckets: int, max_distance: int):
    """transformers' T5Attention._relative_position_bucket (mesh-tensorflow's _relative_position_bucket),
    written out op for op (float32 logs, as it computes them): relative_position (N,) = key - query."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0).to(torch.long) * num_buckets
        relative_position = torch.abs(relative_position)
    else:
        relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    if_large = max_exact + (torch.log(relative_position.float() / max_exact) / math.log(max_distance / max_exact)
                            * (num_buckets - max_exact)).to(torch.long)
    if_large = torch.min(if_large, torch.full_like(if_large, num_buckets - 1))
    return buckets + torch.where(is_small, relative_position, if_large)


def reference_is_sound(num_buckets: int, max_distance: int, bidirectional: bool, far: int) -> bool:
    """Whether the reference gives buckets in [0, num_buckets) that never fall as the distance
    grows, on each side of the query, for distances 0..far."""
    distances = torch.arange(far + 1)
    try:
        sides = [reference_buckets(sign * distances, bidirectional, num_buckets, max_distance)
                 for sign in ((-1, 1) if bidirectional else (-1,))]
    except ZeroDivisionError:  # max_exact = 0
        return False
    return all(bool(((side >= 0) & (side < num_buckets)).all()) and bool((side.diff() >= 0).all()) for side in sides)


@settings(max_examples=300, deadline=None)
@given(num_buckets=st.integers(1, 80), max_distance=st.integers(1, 200), bidirectional=st.booleans())
@example(num_buckets=64, max_distance=16, bidirectional=False)  # the pair
@example(num_buckets=32, max_distance=16, bidirectional=False)  # max_distance == max_exact: log ratio 0 / 0
@example(num_buckets=32, max_distance=8, bidirectional=True)
def test_t5_accepts_exactly_the_pairs_whose_buckets_grow_with_distance(num_buckets, max_distance, bidirectional):
    """Mutation checked: dropping check_log_buckets (t5.py) accepts num_buckets=64 max_distance=16;
    comparing max_distance < max_exact instead of <= accepts max_distance == max_exact (log of 1 = 0)."""
    options = {"name": "t5", "num_buckets": num_buckets, "max_distance": max_distance, "bidirectional": bidirectional}
    far = 4 * max(max_distance, num_buckets)
    sound = reference_is_sound(num_buckets, max_distance, bidirectional, far)
    try:
        scheme = build_scheme(options, SHAPE)
    except RelposError as e:
        assert not sound, f"{options} refused though its buckets are sound: {e}"
        assert f"pos.num_buckets={num_buckets}" in str(e) or f"pos.max_distance={max_distance}" in str(e)
        return
    assert sound, f"{options} accepted though its buckets fall with distance or leave the table"
    relative = torch.arange(-far, far + 1)
    ours = relative_position_bucket(relative, bidirectional, num_buckets, max_distance)
    assert torch.equal(ours, reference_buckets(relative, bidirectional, num_buckets, max_distance))
    assert scheme.tables.shape[1] == num_buckets


@settings(max_examples=100, deadline=None)
@given(num_buckets=st.integers(4, 80), max_distance=st.integers(1, 300), bidirectional=st.booleans(),
       boundaries=st.one_of(st.none(), st.lists(st.integers(1, 300), min_size=1, max_size=6, unique=True)))
@example(num_buckets=32, max_distance=128, bidirectional=False, boundaries=None)  # the defaults
def test_t5_bias_is_flat_from_where_it_says(num_buckets, max_distance, bidirectional, boundaries):
    """distance_bias_flat_from: the bias of every distance past it is its own, by the reference's
    buckets (transformers' formula above, or the boundaries' last); the fused kernel reads no
    farther entry. Mutation checked: max_distance - 1 (the last boundary - 1) fails here."""
    options = {"name": "t5", "num_buckets": num_buckets, "max_distance": max_distance, "bidirectional": bidirectional}
    if boundaries is not None:
        options["boundaries"] = [0, *sorted(boundaries)]
    elif not reference_is_sound(num_buckets, max_distance, bidirectional, 4 * max(max_distance, num_buckets)):
        return  # refused when built (the test above)
    scheme = build_scheme(options, SHAPE)
    flat = scheme.distance_bias_flat_from()
    distances = torch.arange(flat, flat + 4 * max(max_distance, num_buckets, 300))
    if boundaries is None:
        buckets = reference_buckets(-distances, bidirectional, num_buckets, max_distance)
    else:
        buckets = (distances[:, None] >= torch.tensor(options["boundaries"])[None]).sum(1) - 1
    assert (buckets == buckets[0]).all()
    bias = scheme.distance_bias(0, distances)  # (H, N)
    assert torch.equal(bias, bias[:, :1].expand_as(bias))


@pytest.mark.parametrize("options, message", [
    ({"num_buckets": 64, "max_distance": 16}, "pos.max_distance=16 must exceed the 32 distances that pos.num_buckets=64"),
    ({"num_buckets": 32, "max_distance": 16}, "pos.max_distance=16 must exceed the 16 distances"),
    ({"num_buckets": 32, "max_distance": 16, "bidirectional": True}, None),  # 8 exact distances per side: sound
    ({"num_buckets": 1}, "pos.num_buckets=1 must be >= 2"),
    ({"num_buckets": 2, "bidirectional": True}, "pos.num_buckets=2 must be >= 4"),
    ({"num_buckets": 32.5}, "pos.num_buckets=32.5 must be an integer"),
    ({"max_distance": True}, "pos.max_distance=True must be an integer"),
])
def test_t5_bucket_options_are_checked(options, message):
    if message is None:
        build_scheme({"name": "t5", **options}, SHAPE)
        return
    with pytest.raises(RelposError, match="^" + message.replace("(", r"\(").replace(".", r"\.")):
        build_scheme({"name": "t5", **options}, SHAPE)
    # a DAPE base is built with the same check
    with pytest.raises(RelposError, match="pos.num_buckets|pos.max_distance"):
        build_scheme({"name": "dape", "base": "t5", "base_options": options}, SHAPE)


def test_t5_explicit_boundaries_need_no_log_bucket_check():
    """boundaries replace the log buckets: num_buckets / max_distance are not used, so not checked."""
    scheme = build_scheme({"name": "t5", "num_buckets": 64, "max_distance": 16, "boundaries": [0, 1, 2, 5, 17]}, SHAPE)
    assert scheme.tables.shape[1] == 5


def test_a_misbucketed_t5_run_is_refused_in_one_line(tmp_path, monkeypatch):
    """`relpos train pos=t5 pos.num_buckets=64 pos.max_distance=16` trained before, reading distance
    100's bias from row 44 and distance 64's from distance 0's."""
    monkeypatch.chdir(tmp_path)
    code, _, err = run_in_process("train", *TINY, "pos=t5", "pos.num_buckets=64", "pos.max_distance=16",
                                  f"hydra.run.dir={tmp_path / 'run'}")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "pos.max_distance=16" in err and "pos.num_buckets=64" in err
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


@pytest.mark.parametrize("options, message", [
    ({"init_c": 0}, "pos.init_c=0 makes psi"),
    ({"init_c": 0.0}, "pos.init_c=0 makes psi"),
    ({"mlp_width": 0}, "pos.mlp_width=0 must be a positive integer"),
    ({"mlp_width": 2.5}, "pos.mlp_width=2.5 must be a positive integer"),
])
def test_fire_options_that_would_silently_learn_no_position_are_refused(options, message):
    """Sibling of the T5 check: FIRE at init_c=0 trained without complaint, every bias constant
    and c stuck at 0 (below); mlp_width=0 built an MLP of no hidden unit. Mutation checked: without
    the checks in FIRE.__init__ both build."""
    with pytest.raises(RelposError, match=message):
        build_scheme({"name": "fire", **options}, SHAPE)


def test_fire_at_c_zero_would_stay_position_blind():
    """Why init_c=0 is refused: with c = 0 (set after building) the bias is the same for every pair
    and c gets no gradient, so training never moves it."""
    scheme = build_scheme({"name": "fire"}, SHAPE)
    layer = scheme.layers[0]
    with torch.no_grad():
        layer.c.zero_()
    positions = torch.arange(16)
    bias = scheme.pair_bias(0, positions[:, None], positions[None, :])  # (H, T, T)
    assert torch.equal(bias, bias[:, :1, :1].expand_as(bias))
    bias.sum().backward()
    assert layer.c.grad is not None and float(layer.c.grad) == 0.0
