"""Refusing zero-strength settings: a defense that can never change the gradient is a configuration error.

``GradPrune(0)``, ``GaussianNoise(0)`` and the like would be accepted, report themselves and send the
gradient as it is. They are refused with one line naming the field, the allowed range and ``Identity()``,
the one deliberate undefended baseline.
"""

from __future__ import annotations

from typing import Any, Callable

#: The advice every zero-strength refusal ends with.
BASELINE_HINT = "for a deliberate undefended baseline use Identity() (kind: identity)"


def refuse_zero(allowed: str, effect: str) -> Callable[[Any, Any], Any]:
    """A pydantic (after-)validator for a strength field: refuse exactly 0. ``effect``: what 0 does, for
    the message (``"prunes nothing"``); ``allowed``: the field's range. Use as
    ``check = field_validator("ratio")(refuse_zero("(0, 1)", "prunes nothing"))``."""

    def check(cls, value: Any) -> Any:
        if value == 0:
            raise ValueError(f"must be > 0 (got {value!r}): 0 {effect}; allowed: {allowed}; {BASELINE_HINT}")
        return value

    return check


def never_changes(what: str, allowed: str) -> ValueError:
    """The refusal of a combination of settings that never changes the gradient (raise it from a model
    validator; the message is prefixed with the defense's kind)."""
    return ValueError(f"{what} never changes the gradient; allowed: {allowed}; {BASELINE_HINT}")
