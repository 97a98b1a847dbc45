"""The argument checks every bound function shares: one line naming the parameter and its allowed range."""

from __future__ import annotations

import math

from guardfl.errors import ConfigError

KAPPA_RANGE = "a probability in (0, 1)"


def check_kappa(kappa: float, field: str = "kappa") -> float:
    """``kappa`` as a float in (0, 1), else ``ConfigError`` naming ``field``. 0 would mean a prior that never
    succeeds (no bound needed) and 1 one that always does (none possible)."""
    if isinstance(kappa, bool) or not isinstance(kappa, (int, float)) or not 0 < kappa < 1:
        raise ConfigError(f"{field}: expected {KAPPA_RANGE} (got {kappa!r})")
    return float(kappa)


def check_positive(value: float, field: str, what: str = "a finite number > 0") -> float:
    """``value`` as a finite float > 0, else ``ConfigError`` naming ``field`` (zero noise proves nothing)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{field}: expected {what} (got {value!r})")
    return float(value)


def check_rate(value: float, field: str) -> float:
    """A sample rate in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ConfigError(f"{field}: expected a sample rate in (0, 1] (got {value!r})")
    return float(value)


def check_count(value: int, field: str, low: int = 1, high: int | None = None) -> int:
    """An integer in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        span = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ConfigError(f"{field}: expected an integer {span} (got {value!r})")
    return value
