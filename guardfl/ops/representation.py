"""Soteria's feature scores (Sun et al. 2021): how strongly each feature of the representation feeding a
fully connected layer depends on the input, relative to its value.

For the representation ``r`` (the input of an ``nn.Linear``) of a batch ``x``, feature ``f`` and sample
``b``: ``ratio[b, f] = ||d(sum_b' r[b', f]) / dx_b|| / |r[b, f]|`` (the gradient of the feature summed
over the batch, restricted to sample ``b``, as the public code computes it with one backward pass per
feature; without coupling between samples, such as BatchNorm in train mode, it is ``||dr[b, f]/dx_b||``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from guardfl.ops.model import run


class _Captured(Exception):
    """Raised by the capture hook to stop the forward pass once the representation is known."""


def linear_input(module: nn.Module, layer: nn.Linear, x: Tensor) -> Tensor:
    """The input of ``layer`` in ``module(x)`` (its first call), differentiable with respect to ``x``.
    The forward pass stops there; buffers are not updated (``ops.model.run``)."""
    box: list[Tensor] = []

    def hook(_mod: nn.Module, args: tuple) -> None:
        box.append(args[0])
        raise _Captured

    handle = layer.register_forward_pre_hook(hook)
    try:
        run(module, x)
    except _Captured:
        pass
    finally:
        handle.remove()
    if not box:
        raise ValueError("the layer was not called in the model's forward pass")
    return box[0]


def feature_input_grad_norms(r: Tensor, x: Tensor, *, batched: bool | None = None, chunk: int | None = None) -> Tensor:
    """``norms[f, b] = ||d(sum_b' r[b', f]) / dx_b||`` for a representation ``r`` of shape (batch, features)
    computed from ``x`` (which requires grad). One vector-Jacobian product per feature: a loop (fastest on
    CPU) or, with ``batched`` (default: on CUDA), chunks of features vectorised with ``is_grads_batched``."""
    if r.dim() != 2:
        raise ValueError(f"expected a (batch, features) representation, got shape {tuple(r.shape)}")
    batch, features = r.shape
    out = torch.zeros(features, batch, dtype=r.dtype, device=r.device)
    if not r.requires_grad:  # r does not depend on x
        return out
    batched = x.is_cuda if batched is None else batched
    if batched:
        per_feature = max(1, x.numel())
        step = chunk or max(1, min(features, (1 << 22) // per_feature))  # bounds the batched backward's memory
        for start in range(0, features, step):
            stop = min(features, start + step)
            c = stop - start
            v = torch.zeros(c, batch, features, dtype=r.dtype, device=r.device)
            v[torch.arange(c), :, torch.arange(start, stop)] = 1
            (g,) = torch.autograd.grad(r, x, v, retain_graph=True, is_grads_batched=True, allow_unused=True)
            if g is not None:
                out[start:stop] = g.reshape(c, batch, -1).norm(dim=2)
        return out
    v = torch.zeros_like(r)
    for f in range(features):
        v[:, f] = 1
        (g,) = torch.autograd.grad(r, x, v, retain_graph=True, allow_unused=True)
        if g is not None:  # before v is reset: g can be v itself (r = x)
            out[f] = g.reshape(batch, -1).norm(dim=1)
        v[:, f] = 0
    return out


def soteria_scores(norms: Tensor, r: Tensor) -> Tensor:
    """Per feature: the sum over the batch of ``norms[f, b] / |r[b, f]|`` (float64).

    ``r[b, f] = 0`` (a ReLU feature off for sample ``b``; the public code divides by zero there): sample
    ``b`` is left out of feature ``f``'s sum and the sum is rescaled to the batch size, i.e. the mean of
    the other samples' ratios stands in for it. Whenever no ``r[b, f]`` is 0 this is exactly the public
    code's sum. A feature that is 0 for every sample scores +inf: its column of the weight gradient is
    already zero, so pruning it would hide nothing. A non-finite ``r`` or norm scores +inf too (the
    feature is never preferred).
    """
    batch = r.shape[0]
    mag = r.detach().abs().T.double()  # (features, batch)
    n = norms.detach().double()
    alive = mag > 0
    ratio = torch.where(alive, n / torch.where(alive, mag, torch.ones_like(mag)), torch.zeros_like(mag))
    count = alive.sum(1)
    score = ratio.sum(1) * batch / count.clamp(min=1)
    bad = (count == 0) | ~torch.isfinite(mag).all(1) | ~torch.isfinite(n).all(1) | torch.isnan(score)
    return score.masked_fill(bad, math.inf)
