"""Noise samplers that draw only from the generator they are given (never the global RNG).

Every sample is finite, in every dtype. Noise is computed in float32 (float64 for float64 tensors) and
cast at the end: a 16-bit ``torch.rand`` has only 8 to 11 random bits, so an inverse CDF evaluated in that
dtype hits its pole (``log(0)``) for a fraction of a percent of the entries (bfloat16: 0.29%). A scale
large enough to overflow the target dtype after the cast (float16 tops out at 65504) still gives inf there;
``Defense.apply_`` and ``GuardedOptimizer`` refuse such a defended gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from guardfl.ops.scratch import Scratch


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype noise is computed in: float64 for float64 tensors, float32 for every other one."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _draw(x: Tensor, sample, generator: torch.Generator, scratch: Scratch | None) -> Tensor:
    """``sample`` (torch.randn or torch.rand) of ``x``'s shape in the work dtype, into ``scratch`` when given
    (the same values either way: ``out=`` changes where they land, not the stream)."""
    work = _work_dtype(x.dtype)
    if scratch is None:
        return sample(x.shape, generator=generator, dtype=work, device=x.device)
    return sample(x.shape, generator=generator, out=scratch.like(x, work))


def gaussian_like(x: Tensor, std: float, generator: torch.Generator, scratch: Scratch | None = None) -> Tensor:
    """Samples of N(0, std^2) with the shape, dtype and device of ``x`` (in a view of ``scratch`` when
    given and ``x`` is float32 or float64)."""
    return _draw(x, torch.randn, generator, scratch).mul_(std).to(x.dtype)


def laplace_like(x: Tensor, scale: float, generator: torch.Generator, scratch: Scratch | None = None) -> Tensor:
    """Samples of Laplace(0, scale) (std = scale * sqrt(2)) with the shape, dtype and device of ``x``.

    One uniform draw u in [0, 1) per entry gives the sign (u < 1/2) and, from w = 2u mod 1 in [0, 1), the
    magnitude -log(1 - w) ~ Exp(1). Both steps are exact in binary floating point and w < 1 strictly, so the
    pole log(0) is never reached: the largest magnitude is about 16.6 * scale (float32 work) or
    36.7 * scale (float64).
    """
    return laplace_from_uniform_(_draw(x, torch.rand, generator, scratch), scale).to(x.dtype)


def laplace_from_uniform_(u: Tensor, scale: float) -> Tensor:
    """Laplace(0, scale) samples from uniforms ``u`` in [0, 1) (float32 or float64), computed in place
    in ``u``'s dtype: sign from u < 1/2, magnitude -log(1 - w) * scale with w = 2u mod 1. Finite for every
    u in [0, 1], the ends included (u = 1, which rand never returns, is clamped just below 1)."""
    negative = u < 0.5
    w = u.mul_(2.0).sub_((~negative).to(u.dtype))  # 2u (u < 1/2) or 2u - 1 (u >= 1/2): exact, in [0, 1)
    w.clamp_(min=0.0, max=1.0 - torch.finfo(u.dtype).eps / 2)  # defensive: strictly below 1
    mag = w.neg_().log1p_().mul_(-scale)  # -log(1 - w) * scale: finite, >= 0
    return mag.mul_(negative.to(mag.dtype).mul_(-2.0).add_(1.0))  # negative half: -mag
