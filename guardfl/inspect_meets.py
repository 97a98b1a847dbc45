"""Meets: the samples a server reads where two views of a client's updates on one batch meet
(``LeakHistory``, ``inspect_model(..., leak_limit=k, history=)``, issue 34).

A linear layer's update on a batch is ``sum_n delta_n a_n^T``; where the layer's input is the batch itself in
every round (the first layer), every update the client sent on that batch, and every difference of two of
them, is a matrix of coefficients over the same samples. What a server can compute from one such *view* is
the span of its rows: ``{sum_n v_n a_n : v in V}``, ``V`` the span of the view's coefficient columns. Two
views whose spans meet in exactly one direction give the server that direction, whatever else either holds.
Where both hold one sample in common and nothing else that lines up, the meet is that sample: the red team's
``threshold_bins directions: 4`` meets a bin of one direction (the difference of two consecutive thresholds'
updates: the line through two or three faces) with a bin of another that shares one face, four updates
combined, past the pairs ``difference_reads`` compares (25 of 64 LFW faces exactly through a limit of 0).

The test, exact arithmetic on the client's coefficients: each view's span ``V`` in the coefficient space
weighted by the samples' norms (``v_n |a_n|``, as ``row_reads`` weighs a row's terms), its rank taken down to
``MEET_RANK_TOLERANCE`` of its largest singular value (float32 updates' rounding sits below); the samples
``V`` nearly holds (a basis row of norm at least ``cos``: within ``ISOLATION_READ_ERROR``) are its members.
Two views that share a member are met: the cosine of their first principal angle at least
``sqrt(1 - e^2)`` and of the second below it (one direction, not a line or plane in common: the server
could not pick a point), and the meet's coefficients read as ``row_reads`` reads a row: the largest term
alone, every other its contamination, within ``ISOLATION_READ_ERROR`` (``relative_read_error``, from the
inputs' Gram matrix). A meet in more than one direction but less than either view (the line two bins share)
is kept as a view itself and met in turn: a line two views share and a third view cuts is read (six updates
combined, the red team's ``bin_lines.crossings`` at depth 2). Measured on ``threshold_bins``' 129 accepted
rounds against a history of pairs (FC-2, 64 LFW faces): 33 samples read by meets, the 25 the attack read
exactly among them, the first in round 21; against the history with meets the attack reads none exactly
(179 of 260 models refused; ``docs/research/malicious-server.md`` section 19). Honest updates and differences of
honest rounds are full rank: nothing is kept for them.

What it does not bound: views of rank above half the batch (not kept: two of them share directions by
dimension alone, yet three can meet in one sample), layers whose input changes between rounds, and reads by
priors (a line through two samples cut by the box of valid pixels). Cost: one SVD per new view (``R`` per
round, ``R`` the rounds remembered), and one small SVD per kept view that shares a member with a new one; a
batch keeps at most ``MEET_MAX_FLOATS`` numbers of bases (past them ``overflow`` / ``views_full``: the
caller refuses).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from guardfl.inspect_isolation import ISOLATION_READ_ERROR
from guardfl.inspect_pairs import relative_read_error

#: a view's rank: its singular values above this share of its largest (a float32 update's rounding is
#: ~1e-7 of its coefficients; a difference's near-cancelled samples sit there)
MEET_RANK_TOLERANCE = 1e-5
#: views of rank above this share of the batch are not kept (two of them share directions by dimension alone)
MEET_MAX_RANK_SHARE = 0.5
#: the numbers (float64) of the views' bases one batch keeps; past them its next round is refused
MEET_MAX_FLOATS = 4_000_000


@dataclass
class Views:
    """One layer's kept views of one batch: bases (batch x rank, orthonormal, in the norm-weighted coefficient
    space) and members (bool, batch)."""

    bases: list[Tensor] = field(default_factory=list)
    members: list[Tensor] = field(default_factory=list)
    overflow: bool = False  # a view not examined (non-finite) or a flat not kept (past ``MEET_MAX_FLOATS``): the caller refuses

    def floats(self) -> int:
        return sum(b.numel() for b in self.bases)

    def extend(self, other: "Views") -> None:
        self.bases += other.bases
        self.members += other.members


def _spans(z: Tensor) -> list[tuple[Tensor, int]]:
    """Per matrix of ``z`` (views x batch x units, float64): its left singular vectors in decreasing order and
    its rank (``MEET_RANK_TOLERANCE``), from the eigendecomposition of ``z z^T`` (batch x batch: 4.6 times
    faster than an SVD at 64 x 256; singular values down to 1e-5 of the largest are eigenvalues down to 1e-10,
    far above float64's rounding of them)."""
    evals, evecs = torch.linalg.eigh(z @ z.transpose(1, 2))
    sing = evals.flip(-1).clamp_min(0.0).sqrt()
    out = []
    for i in range(z.shape[0]):
        top = float(sing[i, 0])
        rank = int((sing[i] > MEET_RANK_TOLERANCE * top).sum()) if top > 0 else 0
        out.append((evecs[i].flip(-1), rank))
    return out


def view(coefficients: Tensor, norms: Tensor, read_error: float = ISOLATION_READ_ERROR) -> tuple[Tensor, Tensor] | None:
    """A view's basis and members (module docstring) from its coefficients (batch x units) and the samples'
    norms (batch); None when it is empty, holds no sample or is above ``MEET_MAX_RANK_SHARE`` of the batch."""
    got = views_of([coefficients], norms, read_error)
    return (got.bases[0], got.members[0]) if got.bases else None


def _meets(basis: Tensor, others: list[Tensor], norms: Tensor, gram: Tensor, read_error: float) -> tuple[set[int], list[Tensor]]:
    """The samples read where ``basis`` meets one of ``others`` in one direction, and the flats (bases) where it
    meets one in more than one direction but less than either whole (module docstring)."""
    width = max(b.shape[1] for b in others)
    stack = basis.new_zeros(len(others), basis.shape[0], width)
    for i, b in enumerate(others):
        stack[i, :, : b.shape[1]] = b
    u, s, vh = torch.linalg.svd(basis.T.unsqueeze(0) @ stack)
    near = math.sqrt(1.0 - read_error ** 2)
    common = (s >= near).sum(1)
    smaller = torch.tensor([min(basis.shape[1], b.shape[1]) for b in others])
    flats = [basis @ u[i, :, : int(common[i])] for i in ((common >= 2) & (common < smaller)).nonzero().flatten().tolist()]
    one = (common == 1).nonzero().flatten()
    if one.numel() == 0:
        return set(), flats
    point = (basis @ u[one, :, 0].T).T + (stack[one] @ vh[one, 0, :, None])[..., 0]  # meets x batch, weighted
    weight = point.abs()
    top = weight.argmax(1)
    rest = (point / norms.clamp_min(1e-300)).T.clone()  # batch x meets: the coefficients
    rest[top, torch.arange(one.numel())] = 0.0
    ok = relative_read_error(rest, weight.amax(1), gram) <= read_error
    return {int(n) for n in top[ok]}, flats


def _same(a: Tensor, b: Tensor) -> bool:
    """Whether two orthonormal bases of one rank span the same subspace (to rounding)."""
    return float((a.T @ b).square().sum()) >= a.shape[1] - 1e-6


def meet_reads(new: Views, old: Views, norms: Tensor, gram: Tensor, read_error: float = ISOLATION_READ_ERROR,
               max_floats: int = MEET_MAX_FLOATS) -> set[int]:
    """The samples read where a new view meets a kept one or another new one, or where the flat two of them
    share (a line, a plane) meets a third: those flats are added to ``new`` (to be kept with it) and met in
    turn, until none is new or ``new`` and ``old`` hold ``max_floats`` numbers (module docstring)."""
    found: set[int] = set()
    seen: dict[tuple, list[Tensor]] = {}  # (members, rank) -> the bases kept with them: a flat found twice is met once
    for b, m in zip(old.bases + new.bases, old.members + new.members):
        seen.setdefault((tuple(m.nonzero().flatten().tolist()), b.shape[1]), []).append(b)
    k = 0
    while k < len(new.bases):
        bases, members = old.bases + new.bases, old.members + new.members
        i = len(old.bases) + k
        stacked = torch.stack(members[:i]) if i else None
        shared = [] if stacked is None else (stacked & members[i]).any(1).nonzero().flatten().tolist()
        if shared:
            read, flats = _meets(bases[i], [bases[j] for j in shared], norms, gram, read_error)
            found |= read
            for flat in flats:
                q, _ = torch.linalg.qr(flat)
                m = (q * q).sum(1) >= 1.0 - read_error ** 2
                key = (tuple(m.nonzero().flatten().tolist()), q.shape[1])
                if not bool(m.any()) or any(_same(q, b) for b in seen.get(key, [])):
                    continue
                if old.floats() + new.floats() + q.numel() > max_floats:
                    new.overflow = True
                else:
                    seen.setdefault(key, []).append(q)
                    new.bases.append(q.contiguous())
                    new.members.append(m)
        k += 1
    return found


def views_of(coefficients: list[Tensor], norms: Tensor, read_error: float = ISOLATION_READ_ERROR) -> Views:
    """The kept views (``view``) of coefficient matrices over the same samples (``norms``: their inputs'):
    those that are not all zero, of rank at most ``MEET_MAX_RANK_SHARE`` of the batch, holding a member. A
    non-finite one is not examined and sets ``overflow`` (fail closed: the caller refuses)."""
    out = Views()
    z = [c.double() * norms[:, None] for c in coefficients]
    out.overflow = not all(bool(torch.isfinite(m).all()) for m in z) or not bool(torch.isfinite(norms).all())
    z = [m for m in z if m.numel() and bool(torch.isfinite(m).all()) and bool(m.abs().max() > 0)]
    for shape in dict.fromkeys(m.shape for m in z):
        for u, rank in _spans(torch.stack([m for m in z if m.shape == shape])):
            if rank == 0 or rank > MEET_MAX_RANK_SHARE * shape[0]:
                continue
            basis = u[:, :rank].contiguous()
            members = (basis * basis).sum(1) >= 1.0 - read_error ** 2
            if bool(members.any()):
                out.bases.append(basis)
                out.members.append(members)
    return out


def frame(inputs: Tensor) -> tuple[Tensor, Tensor]:
    """The samples' norms and Gram matrix (float64, on the CPU, where the history keeps its coefficients) of a
    layer's input, one row per sample."""
    a = inputs.detach().reshape(inputs.shape[0], -1).double().cpu()
    gram = a @ a.T
    return gram.diagonal().clamp_min(0.0).sqrt(), gram


__all__ = ["MEET_MAX_FLOATS", "MEET_MAX_RANK_SHARE", "MEET_RANK_TOLERANCE", "Views", "frame", "meet_reads", "view", "views_of"]
