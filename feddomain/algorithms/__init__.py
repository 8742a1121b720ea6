"""Federated methods: one module each, registered by name (see ``registry``)."""

import importlib
import pkgutil

from feddomain.algorithms.registry import (
    METHODS,
    algorithm_hparams,
    get_method,
    register,
    resolve_method,
    typed_section,
)

for _module in pkgutil.iter_modules(__path__):
    if _module.name not in {"base", "registry"}:
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "METHODS",
    "algorithm_hparams",
    "get_method",
    "register",
    "resolve_method",
    "typed_section",
]
