"""Exact order statistics for gradient pruning.

``kth_smallest`` returns exactly what ``torch.kthvalue`` returns, but faster on large tensors: it sorts a
small scattered sample to find a bracket [lo, hi] that contains the k-th value with high probability,
counts the entries below ``lo``, and runs ``kthvalue`` only on the few entries inside the bracket. When
the bracket misses (an adversarially ordered tensor, say), it falls back to a full ``kthvalue``, so the
answer is always exact; only the speed depends on the sample.
"""

from __future__ import annotations

import math
from fractions import Fraction
from functools import lru_cache

import torch
from torch import Tensor

#: Below this many entries a plain ``kthvalue`` is as fast as the bracket.
DIRECT_SELECTION_MAX = 1 << 15
#: Size of the strided sample used to bracket the k-th value.
SAMPLE_SIZE = 4096


def _fraction_of(ratio: float, numel: int) -> Fraction:
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ratio must be in [0, 1] (got {ratio!r})")
    # the decimal value of ratio: 0.29 * 100 is 29, not 28.999999999999996
    return Fraction(repr(float(ratio))) * numel


def prune_count(ratio: float, numel: int) -> int:
    """Number of entries a pruning ``ratio`` removes from ``numel`` entries: ``ceil(ratio * (numel - 1))``.

    This is the count of entries strictly below the ``ratio``-quantile (linear interpolation, as
    ``torch.quantile`` and ``np.percentile``) when the magnitudes are distinct: the rule of the public code
    of GradPrune (Huang et al. 2021, GradAttack: ``|g| < quantile(|g|, ratio)``), Outpost (plato:
    ``np.percentile(|g|, rho)``) and Soteria (``np.percentile`` of its feature scores), made exact (ties are
    broken by position instead of pruning fewer). For ``ratio < 1`` it is ``floor(ratio * numel)`` or one more, so large
    layers see the paper's fraction; and any ``ratio > 0`` prunes at least one entry of every layer of two
    or more entries (``floor`` left every layer under ``1 / ratio`` entries untouched). A one-entry layer
    is never pruned by a ratio below 1 (the quantile of one value is that value).
    """
    if numel <= 0:
        _fraction_of(ratio, 0)  # still validate the ratio
        return 0
    return math.ceil(_fraction_of(ratio, numel - 1))


def cover_count(ratio: float, numel: int) -> int:
    """Number of entries a ``ratio`` of ``numel`` covers, rounded up: ``ceil(ratio * numel)``.

    Used for the entries that receive noise, so that any ratio > 0 reaches at least one entry of every
    non-empty layer (a small layer, such as a 10-class bias that reveals labels, is never left out).
    """
    return math.ceil(_fraction_of(ratio, numel))


@lru_cache(maxsize=256)
def _sample_index(n: int, s: int, device: torch.device) -> Tensor:
    """``s`` positions spread over ``range(n)`` by the golden-ratio sequence.

    Not a stride: gradients of conv kernels are periodic (a 3x3 conv on a 1x1 feature map has gradient
    only at the centre tap), and a fixed stride can land on the same tap every time.
    """
    golden = (math.sqrt(5.0) - 1.0) / 2.0
    i = torch.arange(s, dtype=torch.float64)
    return ((i * golden) % 1.0 * n).long().clamp_(max=n - 1).to(device)


def kth_smallest(values: Tensor, k: int) -> Tensor:
    """The k-th smallest entry (1-based) of a 1-D tensor, exactly as ``values.kthvalue(k).values``."""
    return _kth_smallest(values, k)[0]


def _kth_smallest(values: Tensor, k: int) -> tuple[Tensor, bool]:
    """``(value, unique)``: the k-th smallest entry, and True when no other entry equals it (then
    exactly k entries are ``<= value``); False means "unknown"."""
    n = values.numel()
    if values.dim() != 1:
        raise ValueError("kth_smallest expects a 1-D tensor")
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, {n}] (got {k})")
    if n <= DIRECT_SELECTION_MAX:
        return values.kthvalue(k).values, False
    s = SAMPLE_SIZE
    sample = values[_sample_index(n, s, values.device)].sort().values
    q = k / n
    margin = 4.0 * math.sqrt(q * (1.0 - q) / s) + 2.0 / s
    lo_i, hi_i = math.floor((q - margin) * s), math.ceil((q + margin) * s)
    lo = sample[lo_i] if lo_i >= 0 else None
    hi = sample[hi_i] if hi_i < s else None
    # Walk up the bracket: [<= lo] [lo < .. < hi] [== hi]. Ties (say, a layer that is 90% exact
    # zeros) are counted, not selected, so they cost one comparison pass.
    rank = 0  # entries known to be below the candidates
    if lo is not None:
        inside = values > lo
        rank = n - int(torch.count_nonzero(inside))  # entries <= lo
        if k <= rank:
            below = int(torch.count_nonzero(values < lo))
            return (lo, False) if k > below else (values.kthvalue(k).values, False)  # lo's ties, or a miss
        if hi is not None:
            inside.logical_and_(values < hi)
    else:
        inside = values < hi
    candidates = values[inside]
    if k <= rank + candidates.numel():
        value = candidates.kthvalue(k - rank).values
        # every entry equal to value lies strictly inside (lo, hi), so counting candidates is enough
        return value, int(torch.count_nonzero(candidates == value)) == 1
    rank += candidates.numel()
    if hi is not None and k <= rank + int(torch.count_nonzero(values == hi)):
        return hi, False
    return values.kthvalue(k).values, False  # the bracket missed: exact fallback


