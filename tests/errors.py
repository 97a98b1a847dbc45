"""Shared checks of guardfl's error contract: bad input is one line naming the field and the allowed range."""

import pytest

from guardfl.defenses import from_config
from guardfl.errors import ConfigError


def assert_config_error(kind: str, cfg: dict, field: str, allowed: str) -> None:
    """Building defense ``kind`` from ``cfg`` raises a one-line ConfigError naming ``field`` and ``allowed``."""
    with pytest.raises(ConfigError) as info:
        from_config({"kind": kind, **cfg})
    msg = str(info.value)
    assert field in msg and allowed in msg and "\n" not in msg
