"""feddomain: federated domain generalization — faithful methods, fast CPU simulation, Flower.

The Python API (README, "Python API"): ``load_config``, ``run``, ``rescore``, ``sweep``,
``report``, with the result types ``ExperimentResult``, ``FinishedRun``, ``SweepResult``;
``register`` and ``MethodSpec`` for methods of one's own (docs/plugins.md). Each name is
imported on first use, so ``import feddomain`` (and ``feddomain --version``) stays cheap.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> (module, attribute), imported when first asked for
_API: dict[str, tuple[str, str]] = {
    "load_config": ("feddomain.api", "load_config"),
    "run": ("feddomain.api", "run"),
    "rescore": ("feddomain.api", "rescore"),
    "sweep": ("feddomain.api", "sweep"),
    "report": ("feddomain.api", "report"),
    "ExperimentResult": ("feddomain.api", "ExperimentResult"),
    "FinishedRun": ("feddomain.api", "FinishedRun"),
    "SweepResult": ("feddomain.api", "SweepResult"),
    "ExperimentConfig": ("feddomain.config", "ExperimentConfig"),
    "FeddomainError": ("feddomain.errors", "FeddomainError"),
    "ConfigError": ("feddomain.errors", "ConfigError"),
    "MethodSpec": ("feddomain.algorithms.base", "MethodSpec"),
    "Hparams": ("feddomain.algorithms.base", "Hparams"),
    "register": ("feddomain.algorithms.registry", "register"),
    "register_model": ("feddomain.models", "register_model"),
    "register_dataset": ("feddomain.data.sources", "register_dataset"),
    "DatasetSpec": ("feddomain.data.sources", "DatasetSpec"),
    "tune": ("feddomain.tune", "tune"),
}
__all__ = ["__version__", *_API]

if TYPE_CHECKING:  # for type checkers and editors; at run time __getattr__ imports them
    from feddomain.algorithms.base import Hparams as Hparams
    from feddomain.algorithms.base import MethodSpec as MethodSpec
    from feddomain.algorithms.registry import register as register
    from feddomain.api import ExperimentResult as ExperimentResult
    from feddomain.api import FinishedRun as FinishedRun
    from feddomain.api import SweepResult as SweepResult
    from feddomain.api import load_config as load_config
    from feddomain.api import report as report
    from feddomain.api import rescore as rescore
    from feddomain.api import run as run
    from feddomain.api import sweep as sweep
    from feddomain.config import ExperimentConfig as ExperimentConfig
    from feddomain.data.sources import DatasetSpec as DatasetSpec
    from feddomain.data.sources import register_dataset as register_dataset
    from feddomain.errors import ConfigError as ConfigError
    from feddomain.errors import FeddomainError as FeddomainError
    from feddomain.models import register_model as register_model
    from feddomain.tune import tune as tune


def __getattr__(name: str) -> Any:
    if name not in _API:
        raise AttributeError(f"module 'feddomain' has no attribute {name!r}")
    module, attr = _API[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # found directly from now on
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_API})


class _Package(types.ModuleType):
    """``feddomain.sweep`` (and ``feddomain.tune``) are API functions that share their names
    with modules (``feddomain/sweep.py``): importing such a module must not replace the
    function, as Python's import system otherwise does by setting the package attribute.
    ``from feddomain.sweep import X`` still reaches the module."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _API and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
