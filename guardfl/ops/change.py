"""Counting what a defense actually changed, so that its stats never claim more than it did.

A defense's ``StageStats.fired`` and its per-layer fractions come from these counts, not from its settings:
noise too small to move an entry in its dtype, pruning of entries that were already zero, or clipping of a
slice already within the bound change nothing, and are reported as nothing.

The counting forms that apply a change (``add_counting_``, ``sign_counting_``) do it in the same pass over a
layer as the count, in a ``Scratch`` buffer when one is given, so the step allocates nothing.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from guardfl.ops.scratch import Scratch


def changed_count(before: Tensor, after: Tensor, scratch: Scratch | None = None) -> Tensor:
    """How many entries differ between ``before`` and ``after`` (a 0-d tensor on their device)."""
    if scratch is None:
        return torch.count_nonzero(before != after)
    return torch.count_nonzero(torch.ne(before, after, out=scratch.like(before, torch.bool)))


def add_counting_(x: Tensor, delta: Tensor, scratch: Scratch | None = None) -> Tensor:
    """``x += delta`` in place (bit for bit what ``x.add_(delta)`` gives); returns how many entries of
    ``x`` changed value, as a 0-d tensor. A delta entry of 0, or one too small to move its entry of ``x``
    in ``x``'s dtype, changes nothing. ``delta`` is overwritten (it holds ``x + delta`` afterwards)."""
    new = delta.add_(x)
    count = changed_count(x, new, scratch)
    x.copy_(new)
    return count


def sign_counting_(x: Tensor, scratch: Scratch) -> Tensor:
    """``x = sign(x)`` in place; returns how many entries changed (those not already -1, 0 or +1, NaN
    included), as a 0-d tensor. The sign is formed in ``scratch`` and copied back, so nothing is allocated."""
    signs = torch.sign(x, out=scratch.like(x))
    count = changed_count(x, signs, scratch)
    x.copy_(signs)
    return count


def signs_counting_(xs: Sequence[Tensor], scratch: Scratch) -> list[Tensor]:
    """``sign_counting_`` on every tensor, cheaper where the count is known without comparing: a finite
    tensor whose entries all lie in (-1, 1) changes at exactly its non-zero entries (sign keeps only 0, -1
    and +1), so one min/max pass decides, and the sign is taken in place. Tensors with an entry of
    magnitude >= 1 (which may already be -1 or +1) or a non-finite one are compared entry by entry."""
    if not xs:
        return []
    extremes = [torch.aminmax(x) for x in xs]
    exact = (torch.stack([torch.maximum(-lo, hi).float() for lo, hi in extremes]) < 1).logical_not_().tolist()
    counts = []
    for x, compare in zip(xs, exact):
        if compare:
            counts.append(sign_counting_(x, scratch))
        elif x.dtype in (torch.float32, torch.float64) and x.is_contiguous() and x.numel() < 2**24:
            x.sign_()
            flat = x.view(-1)
            counts.append(torch.dot(flat, flat).long())  # sum of squared signs: the non-zero entries, exactly
        else:                                              # (integers below 2**24 are exact in float32)
            counts.append(torch.count_nonzero(x))
            x.sign_()
    return counts


def largest_magnitudes(xs: Sequence[Tensor]) -> list[float]:
    """``max |x|`` of every tensor as Python floats, from one ``aminmax`` pass each and one device sync: NaN
    where a tensor holds a NaN, inf where it holds an infinite entry (and no NaN), 0.0 for an empty one. The
    one pass that both decides ``sign_counting_``'s path and finds non-finite entries (issue 66: the
    separate finiteness scan it replaces was one more pass over every gradient per step)."""
    if not xs:
        return []
    extremes = [torch.aminmax(x) if x.numel() else None for x in xs]
    kept = [e for e in extremes if e is not None]
    if not kept:
        return [0.0] * len(xs)
    if len({e.min.dtype for e in kept}) == 1 and len({e.min.device for e in kept}) == 1:
        lo, hi = torch.stack([e.min for e in kept]), torch.stack([e.max for e in kept])
        top = torch.maximum(-lo, hi).double().tolist()  # neg/max propagate NaN; one sync
    else:  # mixed dtypes or devices: one value each
        top = [float(torch.maximum(-e.min, e.max).double()) for e in kept]
    it = iter(top)
    return [0.0 if e is None else next(it) for e in extremes]


def signs_by_magnitude_(xs: Sequence[Tensor], top: Sequence[float], scratch: Scratch) -> tuple[list[int], list[bool]]:
    """``x = sign(x)`` in place on every (finite) tensor, ``top`` its ``largest_magnitudes``; returns how many
    entries of each changed, and which outputs were verified finite by a full reduction over them after the
    sign was written. A tensor inside (-1, 1) changes at exactly its non-zero entries: its sign is taken in
    place (one foreach call for all of them) and counted as the sum of its squared signs (one BLAS dot, exact
    below 2**24 entries; finite only when every sign is). Others (an entry of magnitude >= 1, which may
    already be -1 or +1, or a float16 / large / strided tensor) are compared entry by entry, as
    ``sign_counting_`` does, and not verified."""
    fast = [i for i, (x, t) in enumerate(zip(xs, top)) if t < 1 and x.dtype in (torch.float32, torch.float64)
            and x.is_contiguous() and 0 < x.numel() < 2**24]
    counts: list[int | None] = [None] * len(xs)
    verified = [False] * len(xs)
    if fast:
        group = [xs[i] for i in fast]
        torch._foreach_sign_(group)
        dots = torch.stack([torch.dot(x.view(-1), x.view(-1)).double() for x in group]).tolist()  # one sync
        for i, d in zip(fast, dots):
            verified[i] = d == d and d != float("inf")
            counts[i] = int(d) if verified[i] else -1
    slow = [i for i in range(len(xs)) if counts[i] is None]
    slow_counts = to_ints([sign_counting_(xs[i], scratch) if xs[i].numel() else 0 for i in slow])
    for i, c in zip(slow, slow_counts):
        counts[i] = c
    return counts, verified  # type: ignore[return-value]


def to_ints(counts: Sequence[Tensor | int]) -> list[int]:
    """Python ints of 0-d count tensors (ints pass through), with one device sync per device instead of
    one per tensor."""
    out: list[int | None] = [c if isinstance(c, int) else None for c in counts]
    by_device: dict[torch.device, list[int]] = {}
    for i, c in enumerate(counts):
        if not isinstance(c, int):
            by_device.setdefault(c.device, []).append(i)
    for idx in by_device.values():
        for i, v in zip(idx, torch.stack([counts[i] for i in idx]).tolist()):
            out[i] = int(v)
    return out  # type: ignore[return-value]
