"""Trap weights through a normalisation of each sample's own units: GroupNorm (what ``guardfl.dp_compatible``
and Opacus put in BatchNorm's place) and LayerNorm. Neither couples the samples of a batch, so the bins
stay exact once the normalisation's per-sample statistics are made (almost) the same for every sample:
some of the normalised units are constants spread far apart, whose spread sets the variance. Our
constructions, not published ones (``trap_weights`` uses them; ``trap_norm`` is the BatchNorm case).
"""

from __future__ import annotations

import copy
import math

import torch
from torch import Tensor, nn

from guardfl.redteam.attacks.malicious.trap_chain import Trap, chain_draw, columns, equal_rows
from guardfl.redteam.attacks.malicious.trap_cuts import cuts_for


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
#: against Outpost (``carried``): the constants' spread, smaller (the square of the weights' spread sets
#: Outpost's noise; the bins stay exact at 3: median error 2e-6 per pixel, measured through LayerNorm)
OUTPOST_SPREAD = 3.0


def carried(probe: Tensor) -> Tensor:
    """A direction whose product with the attacker's inputs is ~1 (their mean over its squared norm): the
    constants written into the weights, ``c <carrier, x>`` instead of a bias ``c``. Outpost adds noise of
    ``lambda Var(w)`` to each layer (the variance of its current values), so constants of 1e4 in a bias
    make the noise on the bias's update ~1e8 and drown every bin; in the weights they add ``c^2 / d^2``
    per entry. The constants then scale with each sample's ``<carrier, x>``: a common factor for all of a
    sample's units, which the bins' ratios cancel. Limit: inputs whose mean is far from 0 (images in
    [0, 1]); on centred inputs ``<carrier, x>`` is near 0 for some samples, whose bins then lose
    exactness (no other carrier is built)."""
    mean = probe.mean(0)
    return mean / max(float(mean @ mean), 1e-12)


def _constants(first: nn.Linear, rows: Tensor, values: Tensor, tiny: Tensor, carrier: Tensor | None) -> None:
    """Constant units: ``values`` in their biases (weights ``tiny``), or with ``carrier`` in their weights."""
    if carrier is None:
        first.weight[rows] = tiny.to(first.weight.dtype)
        first.bias[rows] = values.to(first.bias.dtype)
    else:
        first.weight[rows] = (values.double()[:, None] * carrier[None, :] + tiny.double()).to(first.weight.dtype)
        first.bias[rows] = 0.0


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
                 gen: torch.Generator, carrier: Tensor | None = None, equal: bool = False) -> tuple[Tensor, Tensor]:
    """Write one chain's groups (in cut-off order; see above): ``cut`` on ``<m, x>``, ``scale`` the
    GroupNorm weights of the measuring channels. Returns their units (rows of ``first``) and each row's
    slope ``gamma * d zhat / d z``, by which the recovery divides the row's update. ``carrier``: the
    constants in the weights instead of the biases, ``OUTPOST_SPREAD`` apart (``carried``). ``equal``
    (against FedAvg): every measuring row ``m`` (with a tiny random part) and every measuring channel's
    GroupNorm weight the chain's scale over its slope, so that each unit is ``scale (<m, x> - cut)`` and
    the rows' updates are not ~1e-4 of their weights (a FedAvg delta is a difference of float32 weights:
    at that ratio it keeps three digits, and the bins' differences none)."""
    size = norm.num_channels // norm.num_groups
    others_n = size - 1
    factor = GROUP_SPREAD if carrier is None else OUTPOST_SPREAD
    spread = factor * 2.0 * bound * torch.linspace(-1.0, 1.0, others_n, dtype=torch.float64)
    units, slopes = [], []
    row_norm = float(first.weight.detach().double().norm(dim=1).mean().clamp_min(1e-6))
    for j, g in enumerate(groups.tolist()):
        channels = torch.arange(g * size, (g + 1) * size)
        pick = int(torch.randint(size, (1,), generator=gen))
        unit, rest = int(channels[pick]), channels[torch.arange(size) != pick]
        alpha = float(torch.rand(1, generator=gen, dtype=torch.float64)) * 1.5 + 0.5
        others = spread[torch.randperm(others_n, generator=gen)]
        row = alpha * m
        if equal:  # drawn last: the random-scale groups are unchanged
            alpha = 1.0
            row = equal_rows(m, 1, 1.0, gen)[0]
        first.weight[unit] = row.to(first.weight.dtype)
        first.bias[unit] = 0.0
        tiny = 1e-3 * row_norm / math.sqrt(first.in_features) * torch.randn(others_n, first.in_features, generator=gen)
        _constants(first, rest, others, tiny, carrier)
        at = group_value(torch.tensor([alpha * float(cut[j])], dtype=torch.float64), others, norm.eps)[0]
        gamma = float(scale[j])
        if equal:
            gamma = float(scale.mean()) / group_slope(alpha * float(cut[j]), others, norm.eps)
        norm.weight[unit] = gamma
        norm.bias[unit] = float(-gamma * at) if bool(torch.isfinite(at)) else gamma * 10.0
        norm.weight[rest] = 0.5 / math.sqrt(size)
        norm.bias[rest] = -1.0
        units.append(unit)
        slopes.append(gamma * group_slope(alpha * float(cut[j]), others, norm.eps))
    return torch.tensor(units), torch.tensor(slopes, dtype=torch.float64)


