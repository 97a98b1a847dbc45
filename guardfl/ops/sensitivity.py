"""GradDefense's maths (Wang et al. 2022): per-layer gradient sensitivity, sensitivity-balanced slicing of
the gradient, and clipping / noising of chosen slices.

Sensitivity of layer (parameter tensor) ``l`` on a root set ``x``: the mean over samples ``b`` of the
Frobenius norm of ``d/dx_b sum_j dL/dtheta_{l,j}``, the input-gradient of the layer's gradient summed
over its entries (the public code's vector-Jacobian product with a tensor of ones).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from guardfl.ops.change import add_counting_, to_ints
from guardfl.ops.model import run


def layer_sensitivity(module: nn.Module, params: Sequence[nn.Parameter], x: Tensor) -> list[float]:
    """The sensitivity of each of ``params`` (parameters of ``module``) on the root set ``x``.

    The loss is the cross-entropy of ``module(x)`` (batch mean) against the model's own predictions
    (argmax of its logits): the defense sees the client's inputs, not its labels. A parameter whose
    gradient does not depend on ``x`` (or that the forward pass does not use) has sensitivity 0.
    """
    return [float(norms.mean()) if norms is not None else 0.0 for norms in sample_sensitivity(module, params, x)]


def sample_sensitivity(module: nn.Module, params: Sequence[nn.Parameter], x: Tensor) -> list[Tensor | None]:
    """Per parameter, the per-sample norms ``||d/dx_b sum_j dL/dtheta_{l,j}||_F`` (``(n,)``; None where the
    gradient does not depend on ``x``) whose mean is ``layer_sensitivity``. Without coupling between samples
    (no BatchNorm in train mode), sample b's norm is its own term divided by ``n`` (the loss is a batch mean),
    so the roots of several clients can share one pass (``GradDefense.root_sensitivities``)."""
    x = x.detach().requires_grad_(True)
    logits = run(module, x)
    if not isinstance(logits, Tensor) or logits.dim() != 2 or logits.shape[0] != x.shape[0]:
        shape = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
        raise ValueError(f"expected (batch, classes) logits from the model, got {shape}")
    labels = logits.detach().argmax(1)
    loss = F.cross_entropy(logits, labels)
    grads = torch.autograd.grad(loss, list(params), create_graph=True, allow_unused=True)
    out: list[Tensor | None] = []
    for g in grads:
        if g is None or not g.requires_grad:
            out.append(None)
            continue
        (gx,) = torch.autograd.grad(g, x, torch.ones_like(g), retain_graph=True, allow_unused=True)
        out.append(None if gx is None else gx.reshape(x.shape[0], -1).norm(dim=1))
    return out


def slice_bounds(sizes: Sequence[int], sensitivity: Sequence[float], slices: int) -> list[list[int]]:
    """Cut the gradient (its tensors flattened and concatenated in order) into ``slices`` contiguous
    slices of equal total sensitivity.

    Layer ``l``'s sensitivity is spread evenly over its ``n_l`` entries; an entry belongs to slice
    ``floor(slices * m / S)``, where ``m`` is the sensitivity of all entries before it and ``S`` the total.
    Returns, per layer, ``slices + 1`` non-decreasing offsets: slice ``k`` covers entries
    ``[bounds[l][k], bounds[l][k + 1])`` of layer ``l``. A slice is empty where one entry carries more
    than ``S / slices``. When ``S`` is 0 or not finite, sensitivity is taken proportional to size
    (slices of equal entry counts).
    """
    if slices < 1:
        raise ValueError(f"slices must be >= 1 (got {slices})")
    sens = [max(0.0, float(s)) for s in sensitivity]
    total = math.fsum(sens)
    if not (math.isfinite(total) and total > 0):
        sens = [float(n) for n in sizes]
        total = math.fsum(sens)
    bounds: list[list[int]] = []
    before = 0.0
    for n, s in zip(sizes, sens):
        if n == 0 or total == 0:
            bounds.append([0] * slices + [n])
            continue
        if s == 0:  # the whole layer sits at one point of the sensitivity axis
            k = min(slices - 1, math.floor(slices * before / total))
            bounds.append([0] * (k + 1) + [n] * (slices - k))
            continue
        density = s / n
        row = [0]
        for k in range(1, slices):
            first = math.ceil((k * total / slices - before) / density)  # first entry with mass-before >= k S / K
            row.append(min(n, max(row[-1], first, 0)))
        row.append(n)
        bounds.append(row)
        before += s
    return bounds


def slice_segments(bounds: list[list[int]], k: int) -> list[tuple[int, int, int]]:
    """The non-empty (layer, start, stop) segments slice ``k`` covers."""
    return [(layer, row[k], row[k + 1]) for layer, row in enumerate(bounds) if row[k + 1] > row[k]]


def clip_segments_(flats: Sequence[Tensor], segments: Sequence[tuple[int, int, int]], bound: float) -> float:
    """Scale, in place, the entries of ``segments`` (one slice) so that their joint L2 norm is at most
    ``bound``. Returns the norm before clipping."""
    if not segments:
        return 0.0
    sq = math.fsum(float(flats[layer][a:b].double().pow(2).sum()) for layer, a, b in segments)
    norm = math.sqrt(sq)
    if norm > bound:
        factor = bound / norm
        for layer, a, b in segments:
            flats[layer][a:b].mul_(factor)
    return norm


def noise_segments_(flats: Sequence[Tensor], segments: Sequence[tuple[int, int, int]], std: float,
                    generator_for: Callable[[torch.device], torch.Generator]) -> list[int]:
    """Add N(0, std^2), drawn from ``generator_for(device)``, to every entry of ``segments``, in place.
    Returns, per segment, the number of entries whose value the noise changed (a draw too small to move
    an entry in its dtype changes nothing)."""
    counts = []
    for layer, a, b in segments:
        seg = flats[layer][a:b]
        noise = torch.randn(b - a, generator=generator_for(seg.device), dtype=seg.dtype, device=seg.device).mul_(std)
        counts.append(add_counting_(seg, noise))
    return to_ints(counts)


def joint_norm(tensors: Sequence[Tensor]) -> float:
    """The L2 norm of ``tensors`` together (float64 sums)."""
    return math.sqrt(math.fsum(float(t.detach().double().pow(2).sum()) for t in tensors))


def clip_joint_(tensors: Sequence[Tensor], bound: float) -> float:
    """Scale, in place, ``tensors`` together so that their joint L2 norm is at most ``bound``. Returns the
    norm before clipping."""
    norm = joint_norm(tensors)
    if norm > bound:
        factor = bound / norm
        for t in tensors:
            t.mul_(factor)
    return norm
