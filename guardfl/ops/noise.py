"""Noise samplers that draw only from the generator they are given (never the global RNG)."""

from __future__ import annotations

import torch
from torch import Tensor


def gaussian_like(x: Tensor, std: float, generator: torch.Generator) -> Tensor:
    """Samples of N(0, std^2) with the shape, dtype and device of ``x``."""
    noise = torch.randn(x.shape, generator=generator, dtype=x.dtype, device=x.device)
    return noise.mul_(std)


def laplace_like(x: Tensor, scale: float, generator: torch.Generator) -> Tensor:
    """Samples of Laplace(0, scale) (std = scale * sqrt(2)) by inverse-CDF from one uniform draw."""
    u = torch.rand(x.shape, generator=generator, dtype=x.dtype, device=x.device).sub_(0.5)
    sign = u.sign()
    # -scale * sign(u) * log(1 - 2|u|); u = -0.5 (probability 2^-24) would give log(0): clamp it.
    mag = u.abs_().mul_(-2.0).log1p_().clamp_(min=torch.finfo(x.dtype).min)
    return mag.mul_(sign).mul_(-scale)
