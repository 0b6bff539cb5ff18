"""DAPE's base options: what reaches the base's constructor is the base named by pos.base with its
own options, or a one-line error. Before, pos.base_options.name replaced pos.base after DAPE had
checked it (rope as a base: a TypeError traceback at the first forward; stick-breaking: NaN loss),
and pos.base_options=x was a TypeError traceback."""

import re

import pytest
from omegaconf import OmegaConf

from relpos_cli.config import check_scheme_types
from relpos_cli.errors import RelposError
from relpos_cli.positions import build_scheme
from relpos_cli.positions.base import ModelShape

SHAPE = ModelShape(d_model=32, n_heads=4, n_layers=2, train_seq_len=16)


@pytest.mark.parametrize("base_options, message", [
    ("x", "pos.base_options='x' must be a mapping of the base's own options"),
    ([1], "pos.base_options=[1] must be a mapping of the base's own options"),
    ({"name": "rope"}, "pos.base_options.name='rope': the base is named by pos.base (pos.base='alibi')"),
    ({"name": "stickbreaking"}, "pos.base_options.name='stickbreaking': the base is named by pos.base"),
])
def test_dape_base_options_that_are_no_options_of_the_base_are_clear_errors(base_options, message):
    with pytest.raises(RelposError, match=re.escape(message)):
        build_scheme({"name": "dape", "base": "alibi", "base_options": base_options}, SHAPE)


def test_dape_base_is_the_scheme_pos_base_names_with_its_options():
    scheme = build_scheme({"name": "dape", "base": "kerple_log", "base_options": {"shared_layers": False}}, SHAPE)
    assert scheme.base.name == "kerple_log" and scheme.base.r1.shape == (SHAPE.n_layers, SHAPE.n_heads)
    assert build_scheme({"name": "dape", "base": "alibi", "base_options": None}, SHAPE).base.name == "alibi"


@pytest.mark.parametrize("options, message", [
    ({"base": "kerple_log", "base_options": {"shared_layers": "no"}}, "pos.base_options.shared_layers must be a boolean, got 'no'"),
    ({"base": "sandwich", "base_options": {"dim": "abc"}}, "pos.base_options.dim must be an integer, got 'abc'"),
])
def test_dape_base_options_are_checked_against_the_base_s_types(options, message):
    """'no' would count as true (r1, r2 silently shared); 'abc' was a TypeError traceback."""
    with pytest.raises(RelposError, match=re.escape(message)):
        check_scheme_types(OmegaConf.create({"pos": {"name": "dape", "mlp_width": 32, **options}}))
    check_scheme_types(OmegaConf.create({"pos": {"name": "dape", "base": "t5", "base_options": {"num_buckets": 16}}}))
