"""Registry of position schemes: one module per scheme in this package, one yaml in conf/pos/.

Adding a scheme = a module here whose class is decorated with ``@register("name")`` plus
``conf/pos/name.yaml`` with ``name: name`` and the constructor's keyword arguments.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping

from relpos_cli.errors import RelposError
from relpos_cli.positions.base import ModelShape, PositionScheme
from relpos_cli.registry import import_modules, registrar

REGISTRY: dict[str, type[PositionScheme]] = {}
register = registrar(REGISTRY, "position scheme")


def _import_all() -> None:
    import_modules(__path__, __name__, skip=("base",))


def scheme_names() -> list[str]:
    return sorted(REGISTRY)


def named_schemes(text: str) -> list[str]:
    """The schemes of a comma-separated list (a benchmark's --schemes), each registered; RelposError
    naming the ones that are not."""
    names = text.split(",")
    if unknown := [s for s in names if s not in REGISTRY]:
        raise RelposError(f"unknown scheme {', '.join(s or repr(s) for s in unknown)}; choose from {', '.join(scheme_names())}")
    return names


def accepts_rope_scaling(cls: type[PositionScheme]) -> bool:
    """Whether a scheme takes RoPE scaling (pos.scaling, eval.rope_scaling): it rotates with RoPE's
    frequencies. Not every scheme that transforms q and k does (nope_scaled only scales queries)."""
    return "scaling" in inspect.signature(cls.__init__).parameters


def rope_scaling_error(key: str, name: str) -> RelposError:
    takers = ", ".join(n for n, c in sorted(REGISTRY.items()) if accepts_rope_scaling(c))
    return RelposError(f"{key} applies to schemes that rotate q and k with RoPE's frequencies ({takers}); pos={name} does not")


def scheme_options(cls: type[PositionScheme]) -> set[str]:
    """The pos.* options a scheme takes: its constructor's arguments before the keyword-only ones
    (those, such as eval_scaling, come from elsewhere than pos.*)."""
    params = inspect.signature(cls.__init__).parameters.values()
    return {p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD} - {"self", "shape"}


def build_scheme(pos_cfg: Mapping[str, Any], shape: ModelShape, eval_scaling: Mapping[str, Any] | None = None) -> PositionScheme:
    """Instantiate the scheme named by ``pos_cfg['name']`` with the rest as keyword arguments.
    eval_scaling: eval.rope_scaling naming a type, for a model built for evaluation (schemes that
    accept RoPE scaling only)."""
    params = dict(pos_cfg)
    name = params.pop("name", None)
    if name not in REGISTRY:
        raise RelposError(f"unknown position scheme {name!r}; choose one of: {', '.join(scheme_names())}")
    cls = REGISTRY[name]
    accepted = scheme_options(cls)
    unknown = sorted(set(params) - accepted)
    if "scaling" in unknown:
        raise rope_scaling_error("pos.scaling", name)
    if unknown:
        raise RelposError(
            f"pos={name} has no option {', '.join(unknown)}; its options are: {', '.join(sorted(accepted)) or 'none'}"
        )
    if eval_scaling is not None:
        if not accepts_rope_scaling(cls):
            raise RelposError(f"{rope_scaling_error('eval.rope_scaling', name)}, so the results would be the default ones")
        return cls(shape, **params, eval_scaling=eval_scaling)
    return cls(shape, **params)


def with_added_options(pos_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """A saved run's pos config with the options its scheme gained since, at the values that
    reproduce how it was trained (unknown schemes pass through: build_scheme reports them)."""
    cls = REGISTRY.get(pos_cfg.get("name"))
    return {**(cls.added_options if cls else {}), **pos_cfg}


_import_all()
