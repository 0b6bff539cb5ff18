"""The options of a RoPE scaling (eval.rope_scaling, pos.scaling), checked whatever its type.

Shared by the config schema (relpos_cli/settings.py checks eval.rope_scaling) and the RoPE schemes
(relpos_cli/positions/rope.py checks pos.scaling when a scheme is built): a leaf module, so that
neither imports the other.
"""

from __future__ import annotations

import math
from typing import Any

from relpos_cli.errors import RelposError


# factor: auto = the length scaled to / the length scaled from (a model per eval length at evaluation);
# longest (eval.rope_scaling only) = the longest eval length / L_train, one model at every length
AUTO_FACTOR, LONGEST_FACTOR = "auto", "longest"
# what a null option means (transformers' defaults): the frequencies and the checks read the same
SCALING_DEFAULTS = {"beta_fast": 32, "beta_slow": 1, "high_freq_factor": 4.0, "low_freq_factor": 1.0}


def scaling_option(scaling: Any, name: str) -> Any:
    """The option `name` of a scaling, its SCALING_DEFAULTS value where null."""
    value = scaling.get(name)
    return SCALING_DEFAULTS[name] if value is None else value


def check_rope_scaling(scaling: Any, key: str) -> None:
    """A RoPE scaling's options (eval.rope_scaling, pos.scaling) whatever its type: a value that
    only matters under another type (a YaRN beta under type=none) is still refused when it is
    impossible, rather than accepted and ignored. `key` names the settings in messages."""
    factor = scaling.get("factor", AUTO_FACTOR)
    # longest (one factor for every eval length) exists at evaluation only; training's auto is already fixed
    named = (AUTO_FACTOR, LONGEST_FACTOR) if key == "eval.rope_scaling" else (AUTO_FACTOR,)
    choices = "a number >= 1, auto or longest" if len(named) == 2 else "a number >= 1 or auto"
    if factor not in named:
        try:
            number = float(factor)
        except (TypeError, ValueError):
            raise RelposError(f"{key}.factor={factor!r}; give {choices}") from None
        if isinstance(factor, bool) or not math.isfinite(number):
            raise RelposError(f"{key}.factor={factor!r}; give {choices.replace('a number', 'a finite number')}")
        if not number >= 1:
            raise RelposError(f"{key}.factor={factor} is below 1; give {choices}")
    nullable = ("attention_factor", "low_freq_factor", "high_freq_factor")
    for name in ("beta_fast", "beta_slow", *nullable):
        value = scaling.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf):
            raise RelposError(f"{key}.{name}={value!r}; give a finite positive number" + (" or null" if name in nullable else ""))
    for fast_name, slow_name, what in (("beta_fast", "beta_slow", "YaRN ramps between them"),
                                       ("high_freq_factor", "low_freq_factor", "llama3 blends the wavelengths between them")):
        # a null one as what it means: low_freq_factor=5 alone is above the high one's 4
        if not scaling_option(scaling, fast_name) > scaling_option(scaling, slow_name):
            fast, slow = (f"{key}.{name}=" + (f"null ({SCALING_DEFAULTS[name]})" if scaling.get(name) is None else f"{scaling[name]}")
                          for name in (fast_name, slow_name))
            raise RelposError(f"{fast} must be above {slow}: {what}")


# the options each scaling type reads besides its type; the others are left at their defaults
READ_BY_TYPE = {"none": (), "linear": ("factor",), "ntk": ("factor",), "dynamic": ("factor",),
                "yarn": ("factor", "beta_fast", "beta_slow", "attention_factor"),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor")}
SCALING_TYPES = tuple(READ_BY_TYPE)  # type: none, then those a checkpoint's rope_scaling may name


def check_scaling_takes_effect(scaling: Any, defaults: Any, key: str) -> None:
    """An option set away from its default that the scaling's type never reads, refused in one line:
    the results would be the unscaled (or the type's own) numbers under a name that says otherwise
    (eval.rope_scaling.factor=4 with type none, a YaRN beta with type linear)."""
    rope_type = scaling.get("type", "none")
    read = READ_BY_TYPE.get(rope_type, ())
    for name, value in scaling.items():
        if name != "type" and name not in read and value != defaults.get(name):
            if rope_type == "none":
                raise RelposError(f"{key}.{name}={value} does nothing without {key}.type; name a type "
                                  f"({', '.join(t for t in READ_BY_TYPE if t != 'none')}) or leave it out")
            readers = ", ".join(t for t, names in READ_BY_TYPE.items() if name in names)
            raise RelposError(f"{key}.{name}={value} does nothing with {key}.type={rope_type} (it is read by "
                              f"type {readers}); leave it out")
