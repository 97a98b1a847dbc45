"""Field tables from pydantic models: name, type, default, allowed values and the field's own documentation.

Everything comes from the model: the annotation, the default (or default factory), the constraints
(``ge`` / ``gt`` / ``le`` / ``lt``, ``Literal`` choices) and the ``json_schema_extra={"allowed": ...}`` text
the model's one-line errors also quote. The description is the field's ``description``, else the ``#:``
comment lines right above the field in the class's source, else the ``name: text`` entry of the class
docstring (``ThreatModel`` documents its fields that way). Nothing is typed by hand, so the reference
cannot drift from the validation.
"""

from __future__ import annotations

import enum
import inspect
import re
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

_FIELD_LINE = re.compile(r"^\s*(\w+)\s*:")


def source_comments(cls: type) -> dict[str, str]:
    """``#:`` comments above each field of ``cls`` and its bases (the nearest class wins)."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is BaseModel or not issubclass(klass, BaseModel):
            continue
        try:
            lines = inspect.getsource(klass).splitlines()
        except (OSError, TypeError):
            continue
        pending: list[str] = []
        for line in lines:
            stripped = line.strip()
            if stripped.startswith("#:"):
                pending.append(stripped[2:].strip())
                continue
            m = _FIELD_LINE.match(line)
            if m and pending and not stripped.startswith(("def ", "class ", "@", "return")):
                out[m.group(1)] = " ".join(pending)
            if stripped:
                pending = []
    return out


def docstring_entries(cls: type) -> dict[str, str]:
    """``name: text`` entries of a class docstring (continuation lines indented deeper)."""
    doc = inspect.getdoc(cls) or ""
    out: dict[str, str] = {}
    current: str | None = None
    for line in doc.splitlines():
        m = re.match(r"^(\w+): (.*)$", line)
        if m:
            current = m.group(1)
            out[current] = m.group(2).strip()
        elif current and line.startswith(" ") and line.strip():
            out[current] += " " + line.strip()
        else:
            current = None
    return out


def args_entries(cls: type | None) -> dict[str, str]:
    """The ``Args:`` section of a class docstring (Google style), ``name -> text``: a defense's parameters,
    the description column of its config table where the Config field has no ``#:`` comment."""
    doc = (inspect.getdoc(cls) or "") if cls is not None else ""
    section = re.search(r"^Args:\n((?:[ \t]+.*\n?|\n)*)", doc, flags=re.M)
    if not section:
        return {}
    out: dict[str, str] = {}
    current: str | None = None
    for line in section.group(1).splitlines():
        m = re.match(r"^ {4}(\w+): (.*)$", line)
        if m:
            current = m.group(1)
            out[current] = m.group(2).strip()
        elif current and line.startswith("        ") and line.strip():
            out[current] += " " + line.strip()
    return out


def type_name(annotation: Any) -> str:
    """A readable type: ``int | None``, ``'fedsgd' | 'fedavg'``, ``list[int]``, a model's name."""
    if annotation is type(None):
        return "null"
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(annotation))
    if origin is typing.Annotated:
        return type_name(typing.get_args(annotation)[0])
    if origin is not None:
        args = ", ".join(type_name(a) for a in typing.get_args(annotation))
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{args}]" if args else name
    if isinstance(annotation, type):
        if issubclass(annotation, enum.Enum):
            return " | ".join(repr(m.value) for m in annotation)
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def default_text(field: FieldInfo) -> str:
    """The default as YAML would spell it; ``required`` when there is none."""
    if field.default_factory is not None:
        try:
            value = field.default_factory()
        except TypeError:
            return "(computed)"
        if isinstance(value, BaseModel):
            return "(the section's defaults)"
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    return yaml_value(value)


def yaml_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_value(v)}" for k, v in value.items()) + "}" if value else "{}"
    if isinstance(value, BaseModel):
        return "(the section's defaults)"
    if isinstance(value, enum.Enum):
        return repr(value.value)
    if isinstance(value, str):
        return repr(value)
    return str(value)


