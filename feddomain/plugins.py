"""Plug-ins: methods, datasets and models from outside the package, without forking it.

Two ways in (docs/plugins.md):

* an installed distribution declares entry points in the groups ``feddomain.methods``,
  ``feddomain.datasets`` or ``feddomain.models``; each is loaded before the first config is
  validated. An entry point naming a module registers by being imported (its code calls
  ``feddomain.register(MethodSpec(...))``, ``register_dataset`` or ``register_model``); one
  naming an object registers that object: a ``MethodSpec``, a ``DatasetSpec``, or a model
  builder (registered under the entry point's name);
* a config's ``plugins: [my_package.my_method]`` lists modules imported before that config is
  validated (on Flower, by the ServerApp and by every node that loads the config).

Registration goes through the registries' own ``register`` functions, so a plug-in is checked
like a built-in method (hyper-parameter model, privacy declaration, a name not yet taken). A
plug-in that fails gets a ``PluginError`` naming it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import types
from typing import Any

from feddomain.errors import ConfigError

GROUPS = ("feddomain.methods", "feddomain.datasets", "feddomain.models")


class PluginError(ConfigError):
    """A plug-in could not be imported, or what it registers is refused."""


_entry_points_loaded = False
_imported: set[str] = set()  # config plug-in modules imported in this process


def load_plugins(modules: Any, source: str = "config") -> None:
    """Load the installed entry points (once per process), then import every module a
    config's ``plugins`` lists (``source``: where the config came from, for messages)."""
    load_entry_points()
    if modules is None:
        return
    if isinstance(modules, str):
        modules = [modules]
    if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
        raise PluginError(
            f"invalid configuration ({source}): 'plugins' must be a list of module names, "
            f"got {modules!r}"
        )
    for name in modules:
        if name not in _imported:
            _import_module(name, f"plugin {name!r} ('plugins' in {source})")
            _imported.add(name)


def load_entry_points() -> None:
    """Load every entry point of the three groups; a second call does nothing."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True  # first: a plug-in importing feddomain must not recurse
    for group in GROUPS:
        for entry in importlib.metadata.entry_points(group=group):
            _load_entry_point(group, entry)


def _load_entry_point(group: str, entry: importlib.metadata.EntryPoint) -> None:
    dist = getattr(entry.dist, "name", None)
    who = f"plugin entry point {entry.name} = {entry.value!r} (group {group}" + (
        f", distribution {dist})" if dist else ")"
    )
    try:
        obj = entry.load()
    except Exception as err:
        raise PluginError(f"{who} failed to import: {type(err).__name__}: {err}") from err
    _register_object(group, entry.name, obj, who)


def _import_module(name: str, who: str) -> types.ModuleType:
    try:
        return importlib.import_module(name)
    except PluginError:
        raise
    except ConfigError as err:  # a registration refused while the module ran
        raise PluginError(f"{who}: {err}") from err
    except Exception as err:
        hint = (
            "; is its package installed (or on PYTHONPATH) here?"
            if isinstance(err, ModuleNotFoundError)
            else ""
        )
        raise PluginError(f"{who} failed to import: {type(err).__name__}: {err}{hint}") from err


def _register_object(group: str, name: str, obj: Any, who: str) -> None:
    """Register what an entry point named (a module registered itself when imported)."""
    from feddomain.algorithms.base import MethodSpec
    from feddomain.data.sources import DatasetSpec, register_dataset

    try:
        if isinstance(obj, types.ModuleType):
            return
        if group == "feddomain.methods" and isinstance(obj, MethodSpec):
            _register_method(obj)
        elif group == "feddomain.datasets" and isinstance(obj, DatasetSpec):
            register_dataset(obj)
        elif group == "feddomain.models" and callable(obj):
            from feddomain.models import register_model

            register_model(name, obj)
        else:
            raise PluginError(f"names a {type(obj).__name__}, which group {group} cannot register")
    except ConfigError as err:
        raise PluginError(f"{who}: {err}") from err


def _register_method(spec: Any) -> None:
    from feddomain.algorithms import register  # late: importing algorithms loads every method

    register(spec)

