"""Pydantic plumbing shared by every config: strict models and one-line error messages."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from guardfl.errors import ConfigError


class StrictModel(BaseModel):
    """A config model: unknown keys are errors; frozen, so a live defense cannot drift from its config."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def _allowed(model: type[BaseModel] | None, loc: tuple[Any, ...]) -> str | None:
    """The human-readable allowed range declared on the field at ``loc`` (json_schema_extra["allowed"])."""
    if model is None or not loc:
        return None
    field = model.model_fields.get(str(loc[-1])) if isinstance(loc[-1], str) else None
    if field is None:
        return None
    extra = field.json_schema_extra
    if isinstance(extra, dict) and "allowed" in extra:
        return str(extra["allowed"])
    return None


def format_validation_error(err: ValidationError, prefix: str, model: type[BaseModel] | None = None) -> str:
    """Turn a pydantic ValidationError into ``prefix.field: problem (got X); allowed: RANGE`` lines."""
    lines = []
    for e in err.errors(include_url=False):
        loc = tuple(x for x in e.get("loc", ()) if not (isinstance(x, str) and x.startswith("function-")))
        name = ".".join(str(x) for x in (prefix, *loc) if x != "")
        msg = e.get("msg", "invalid value").removeprefix("Value error, ")
        if e.get("type") == "extra_forbidden":
            allowed = ", ".join(sorted(model.model_fields)) if model is not None else None
            msg = "unknown key"
        elif e.get("type") == "value_error":  # a nested config's own one-line message
            allowed = None
        else:
            allowed = _allowed(model, loc) if len(loc) == 1 else None
        got = e.get("input")
        text = f"{name}: {msg}"
        if e.get("type") not in ("missing", "extra_forbidden") and not isinstance(got, (dict, list)):
            text += f" (got {got!r})"
        if allowed:
            text += f"; allowed: {allowed}"
        lines.append(text)
    return "; ".join(lines)


def validate(model: type[BaseModel], data: Any, prefix: str) -> BaseModel:
    """Validate ``data`` against ``model``; raise ConfigError with a one-line message on failure."""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, prefix, model)) from None