def allowed_text(field: FieldInfo) -> str:
    """The model's own ``allowed`` text, else the range and choices its constraints say."""
    extra = field.json_schema_extra
    if isinstance(extra, dict) and extra.get("allowed"):
        return str(extra["allowed"])
    bounds = []
    for meta in field.metadata:
        for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"), ("min_length", "length >="),
                          ("max_length", "length <=")):
            v = getattr(meta, attr, None)
            if v is not None:
                bounds.append(f"{sym} {v}")
    if bounds:
        return ", ".join(bounds)
    args = typing.get_args(field.annotation)
    if typing.get_origin(field.annotation) is typing.Literal:
        return ", ".join(repr(a) for a in args)
    return ""


def nested_models(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models a field's annotation holds (a section, ``X | None``, ``list[X]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    out: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        out += nested_models(arg)
    return out


def cell(text: str) -> str:
    """Markdown-table-safe text: no newlines, pipes escaped outside code spans (inside one, the table
    extension keeps the pipe in its cell, and an escape would be shown: a type read ``int \\| None``)."""
    parts = re.split(r"(`+[^`]*`+)", " ".join(str(text).split()))
    return "".join(s if s.startswith("`") else s.replace("|", "\\|") for s in parts)


def _code(text: str) -> str:
    return f"`{text}`" if text else ""


def field_rows(model: type[BaseModel], skip: tuple[str, ...] = (), owner: type | None = None) -> list[dict[str, str]]:
    """One row per field of ``model``: name, type, default, allowed, description (``owner``: the class
    whose ``Args:`` describe the fields the model does not, a defense for its Config)."""
    comments = source_comments(model)
    entries = {**args_entries(owner), **docstring_entries(model)}
    rows = []
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        rows.append({
            "name": name,
            "type": type_name(field.annotation),
            "default": default_text(field),
            "allowed": allowed_text(field),
            "description": field.description or comments.get(name) or entries.get(name, ""),
        })
    return rows


def anchor(key: str) -> str:
    """The heading id of a section's key (``aux.ood`` -> ``aux-ood``)."""
    return key.replace("[]", "").replace(".", "-").replace("_", "-") or "top-level"


def rst_to_md(text: str) -> str:
    """Docstring markup to markdown: ````x```` to ```x```."""
    return re.sub(r"``([^`]+)``", r"`\1`", text)


def field_table(model: type[BaseModel], prefix: str = "", skip: tuple[str, ...] = (), sections: dict | None = None,
                owner: type | None = None) -> str:
    """A markdown table of ``model``'s fields (the key written ``prefix.name``); ``sections``: the nested
    models that have a section of their own (model -> key), linked from the fields that hold them;
    ``owner``: see ``field_rows``."""
    sections = sections or {}
    lines = ["| key | type | default | allowed | what it is |", "|---|---|---|---|---|"]
    for row in field_rows(model, skip, owner):
        key = f"{prefix}.{row['name']}" if prefix else row["name"]
        field = model.model_fields[row["name"]]
        linked = [sections[m] for m in nested_models(field.annotation) if m in sections]
        default = cell(_code(row["default"]))
        description = cell(rst_to_md(row["description"]))
        if linked:
            if row["default"] == "(the section's defaults)":
                default = "its section's"
            description = (description + " " if description else "") + "Keys: " + ", ".join(
                f"[`{k}`](#{anchor(k)})" for k in linked) + "."
        lines.append("| " + " | ".join([
            f"`{key}`", cell(_code(row["type"])), default, cell(rst_to_md(row["allowed"])), description,
        ]) + " |")
    return "\n".join(lines)


def class_summary(cls: type) -> str:
    """The first paragraph of a class docstring, on one line (empty for pydantic's inherited one)."""
    if "__doc__" not in cls.__dict__ or not cls.__doc__:
        return ""
    return " ".join(inspect.cleandoc(cls.__doc__).split("\n\n")[0].split())
