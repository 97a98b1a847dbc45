"""Build any defense from a config: a dict, YAML text, a YAML file, or a config model.

The ``kind`` key selects the defense (a discriminated union over the registry), so a new defense is one
new file plus its ``@register`` line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from guardfl.config import validate
from guardfl.defenses.base import REGISTRY, Defense, DefenseConfig
from guardfl.errors import ConfigError
from guardfl.yamlio import load_yaml, parse_yaml


def _load(data: Any) -> Any:
    if isinstance(data, Path) or (isinstance(data, str) and "\n" not in data and data.endswith((".yaml", ".yml"))):
        if not Path(data).is_file():
            raise ConfigError(f"defense config file not found: {data}")
        data = load_yaml(data)  # duplicate keys, alias bombs, deep nesting, non-UTF-8, empty: one line
    elif isinstance(data, str):
        try:
            data = parse_yaml(data)
        except ConfigError as err:
            raise ConfigError(f"defense config: {err}") from None
    if isinstance(data, dict) and set(data) == {"defense"}:
        data = data["defense"]
    return data


def parse_config(data: Any) -> DefenseConfig:
    """Validate ``data`` into the config model of the defense its ``kind`` names."""
    if isinstance(data, DefenseConfig):
        return data
    data = _load(data)
    allowed = ", ".join(sorted(REGISTRY))
    if not isinstance(data, dict):
        raise ConfigError(f"defense: expected a mapping with a 'kind' key (got {type(data).__name__}); kinds: {allowed}")
    kind = data.get("kind")
    if not isinstance(kind, str) or kind not in REGISTRY:
        raise ConfigError(f"defense.kind: unknown kind {kind!r}; allowed: {allowed}")
    return validate(REGISTRY[kind].Config, data, prefix=kind)


def from_config(data: Any) -> Defense:
    """Build a defense from ``data``: a dict, YAML text, a ``.yaml`` path, or a config model (its ``kind``
    selects the defense; a bad value is a one-line ``ConfigError`` naming the key and the allowed range).

    >>> from guardfl.defenses import from_config
    >>> from_config({"kind": "gaussian", "sigma": 0.01, "clip": 1.0}).config.clip
    1.0
    >>> from_config("{kind: gradprune, ratio: 1.2}")
    Traceback (most recent call last):
    ...
    guardfl.errors.ConfigError: gradprune.ratio: Input should be less than 1 (got 1.2); allowed: (0, 1)
    """
    config = parse_config(data)
    return REGISTRY[config.kind].from_config(config)


def available() -> list[str]:
    """The registered defense kinds."""
    return sorted(REGISTRY)
