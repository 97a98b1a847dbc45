"""The cut-offs of a trap's measurement (``trap_weights``): equal-mass quantiles over the whole range, a
few at the top, or a few around the median; of the attacker's auxiliary measurements, else of a normal
approximation (inputs uniform on their range, or N(0, 1) once standardised by a BatchNorm)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from guardfl.redteam.attacks.malicious import trap_norm


def quantile_cuts(measure: Tensor | None, rows: int, input_range: tuple[float, float], direction: Tensor) -> Tensor:
    """``rows`` increasing cut-offs of ``<direction, x>``: equal-mass quantiles of the attacker's
    measurements ``measure`` (aux data), else of a Gaussian guess (inputs uniform in the range); the first
    one below any possible input."""
    q = torch.arange(1, rows, dtype=torch.float64) / rows
    if measure is not None and measure.numel() >= 2:
        inner = torch.quantile(measure.double(), q)
    else:
        lo, hi = input_range
        mean = (lo + hi) / 2 * float(direction.sum())
        std = (hi - lo) / math.sqrt(12) * float(direction.norm())
        inner = torch.distributions.Normal(torch.tensor(mean, dtype=torch.float64),
                                           torch.tensor(max(std, 1e-12), dtype=torch.float64)).icdf(q)
    bound = float(direction.abs().sum()) * max(abs(input_range[0]), abs(input_range[1])) + 1.0
    cuts = torch.cat([torch.tensor([-bound], dtype=torch.float64), inner])
    return torch.cummax(cuts + torch.arange(rows, dtype=torch.float64) * 1e-9, 0).values


def top_quantiles(rows: int, samples: int) -> Tensor:
    """``1 - (rows - j) / (samples + 1)``: each bin, and the top row, holds one of ``samples`` on average."""
    return 1 - torch.arange(rows, 0, -1, dtype=torch.float64) / (samples + 1)


def middle_quantiles(rows: int, samples: int) -> Tensor:
    """``0.5 + (j - (rows - 1) / 2) / (samples + 1)``: one of ``samples`` per bin, half of them above the lowest."""
    return (0.5 + (torch.arange(rows, dtype=torch.float64) - (rows - 1) / 2) / (samples + 1)).clamp(1e-6, 1 - 1e-6)


def _cuts_at(q: Tensor, measure: Tensor | None, input_range: tuple[float, float], direction: Tensor) -> Tensor:
    """Increasing cut-offs at the quantiles ``q`` of ``<direction, x>``: of the attacker's measurement
    ``measure`` when it has two values or more (tied quantiles nudged apart), else of the normal
    approximation for inputs uniform on ``input_range``."""
    if measure is not None and measure.numel() >= 2:
        return torch.cummax(torch.quantile(measure.double(), q) + torch.arange(len(q), dtype=torch.float64) * 1e-9, 0).values
    lo, hi = input_range
    mean = (lo + hi) / 2 * float(direction.sum())
    std = max((hi - lo) / math.sqrt(12) * float(direction.norm()), 1e-12)
    return torch.distributions.Normal(torch.tensor(mean, dtype=torch.float64), torch.tensor(std, dtype=torch.float64)).icdf(q)


def top_cuts(measure: Tensor | None, rows: int, samples: int, input_range: tuple[float, float], direction: Tensor) -> Tensor:
    """``rows`` increasing cut-offs at the top of ``<direction, x>``: quantiles ``1 - (rows - j) / (samples + 1)``,
    so that each bin, and the top row, holds one sample of a batch of ``samples`` on average."""
    return _cuts_at(top_quantiles(rows, samples), measure, input_range, direction)


def middle_cuts(measure: Tensor | None, rows: int, samples: int, input_range: tuple[float, float], direction: Tensor) -> Tensor:
    """``rows`` increasing cut-offs around the median of ``<direction, x>``: quantiles
    ``0.5 + (j - (rows - 1) / 2) / (samples + 1)``, so that each bin between two adjacent cuts holds one
    sample of a batch of ``samples`` on average and the lowest cut lets about half of the batch through."""
    return _cuts_at(middle_quantiles(rows, samples), measure, input_range, direction)


def cuts_for(measure: Tensor | None, k: int, rows: int | None, cuts: str, samples: int,
             input_range: tuple[float, float], m: Tensor) -> Tensor:
    """A chain's cut-offs of ``<m, x>``: quantiles of the whole range (``rows`` None), the top or the middle."""
    if rows is None:
        return quantile_cuts(measure, k, input_range, m)
    if cuts == "middle":
        return middle_cuts(measure, k, samples, input_range, m)
    return top_cuts(measure, k, samples, input_range, m)


def norm_cuts_for(t_aux: Tensor | None, k: int, rows: int | None, cuts: str, samples: int) -> Tensor:
    """The same cut-offs of the standardised measurement (through a BatchNorm: ``trap_norm``). A small
    trap's cuts sit at quantiles ``1 / (B + 1)`` apart, finer than a few dozen auxiliary images resolve:
    those come from N(0, 1), what a random projection of images is once standardised."""
    if rows is None:
        return trap_norm.standard_cuts(t_aux, torch.arange(k, dtype=torch.float64) / k, samples, True)
    q = middle_quantiles(k, samples) if cuts == "middle" else top_quantiles(k, samples)
    return trap_norm.standard_cuts(None, q, samples, False)