def craft_grouped(model: nn.Module, layers, aux: Tensor | None, chains: int, column_noise: float,
                  input_range: tuple[float, float], gen: torch.Generator, rows: int | None, samples: int,
                  boost: float, cuts: str, outpost: bool = False, equal: bool = False) -> Trap:
    """``craft`` through GroupNorm: a chain's rows are groups, one measuring channel each
    (``write_groups``); the other groups keep their honest weights. ``outpost``: the constants in the
    weights (``carried``); ``equal``: adapted to FedAvg (``write_groups``)."""
    sent = copy.deepcopy(model)
    modules = dict(sent.named_modules())
    first, second, norm = modules[layers.first_name], modules[layers.second_name], modules[layers.norm_name]
    groups, d = norm.num_groups, first.in_features
    k = groups // chains if rows is None else min(rows, groups // chains)
    order = torch.randperm(groups, generator=gen)
    bound = math.sqrt(d) * max(abs(input_range[0]), abs(input_range[1])) + 1.0
    slopes = torch.ones(first.out_features, dtype=torch.float64)
    carrier = carried(_probe(aux, input_range, d, gen)) if outpost else None
    chain_rows = []
    with torch.no_grad():
        for c in range(chains):
            m, scale = chain_draw(d, k, rows, cuts, boost, gen)
            cut = cuts_for(None if aux is None else aux.flatten(1).double() @ m, k, rows, cuts, samples, input_range, m)
            units, slope = write_groups(first, norm, order[c * k:(c + 1) * k], m, cut, scale, bound, gen, carrier, equal)
            slopes[units] = slope
            columns(second, units, boost, column_noise, gen)
            chain_rows.append(units)
    return Trap(sent, chain_rows, f"{layers.first_name}.weight", f"{layers.first_name}.bias", layers.norm_name,
                None, slopes)


# -- through LayerNorm (an MLP block's normalisation: each sample over all of the layer's units) ---------------
# LayerNorm subtracts each sample's mean over the layer's units and divides by their standard deviation,
# so every unit's backward pass holds two terms shared by all of a sample's units: the mean of the gradient
# into the normalised units (``m_n``) and that gradient's projection on the normalised values (``q_n``):
# ``dL/dz_i = (gamma_i g_i - m_n - zhat_i q_n) / sigma_n``. Three choices make the bins exact again:
# - one unit in ``LAYER_CONSTANTS`` holds a constant (tiny random weights), spread symmetrically so far
#   apart that the layer's standard deviation is ``LAYER_SPREAD`` times any other unit's reach: ``sigma_n``
#   is the same for every sample and every other unit's normalised value ``zhat_i`` is ~0, so ``q_n``
#   (a sum of ``g_j zhat_j`` over the units that fire) is negligible;
# - a chain's rows are one row ``alpha m`` (each with a tiny random part, so that no two are equal): the
#   layer's mean ``<wbar, x> + bbar`` is linear in the input (LayerNorm reads the linear layer), so every
#   unit of the chain normalises the same measurement ``<alpha m - wbar, x>``, cut at its quantiles;
# - a chain's units share one LayerNorm weight, so ``m_n`` cancels in adjacent differences.
# That weight is ``sigma``, which undoes the normalisation (once LayerNorm's bias cuts it, the unit is the
# measurement minus its cut-off); the honest units' weights are scaled by ``sigma`` over the honest layer's
# own per-sample standard deviation (on the attacker's data), so that they compute what they did. The
# constants never fire (weight ``0.5 / sqrt(U)``, bias -1: ``|zhat| <= sqrt(U)``).

#: LayerNorm: one unit in this many is a constant (at least 2)
LAYER_CONSTANTS = 16
#: LayerNorm: the layer's standard deviation over the largest value any other unit can take
LAYER_SPREAD = 100.0


def _probe(aux: Tensor | None, input_range: tuple[float, float], d: int, gen: torch.Generator) -> Tensor:
    """The inputs the attacker expects (float64, flattened): its auxiliary images, else 256 uniform draws."""
    if aux is not None and aux.shape[0] >= 2:
        return aux.flatten(1).double()
    lo, hi = input_range
    return lo + (hi - lo) * torch.rand(256, d, generator=gen, dtype=torch.float64)


def _layer_sigma(first: nn.Linear, probe: Tensor, eps: float) -> float:
    """LayerNorm's per-sample standard deviation of ``first``'s units on the probe, averaged."""
    z = probe @ first.weight.detach().double().T + first.bias.detach().double()
    return float(torch.sqrt(z.var(1, unbiased=False) + eps).mean())


