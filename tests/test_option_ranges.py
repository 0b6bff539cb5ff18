"""Numeric options out of range, NaN and inf refused in one line (RelposError) before any training or
scoring: a NaN compares False with everything, so a range check written as `value < low` lets it
through, and inf passes `value > 0`. The properties below walk every scheme's yaml rather than
listing options, so a scheme or option added later is covered too."""

from __future__ import annotations

import copy
import math

import pytest
import yaml
from omegaconf import OmegaConf

from relpos_cli.config import check_scheme_types, conf_dir, default_group
from relpos_cli.errors import RelposError
from relpos_cli.extension import eval_method
from relpos_cli.positions import build_scheme, scheme_names
from relpos_cli.positions.base import ModelShape
from relpos_cli.rope_options import check_rope_scaling
from relpos_cli.settings import check_booleans, EvalOnly, RunSettings, validate

SHAPE = ModelShape(d_model=64, n_heads=4, n_layers=2, train_seq_len=32)
NOT_FINITE = (float("nan"), float("inf"), float("-inf"))


def numeric_options(name: str) -> list[tuple[tuple[str, ...], object]]:
    """(path, default) of every number in conf/pos/<name>.yaml, nested sections included."""
    found = []

    def walk(node, path):
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, (*path, key))
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                found.append(((*path, key), value))

    walk(yaml.safe_load((conf_dir() / "pos" / f"{name}.yaml").read_text()), ())
    return found


def with_option(name: str, path: tuple[str, ...], value: object) -> dict:
    cfg = copy.deepcopy(yaml.safe_load((conf_dir() / "pos" / f"{name}.yaml").read_text()))
    node = cfg
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return cfg


def build_checked(pos_cfg: dict):
    """What a run does with pos.*: its yaml's types (check_scheme_types), then the constructor's ranges."""
    check_scheme_types(OmegaConf.create({"pos": pos_cfg}))
    return build_scheme(pos_cfg, SHAPE)


CASES = [(name, path) for name in scheme_names() for path, _ in numeric_options(name)]


@pytest.mark.parametrize("name,path", CASES, ids=[f"{n}:{'.'.join(p)}" for n, p in CASES])
@pytest.mark.parametrize("bad", NOT_FINITE, ids=str)
def test_every_numeric_scheme_option_refuses_non_finite_values(name, path, bad):
    with pytest.raises(RelposError, match=f"pos.{path[-1]}|{'.'.join(path)}"):
        build_checked(with_option(name, path, bad))


def test_the_walk_reaches_the_options_it_should():
    """The property above is only as good as the options it walks: the nested RoPE scaling and the
    options that had no range check before are among them."""
    assert {("rope", ("base",)), ("rope", ("rotary_fraction",)), ("rope", ("scaling", "beta_fast")),
            ("xpos", ("scale_base",)), ("sinusoidal", ("base",)), ("fire", ("init_c",))} <= set(CASES)


@pytest.mark.parametrize("name,options,message", [
    ("rope", {"base": 1.0}, "pos.base=1.0 must be a finite number above 1"),
    ("rope", {"base": -10000.0}, "pos.base=-10000.0 must be a finite number above 1"),
    ("p_rope", {"base": 0.5}, "pos.base=0.5 must be a finite number above 1"),
    ("sinusoidal", {"base": 1}, "pos.base=1 must be a finite number above 1"),
    ("xpos", {"scale_base": 0.0}, "pos.scale_base=0.0 must be a finite number above 0"),
    ("fire", {"init_threshold": -3.0}, "pos.init_threshold=-3.0 must be a finite number above 0"),
    ("fire", {"init_threshold": 0}, "pos.init_threshold=0 must be a finite number above 0"),
    ("t5", {"boundaries": [0, 1.5, 3]}, r"pos.boundaries=\[0, 1.5, 3\] must be a list of integers"),
    ("t5", {"boundaries": 4}, "pos.boundaries=4 must be a list of integers"),
    ("rope", {"scaling": {"type": "linear", "factor": 2.0, "original_length": 0}},
     "pos.scaling.original_length=0; give a positive integer or null"),  # 0 was taken as null (train.seq_len)
])
def test_out_of_range_scheme_options_are_one_line_errors(name, options, message):
    with pytest.raises(RelposError, match=message):
        build_scheme({"name": name, **options}, SHAPE)


@pytest.mark.parametrize("name,options", [
    ("fire", {"init_c": -0.1}),  # psi uses |c|: a negative c is the positive one's scheme
    ("fire", {"init_threshold": 16.0}),
    ("rope", {"base": 500000.0}),
    ("t5", {"boundaries": [0, 1, 2, 5, 17]}),
])
def test_in_range_scheme_options_still_build(name, options):
    build_scheme({"name": name, **options}, SHAPE)


# ---- RoPE scaling (pos.scaling and eval.rope_scaling share the checks) ---------------------------

