"""The isolation check's pairwise tests over every nested pair of rows of a layer (``guardfl.inspect_isolation``),
with no cap on how many pairs are examined.

Why no cap: until 2026-11-27 the tests examined the first 200,000 nested pairs in row order and reported
the rest as capped, while the layer passed. A server that has read this code fills the cap first: rows
of a few identical measurements near the bottom of one direction (a few hundred rows per level, each
firing for all but one, two, ... samples of the batch) make hundreds of thousands of nested pairs that
separate nothing, and the trap's rows, put last, are never compared. Measured (FC-2 with 1,024 units, 64
normalised CIFAR-10 images, 976 such rows in 5 levels and a 24-row trap after them): 209,675 nested pairs,
the pairwise count 0 with the cap and 11 without it. With the group test the layer was still refused (11
samples by groups of rows), but by chance: only where two of the trap's cuts held the same samples.

How it stays cheap: every pair's tests are bounded first from sums over the batch that are matrix
products of the whole layer (a block of rows at a time), and only the pairs whose bounds do not rule them
out are computed exactly, sample by sample, as before. For a nested pair ``(i, j)`` (``j``'s samples ``S``
all in ``i``'s, the extra samples ``h``), with ``a``, ``b`` the two rows' coefficients over the batch:

- the coefficient test's residual ``r = a_S - c b`` (least squares ``c = a_S . b / b . b``) has
  ``|r|_1 >= |r|_2`` and ``|r|_2^2 = a_S . a_S - (a_S . b)^2 / b . b``, while its lead, the smallest
  ``|a_h|``, is at most ``sqrt(sum_h a_h^2 / |h|)``;
- the read's contamination ``r^T G r`` (``G`` the inputs' Gram matrix) is at least
  ``2 a_S^T G a - a^T G a - 2 c a_S^T G b + c^2 b^T G b`` (dropping ``(a_h)^T G a_h >= 0``), while its lead,
  the smallest ``|a_h| |x_h|``, is at most ``sqrt(sum_h a_h^2 G_hh / |h|)``.

A pair whose lower bound exceeds its upper bound (with a margin for rounding) separates nothing; the rest
are tested exactly. Both are exact arithmetic on the client's batch: the screen changes the cost, never
the outcome (``tests/guardfl/test_inspect_pairs.py`` compares it with the exhaustive test).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

#: relative slack of the screen's bounds for rounding (sums of up to a few thousand float64 products)
SCREEN_SLACK = 1e-9
#: rows of the layer per block of the screen (block x units matrices)
_ROWS = 256
#: pairs per block of the exact tests
_PAIRS = 8192


def nested_blocks(support: Tensor, peel: int, rows: int = _ROWS) -> Iterator[tuple[int, Tensor]]:
    """``nested_pairs`` a block of ``rows`` rows ``i`` at a time: ``(start, pairs)``, the block's first row
    and its pairs as ``(i, j)``. The shared samples are a block x units matrix, never units x units (8,192
    units: 268 MB of float32 and twice that of differences at once; a block of 256 rows, 8 MB)."""
    s = support.float()
    size = s.sum(0)  # exact in float32 below 2**24
    for start in range(0, s.shape[1], rows):
        block = slice(start, start + rows)
        overlap = s[:, block].T @ s  # block x units: shared samples
        extra = size[block, None] - size[None, :]
        nested = (overlap == size[None, :]) & (extra >= 1) & (extra <= peel) & (size[None, :] >= 1)
        found = nested.nonzero()
        found[:, 0] += start
        yield start, found


def nested_pairs(support: Tensor, peel: int) -> Tensor:
    """``(i, j)`` pairs of units (rows), ``j``'s samples all among ``i``'s and at most ``peel`` more,
    ``j`` holding at least one sample. ``support``: batch x units."""
    return torch.cat([torch.zeros(0, 2, dtype=torch.long), *(found for _, found in nested_blocks(support, peel))])


def relative_read_error(e: Tensor, lead: Tensor, gram: Tensor) -> Tensor:
    """Per column of ``e`` (batch x k: the coefficients of everything but the read sample, which is
    ``lead`` = its coefficient times its input's norm), the relative error ``|sum_n e_n a_n| / lead``."""
    contamination = (e * (gram @ e)).sum(0).clamp_min(0.0).sqrt()
    return torch.where(lead > 0, contamination / lead.clamp_min(1e-300), torch.full_like(lead, float("inf")))


class _Screen:
    """The bounds of the module docstring for the nested pairs of one block of rows at a time (``near``):
    the per-unit sums shared by every block computed once. ``ds``: the coefficients, zero outside their
    support; ``sf``: the support as float64."""

    def __init__(self, ds: Tensor, sf: Tensor, gram: Tensor | None, norms: Tensor | None, tolerance: float,
                 read_error: float) -> None:
        self.ds, self.sf, self.gram, self.tolerance, self.read_error = ds, sf, gram, tolerance, read_error
        self.a2, self.outside = ds * ds, 1.0 - sf
        self.energy, self.size = self.a2.sum(0), sf.sum(0)  # b . b and the samples held, per unit
        if gram is not None:
            gd = gram @ ds
            self.quad, self.sgd, self.dgd = (ds * gd).sum(0), sf * gd, ds * gd  # a^T G a per unit
            self.weighted = self.a2 * norms.square()  # a_n^2 G_nn

    def near(self, start: int, pairs: Tensor) -> Tensor:
        """A mask over ``pairs`` (all with ``i`` in the block of ``_ROWS`` rows from ``start``) of those the
        bounds do not rule out."""
        ds, sf, energy, size = self.ds, self.sf, self.energy, self.size
        block = slice(start, start + _ROWS)
        i, j = pairs[:, 0], pairs[:, 1]
        li, count = i - start, size[i] - size[j]  # |h| >= 1
        ab = (ds[:, block].T @ ds)[li, j]  # a_S . b (b is zero outside S)
        shared = (self.a2[:, block].T @ sf)[li, j]  # a_S . a_S
        held = (self.a2[:, block].T @ self.outside)[li, j]  # sum_h a_h^2: positive terms, no cancellation
        residual = shared - ab * ab / energy[j]  # |r|_2^2
        near = ~(residual - SCREEN_SLACK * shared > self.tolerance ** 2 * held / count)  # NaN: tested exactly
        if self.gram is not None:
            c = ab / energy[j]
            t1 = (ds[:, block].T @ self.sgd)[li, j]  # a_S^T G b
            t2 = (self.dgd[:, block].T @ sf)[li, j]  # a_S^T G a
            low = 2 * t2 - self.quad[i] - 2 * c * t1 + c * c * self.quad[j]
            scale = 2 * t2.abs() + self.quad[i] + 2 * (c * t1).abs() + c * c * self.quad[j]
            lead = (self.weighted[:, block].T @ self.outside)[li, j] / count  # sum_h a_h^2 G_hh / |h|
            near |= ~(low - SCREEN_SLACK * scale > self.read_error ** 2 * lead)
        return near


def pair_sets(d: Tensor, support: Tensor, gram: Tensor | None, norms: Tensor | None, tolerance: float,
              read_error: float, peel: int, screen: bool = True) -> tuple[Tensor, dict[str, int]]:
    """The sample sets the nested pairs of rows separate (see ``isolated_samples``): (sets, batch), and
    counts (``nested_pairs``, ``separating_pairs``, ``screened_pairs``: those tested exactly). ``d``: batch
    x units coefficients (float64), ``support``: their non-zero pattern, ``gram`` / ``norms``: the layer
    inputs' Gram matrix and norms (batch x 1), or None. ``screen=False``: every pair tested exactly (the
    baseline of ``bench/bench_inspect_pairs.py``; the same outcome)."""
    n = d.shape[0]
    info = {"nested_pairs": 0, "separating_pairs": 0, "screened_pairs": 0}
    sf = support.double()
    bounds = None  # the screen's per-unit sums, made at the first block with pairs (most honest layers have none)
    kept = [torch.zeros(0, 2, dtype=torch.long)]
    for start, found in nested_blocks(support, peel):
        info["nested_pairs"] += found.shape[0]
        if screen and found.shape[0]:
            bounds = bounds or _Screen(d * sf, sf, gram, norms, tolerance, read_error)
            found = found[bounds.near(start, found)]
        kept.append(found)
    pairs = torch.cat(kept)
    info["screened_pairs"] = int(pairs.shape[0])
    if pairs.shape[0] == 0:
        return torch.zeros(0, n, dtype=torch.bool), info
    dt, st = d.T.contiguous(), support.T.contiguous()  # units x batch: rows gathered contiguously
    norm_row = None if norms is None else norms.flatten()
    inf = torch.tensor(float("inf"), dtype=d.dtype)
    sets = []
    for block in pairs.split(_PAIRS):
        di, dj, shared = dt[block[:, 0]], dt[block[:, 1]], st[block[:, 1]]
        dj = dj * shared
        c = (di * dj).sum(1) / (dj * dj).sum(1)
        residual = (di - c[:, None] * dj) * shared
        held = st[block[:, 0]] & ~shared  # pairs x batch: the samples the difference holds
        cancels = residual.abs().sum(1) <= tolerance * torch.where(held, di.abs(), inf).amin(1)
        if gram is not None:
            lead_read = torch.where(held, di.abs() * norm_row, inf).amin(1)
            cancels |= relative_read_error(residual.T, lead_read, gram) <= read_error
        info["separating_pairs"] += int(cancels.sum())
        sets.append(held[cancels])
    return torch.cat(sets), info


__all__ = ["SCREEN_SLACK", "nested_blocks", "nested_pairs", "pair_sets", "relative_read_error"]
