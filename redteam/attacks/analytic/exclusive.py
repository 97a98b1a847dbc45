"""The maths of reading exclusively activated units from a first linear layer's update (pure functions).

A first layer ``z = W x + b`` on the flattened input, straight into a ReLU, gets from a batch the update
``G = sum_n D_n x_n^T`` and ``g = sum_n D_n``, where ``D_n`` (one per unit) is sample n's share of the
loss's derivative with respect to ``z``: zero for every unit that does not fire for n. A unit that fires
for ONE sample alone holds that sample exactly: row ``G_i / g_i`` (Phong et al. 2017's single-sample
identity; Pan et al. 2022 call such units exclusively activated). The attacker checks a candidate without
the ground truth: run it through the model it knows, alone, with the label the unit's column of the next
layer's update shows, and compare its own ``D_i`` and its share of that column with the update (a mix of
several samples matches neither). A checked sample's whole share
``D x^T`` is then known and subtracted from every row (``peel``), which can leave rows that fired for it
and one other sample holding that other sample alone: the reading is repeated until nothing new checks.

Pruning (GradPrune, Outpost's prune): the zeroed entries of a row are missing, and bounded: an entry was
pruned because ``|D_i x_p|`` fell under the smallest entry kept (``t``), so ``|x_p| <= t / |g_i|``
(``pruned_bounds``; exact for a layer-scoped pruning, an upper bound for a global one, whose threshold is
at most the layer's smallest kept entry). ``inpaint`` fills them from their kept neighbours within that
interval.
"""

from __future__ import annotations

import torch
from torch import Tensor


def ratios(weight: Tensor, bias: Tensor, min_mass: float, scale: float | None = None) -> tuple[Tensor, Tensor]:
    """Rows whose bias entry carries at least ``min_mass`` of ``scale`` (default: the largest |bias|), and
    their candidates ``weight_i / bias_i`` (float64): ``(rows, candidates)``."""
    mass = bias.abs()
    top = float(mass.max()) if scale is None and mass.numel() else (scale or 0.0)
    if top <= 0:
        return torch.zeros(0, dtype=torch.long, device=bias.device), weight.new_zeros((0, weight.shape[1]), dtype=torch.float64)
    rows = torch.nonzero(mass > min_mass * top).flatten()
    return rows, weight[rows].double() / bias[rows, None].double()


def in_range(x: Tensor, input_range: tuple[float, float], slack: float) -> Tensor:
    """Per candidate (rows of ``x``): the fraction of its entries within the input range widened by
    ``slack`` of its width on both sides."""
    lo, hi = input_range
    pad = slack * (hi - lo)
    return ((x >= lo - pad) & (x <= hi + pad)).double().mean(1)


def disagreement(predicted: Tensor, observed: Tensor) -> Tensor:
    """Relative disagreement of vectors (last dimension; a scalar per row is a vector of one):
    ``|predicted - observed| / |observed|``, infinite where ``observed`` is zero."""
    return (predicted - observed).norm(dim=-1) / observed.norm(dim=-1)


def peel(weight: Tensor, bias: Tensor, shares: Tensor, samples: Tensor) -> tuple[Tensor, Tensor]:
    """The update with checked samples' shares removed: ``G - shares^T samples``, ``g - sum shares``
    (``shares``: (k, units), ``samples``: (k, d); float64)."""
    return weight - shares.T @ samples, bias - shares.sum(0)


def distinct(x: Tensor, tol: float, keep: Tensor | None = None) -> Tensor:
    """Indices of the rows of ``x`` (in order) not within ``tol`` (largest absolute difference) of an
    earlier kept row, nor of a row of ``keep``. Rows are compared only with those whose projection on a
    fixed positive direction ``u`` lies within ``tol * sum(u)`` of theirs (a necessary condition), found by
    sorting: near-linear in the rows for the candidates of a wide layer, not quadratic."""
    device = x.device
    x = x.detach().double().cpu()
    ref = keep.detach().double().cpu() if keep is not None and keep.numel() else x.new_zeros((0, x.shape[1]))
    if not x.shape[0]:
        return torch.zeros(0, dtype=torch.long, device=device)
    u = torch.linspace(1.0, 2.0, x.shape[1], dtype=torch.float64)
    bound = tol * float(u.sum())
    px, pr = x @ u, ref @ u
    order_x, order_r = torch.argsort(px), torch.argsort(pr)
    sx, sr = px[order_x], pr[order_r]
    kept = torch.zeros(x.shape[0], dtype=torch.bool)
    for i in range(x.shape[0]):
        lo, hi = float(px[i]) - bound, float(px[i]) + bound
        near = order_r[int(torch.searchsorted(sr, lo)):int(torch.searchsorted(sr, hi, right=True))]
        if near.numel() and float((ref[near] - x[i]).abs().amax(1).min()) <= tol:
            continue
        near = order_x[int(torch.searchsorted(sx, lo)):int(torch.searchsorted(sx, hi, right=True))]
        near = near[(near < i) & kept[near]]
        if near.numel() and float((x[near] - x[i]).abs().amax(1).min()) <= tol:
            continue
        kept[i] = True
    return torch.nonzero(kept).flatten().to(device)


def pruned_bounds(row: Tensor, bias: float, threshold: float, input_range: tuple[float, float]) -> tuple[Tensor, Tensor, Tensor]:
    """For one candidate row ``weight_i`` of a pruned update with its (kept) bias entry: which entries were
    pruned (exactly zero), and the interval each pruned input value lies in: ``|x_p| <= threshold / |bias|``
    intersected with the input range. Returns ``(missing, low, high)``."""
    lo, hi = input_range
    missing = row == 0
    bound = threshold / abs(bias)
    low = torch.full_like(row, max(lo, -bound), dtype=torch.float64)
    high = torch.full_like(row, min(hi, bound), dtype=torch.float64)
    return missing, low, high.clamp(min=low)


def inpaint(image: Tensor, missing: Tensor, low: Tensor, high: Tensor, iterations: int = 100) -> Tensor:
    """``image`` (C, H, W) with its ``missing`` entries filled by repeated averaging of their four
    neighbours, each kept within ``[low, high]`` (same shapes); known entries are left as they are. The
    missing entries start at their interval's middle."""
    x = image.clone()
    x[missing] = ((low + high) / 2)[missing]
    if image.dim() != 3 or not bool(missing.any()):
        return x
    for _ in range(iterations):
        padded = torch.nn.functional.pad(x[None], (1, 1, 1, 1), mode="replicate")[0]
        mean = (padded[:, :-2, 1:-1] + padded[:, 2:, 1:-1] + padded[:, 1:-1, :-2] + padded[:, 1:-1, 2:]) / 4
        x = torch.where(missing, torch.minimum(torch.maximum(mean, low), high), x)
    return x
