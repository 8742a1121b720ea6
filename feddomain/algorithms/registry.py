"""Method registry. Each method module registers its ``MethodSpec`` when imported; the package
``__init__`` imports every module, so adding a method touches no other file."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from feddomain.algorithms.base import Hparams, MethodSpec
from feddomain.config import closest
from feddomain.errors import ConfigError

METHODS: dict[str, MethodSpec] = {}


def register(spec: MethodSpec) -> MethodSpec:
    if spec.name in METHODS:
        raise ValueError(f"method {spec.name!r} is registered twice")
    METHODS[spec.name] = spec
    return spec


def get_method(name: str) -> MethodSpec:
    try:
        return METHODS[name]
    except KeyError:
        raise ConfigError(
            f"unknown algorithm '{name}'{closest(name, list(METHODS))} "
            f"(available: {', '.join(sorted(METHODS))})"
        ) from None


def algorithm_hparams(name: str, values: dict[str, Any]) -> Hparams:
    """Validate a method's hyper-parameters; errors name the key and the closest valid one."""
    spec = get_method(name)
    try:
        return spec.make_hparams(values)
    except ValidationError as err:
        lines = [f"invalid hyper-parameters for algorithm '{name}':"]
        for e in err.errors():
            key = ".".join(str(p) for p in e["loc"])
            if e["type"] == "extra_forbidden":
                hint = closest(key, list(spec.hparams.model_fields), prefix="algorithm")
                lines.append(f"  unknown key 'algorithm.{key}'{hint}")
            else:
                lines.append(f"  'algorithm.{key}': {e['msg']} (got {e.get('input')!r})")
        raise ConfigError("\n".join(lines)) from None
