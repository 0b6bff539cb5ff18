"""Registry of pretrained model families: one module per family in this package.

A family maps a Hugging Face config (config.json as a dict) to relpos's own model options and
position scheme, and the checkpoint's weight names to relpos's (relpos_cli/model.py). Adding a
family = a module here whose class is decorated with ``@register("name")`` and lists the
``model_type`` values it reads. Nothing outside this package tests a family's name: an imported
run is a run config (model.*, pos.*) and a checkpoint like any other.
"""

from __future__ import annotations

from typing import Any, Mapping

from relpos_cli.errors import RelposError
from relpos_cli.families.base import Family
from relpos_cli.registry import import_modules, registrar

REGISTRY: dict[str, type[Family]] = {}
register = registrar(REGISTRY, "model family")


def family_for(hf_config: Mapping[str, Any]) -> Family:
    """The family that reads a checkpoint with this config, or a one-line error naming those that exist."""
    model_type = hf_config.get("model_type")
    for cls in REGISTRY.values():
        if model_type in cls.model_types:
            return cls()
    families = ", ".join(f"{name} ({'/'.join(cls.model_types)})" for name, cls in sorted(REGISTRY.items()))
    raise RelposError(f"architecture {model_type!r} is not supported; relpos imports these families: {families}")


import_modules(__path__, __name__, skip=("base",))
