"""MixUp / InstaHide encoding maths (Huang et al. 2020, as evaluated in Huang et al. 2021, Sec. 4).

The k images of one mix are k DISTINCT images (``batch_partners``, ``public_partners``), so the bound
``max_coeff`` on each coefficient (``mixing_coefficients``) is a bound on the total weight of each
distinct image in an encoding.
"""

from __future__ import annotations

import torch
from torch import Tensor


#: rejection rounds before the remaining rows are shrunk toward uniform
MAX_REDRAWS = 20


def mixing_coefficients(n: int, k: int, max_coeff: float, generator: torch.Generator, device=None) -> Tensor:
    """``(n, k)`` non-negative coefficients, each row summing to 1 with every entry <= ``max_coeff``.

    As InstaHide's reference: |N(0, 1)| draws normalised per row, rows violating the bound redrawn
    (rejection sampling, from ``generator`` only). Needs ``1/k < max_coeff <= 1``. The bound is per
    coefficient, i.e. per slot of a mix: it bounds each image's weight because the k partners of a mix
    are distinct.

    Deviation: a bound close to 1/k makes rejection practically endless, so after ``MAX_REDRAWS`` rounds
    the remaining rows are shrunk toward the uniform row (1/k, ..., 1/k) just enough to meet the bound
    (still non-negative, still summing to 1). With InstaHide's k = 4, bound 0.65 this never happens.
    """
    if not 1.0 / k < max_coeff <= 1.0:
        raise ValueError(f"max_coeff must be in (1/k, 1] = ({1.0 / k:.4f}, 1] (got {max_coeff})")
    out = torch.empty(n, k, dtype=torch.float64)
    todo = torch.arange(n)
    for _ in range(MAX_REDRAWS):
        if not todo.numel():
            break
        draw = torch.randn(todo.numel(), k, generator=generator, dtype=torch.float64).abs()
        draw = draw / draw.sum(1, keepdim=True).clamp_min(1e-12)
        ok = draw.max(1).values <= max_coeff
        out[todo[ok]] = draw[ok]
        todo = todo[~ok]
    if todo.numel():
        draw = torch.randn(todo.numel(), k, generator=generator, dtype=torch.float64).abs()
        draw = draw / draw.sum(1, keepdim=True).clamp_min(1e-12)
        peak = draw.max(1, keepdim=True).values
        t = ((peak - max_coeff) / (peak - 1.0 / k)).clamp(0, 1)  # convex weight of the uniform row
        out[todo] = (1 - t) * draw + t / k
    return out.float().to(device) if device is not None else out.float()


def mix(images: Tensor, partners: Tensor, coeffs: Tensor) -> Tensor:
    """``sum_j coeffs[:, j] * images[partners[:, j]]``: ``partners`` and ``coeffs`` are ``(n, k)``.

    An image's total weight in a row is the sum of its coefficients in that row: only with partners
    distinct per row (``batch_partners``, ``public_partners``) is it one coefficient, so <= ``max_coeff``."""
    picked = images[partners]  # (n, k, C, H, W)
    shape = (*coeffs.shape, *([1] * (picked.dim() - 2)))
    return (picked * coeffs.reshape(shape).to(picked.dtype)).sum(1)


def sign_masks(shape: tuple[int, ...], generator: torch.Generator, device=None) -> Tensor:
    """Random {-1, +1} masks of ``shape`` (one fresh pattern per encoded image)."""
    bits = torch.randint(0, 2, shape, generator=generator, dtype=torch.int8)
    return (bits * 2 - 1).float().to(device) if device is not None else (bits * 2 - 1).float()


def distinct_draws(exclude: Tensor, count: int, pool_size: int, generator: torch.Generator) -> Tensor:
    """``(rows, count)`` indices into ``range(pool_size)``, distinct within each row and absent from that
    row of ``exclude`` (``(rows, e)``, entries distinct within a row): per row, a uniform random sample
    without replacement, in draw order, from ``generator`` only.

    Sequential draws, vectorised over rows: draw ``r`` uniform among the ``pool_size - taken`` free indices
    and map it to the ``r``-th free one by stepping past the taken ones (sorted). O(rows * count * (e + count))
    time and O(rows * (e + count)) memory, whatever ``pool_size``. Needs ``e + count <= pool_size``.
    """
    rows, taken = exclude.shape[0], exclude.long().sort(1).values
    if taken.shape[1] + count > pool_size:
        raise ValueError(f"cannot draw {count} distinct indices per row from a pool of {pool_size} with "
                         f"{taken.shape[1]} excluded")
    picks = []
    for _ in range(count):
        v = torch.randint(0, pool_size - taken.shape[1], (rows,), generator=generator)
        for c in range(taken.shape[1]):
            v = v + (v >= taken[:, c]).long()
        picks.append(v)
        taken = torch.cat([taken, v[:, None]], 1).sort(1).values
    return torch.stack(picks, 1) if picks else torch.empty(rows, 0, dtype=torch.long)


def batch_partners(n: int, k: int, generator: torch.Generator) -> Tensor:
    """``(n, k)`` indices into the batch (InstaHide's intra mixing): column 0 is the image itself, columns
    1..k-1 are k-1 DISTINCT other images of the batch, drawn uniformly without replacement per row. So a
    bound on each coefficient bounds the total weight of each distinct image. Needs ``2 <= k <= n``.

    Distinct indices, not distinct contents: a batch holding the same sample twice (a sampler with
    replacement) can still mix it twice."""
    if not 2 <= k <= n:
        raise ValueError(f"k={k} images per mix needs a batch of at least k distinct images (got {n}); allowed: 2 <= k <= n")
    own = torch.arange(n)[:, None]
    return torch.cat([own, distinct_draws(own, k - 1, n, generator)], 1)


def public_partners(n: int, k: int, pool_size: int, generator: torch.Generator) -> Tensor:
    """``(n, k - 1)`` indices into a public set of ``pool_size`` images (InstaHide's inter mixing): per
    row, k-1 DISTINCT public images drawn uniformly without replacement. Needs ``k - 1 <= pool_size``."""
    if not 2 <= k <= pool_size + 1:
        raise ValueError(f"k={k} images per mix needs at least k-1 = {k - 1} public images (got {pool_size})")
    return distinct_draws(torch.empty(n, 0, dtype=torch.long), k - 1, pool_size, generator)
