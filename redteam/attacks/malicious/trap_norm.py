"""Trap weights through batch normalisation: the cut-offs in BatchNorm's affine parameters, and the
recovery that undoes BatchNorm's coupling of the batch (pure functions; ``trap_weights`` uses them).

A model ``Linear(d -> U) -> BatchNorm1d(U) -> ReLU -> Linear`` trains in train mode: unit i's
pre-activation is normalised with the batch's own statistics. With row i of the linear layer set to
``alpha_i m`` (one measurement direction ``m`` per chain), every row of a chain normalises ``s_n = <m, x_n>``
to the same standardised value ``t_n = (s_n - mean s) / std s`` (the linear bias cancels: it keeps its
honest value), and BatchNorm's affine ``h_in = gamma_i t_n + beta_i`` with ``beta_i = -gamma_i c_i`` makes
unit i fire for ``t_n > c_i``. The cut-offs ``c_i`` are quantiles of the standardised measurement (of the
attacker's auxiliary data, else of N(0, 1)): batch-relative, so they fit every batch.

The gradient no longer holds each bin alone: BatchNorm's backward pass gives the linear row
``dL/dw_i = (gamma_i / sigma_i) [sum_n g_in x_n - dbeta_i xbar - dgamma_i T]``, with ``g_in`` the
gradient into unit i's output (``D_n`` for the samples that fire it, 0 elsewhere), ``dbeta_i = sum_n g_in``
and ``dgamma_i = sum_n g_in t_n`` (BatchNorm's own parameter gradients, which the client sends),
``xbar`` the batch mean and ``T = mean_n t_n x_n``. For two adjacent rows whose difference holds one sample
n: ``d(sigma/gamma dL/dw) / d dbeta = x_n - xbar - t_n T`` with ``t_n = d dgamma / d dbeta`` read exactly.
``xbar`` and ``T`` are two images shared by every bin that the update does not determine (moving every
sample by ``a + t_n b`` changes no gradient); the attacker puts in their values on its auxiliary data
(without it: the input range's midpoint, and ``T = sd m`` for independent uniform pixels). ``sigma_i =
sqrt(alpha_i^2 var s + eps)`` needs the batch's variance of ``s``, likewise estimated. So the images come
back up to the batch's deviation from the auxiliary mean in those two terms: SSIM 0.9 and more on most
of a batch of 64 LFW faces, not bit-exact as without BatchNorm. Our construction, not a published one.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from guardfl.redteam.attacks.malicious.robbing_the_fed import candidates
from guardfl.redteam.attacks.malicious.trap_chain import Trap


def standardised(aux: Tensor | None, m: Tensor) -> Tensor | None:
    """The attacker's measurements ``<m, x>`` on its auxiliary images, standardised as BatchNorm does
    (population variance); None without two or more images."""
    if aux is None or aux.shape[0] < 2:
        return None
    s = aux.flatten(1).double() @ m
    return (s - s.mean()) / s.std(unbiased=False).clamp_min(1e-12)


def standard_cuts(t_aux: Tensor | None, q: Tensor, samples: int, first_below_all: bool) -> Tensor:
    """Increasing cut-offs of the standardised measurement at the quantiles ``q``: of ``t_aux``, else of
    N(0, 1). ``first_below_all``: the first one below any standardised value a batch of ``samples`` can take
    (``|t| <= sqrt(samples - 1)``)."""
    q = q.double()
    if t_aux is not None:
        cuts = torch.quantile(t_aux, q)
    else:
        cuts = torch.distributions.Normal(torch.tensor(0.0, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64)).icdf(q)
    if first_below_all:
        cuts = torch.cat([torch.tensor([-math.sqrt(max(samples - 1, 1)) - 1.0], dtype=torch.float64), cuts[1:]])
    return torch.cummax(cuts + torch.arange(len(cuts), dtype=torch.float64) * 1e-9, 0).values


def batch_terms(aux: Tensor | None, m: Tensor, input_range: tuple[float, float], d: int) -> tuple[Tensor, Tensor, float]:
    """The attacker's estimates of ``xbar``, ``T`` (flattened) and ``var s`` for direction ``m`` (see the
    module docstring): on its auxiliary images, else for pixels independent and uniform on the range."""
    if aux is not None and aux.shape[0] >= 2:
        a = aux.flatten(1).double()
        s = a @ m
        t = (s - s.mean()) / s.std(unbiased=False).clamp_min(1e-12)
        return a.mean(0), (t[:, None] * a).mean(0), float(s.var(unbiased=False))
    lo, hi = input_range
    sd = (hi - lo) / math.sqrt(12)
    return torch.full((d,), (lo + hi) / 2, dtype=torch.float64), sd * m / m.norm().clamp_min(1e-12), sd * sd * float(m @ m)


def bins(weight: Tensor, gamma_update: Tensor, beta_update: Tensor, alpha: Tensor, gamma: Tensor, eps: float,
         xbar: Tensor, t_term: Tensor, var_s: float) -> tuple[Tensor, Tensor]:
    """One chain's bins (rows in increasing cut-off order): each bin's image estimate (flattened, float64)
    and its mass ``d dbeta`` (adjacent rows' differences, the last row as it is). ``weight`` /
    ``gamma_update`` / ``beta_update``: the update of the chain's linear rows and BatchNorm parameters (a
    gradient, or a FedAvg delta: the ratios do not depend on its sign or scale); ``alpha`` / ``gamma``: the
    rows' scales and BatchNorm weights the server sent."""
    sigma = torch.sqrt(alpha.double() ** 2 * var_s + eps)
    g = weight.double() * (sigma / gamma.double())[:, None]
    dg = torch.cat([g[:-1] - g[1:], g[-1:]])
    db = torch.cat([beta_update[:-1] - beta_update[1:], beta_update[-1:]]).double()
    dgam = torch.cat([gamma_update[:-1] - gamma_update[1:], gamma_update[-1:]]).double()
    safe = torch.where(db.abs() > 0, db, torch.ones_like(db))
    t = dgam / safe
    images = dg / safe[:, None] + xbar[None, :] + t[:, None] * t_term[None, :]
    return images, db


def recover_through_norm(update: dict[str, Tensor], trap: Trap, eps: float, aux: Tensor | None, samples: int,
                         input_shape: tuple[int, ...], input_range: tuple[float, float], min_mass: float,
                         top_row: bool = True) -> tuple[Tensor, int]:
    """``trap_weights.recover`` for a trap behind a BatchNorm (``bins``: BatchNorm's coupling undone, the two
    batch-wide terms estimated on ``aux``)."""
    d = math.prod(input_shape)
    images, masses = [], []
    for rows, (m, alpha, gamma) in zip(trap.chains, trap.norm_chains):
        xbar, t_term, var_s = batch_terms(aux, m, input_range, d)
        image, mass = bins(update[trap.weight][rows], update[f"{trap.norm}.weight"][rows],
                           update[f"{trap.norm}.bias"][rows], alpha, gamma, eps, xbar, t_term, var_s)
        cut = None if top_row else -1
        images.append(image[:cut])
        masses.append(mass[:cut])
    mass = torch.cat(masses)
    return candidates(torch.cat(images) * mass[:, None], mass, input_shape, samples, input_range, min_mass)
