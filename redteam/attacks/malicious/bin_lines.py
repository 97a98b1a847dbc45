"""Bins read as lines, and lines met across directions: ``threshold_bins``' exact reads past a client that
limits what each difference of two of its updates reads (``guardfl.inspect_history``; issue 34).

A bin between two accepted thresholds holds a few samples (the client refuses the thresholds that would
leave one alone). Unit ``u`` of the difference of the two first-layer updates is ``sum_n c_nu [x_n; 1]``,
so its weight difference over its bias difference is a point of the affine hull of the bin's samples. When
the samples' coefficients differ from unit to unit (each leaves a different class when it switches: the
classifier's other rows spread, ``threshold_bins spread``), the points span that hull: a line through two
samples, a plane through three. Two bins of different directions that share exactly one sample have hulls
that meet in that sample, exactly (four updates combined, past the pairs the client's history examined until it
met its views too: ``guardfl.inspect_meets``; a line two bins share, cut by a third, is ``crossings``' depth 2).

Pure functions over the attacker's own view (the updates it received), no ground truth.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: a unit's bias difference below this share of the bin's largest is no point (its ratio is noise)
BIAS_SHARE = 1e-3
#: a direction of the hull is kept above this share of the points' largest norm (float32 updates' noise)
RANK_TOLERANCE = 1e-4
#: a bin's hull has at most this many dimensions (bins of up to this many + 1 samples)
MAX_RANK = 8
#: two hulls meet in one point when the smallest singular value of their joint basis is above this share
#: of the largest (else they are near parallel: a line, not a point) ...
CONDITION = 1e-2
#: ... and the gap between them there is below this share of the point's norm
RESIDUAL = 1e-3


def bin_hull(w0: Tensor, b0: Tensor, w1: Tensor, b1: Tensor) -> tuple[Tensor, Tensor] | None:
    """The affine hull of a bin's samples from two consecutive updates of the first layer: a point on it
    and an orthonormal basis of its directions (features x rank, rank 0 for a bin whose samples share one
    coefficient profile: their weighted mean only); None for an empty bin."""
    dw, db = (w1 - w0).double(), (b1 - b0).double()
    if not bool(torch.isfinite(dw).all() and torch.isfinite(db).all()) or float(db.abs().max()) == 0.0:
        return None
    keep = db.abs() > BIAS_SHARE * db.abs().max()
    points = dw[keep] / db[keep, None]
    centre = points.mean(0)
    if points.shape[0] < 2:
        return centre, points.new_zeros(points.shape[1], 0)
    _, s, vh = torch.linalg.svd(points - centre, full_matrices=False)
    rank = min(int((s > RANK_TOLERANCE * points.norm(dim=1).max()).sum()), MAX_RANK)
    return centre, vh[:rank].T


def _common(a: tuple[Tensor, Tensor], b: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor] | None:
    """Two hulls' joint basis (both bases side by side): its singular values and right singular vectors, and
    the least-squares point of the first closest to the second; None when either has no basis or the gap
    between them there is above ``RESIDUAL``."""
    (pa, ua), (pb, ub) = a, b
    if ua.shape[1] == 0 or ub.shape[1] == 0:
        return None
    joint = torch.cat([ua, -ub], 1)
    _, s, vh = torch.linalg.svd(joint, full_matrices=False)  # vh: (both ranks) square, the joint basis being tall
    gap = (pb - pa)[:, None]
    sol = torch.linalg.lstsq(joint, gap).solution
    point = pa + ua @ sol[: ua.shape[1], 0]
    if float((joint @ sol - gap).norm()) > RESIDUAL * float(point.norm()):
        return None
    return s, vh, point


def meet(a: tuple[Tensor, Tensor], b: tuple[Tensor, Tensor]) -> Tensor | None:
    """The one point where two hulls meet (least squares over both bases), or None: no basis on either side,
    near-parallel bases (they share more than a point), or a gap between them above ``RESIDUAL``."""
    common = _common(a, b)
    if common is None or float(common[0][-1]) < CONDITION * float(common[0][0]):
        return None
    return common[2]


def box_ends(hull: tuple[Tensor, Tensor], lo: float, hi: float) -> list[Tensor]:
    """The two ends of a line hull inside the box of valid inputs ``[lo, hi]`` (the attacker knows the input
    range): the line through a bin's two samples leaves the box where the first pixel of one of them reaches
    ``lo`` or ``hi``, so a sample with a pixel at (or near) the range's edge, facing the other sample's
    value, is an end (the faces' darkest pixels are ~0). Empty for a hull that is no line, or whose line
    misses the box."""
    point, basis = hull
    if basis.shape[1] != 1:
        return []
    u = basis[:, 0]
    moving = u.abs() > 1e-12 * float(u.abs().max())
    if not bool(moving.any()):
        return []
    a, b = (lo - point[moving]) / u[moving], (hi - point[moving]) / u[moving]
    low, high = float(torch.minimum(a, b).max()), float(torch.maximum(a, b).min())
    if low > high:
        return []
    return [point + low * u, point + high * u]


def shared(a: tuple[Tensor, Tensor], b: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor] | None:
    """The flat two hulls share when it is more than a point (a line, a plane: a point on it and a basis), or
    None: they meet in one point or not at all, or either has no basis."""
    common = _common(a, b)
    if common is None:
        return None
    s, vh, point = common
    free = vh[int((s >= CONDITION * s[0]).sum()):]  # combinations the joint basis sends (near) nowhere
    if free.shape[0] == 0:
        return None
    q, _ = torch.linalg.qr(a[1] @ free[:, : a[1].shape[1]].T)
    return point, q


def crossings(hulls: list[list[tuple[Tensor, Tensor] | None]], depth: int = 2) -> list[Tensor]:
    """Every point where a bin of one direction meets a bin of another (``hulls``: per direction, its bins'
    hulls), each once (points within ``RESIDUAL`` of one found before are the same sample); with ``depth`` 2,
    also where the line or plane two such bins share meets a third bin (six updates combined: the answer to a
    client that refuses a round whose bin meets an earlier one in a point, ``guardfl.inspect_meets``)."""
    found: list[Tensor] = []
    flats: list[tuple[Tensor, Tensor]] = []

    def add(point: Tensor | None) -> None:
        if point is not None and all(float((point - p).norm()) > RESIDUAL * float(p.norm()) for p in found):
            found.append(point)

    for i, first in enumerate(hulls):
        for second in hulls[i + 1:]:
            for a in first:
                for b in second:
                    if a is None or b is None:
                        continue
                    add(meet(a, b))
                    if depth > 1 and (common := shared(a, b)) is not None:
                        flats.append(common)
    everything = [h for bins in hulls for h in bins if h is not None]
    for flat in flats:
        for h in everything:
            add(meet(flat, h))
    return found


__all__ = ["BIAS_SHARE", "CONDITION", "MAX_RANK", "RANK_TOLERANCE", "RESIDUAL", "bin_hull", "box_ends", "crossings", "meet", "shared"]
