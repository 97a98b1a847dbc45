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


# -- through GroupNorm (what guardfl.dp_compatible / Opacus put in BatchNorm's place) --------------------------
# GroupNorm normalises each sample over the channels of a group, so a group is a measuring instrument of its
# own: one channel measures ``u_n = alpha <m, x_n>``, the group's other channels are constants spread far
# apart (``K`` times the measurement's range, symmetric around 0, tiny random weights so that no two rows
# are equal). Their spread sets the group's variance, so the measuring channel normalises to an almost
# linear function of ``u_n``, and GroupNorm's affine bias cuts it; the constants are never let fire
# (weight 0.5 / sqrt(size), bias -1). Nothing mixes samples: each group's row sends ``sum D_n s_a x_n``
# over the samples it fires for, ``s_a`` the slope of the normalised value (nearly the same for every
# sample), so rows divided by their slopes difference to single samples as without normalisation.

#: the constants' spread over the largest possible measurement
GROUP_SPREAD = 100.0


def group_value(u: Tensor, others: Tensor, eps: float) -> Tensor:
    """GroupNorm's normalised value of a group's first channel for measurements ``u`` (n,), the other
    channels holding ``others`` (float64)."""
    z = torch.cat([u.double()[:, None], others.double()[None, :].expand(len(u), -1)], 1)
    mu = z.mean(1, keepdim=True)
    var = z.var(1, unbiased=False, keepdim=True)
    return ((z - mu) / torch.sqrt(var + eps))[:, 0]


def group_slope(u: float, others: Tensor, eps: float) -> float:
    """``d group_value / d u`` at ``u``."""
    with torch.enable_grad():  # the crafting runs under no_grad
        point = torch.tensor([u], dtype=torch.float64, requires_grad=True)
        (slope,) = torch.autograd.grad(group_value(point, others, eps).sum(), point)
    return float(slope)


def write_groups(first, norm, groups: Tensor, m: Tensor, cut: Tensor, scale: Tensor, bound: float,
                 gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """Write one chain's groups (in cut-off order; see above): ``cut`` on ``<m, x>``, ``scale`` the
    GroupNorm weights of the measuring channels. Returns their units (rows of ``first``) and each row's
    slope ``gamma * d zhat / d z``, by which the recovery divides the row's update."""
    size = norm.num_channels // norm.num_groups
    others_n = size - 1
    spread = GROUP_SPREAD * 2.0 * bound * torch.linspace(-1.0, 1.0, others_n, dtype=torch.float64)
    units, slopes = [], []
    row_norm = float(first.weight.detach().double().norm(dim=1).mean().clamp_min(1e-6))
    for j, g in enumerate(groups.tolist()):
        channels = torch.arange(g * size, (g + 1) * size)
        pick = int(torch.randint(size, (1,), generator=gen))
        unit, rest = int(channels[pick]), channels[torch.arange(size) != pick]
        alpha = float(torch.rand(1, generator=gen, dtype=torch.float64)) * 1.5 + 0.5
        others = spread[torch.randperm(others_n, generator=gen)]
        first.weight[unit] = (alpha * m).to(first.weight.dtype)
        first.bias[unit] = 0.0
        first.weight[rest] = (1e-3 * row_norm / math.sqrt(first.in_features)
                              * torch.randn(others_n, first.in_features, generator=gen)).to(first.weight.dtype)
        first.bias[rest] = others.to(first.bias.dtype)
        at = group_value(torch.tensor([alpha * float(cut[j])], dtype=torch.float64), others, norm.eps)[0]
        gamma = float(scale[j])
        norm.weight[unit] = gamma
        norm.bias[unit] = float(-gamma * at) if bool(torch.isfinite(at)) else gamma * 10.0
        norm.weight[rest] = 0.5 / math.sqrt(size)
        norm.bias[rest] = -1.0
        units.append(unit)
        slopes.append(gamma * group_slope(alpha * float(cut[j]), others, norm.eps))
    return torch.tensor(units), torch.tensor(slopes, dtype=torch.float64)
