"""Pydantic plumbing shared by every config: strict models and one-line error messages."""

from __future__ import annotations

from typing import Annotated, Any, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator

from guardfl.errors import ConfigError


def _numeric(annotation: Any) -> str | None:
    """"an integer" / "a number" when ``annotation`` (through ``X | None`` and ``Annotated``) is an int or a
    float field and not also a bool one; "a list of integers" / "a list of numbers" for ``list[int]`` and
    ``list[float]``; else None."""
    if annotation is bool:
        return None
    if annotation is int:
        return "an integer"
    if annotation is float:
        return "a number"
    if get_origin(annotation) is list:
        inner = _numeric(next(iter(get_args(annotation)), None))
        return f"a list of {'integers' if inner == 'an integer' else 'numbers'}" if inner else None
    args = [a for a in get_args(annotation) if a is not type(None)]
    if get_origin(annotation) is Annotated:
        args = args[:1]
    if any(a is bool for a in args):
        return None
    for a in args:
        found = _numeric(a)
        if found is not None:
            return found
    return None


class StrictModel(BaseModel):
    """A config model: unknown keys are errors; frozen, so a live defense cannot drift from its config.

    Numbers are taken at face value: ``inf`` and ``nan`` are refused in every float field
    (``allow_inf_nan=False``), and a boolean is refused where a number is expected (pydantic would read
    ``batch_size: true`` as 1 and ``sigma: true`` as 1.0)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name is None:
            return value
        field = cls.model_fields[info.field_name]
        wanted = _numeric(field.annotation)
        if wanted is None:
            return value
        flagged = isinstance(value, bool) or (
            wanted.startswith("a list") and isinstance(value, (list, tuple)) and any(isinstance(v, bool) for v in value)
        )
        if flagged:
            extra = field.json_schema_extra
            allowed = extra.get("allowed") if isinstance(extra, dict) else None
            raise ValueError(f"expected {wanted}, not a boolean (got {value!r})" + (f"; allowed: {allowed}" if allowed else ""))
        return value


def _submodel(annotation: Any) -> type[BaseModel] | None:
    """The BaseModel inside an annotation such as ``Sub``, ``Sub | None`` or ``list[Sub]``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _submodel(arg)
        if found is not None:
            return found
    return None


def _owner(model: type[BaseModel] | None, loc: tuple[Any, ...]) -> tuple[type[BaseModel] | None, Any]:
    """Walk ``loc`` through nested models: (the model owning the last key, that key's FieldInfo)."""
    owner, field = model, None
    for i, key in enumerate(loc):
        if owner is None or not isinstance(key, str) or key not in owner.model_fields:
            continue
        field = owner.model_fields[key]
        if i < len(loc) - 1:
            nested = _submodel(field.annotation)
            if nested is not None:
                owner, field = nested, None
    return owner, field


def _clean(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """Drop pydantic's internal location segments (validator and union branch names)."""
    return tuple(x for x in loc if not (isinstance(x, str) and ("[" in x or x.startswith("function-"))))


def format_validation_error(err: ValidationError, prefix: str, model: type[BaseModel] | None = None) -> str:
    """Turn a pydantic ValidationError into ``prefix.field: problem (got X); allowed: RANGE`` lines."""
    lines = []
    for e in err.errors(include_url=False):
        loc = _clean(tuple(e.get("loc", ())))
        name = ".".join(str(x) for x in (prefix, *loc) if x != "")
        msg = e.get("msg", "invalid value").removeprefix("Value error, ")
        owner, field = _owner(model, loc)
        allowed = None
        if e.get("type") == "extra_forbidden":
            owner, _ = _owner(model, loc[:-1] + ("",))
            allowed = ", ".join(sorted(owner.model_fields)) if owner is not None else None
            msg = "unknown key"
        elif e.get("type") != "value_error" and field is not None:  # value_error: a nested one-line message
            extra = field.json_schema_extra
            if isinstance(extra, dict) and "allowed" in extra:
                allowed = str(extra["allowed"])
        got = e.get("input")
        text = f"{name}: {msg}"
        if e.get("type") not in ("missing", "extra_forbidden", "value_error") and not isinstance(got, (dict, list)):
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
