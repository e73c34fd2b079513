"""A package's names imported on first use (PEP 562): :func:`lazy_names`.

Each wing's ``__init__`` (and the package root) maps the names of its interface to the
modules that define them and imports none of those modules itself; the module-level
``__getattr__`` this returns imports a name's module when the name is first read and then
stores the value in the package's namespace (a plain attribute from then on)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(
    package: str,
    namespace: MutableMapping[str, Any],
    names: Mapping[str, str],
    exported: Sequence[str],
    *,
    fallback: Callable[[str], Any] | None = None,
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``(__getattr__, __dir__)`` pair of package ``package``, whose ``namespace`` is its
    ``globals()``: ``names`` maps a name to the module that defines it (absolute, or relative
    to ``package`` when it starts with a dot); ``exported`` is the package's ``__all__``, which
    ``__dir__`` lists beside what is already in the namespace. ``fallback(name)``, when given,
    is asked first (for deprecated or removed names: it returns a value, raises, or returns
    ``NotImplemented`` to let the lookup go on).

    Raised by ``__getattr__``: :class:`AttributeError` for a name the package does not have."""

    def __getattr__(name: str) -> Any:
        if fallback is not None:
            value = fallback(name)
            if value is not NotImplemented:
                return value
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value  # once imported, a plain attribute
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exported))

    return __getattr__, __dir__
