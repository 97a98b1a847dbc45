"""Exact order statistics for gradient pruning.

``kth_smallest`` returns exactly what ``torch.kthvalue`` returns, but faster on large tensors: it sorts a
small strided sample to find a bracket [lo, hi] that contains the k-th value with high probability,
counts the entries below ``lo``, and runs ``kthvalue`` only on the few entries inside the bracket. When
the bracket misses (an adversarially ordered tensor, say), it falls back to a full ``kthvalue``, so the
answer is always exact; only the speed depends on the sample.
"""

from __future__ import annotations

import math
from fractions import Fraction

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
    """Number of entries a pruning ``ratio`` removes from ``numel`` entries: ``floor(ratio * numel)``."""
    return math.floor(_fraction_of(ratio, numel))


def cover_count(ratio: float, numel: int) -> int:
    """Number of entries a ``ratio`` of ``numel`` covers, rounded up: ``ceil(ratio * numel)``.

    Used for the entries that receive noise, so that any ratio > 0 reaches at least one entry of every
    non-empty layer (a small layer, such as a 10-class bias that reveals labels, is never left out).
    """
    return math.ceil(_fraction_of(ratio, numel))


def kth_smallest(values: Tensor, k: int) -> Tensor:
    """The k-th smallest entry (1-based) of a 1-D tensor, exactly as ``values.kthvalue(k).values``."""
    n = values.numel()
    if values.dim() != 1:
        raise ValueError("kth_smallest expects a 1-D tensor")
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, {n}] (got {k})")
    if n <= DIRECT_SELECTION_MAX:
        return values.kthvalue(k).values
    stride = n // SAMPLE_SIZE
    sample = values[stride // 2 :: stride].sort().values
    s = sample.numel()
    q = k / n
    margin = 4.0 * math.sqrt(q * (1.0 - q) / s) + 2.0 / s
    lo_i = math.floor((q - margin) * s)
    hi_i = math.ceil((q + margin) * s)
    inside = None
    below = 0
    if lo_i >= 0:
        lo = sample[lo_i]
        below = int(torch.count_nonzero(values < lo))
        inside = values >= lo
    if hi_i < s:
        upper = values <= sample[hi_i]
        inside = upper if inside is None else inside.logical_and_(upper)
    candidates = values if inside is None else values[inside]
    if below < k <= below + candidates.numel():
        return candidates.kthvalue(k - below).values
    return values.kthvalue(k).values  # the bracket missed: exact fallback


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
    threshold = kth_smallest(flat, k)
    mask = flat <= threshold
    if int(torch.count_nonzero(mask)) != k:  # ties at the threshold: keep only the first ones
        mask = flat < threshold
        need = k - int(torch.count_nonzero(mask))
        ties = (flat == threshold).nonzero().squeeze(1)[:need]
        mask[ties] = True
    return mask.reshape(values.shape)
