"""Attacks by name: ``get(name, **budget)``; a new attack is one file plus one ``@register`` line."""

from __future__ import annotations

from typing import Any

from guardfl.errors import ConfigError

ATTACKS: dict[str, type] = {}


def register(cls: type) -> type:
    """Class decorator; a second attack under a name already taken is refused (one way to name an attack)."""
    if cls.name in ATTACKS and ATTACKS[cls.name] is not cls:
        raise ValueError(f"attack name {cls.name!r} registered twice ({ATTACKS[cls.name].__qualname__} and {cls.__qualname__})")
    ATTACKS[cls.name] = cls
    return cls


def get(name: str, **budget: Any):
    """The attack ``name`` with the given budget (iterations, restarts, weights...)."""
    if name not in ATTACKS:
        raise ConfigError(f"attack: unknown attack {name!r}; allowed: {', '.join(sorted(ATTACKS))}")
    return ATTACKS[name](**budget)


def available() -> list[str]:
    return sorted(ATTACKS)
