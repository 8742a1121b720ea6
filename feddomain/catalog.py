"""What feddomain offers, read from the registries and schemas themselves: the rows of
``feddomain list methods|models|datasets|configs`` and the text of ``docs/config.md``.

``python -m feddomain.catalog > docs/config.md`` regenerates the config reference; a test checks
that the file is current, so it cannot drift from the schemas.
"""

from __future__ import annotations

import inspect
import json
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from feddomain.config import SHIPPED_DIR, ExperimentConfig, shipped_name

Row = tuple[str, str]  # (name, one-line description)

def methods() -> list[Row]:
    """Every registered method with its description and citation."""
    from feddomain.algorithms import METHODS

    return [(name, spec.description) for name, spec in sorted(METHODS.items())]

def models() -> list[Row]:
    """Every model with the first line of its builder's docstring and its options."""
    from feddomain.models import MODELS, model_options

    rows = []
    for name, builder in sorted(MODELS.items()):
        doc = (inspect.getdoc(builder) or "").split("\n\n")[0].replace("\n", " ")
        options = ", ".join(f"{k}={v!r}" for k, v in model_options(name).items())
        rows.append((name, f"{doc} Options: {options or 'none'}."))
    return rows

def datasets() -> list[Row]:
    """Every dataset preset with its domains (a `folder` dataset's are its sub-folders)."""
    from feddomain.data.embedded import DOMAINS as EMBEDDED_DOMAINS
    from feddomain.data.sources import DATASETS

    rows = []
    for name, spec in DATASETS.items():
        if spec.builtin is not None:
            rows.append((name, f"built in, no download; domains: {', '.join(EMBEDDED_DOMAINS)}"))
        elif spec.domains is None:
            rows.append((name, "any <root>/<domain>/<class>/<image> tree; domains: its folders"))
        else:
            classes = f"{len(spec.classes)} classes" if spec.classes else "classes: its folders"
            rows.append(
                (name, f"<root>/{spec.folder}/; domains: {', '.join(spec.domains)}; {classes}")
            )
    return rows

def configs() -> list[Row]:
    """Every shipped config, by the name ``feddomain run`` accepts from any folder
    (``feddomain:pacs/lenet32``), with the first line of its leading comment."""
    rows = []
    for path in sorted(SHIPPED_DIR.rglob("*.yaml")):
        first = next(iter(path.read_text().splitlines()), "")
        comment = first.lstrip("# ").strip() if first.startswith("#") else ""
        rows.append((shipped_name(path), comment))
    return rows

# ----------------------------------------------------------------------- docs/config.md
def config_reference() -> str:
    """Markdown documenting every config key and every method's hyper-parameters."""
    from feddomain.algorithms import METHODS

    parts = [
        "# Configuration reference",
        "",
        "<!-- Generated from the schemas by `python -m feddomain.catalog > docs/config.md`; "
        "tests/test_cli_discover.py fails when it is out of date. Do not edit by hand. -->",
        "",
        "A config is YAML; any key can be overridden on the command line with a dotted path, "
        "e.g. `feddomain run configs/demo.yaml rounds=20 train.lr=0.01 split.targets=sketch`. "
        "`feddomain run CONFIG --dry-run` prints the resolved config without training. "
        "`null` is YAML's none.",
        "",
    ]
    parts += _section_tables(ExperimentConfig, "")
    parts += [
        "## Method hyper-parameters (`algorithm.*`)",
        "",
        "`algorithm: NAME` or `algorithm: {name: NAME, KEY: VALUE, ...}`; an aggregator that "
        "takes a client part also accepts `client: {name: METHOD, ...}`.",
        "",
    ]
    for name, spec in sorted(METHODS.items()):
        parts += [f"### `{name}`", "", spec.description, ""]
        fields = spec.hparams.model_fields
        meanings = {k: _inherited_meaning(spec.hparams, k) for k in fields}
        table = _table(fields, "algorithm.", meanings)
        parts += table if fields else ["No hyper-parameters.", ""]
    return "\n".join(parts).rstrip() + "\n"

def _section_tables(model: type[BaseModel], prefix: str) -> list[str]:
    """A table of ``model``'s plain keys, then one sub-section per nested section."""
    plain = {k: f for k, f in model.model_fields.items() if not _is_section(f)}
    title = f"`{prefix.rstrip('.')}`" if prefix else "Top level"
    out = [f"## {title}", ""]
    if model.__doc__ and prefix:
        out += [inspect.cleandoc(model.__doc__), ""]
    out += _table(plain, prefix)
    for key, field in model.model_fields.items():
        if _is_section(field):
            out += _section_tables(field.annotation, f"{prefix}{key}.")
    return out

def _is_section(field: FieldInfo) -> bool:
    return isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)

def _inherited_meaning(model: type[BaseModel], key: str) -> str:
    """The field's meaning, or, where a subclass only fixes its value (hFedF's ablations set
    ``gradalign: false``), the nearest base class's."""
    for cls in model.__mro__:
        fields = getattr(cls, "model_fields", {})
        if key in fields and fields[key].description:
            return fields[key].description
    return ""

def _table(
    fields: dict[str, FieldInfo], prefix: str, meanings: dict[str, str] | None = None
) -> list[str]:
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key, field in fields.items():
        text = (meanings or {}).get(key) or field.description or ""
        meaning = " ".join(text.split())
        rows.append(
            f"| `{prefix}{key}` | {_type(field)} | `{_default(field)}` | {_cell(meaning)} |"
        )
    return [*rows, ""]

def _type(field: FieldInfo) -> str:
    """The annotation in YAML terms, with the field's bounds (e.g. ``int ≥ 1``)."""
    text = _annotation(field.annotation)
    bounds = []
    for meta in field.metadata:
        for attr, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
            value = getattr(meta, attr, None)
            if value is not None:
                bounds.append(f"{sign} {value}")
    return _cell(f"{text} {', '.join(bounds)}".strip())

def _annotation(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:  # e.g. Annotated[int, Field(ge=1)]: the plain type
        return _annotation(args[0])
    if origin is typing.Literal:
        return " or ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_annotation(a) for a in args)
    if annotation is type(None):
        return "null"
    if origin in (list, tuple):
        inner = sorted({_annotation(a) for a in args if a is not Ellipsis})
        fixed = origin is tuple and Ellipsis not in args  # tuple[int, ...] has any length
        return f"list of {' or '.join(inner)}" + (f" ({len(args)})" if fixed else "")
    if origin is dict:
        return "mapping"
    return getattr(annotation, "__name__", str(annotation))

def _default(field: FieldInfo) -> str:
    value = field.default_factory() if field.default_factory else field.default
    return json.dumps(value)

def _cell(text: str) -> str:
    return text.replace("|", "\\|")

if __name__ == "__main__":
    print(config_reference(), end="")
