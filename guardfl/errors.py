"""Exceptions guardfl raises on bad input.

Every message names the offending field (or parameter) and, where there is one, the allowed range,
so that a user sees one clear line instead of a deep traceback.
"""

from __future__ import annotations


class GuardflError(Exception):
    """Base class of guardfl's own errors."""


class ConfigError(GuardflError, ValueError):
    """A configuration value is invalid (unknown kind, field out of range, unknown key)."""


class NonFiniteGradientError(GuardflError, FloatingPointError):
    """A gradient handed to a defense holds NaN or infinite entries."""


class UndefendedUpdateError(GuardflError, ValueError):
    """Part of an update cannot be defended (an integer, boolean or complex array that training changed, a
    changed buffer no gradient defense reaches): the update is refused rather than sent undefended."""


class UnsupportedOptimizerError(GuardflError, TypeError):
    """The optimizer cannot be guarded (for example it re-evaluates gradients inside step())."""


class MaliciousModelError(GuardflError):
    """A received global model carries the signature of a malicious-server attack (``guardfl.inspect_model``
    with ``strict=True``); ``reasons`` lists what was found, one sentence each."""

    def __init__(self, reasons: list[str] | str) -> None:
        self.reasons = [reasons] if isinstance(reasons, str) else list(reasons)
        super().__init__("the received model was refused: " + "; ".join(self.reasons))


class RoundBudgetError(GuardflError):
    """The client's round budget (``max_rounds`` in the integrations) is spent: it has answered that many
    rounds and answers no more, whatever model it receives (``guardfl.integrations.budget``)."""


class StateFileError(ConfigError):
    """A client's state file (``GuardedTrainer(state_path=)``, a round budget's ``budget_path``) is lost,
    unreadable, cut short, in use by another process or written by another configuration or format: refused,
    naming the file, rather than read as round 0 (which would reset the round budget and the privacy
    accountant; ``guardfl.integrations.statefile``)."""