@pytest.mark.parametrize("options,message", [
    ({"type": "yarn", "factor": float("inf")}, "factor=inf; give a finite number"),
    ({"type": "yarn", "factor": float("nan")}, "factor=nan; give a finite number"),
    ({"type": "yarn", "factor": 2.0, "attention_factor": float("inf")}, "attention_factor=inf; give a finite positive number"),
    ({"type": "llama3", "factor": 2.0, "low_freq_factor": float("nan")}, "low_freq_factor=nan; give a finite positive number"),
    ({"type": "llama3", "factor": 2.0, "low_freq_factor": -1.0}, "low_freq_factor=-1.0; give a finite positive number"),
    ({"type": "llama3", "factor": 2.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0},
     "high_freq_factor=1.0 must be above pos.scaling.low_freq_factor=4.0"),
])
def test_rope_scaling_values_out_of_range(options, message):
    with pytest.raises(RelposError, match=message):
        check_rope_scaling(options, "pos.scaling")


def eval_cfg(**rope_scaling):
    cfg = default_group("eval")
    cfg.rope_scaling = {**cfg.rope_scaling, **rope_scaling}
    return cfg


@pytest.mark.parametrize("options,message", [
    ({"factor": 4}, "eval.rope_scaling.factor=4 does nothing without eval.rope_scaling.type"),
    ({"factor": "longest"}, "eval.rope_scaling.factor=longest does nothing without eval.rope_scaling.type"),
    ({"beta_fast": 16}, "eval.rope_scaling.beta_fast=16 does nothing without eval.rope_scaling.type"),
    ({"type": "linear", "factor": 2, "beta_fast": 16},
     r"eval.rope_scaling.beta_fast=16 does nothing with eval.rope_scaling.type=linear \(it is read by type yarn\)"),
    ({"type": "ntk", "attention_factor": 1.2}, "attention_factor=1.2 does nothing with eval.rope_scaling.type=ntk"),
])
def test_rope_scaling_options_the_type_ignores_are_refused(options, message):
    """The numbers would be the unscaled ones under a variant name that says a scaling ran."""
    with pytest.raises(RelposError, match=message):
        eval_method(eval_cfg(**options))


@pytest.mark.parametrize("options", [
    {},
    {"type": "linear", "factor": 2},
    {"type": "yarn", "factor": 4, "beta_fast": 16, "beta_slow": 2, "attention_factor": 1.1},
    {"type": "dynamic"},
    {"type": "none", "beta_fast": 32.0},  # the default, spelt as a float
])
def test_rope_scaling_options_the_type_reads_are_kept(options):
    method = eval_method(eval_cfg(**options))
    assert (method.rope_scaling is None) == (options.get("type", "none") == "none")


# ---- the run schema: finite numbers and real booleans ---------------------------------------------

def run_config(**overrides):
    """The composed train config with overrides, as `relpos train key=value` composes it."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        return compose("config", overrides=[f"{k}={v}" for k, v in overrides.items()])


@pytest.mark.parametrize("key,value,message", [
    ("train.lr", "inf", "train.lr must be a finite number, got inf"),
    ("train.weight_decay", "inf", "train.weight_decay must be a finite number, got inf"),
    ("train.lr", "nan", "train.lr must be positive, got nan"),
    ("eval.tokens", "-1", "eval.tokens must be positive, got -1"),
])
def test_schema_numbers_must_be_finite(key, value, message):
    with pytest.raises(RelposError, match=message):
        validate(run_config(**{key: value}))


def test_wandb_project_names_wandb_refuses_are_refused_before_the_run_starts():
    with pytest.raises(RelposError, match="wandb.project='a/b': a W&B project name is 1 to 128 characters without"):
        validate(run_config(**{"wandb.project": "a/b"}))
    validate(run_config(**{"wandb.project": "relpos-2026", "wandb.group": 123}))  # a group is a string W&B gets


@pytest.mark.parametrize("key,value", [("eval.allow_changed_data", 3), ("eval.context_use", 0),
                                       ("eval.allow_changed_data", "'yes'")])
def test_schema_booleans_must_be_true_or_false(key, value):
    """OmegaConf turns 3, 0 and "yes" into booleans; the raw value would still name a variant's files."""
    cfg = run_config(**{key: value})
    with pytest.raises(RelposError, match=f"{key} must be a boolean \\(true or false\\), got"):
        validate(cfg)
    if key.startswith("eval."):
        with pytest.raises(RelposError, match=f"{key} must be a boolean"):
            check_booleans(cfg, EvalOnly)


def test_schema_booleans_accept_booleans():
    check_booleans(run_config(**{"eval.allow_changed_data": "false"}), RunSettings)
    assert math.isfinite(validate(run_config(**{"train.lr": "0.001"})).train.lr)


@pytest.mark.parametrize("value", ["false", "true", "default", "reduce-overhead", "max-autotune",
                                   "max-autotune-no-cudagraphs"])
def test_train_compile_takes_a_boolean_or_a_torch_compile_mode(value):
    assert validate(run_config(**{"train.compile": value})).train.compile == {"false": False, "true": True}.get(value, value)


@pytest.mark.parametrize("value", ["3", "0", "'yes'", "reduce_overhead", "'True'"])
def test_train_compile_refuses_anything_else_in_one_line(value):
    with pytest.raises(RelposError, match=r"train.compile=.*; choose false, true or a torch.compile mode: default, "
                                          r"reduce-overhead, max-autotune, max-autotune-no-cudagraphs$"):
        validate(run_config(**{"train.compile": value}))
