"""Method registry. Each method module registers its ``MethodSpec`` when imported; the package
``__init__`` imports every module, so adding a method touches no other file."""

from __future__ import annotations

import inspect
from typing import Any

from pydantic import ValidationError

from feddomain.algorithms.base import (
    ClientAlgorithm,
    Hparams,
    Method,
    MethodSpec,
    ServerAlgorithm,
    StationAlgorithm,
)
from feddomain.algorithms.space import check_space
from feddomain.config import closest
from feddomain.errors import ConfigError

METHODS: dict[str, MethodSpec] = {}


def register(spec: MethodSpec) -> MethodSpec:
    """Add ``spec`` under its name, once its parts and its search space are checked: built-in
    methods and plug-ins (docs/plugins.md) alike. A ``ConfigError`` names the method and what is
    wrong."""
    problem = _spec_problem(spec)
    if problem:
        raise ConfigError(f"method {spec.name!r} cannot be registered: {problem}")
    if spec.name in METHODS:
        taken = METHODS[spec.name].server.__module__
        raise ConfigError(f"method {spec.name!r} is already registered (by {taken})")
    try:
        check_space(spec.name, spec.hparams, spec.space)
    except ValueError as err:
        raise ConfigError(f"method {spec.name!r} cannot be registered: {err}") from err
    METHODS[spec.name] = spec
    return spec


def _spec_problem(spec: MethodSpec) -> str | None:
    """What is wrong with a method's declaration, or None: its name, its parts' types, the
    privacy declaration of its client (``uploads``), its hyper-parameter model."""
    if not isinstance(spec.name, str) or not spec.name.strip() or spec.name != spec.name.strip():
        return f"its name must be a non-empty string without surrounding spaces, got {spec.name!r}"
    for part, base in (
        ("server", ServerAlgorithm),
        ("client", ClientAlgorithm),
        ("station", StationAlgorithm),
    ):
        cls = getattr(spec, part)
        if not (isinstance(cls, type) and issubclass(cls, base)):
            return f"{part} must be a subclass of {base.__name__}, got {cls!r}"
        if inspect.isabstract(cls):
            missing = ", ".join(sorted(cls.__abstractmethods__))
            privacy = " (uploads: the privacy declaration)" if "uploads" in missing else ""
            return f"{part} {cls.__name__} does not implement {missing}{privacy}"
    if not (isinstance(spec.hparams, type) and issubclass(spec.hparams, Hparams)):
        return (
            f"hparams must be a subclass of feddomain's Hparams (typed, unknown keys refused), "
            f"got {spec.hparams!r}"
        )
    defaults = {  # given explicitly, so that pydantic validates them (it trusts defaults)
        name: field.get_default(call_default_factory=True)
        for name, field in spec.hparams.model_fields.items()
        if not field.is_required()
    }
    try:
        spec.make_hparams(defaults)
    except ValidationError as err:
        fields = ", ".join(".".join(map(str, e["loc"])) + f" ({e['msg']})" for e in err.errors())
        return f"its hyper-parameters {spec.hparams.__name__} need valid defaults: {fields}"
    return None


def get_method(name: str) -> MethodSpec:
    try:
        return METHODS[name]
    except KeyError:
        raise ConfigError(
            f"unknown algorithm '{name}'{closest(name, list(METHODS))} "
            f"(available: {', '.join(sorted(METHODS))})"
        ) from None


def resolve_method(name: str, values: dict[str, Any]) -> Method:
    """The validated method of an ``algorithm:`` section: its own hyper-parameters, or, with a
    ``client`` key, an aggregator's composed with another method's client part. Errors name the
    key (``algorithm.client.mu``) and the closest valid one."""
    spec = get_method(name)
    values = dict(values)
    client = values.pop("client", None)
    hp = _validated(spec, values, "algorithm")
    if client is None:
        return Method(spec, hp, spec, hp)
    if not spec.takes_client:
        composable = sorted(m for m, s in METHODS.items() if s.takes_client)
        raise ConfigError(
            f"'algorithm.client': {name} has its own client part and takes no other "
            f"(methods that take one: {', '.join(composable)})"
        )
    client = {"name": client} if isinstance(client, str) else client
    if not isinstance(client, dict) or "name" not in client:
        raise ConfigError(
            f"'algorithm.client' must be a method name or a mapping with 'name', got {client!r}"
        )
    client = dict(client)
    client_spec = get_method(str(client.pop("name")))
    if _is_plain_client_of(spec, client_spec) and not client:
        return Method(spec, hp, spec, hp)  # `client: fedavg`: the aggregator's own plain clients
    if client_spec.pooled or client_spec.takes_client:
        raise ConfigError(
            f"'algorithm.client.name': {client_spec.name} cannot be a client part "
            f"({'it pools all data' if client_spec.pooled else 'it is an aggregator'})"
        )
    client_hp = _validated(client_spec, client, "algorithm.client")
    return Method(spec, hp, client_spec, client_hp)


def _is_plain_client_of(spec: MethodSpec, client_spec: MethodSpec) -> bool:
    """Whether naming ``client_spec`` as the client part means ``spec``'s own clients: an
    aggregator with no layers of its own (FedAvg) whose client part is ``spec``'s."""
    return (
        client_spec.takes_client
        and client_spec.client is spec.client
        and client_spec.client_wrapper is None
        and client_spec.station_wrapper is None
    )


def typed_section(section: dict[str, Any] | str, *, defaults: bool) -> dict[str, Any]:
    """An ``algorithm:`` section with each hyper-parameter as its method's schema types it
    (YAML reads ``1e-2`` as the string "1e-2"; the schema, as the float 0.01), a composed
    client part's too; with ``defaults``, every hyper-parameter, the method's defaults filled
    in, so that a run stating a default and one leaving it implicit compare equal."""
    values = {"name": section} if isinstance(section, str) else dict(section)
    head = {k: values.pop(k) for k in ("name", "label") if k in values}
    method = resolve_method(str(head.get("name", "fedavg")), values)
    out = {**head, **_typed(method.hp, values, defaults)}
    client = values.get("client")
    if client is None:
        return out
    if method.client_spec is method.spec:  # `client: fedavg`: the aggregator's own clients
        out["client"] = client
        return out
    given = {"name": client} if isinstance(client, str) else dict(client)
    out["client"] = {"name": given.pop("name"), **_typed(method.client_hp, given, defaults)}
    return out


def _typed(hp: Hparams, given: dict[str, Any], defaults: bool) -> dict[str, Any]:
    dumped = hp.model_dump(mode="json")
    return dumped if defaults else {k: dumped[k] for k in given if k in dumped}


def algorithm_hparams(name: str, values: dict[str, Any]) -> Hparams:
    """Validate a method's hyper-parameters (and a composed client's)."""
    return resolve_method(name, values).hp


def _validated(spec: MethodSpec, values: dict[str, Any], prefix: str) -> Hparams:
    try:
        return spec.make_hparams(values)
    except ValidationError as err:
        lines = [f"invalid hyper-parameters for algorithm '{spec.name}':"]
        for e in err.errors():
            key = ".".join(str(p) for p in e["loc"])
            if e["type"] == "extra_forbidden":
                hint = closest(key, list(spec.hparams.model_fields), prefix=prefix)
                lines.append(f"  unknown key '{prefix}.{key}'{hint}")
            else:
                lines.append(f"  '{prefix}.{key}': {e['msg']} (got {e.get('input')!r})")
        raise ConfigError("\n".join(lines)) from None