def smallest_k_mask(values: Tensor, k: int) -> Tensor:
    """Boolean mask (same shape as ``values``) marking exactly ``k`` entries with the smallest values.

    Ties at the threshold are broken by position (lower flat index first), so the count is always
    exactly ``k``, even for tensors full of equal values (for example all-zero gradients).
    """
    flat = values.reshape(-1)
    n = flat.numel()
    if not 0 <= k <= n:
        raise ValueError(f"k must be in [0, {n}] (got {k})")
    if k == 0:
        return torch.zeros_like(values, dtype=torch.bool)
    if k == n:
        return torch.ones_like(values, dtype=torch.bool)
    return mask_below(values, k, *_kth_smallest(flat, k))


def mask_below(values: Tensor, k: int, threshold: Tensor, unique: bool = False) -> Tensor:
    """The mask of ``smallest_k_mask(values, k)``, given its ``threshold = kth_smallest(values, k)``.
    ``unique=True`` promises that no other entry equals the threshold (skips the count)."""
    flat = values.reshape(-1)
    mask = flat <= threshold
    if not unique and int(torch.count_nonzero(mask)) != k:  # ties at the threshold: keep the first ones
        mask = flat < threshold
        need = k - int(torch.count_nonzero(mask))
        ties = (flat == threshold).nonzero().squeeze(1)[:need]
        mask[ties] = True
    return mask.reshape(values.shape)


def largest_k_mask(values: Tensor, m: int) -> Tensor:
    """Boolean mask marking exactly ``m`` entries with the largest values: the complement of
    ``smallest_k_mask(values, n - m)`` (ties broken by position, higher flat index first)."""
    n = values.numel()
    if not 0 <= m <= n:
        raise ValueError(f"m must be in [0, {n}] (got {m})")
    if m == 0 or m == n:
        return smallest_k_mask(values, n - m).logical_not_()
    threshold, unique = _kth_smallest(values.reshape(-1), n - m)
    if unique:  # exactly n - m entries are <= threshold
        return values > threshold
    return mask_below(values, n - m, threshold).logical_not_()


def zero_smallest_(x: Tensor, k: int, magnitude: Tensor | None = None) -> int:
    """Zero, in place, the ``k`` entries of ``x`` with the smallest |x| (ties broken by position).
    Returns how many entries this changed: the ``k`` less those that were already zero.

    ``magnitude``: ``x.abs()`` if the caller already has it. When the k-th magnitude is unique the
    zeroing is one fused ``hardshrink`` pass; when it is 0 the k smallest are already zero.
    """
    if k == 0:
        return 0
    magnitude = x.abs() if magnitude is None else magnitude
    threshold, unique = _kth_smallest(magnitude.reshape(-1), k)
    if threshold == 0:  # the k smallest are already zero: zeroing them changes nothing
        return 0
    # threshold > 0, so every zero entry is among the k smallest: k minus the zeros is what changes
    changed = k - (x.numel() - int(torch.count_nonzero(x)))
    if unique:  # exactly k entries have |x| <= threshold
        torch.ops.aten.hardshrink.out(x, float(threshold), out=x)
    else:
        x.masked_fill_(mask_below(magnitude, k, threshold), 0)
    return changed


def smallest_k_mask_rows(values: Tensor, k: int) -> Tensor:
    """``smallest_k_mask`` of each row of ``values`` ``(N, n)`` at once: exactly ``k`` entries per row,
    ties broken by position (lower index first). One ``kthvalue`` per row (linear time), then the entries
    below it and the first of those equal to it (a running count of the ties)."""
    if values.dim() != 2:
        raise ValueError(f"smallest_k_mask_rows expects (N, n) values (got shape {tuple(values.shape)})")
    n = values.shape[1]
    if not 0 <= k <= n:
        raise ValueError(f"k must be in [0, {n}] (got {k})")
    mask = torch.zeros_like(values, dtype=torch.bool)
    if k == n:
        return mask.fill_(True)
    if k == 0:
        return mask
    threshold = values.kthvalue(k, dim=1, keepdim=True).values
    torch.lt(values, threshold, out=mask)
    need = k - mask.sum(1, keepdim=True)  # how many of the ties at the threshold each row still takes
    ties = values == threshold
    return mask.logical_or_(ties.logical_and_(ties.cumsum(1) <= need))


def largest_k_mask_rows(values: Tensor, m: int) -> Tensor:
    """``largest_k_mask`` of each row: the complement of ``smallest_k_mask_rows(values, n - m)``."""
    n = values.shape[1] if values.dim() == 2 else 0
    if not 0 <= m <= n:
        raise ValueError(f"m must be in [0, {n}] (got {m})")
    return smallest_k_mask_rows(values, n - m).logical_not_()
