"""Isolation by groups of rows (``inspect_model``'s isolation check, issue 34): the samples a server reads
from a linear combination of several rows of a layer's weight gradient, not only one row or the
difference of two (``guardfl.inspect_isolation``).

Why: a trap whose bins share one classifier column reads a sample from the difference of two adjacent
rows, which the pairwise tests count. Give each bin ``k`` rows with the same cut but independent columns
drawn from a ``k``-dimensional subspace, and no two rows' coefficients are proportional any more (the
pairwise tests and the shared-columns check see nothing), yet the server, who knows the columns, solves a
``k x k`` system per bin for the bin's ``k`` measurements and reads each sample exactly from the
difference of two bins (the red team's ``trap_weights columns: k``). Measured (FC-2, 64 LFW faces in
[0, 1], the whole layer, 2026-11-27): ``k = 2`` passed every check and read 20 faces exactly (``k = 1``,
the pairwise case, was refused: 58 isolated), ``k = 3`` 19, isolating 4 by the pairwise count, under the
honest architecture's own 25.

The test: rows whose supports (the samples they hold) are identical form a group. A nested pair of groups
(the smaller's samples all in the larger, at most ``ISOLATION_PEEL`` more), one of them of 2+ rows,
separates the larger's extra samples when a combination of the larger group's rows minus one of the
smaller's holds them and (almost) nothing of the shared ones; the sets are peeled with the others. A group
alone is not counted: its rows mix the same samples, and to cancel all but one the server would need the
batch's coefficients (a row dominated by one sample is the pairwise tests' own).

"Almost nothing" is the pairwise tests' own: summed absolute residual coefficients within ``tolerance`` of
the read sample's (the combination with least squared residual), or the read within ``read_error`` of its
input (the combination with least contamination in the input, from the batch's Gram matrix). The
combination is the best on this batch. A server finds it without the batch's coefficients (which it does
not know) when the two groups' classifier columns share a direction ``u``: then ``u`` applied to each
group's rows gives ``sum (u . e_n) [a_n, 1]`` over each group's samples, and their difference the extra
samples alone. It does when the columns span no more dimensions than a group has rows (the constructions
above; an honest layer on uncentred inputs, whose units firing for the whole batch span every column
direction, does too). Elsewhere the count over-approximates what a server reads; it is judged like every
count against the client's own architecture at a fresh initialisation on the same batch.

Cost: a pair of groups with more rows than the batch has samples is tested at the batch's width
(``_factor``: every test depends on the rows only through the per-sample vectors their combinations make
and the least norm that makes each, which a QR factor keeps), so a server's groups of hundreds of rows cost
a solve of the batch's size per pair, not of theirs. Until 2026-11-27 they cost theirs: 800 rows firing for
the whole batch and 800 nested under them, each missing one or two samples, took 7.7 s for one layer
(1,600 + 1,600 rows: 92 s; now 0.3 and 0.6 s), a stall a server could put in front of every client.

Not examined: combinations of three or more distinct supports (a server that solves for a bin from rows
of several neighbouring supports), and supports that differ by samples the rows barely hold.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from guardfl.inspect_pairs import nested_pairs

#: the most nested group pairs examined per layer: a layer with more is refused by ``inspect_model`` (fail
#: closed: decoy groups could otherwise hide a trap past the cap), and ``groups_capped`` says so. A trap's
#: chain has about one nested pair per cut. Honest layers on uncentred inputs have many: FC-2 at PyTorch's
#: default init on CIFAR-10 in [0, 1], over batches of 2 to 64, up to 2,252 with 1,024 units (batch 8) and
#: 13,394 with 4,096 (batch 12; 2026-11-27) and 41,302 with 8,192 (batch 12, the widest layer isolation
#: examines since). The cap was 2,000 until then, which refused the honest 1,024-unit FC-2 on 8 such
#: images, then 50,000; each pair costs at most a solve of the batch's width (``_factor``)
GROUP_MAX_PAIRS = 200_000
#: group pairs of up to this many rows are tested together at this width (``_separates``: padded); larger
#: ones through ``_factor``, at most the batch wide, in batches of one width rounded up to a power of two
#: (``_parts``)
BATCH_ROWS = 16
#: pairs per batch of ``_separates`` at ``BATCH_ROWS``; wider batches hold about as many elements
_BATCH = 2048
#: ridge of the least-squares combinations, relative to the mean diagonal of the normal matrix: the
#: combination is found even when the group's coefficients are collinear
_RIDGE = 1e-12


def _factor(f: Tensor) -> Tensor:
    """A ``batch x w`` matrix ``F'`` with ``F' F'^T = F F^T`` and ``w = min(columns, batch)``: ``f`` itself
    when it is no wider than the batch, else the transpose of the triangular factor of ``f^T``'s QR
    decomposition. Every test of a group pair depends on its rows' coefficients ``F`` (batch x rows) only
    through the per-sample vectors ``v = F w`` their combinations make and the least ``|w|`` that makes
    each (the ridge): ``v^T (F F^T)^+ v``, which ``F'`` keeps. So a pair of hundreds of rows is tested at
    the batch's width, not its own (a server's large groups cost a solve of their size per pair)."""
    if f.shape[1] <= f.shape[0]:
        return f
    return torch.linalg.qr(f.T, mode="r")[1].T


def _separates(full: Tensor, count: Tensor, cancel: Tensor, held: Tensor, gram: Tensor | None, tolerance: float,
               read_error: float, norms: Tensor | None, peel: int) -> Tensor:
    """Which group pairs have a combination of their rows that holds the ``held`` samples and (almost)
    nothing of ``cancel``, for some held sample as its lead: a mask over the pairs. ``full``: each pair's
    rows' coefficients over the batch (pairs x batch x width: padded with zero columns, which change no
    combination, or ``_factor``'s columns in their place), ``count``: each pair's number of rows (its
    ridge), ``cancel`` / ``held``: masks over the batch (pairs x batch). The combination ``w`` is the one of
    least ``|x w|`` with ``lead . w = 1`` (``x``: ``full`` on ``cancel``; with ``gram``, also the one of
    least contamination in the input)."""
    n = full.shape[1]
    x = full * cancel[:, :, None]
    lead_at = held.double().topk(min(peel, n), dim=1)  # each pair's held samples first
    lead = torch.gather(full, 1, lead_at.indices[:, :, None].expand(-1, -1, full.shape[2]))
    valid = (lead_at.values > 0) & (lead.abs().amax(2) > 0)  # p x leads: a held sample with a non-zero lead
    lead = lead * valid[:, :, None]
    out = _batched_tolerance(x, lead, valid, count, tolerance)
    rest = (~out).nonzero().flatten()  # the read test only where the coefficients do not already separate
    if gram is not None and rest.numel():
        out[rest] = _batched_read(gram, x[rest], lead[rest], valid[rest], count[rest], cancel[rest],
                                  norms.flatten()[lead_at.indices[rest]], read_error)
    return out


def _batched_read(gram: Tensor, x: Tensor, lead: Tensor, valid: Tensor, count: Tensor, cancel: Tensor,
                  lead_norms: Tensor, read_error: float) -> Tensor:
    """The read test for every pair and lead: the combination of least contamination in the input (``x``'s
    rows weighted by the Gram matrix of ``cancel``'s inputs, with a jitter of 1e-12 of its mean diagonal)
    reads some held sample within ``read_error`` of its input (``lead_norms``: the held samples' input
    norms, p x leads)."""
    jitter = 1e-12 * ((cancel * gram.diagonal()).sum(1) / cancel.sum(1).clamp_min(1) + 1e-300)
    gx = torch.einsum("nm,pmr->pnr", gram, x) + jitter[:, None, None] * x  # (G_S + jitter) x, zero-padded
    w = _least(x.transpose(1, 2) @ gx, lead, count)  # p x rows x leads
    lead_min = ((lead @ w).abs() * lead_norms[:, :, None]).masked_fill(~valid[:, :, None], float("inf")).amin(1)
    contamination = ((x @ w) * (gx @ w)).sum(1).clamp_min(0.0).sqrt()  # p x leads
    return ((lead_min > 0) & (contamination <= read_error * lead_min) & valid).any(1)


def _least(q: Tensor, lead: Tensor, count: Tensor) -> Tensor:
    """Per pair and per lead, the ``w`` of least ``w^T q w`` with ``lead_h . w = 1`` (``q``: p x rows x rows,
    with a ridge of ``_RIDGE`` times its mean diagonal over the pair's own ``count`` rows; ``lead``: p x
    leads x rows) -> p x rows x leads (a zero lead gives zeros)."""
    diag = q.diagonal(dim1=1, dim2=2)
    ridge = _RIDGE * ((diag.sum(1) / count).abs() + 1e-300)
    eye = torch.eye(q.shape[1], dtype=q.dtype)
    z = torch.linalg.solve(q + ridge[:, None, None] * eye, lead.transpose(1, 2))
    scale = (lead.transpose(1, 2) * z).sum(1, keepdim=True)  # p x 1 x leads
    return torch.where(scale != 0, z / torch.where(scale != 0, scale, torch.ones_like(scale)), torch.zeros_like(z))


def _batched_tolerance(x: Tensor, lead: Tensor, valid: Tensor, count: Tensor, tolerance: float) -> Tensor:
    """The coefficient test for every pair and lead: some lead's combination leaves a summed
    absolute residual on ``cancel`` within ``tolerance`` of its smallest coefficient on the held samples."""
    w = _least(x.transpose(1, 2) @ x, lead, count)
    coef = (lead @ w).abs().masked_fill(~valid[:, :, None], float("inf")).amin(1)  # p x leads
    return ((x @ w).abs().sum(1) <= tolerance * coef).logical_and(valid).any(1)


def group_sets(d: Tensor, support: Tensor, gram: Tensor | None, norms: Tensor | None, tolerance: float,
               read_error: float, peel: int) -> tuple[Tensor, dict[str, int]]:
    """The sample sets a server separates by combining the rows of a nested pair of groups of identical
    supports (see the module docstring): (sets, batch), and counts (``row_groups``: groups of
    2+ rows; ``separating_groups``; ``groups_capped``). ``d``: batch x units coefficients (float64),
    ``support``: their non-zero pattern, ``gram`` / ``norms``: the layer inputs' Gram matrix and norms
    (batch x 1), or None."""
    n = d.shape[0]
    info = {"row_groups": 0, "separating_groups": 0, "groups_capped": 0}
    live = support.any(0)
    if int(live.sum()) < 2:
        return torch.zeros(0, n, dtype=torch.bool), info
    patterns, inverse = torch.unique(support[:, live].T, dim=0, return_inverse=True)  # groups x batch
    units = live.nonzero().flatten()[torch.argsort(inverse, stable=True)]
    count = torch.bincount(inverse, minlength=patterns.shape[0])
    members = list(units.split(count.tolist()))
    info["row_groups"] = int((count >= 2).sum())
    if info["row_groups"] == 0:
        return torch.zeros(0, n, dtype=torch.bool), info
    nested = nested_pairs(patterns.T, peel)  # groups x groups, a block of rows at a time
    nested = nested[count[nested[:, 0]] + count[nested[:, 1]] >= 3]  # single rows: the pairwise tests' own
    if nested.shape[0] > GROUP_MAX_PAIRS:  # capped before the list is made (millions of pairs: gigabytes)
        nested, info["groups_capped"] = nested[:GROUP_MAX_PAIRS], 1
    jobs = nested.tolist()
    sets = []
    for part, full in _parts(d, jobs, members):
        big, small = torch.tensor([j[0] for j in part]), torch.tensor([j[1] for j in part])
        cancel, held = patterns[small], patterns[big] & ~patterns[small]
        found = _separates(full, (count[big] + count[small]).double(), cancel, held, gram, tolerance, read_error,
                           norms, peel)
        sets += [held[k] for k in found.nonzero().flatten().tolist()]
    info["separating_groups"] = len(sets)
    return (torch.stack(sets) if sets else torch.zeros(0, n, dtype=torch.bool)), info


def _parts(d: Tensor, jobs: list[list[int]], members: list[Tensor]) -> Iterator[tuple[list[list[int]], Tensor]]:
    """The group pairs ``jobs`` (big, small) in batches for ``_separates``, each with its rows' coefficients
    (pairs x batch x width, zero-padded): pairs of up to ``BATCH_ROWS`` rows at that width, ``_BATCH`` at a
    time; wider ones through ``_factor`` (each group factored once), at most the batch wide, in batches of
    one width (rounded up to a power of two) of about as many elements."""
    n = d.shape[0]
    narrow, wide = [], {}
    factors: dict[int, Tensor] = {}
    for job in jobs:
        rows = members[job[0]].numel() + members[job[1]].numel()
        if rows <= BATCH_ROWS:
            narrow.append(job)
            continue
        for g in job:
            if g not in factors:
                factors[g] = _factor(d[:, members[g]])
        f = _factor(torch.cat([factors[job[0]], factors[job[1]]], 1))
        wide.setdefault(1 << (f.shape[1] - 1).bit_length(), []).append((job, f))
    for k in range(0, len(narrow), _BATCH):
        part = narrow[k:k + _BATCH]
        yield part, _stacked([d[:, torch.cat([members[b], members[s]])] for b, s in part], BATCH_ROWS, n)
    for width, found in sorted(wide.items()):
        step = max(1, _BATCH * BATCH_ROWS // width)
        for k in range(0, len(found), step):
            part = found[k:k + step]
            yield [job for job, _ in part], _stacked([f for _, f in part], width, n)


def _stacked(blocks: list[Tensor], width: int, n: int) -> Tensor:
    """``blocks`` (each batch x at most ``width``) as one pairs x batch x ``width`` tensor, zero-padded."""
    out = torch.zeros(len(blocks), n, width, dtype=torch.float64)
    for k, f in enumerate(blocks):
        out[k, :, :f.shape[1]] = f
    return out


__all__ = ["GROUP_MAX_PAIRS", "group_sets"]
