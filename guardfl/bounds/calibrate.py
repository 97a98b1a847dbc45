"""The least noise that proves a reconstruction bound: ``calibrate``, as Opacus's ``get_noise_multiplier``
finds the least noise multiplier for a target epsilon.

The bound falls as the noise grows (``tests/guardfl/bounds`` checks it), so the least noise with a bound at
most ``rero`` is found by doubling, then bisection, to a relative ``tolerance``; the answer is on the safe
side (the bound at the returned noise is at most ``rero``). Mechanisms:

- ``dpsgd``: the noise multiplier of DP-SGD at ``sample_rate`` and ``steps_per_round`` steps a round;
- ``gaussian``: the per-entry noise std ``sigma`` for an update clipped to ``clip`` (every step counted);
- ``laplace``: the per-entry Laplace scale for an update clipped to ``clip`` over ``dimension`` entries.

No noise proves a bound at or below kappa (the prior alone reaches it), so ``rero`` must exceed ``kappa``.

>>> z = calibrate(rero=0.2, kappa=0.1, rounds=16)  # DP-SGD, full batch, one step a round
>>> round(z, 2)
9.09
"""

from __future__ import annotations

import math

from guardfl.bounds.checks import check_count, check_kappa, check_positive, check_rate
from guardfl.bounds.mechanisms import Mechanism
from guardfl.bounds.rero import rero as rero_of
from guardfl.defenses.dpsgd import NOISE_MULTIPLIER_MAX
from guardfl.defenses.noise import NOISE_MAX
from guardfl.errors import ConfigError
from guardfl.integrations.budget import MAX_ROUNDS_LIMIT

MECHANISMS = ("dpsgd", "gaussian", "laplace")


def calibrate(rero: float, kappa: float, rounds: int, *, mechanism: str = "dpsgd", sample_rate: float = 1.0,
              steps_per_round: int = 1, clip: float | None = None, dimension: int | None = None,
              tolerance: float = 1e-3) -> float:
    """The least noise (``dpsgd``: noise multiplier; ``gaussian``: sigma; ``laplace``: scale) whose bound on
    reconstruction success over ``rounds`` rounds is at most ``rero`` for a prior of baseline ``kappa``.

    Parameters: ``rero`` the target bound in (kappa, 1); ``kappa`` in (0, 1); ``rounds`` the client's round
    budget; ``mechanism`` which noise is calibrated (``dpsgd``, ``gaussian`` or ``laplace``); ``sample_rate`` DP-SGD's Poisson rate (1 for the clipped-update mechanisms); ``steps_per_round``
    local steps a round; ``clip`` the update's clip (``gaussian``, ``laplace``); ``dimension`` the entries the
    Laplace noise covers; ``tolerance`` the relative precision of the answer."""
    kappa = check_kappa(kappa)
    if isinstance(rero, bool) or not isinstance(rero, (int, float)) or not kappa < rero < 1:
        raise ConfigError(f"rero: expected a bound in (kappa, 1) = ({kappa:g}, 1): no noise proves less than the "
                          f"prior's baseline (got {rero!r})")
    check_count(rounds, "rounds", 1, MAX_ROUNDS_LIMIT)
    check_count(steps_per_round, "steps_per_round")
    check_positive(tolerance, "tolerance")
    if mechanism not in MECHANISMS:
        raise ConfigError(f"mechanism: unknown {mechanism!r}; allowed: {', '.join(MECHANISMS)}")
    if mechanism == "dpsgd":
        q = check_rate(sample_rate, "sample_rate")
        return _least(lambda z: _gaussian(z, q, steps_per_round), rero, kappa, rounds, NOISE_MULTIPLIER_MAX,
                      "noise_multiplier", tolerance)
    if sample_rate != 1.0:
        raise ConfigError(f"sample_rate: {mechanism} claims no subsampling (every step counts); allowed: 1")
    clip = check_positive(clip, "clip") if clip is not None else None
    if clip is None:
        raise ConfigError(f"clip: {mechanism} noise proves nothing without a clip; allowed: finite, in (0, 1e6]")
    if mechanism == "gaussian":
        return _least(lambda s: _gaussian(s / clip, 1.0, steps_per_round), rero, kappa, rounds, NOISE_MAX, "sigma",
                      tolerance)
    check_count(dimension, "dimension") if dimension is not None else None
    if dimension is None:
        raise ConfigError("dimension: Laplace noise needs the number of entries it covers (an integer >= 1)")
    l1 = math.sqrt(dimension) * clip
    return _least(lambda b: _laplace(l1 / b, steps_per_round), rero, kappa, rounds, NOISE_MAX, "scale", tolerance)


def _gaussian(z: float, q: float, steps: int) -> Mechanism:
    return Mechanism(leaf="calibrate", noise="gaussian", sample_rate=q, steps_per_round=steps, reference="",
                     description="", noise_multiplier=z)


def _laplace(eps: float, steps: int) -> Mechanism:
    return Mechanism(leaf="calibrate", noise="laplace", sample_rate=1.0, steps_per_round=steps, reference="",
                     description="", epsilon=eps)


def _least(make, target: float, kappa: float, rounds: int, high: float, name: str, tolerance: float) -> float:
    """The least ``x`` in (0, ``high``] with ``rero(make(x)) <= target`` (the bound falls as ``x`` grows)."""
    ok = lambda x: rero_of(make(x), kappa, rounds) <= target  # noqa: E731
    hi = 1.0
    while not ok(hi):
        if hi >= high:
            raise ConfigError(f"rero: no {name} up to {high:g} proves {target:g} at kappa {kappa:g} over {rounds} "
                              f"round(s); allowed: a larger rero, or fewer rounds")
        hi = min(high, hi * 2)
    lo = hi / 2
    while ok(lo):
        hi, lo = lo, lo / 2
    while hi - lo > tolerance * hi:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi
