"""The options of a RoPE scaling (eval.rope_scaling, pos.scaling), checked whatever its type.

Shared by the config schema (relpos_cli/settings.py checks eval.rope_scaling) and the RoPE schemes
(relpos_cli/positions/rope.py checks pos.scaling when a scheme is built): a leaf module, so that
neither imports the other.
"""

from __future__ import annotations

from typing import Any

from relpos_cli.errors import RelposError


def check_rope_scaling(scaling: Any, key: str) -> None:
    """A RoPE scaling's options (eval.rope_scaling, pos.scaling) whatever its type: a value that
    only matters under another type (a YaRN beta under type=none) is still refused when it is
    impossible, rather than accepted and ignored. `key` names the settings in messages."""
    factor = scaling.get("factor", "auto")
    # longest (one factor for every eval length) exists at evaluation only; training's auto is already fixed
    named = ("auto", "longest") if key == "eval.rope_scaling" else ("auto",)
    choices = "a number >= 1, auto or longest" if len(named) == 2 else "a number >= 1 or auto"
    if factor not in named:
        try:
            number = float(factor)
        except (TypeError, ValueError):
            raise RelposError(f"{key}.factor={factor!r}; give {choices}") from None
        if isinstance(factor, bool) or not number >= 1:
            raise RelposError(f"{key}.factor={factor} is below 1; give {choices}")
    for name in ("beta_fast", "beta_slow", "attention_factor"):
        value = scaling.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise RelposError(f"{key}.{name}={value!r}; give a positive number" + (" or null" if name == "attention_factor" else ""))
    fast, slow = scaling.get("beta_fast"), scaling.get("beta_slow")
    if fast is not None and slow is not None and not fast > slow:
        raise RelposError(f"{key}.beta_fast={fast} must be above {key}.beta_slow={slow}: YaRN ramps between them")
