"""RoPE scaling settings that have no meaning, refused in one line: the scalings that rescale the
base (static and dynamic NTK) on a model rotating 2 dimensions (base * factor^(d/(d-2)) divides by
zero there, and the one frequency, base^0 = 1, has no base to scale), at training (pos.scaling) and
evaluation (eval.rope_scaling); eval.rope_scaling.factor=longest with dynamic NTK; llama3 bounds in
the wrong order where one of them is left null (its default)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from relpos_cli.errors import RelposError
from relpos_cli.extension import resolve_longest_factor
from relpos_cli.positions import build_scheme
from relpos_cli.positions.base import ModelShape
from relpos_cli.positions.rope import rope_inv_freq

SHAPE = ModelShape(d_model=32, n_heads=2, n_layers=1, train_seq_len=64)  # head_dim 16
TWO_DIMS = {"name": "rope", "rotary_fraction": 0.125}  # 16 x 0.125 = 2 rotated dimensions


@pytest.mark.parametrize("rope_type", ["ntk", "dynamic"])
def test_base_scalings_of_two_rotated_dimensions_are_a_clear_error(rope_type):
    with pytest.raises(RelposError, match=f"type={rope_type} .* needs d >= 4; this model rotates 2"):
        rope_inv_freq(2, 10000.0, {"rope_type": rope_type, "factor": 2.0, "original_max_position_embeddings": 64},
                      seq_len=128)
    with pytest.raises(RelposError, match=f"type={rope_type}"):
        build_scheme(TWO_DIMS, SHAPE, eval_scaling={"type": rope_type, "factor": 2.0})
    with pytest.raises(RelposError, match=f"type={rope_type}"):
        build_scheme({**TWO_DIMS, "scaling": {"type": rope_type, "factor": 2.0}}, SHAPE)


@pytest.mark.parametrize("rope_type", ["linear", "yarn", "llama3"])
def test_scalings_of_the_frequencies_still_take_two_rotated_dimensions(rope_type):
    inv_freq, _ = rope_inv_freq(2, 10000.0, {"rope_type": rope_type, "factor": 2.0, "original_max_position_embeddings": 64})
    assert inv_freq.shape == (1,) and 0 < float(inv_freq[0]) <= 1


def test_longest_is_refused_for_dynamic_ntk_whose_base_follows_every_length():
    """factor=longest promises one scaled model at every length, the factor pos.scaling's auto
    would give; dynamic NTK rescales at each length itself, and its factor N turns into a base
    alpha = N * L / L_train - (N - 1) (13 at 4x for N = 4, against dynamic's own 4), so no number
    stands for it."""
    eval_cfg = OmegaConf.create({"rope_scaling": {"type": "dynamic", "factor": "longest"}})
    with pytest.raises(RelposError, match="factor=longest .* type=dynamic"):
        resolve_longest_factor(eval_cfg, longest=512, train_len=128)
    for rope_type in ("linear", "ntk", "yarn", "llama3"):  # one fixed factor: the longest length over the training length
        eval_cfg = OmegaConf.create({"rope_scaling": {"type": rope_type, "factor": "longest"}})
        resolve_longest_factor(eval_cfg, longest=512, train_len=128)
        assert eval_cfg.rope_scaling.factor == 4


@pytest.mark.parametrize("given, match", [
    ({"low_freq_factor": 5}, r"high_freq_factor=null \(4.0\) must be above pos.scaling.low_freq_factor=5"),
    ({"high_freq_factor": 0.5}, r"high_freq_factor=0.5 must be above pos.scaling.low_freq_factor=null \(1.0\)"),
])
def test_a_llama3_bound_given_alone_is_checked_against_the_other_ones_default(given, match):
    """A null bound is transformers' default (low 1, high 4): low_freq_factor=5 alone inverts the
    blend (the band between the two bounds is then empty) as low=5, high=4 given together does."""
    scaling = {"type": "llama3", "factor": 2.0, **given}
    with pytest.raises(RelposError, match=match):
        build_scheme({"name": "rope", "scaling": scaling}, SHAPE)
    with pytest.raises(RelposError, match=match.replace("pos.scaling", "eval.rope_scaling")):
        build_scheme({"name": "rope"}, SHAPE, eval_scaling=scaling)
    build_scheme({"name": "rope", "scaling": {**scaling, "low_freq_factor": 2, "high_freq_factor": 8}}, SHAPE)


@pytest.mark.parametrize("overrides, message", [
    (["pos.scaling.factor=4"], "pos.scaling.factor=4 does nothing without pos.scaling.type"),
    (["pos.scaling.original_length=32"], "pos.scaling.original_length=32 does nothing without pos.scaling.type"),
    (["pos.scaling.type=linear", "pos.scaling.beta_fast=16"],
     "pos.scaling.beta_fast=16 does nothing with pos.scaling.type=linear (it is read by type yarn)"),
])
@pytest.mark.usefixtures("in_temp_cwd")  # in-process runs point outputs/latest: not in the checkout
def test_training_refuses_pos_scaling_options_its_type_never_reads(overrides, message, tmp_path):
    """config.yaml (and compare's label) would say factor 4 of a run that trained plain RoPE."""
    from conftest import TINY, run_in_process

    code, _, err = run_in_process("train", *TINY, "pos=rope", *overrides, f"hydra.run.dir={tmp_path / 'run'}")
    assert code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "run" / "config.yaml").exists()
    # what the type reads trains: yarn from 16 with its own beta
    code, _, err = run_in_process("train", *TINY, "pos=rope", "pos.scaling.type=yarn", "pos.scaling.original_length=16",
                                  "pos.scaling.beta_fast=16", f"hydra.run.dir={tmp_path / 'yarn'}")
    assert code == 0, err