def _spread_constants(first: nn.Linear, constants: Tensor, others: Tensor, xmax: float, gen: torch.Generator,
                      carrier: Tensor | None = None) -> None:
    """The constant units, spread symmetrically so far apart that the layer's standard deviation is
    ``LAYER_SPREAD`` (with ``carrier``: ``OUTPOST_SPREAD``, in the weights) times the largest value any of
    the ``others`` can take."""
    w, b = first.weight.detach().double()[others], first.bias.detach().double()[others]
    reach = float(w.abs().sum(1).max()) * xmax + float(b.abs().max()) + 1.0
    spread = torch.linspace(-1.0, 1.0, len(constants), dtype=torch.float64)
    factor = LAYER_SPREAD if carrier is None else OUTPOST_SPREAD
    peak = factor * reach * math.sqrt(first.out_features / float((spread ** 2).sum()))
    row_norm = float(w.norm(dim=1).mean().clamp_min(1e-6))
    tiny = 1e-3 * row_norm / math.sqrt(first.in_features) * torch.randn(len(constants), first.in_features, generator=gen)
    _constants(first, constants, peak * spread[torch.randperm(len(constants), generator=gen)], tiny, carrier)


def craft_layer_norm(model: nn.Module, layers, aux: Tensor | None, chains: int, column_noise: float,
                     input_range: tuple[float, float], gen: torch.Generator, rows: int | None, samples: int,
                     boost: float, cuts: str, outpost: bool = False, equal: bool = True) -> Trap:
    """``craft`` through LayerNorm (above; a chain always shares one scale, ``equal`` or not): chains of measuring units, ``U // LAYER_CONSTANTS`` constants,
    the other units honest (their LayerNorm weights rescaled) or, for the whole layer, never firing. Every
    measuring unit's slope is ~1: the recovery is the plain one. ``outpost``: the constants in the weights
    (``carried``)."""
    sent = copy.deepcopy(model)
    modules = dict(sent.named_modules())
    first, second, norm = modules[layers.first_name], modules[layers.second_name], modules[layers.norm_name]
    units, d = first.out_features, first.in_features
    spread_n = max(2, units // LAYER_CONSTANTS)
    k = (units - spread_n) // chains if rows is None else min(rows, (units - spread_n) // chains)
    order = torch.randperm(units, generator=gen)
    constants, honest = order[:spread_n], order[spread_n + chains * k:]
    probe = _probe(aux, input_range, d, gen)
    honest_sigma = _layer_sigma(first, probe, norm.eps)
    xmax = max(abs(input_range[0]), abs(input_range[1]))
    chain_rows, directions = [], []
    with torch.no_grad():
        for c in range(chains):
            m, scale = chain_draw(d, k, rows, cuts, boost, gen)
            rows_w = equal_rows(m, k, float(scale.mean()), gen)
            chain = order[spread_n + c * k:spread_n + (c + 1) * k]
            first.weight[chain] = rows_w.to(first.weight.dtype)
            first.bias[chain] = 0.0
            columns(second, chain, boost, column_noise, gen)
            chain_rows.append(chain)
            directions.append(float(scale.mean()) * m)
        if rows is None:  # the left-over units: 0, never firing
            first.weight[honest] = 0.0
            first.bias[honest] = 0.0
        _spread_constants(first, constants, order[spread_n:], xmax, gen, carried(probe) if outpost else None)
        wbar, bbar = first.weight.detach().double().mean(0), float(first.bias.detach().double().mean())
        sigma = _layer_sigma(first, probe, norm.eps)
        for chain, direction in zip(chain_rows, directions):
            e = direction - wbar  # every unit of the chain normalises <e, x> - bbar
            cut = cuts_for(None if aux is None else probe @ e, k, rows, cuts, samples, input_range, e)
            norm.weight[chain] = sigma
            norm.bias[chain] = (-(cut - bbar)).to(norm.bias.dtype)
        if rows is None:
            norm.weight[honest], norm.bias[honest] = 0.5 / math.sqrt(units), -1.0
        else:
            norm.weight[honest] = norm.weight[honest] * (sigma / honest_sigma)
        norm.weight[constants], norm.bias[constants] = 0.5 / math.sqrt(units), -1.0
    return Trap(sent, chain_rows, f"{layers.first_name}.weight", f"{layers.first_name}.bias", layers.norm_name,
                None, torch.ones(units, dtype=torch.float64))


def through(norm: nn.Module, name: str, aux: bool) -> str:
    """The certificate's line on the normalisation the trap went through."""
    if isinstance(norm, nn.GroupNorm):
        return f"GroupNorm '{name}' (one measuring channel per group, the others spread constants; cut-offs in its affine bias)"
    if isinstance(norm, nn.LayerNorm):
        return (f"LayerNorm '{name}' (one unit in {LAYER_CONSTANTS} a spread constant; a chain's units normalise one "
                "measurement and share one weight, which undoes the normalisation; cut-offs in its bias)")
    return (f"BatchNorm1d '{name}' (cut-offs in its affine parameters; batch terms estimated "
            + ("on aux)" if aux else "for uniform pixels)"))
