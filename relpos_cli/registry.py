"""Named registries (position schemes, tasks): a decorator that files a class under its name, and
the import of a package's modules, each of which registers what it defines."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Callable, Iterable, TypeVar

T = TypeVar("T", bound=type)


def registrar(registry: dict[str, T], kind: str) -> Callable[[str], Callable[[T], T]]:
    """`register = registrar(REGISTRY, "task")`, then `@register("passkey")` on a class."""

    def register(name: str) -> Callable[[T], T]:
        def wrap(cls: T) -> T:
            if name in registry:
                raise ValueError(f"{kind} {name!r} registered twice")
            cls.name = name
            registry[name] = cls
            return cls

        return wrap

    return register


def import_modules(path: Iterable[str], package: str, skip: Iterable[str] = ()) -> None:
    """Import every module of a package (its __path__ and __name__) but those in `skip`."""
    for module in pkgutil.iter_modules(path):
        if module.name not in set(skip):
            importlib.import_module(f"{package}.{module.name}")
