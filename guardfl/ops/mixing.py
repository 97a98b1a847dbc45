"""MixUp / InstaHide encoding maths (Huang et al. 2020, as evaluated in Huang et al. 2021, Sec. 4)."""

from __future__ import annotations

import torch
from torch import Tensor


#: rejection rounds before the remaining rows are shrunk toward uniform
MAX_REDRAWS = 20


def mixing_coefficients(n: int, k: int, max_coeff: float, generator: torch.Generator, device=None) -> Tensor:
    """``(n, k)`` non-negative coefficients, each row summing to 1 with every entry <= ``max_coeff``.

    As InstaHide's reference: |N(0, 1)| draws normalised per row, rows violating the bound redrawn
    (rejection sampling, from ``generator`` only). Needs ``1/k < max_coeff <= 1``.

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
    """``sum_j coeffs[:, j] * images[partners[:, j]]``: ``partners`` and ``coeffs`` are ``(n, k)``."""
    picked = images[partners]  # (n, k, C, H, W)
    shape = (*coeffs.shape, *([1] * (picked.dim() - 2)))
    return (picked * coeffs.reshape(shape).to(picked.dtype)).sum(1)


def sign_masks(shape: tuple[int, ...], generator: torch.Generator, device=None) -> Tensor:
    """Random {-1, +1} masks of ``shape`` (one fresh pattern per encoded image)."""
    bits = torch.randint(0, 2, shape, generator=generator, dtype=torch.int8)
    return (bits * 2 - 1).float().to(device) if device is not None else (bits * 2 - 1).float()


def batch_partners(n: int, k: int, generator: torch.Generator) -> Tensor:
    """``(n, k)`` indices into the batch: column 0 is the image itself, columns 1.. are random
    permutations of the batch (InstaHide's intra mixing)."""
    cols = [torch.arange(n)] + [torch.randperm(n, generator=generator) for _ in range(k - 1)]
    return torch.stack(cols, 1)
