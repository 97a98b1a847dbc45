"""The inspection's measured false-positive rates: each check's threshold next to how often it refused an
honest model (issue 66).

``FALSE_POSITIVES`` is the measurement of ``bench/bench_inspect_zoo.py`` on the benign zoo
(``tests/benign_zoo.py``: honestly trained models across the red team's architectures, optimizers,
learning rates, lengths, FedAvg rounds over non-IID clients and the degenerate-but-honest cases), at the
default thresholds, as a deployed client inspects (the received state against its own model, its first
batch). Per check: the models it examined, those it refused, the rate and its exact (Clopper-Pearson)
one-sided 95% upper bound, and the threshold it was measured at. The certificate and the report show
them beside each check a client runs (``rates_for``); ``tests/guardfl/test_inspect_rates.py`` checks that
the bound agrees with an independent computation and a simulation.

``check_of(reason)``: the check an ``Inspection`` reason comes from (its prefix).
"""

from __future__ import annotations

from typing import Any

#: reason prefix -> check (``Inspection.reasons`` start with the check's name)
_PREFIXES = {"architecture": "architecture", "imprint": "imprint", "parallel rows": "parallel_rows",
             "class fishing": "class_fishing", "gradient concentration": "gradient_concentration",
             "isolation": "isolation", "shared columns": "shared_columns", "disaggregation": "disaggregation",
             "leak limit": "leak_limit", "non-finite": "tensors", "unusable": "tensors", "batch": "batch"}


def check_of(reason: str) -> str:
    """The check a reason of ``inspect_model`` comes from (``"other"`` for an unknown prefix)."""
    head = reason.split(":", 1)[0].strip()
    return _PREFIXES.get(head, "other")


def upper_bound(k: int, n: int, confidence: float = 0.95) -> float:
    """Clopper-Pearson one-sided upper bound on a rate from ``k`` events in ``n`` trials (1.0 when n is 0)."""
    if n <= 0:
        return 1.0
    if k >= n:
        return 1.0
    from scipy.stats import beta

    return float(beta.ppf(confidence, k + 1, n - k))


#: measured on the benign zoo (see the module docstring); filled from bench/bench_inspect_zoo.py --json
FALSE_POSITIVES: dict[str, dict[str, Any]] = {}
#: what the table was measured on
ZOO = {"script": "bench/bench_inspect_zoo.py", "zoo": "tests/benign_zoo.py", "models": 0, "date": None}


def rates_for(checks: list[str] | tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """The measured rate of each of ``checks`` (those measured), for a certificate or a report."""
    return {c: dict(FALSE_POSITIVES[c], zoo=ZOO["zoo"], script=ZOO["script"]) for c in checks if c in FALSE_POSITIVES}


__all__ = ["FALSE_POSITIVES", "ZOO", "check_of", "rates_for", "upper_bound"]
