"""Independent component analysis for the Cocktail Party Attack (Kariyappa et al. 2023, Sec. 3-4).

Pure functions. The mixed signals are the rows of ``G`` (m x d): one row per neuron of a linear layer,
each a linear mix of the B sources (the layer's inputs, one per sample) over d coordinates (pixels or
embedding features): ``G = A X``.

- ``whiten``: centre every row over its d coordinates, take the m x m covariance ``G_c G_c^T / (d - 1)``,
  keep its top-B eigenpairs (``torch.linalg.eigh``: the matrix is symmetric; the release's general ``eig``
  is not needed) and map to ``Z = D^-1/2 E^T G_c`` with identity covariance. A known i.i.d. noise variance
  on G's entries is subtracted from the eigenvalues first (noise-aware whitening).
- ``negentropy``: Hyvarinen's log-cosh approximation, Eq. 7: ``E[log cosh^2(a s) / a^2]``. It is part of
  the objective (the released code computes it and then overwrites it with zero).
- ``mutual_independence``: Eq. 8, ``E_{i != j} exp(T |cos(u_i, u_j)|)`` over the unmixing matrix's rows
  (minus 1, so an orthogonal U costs 0).
- ``bias_scale``: the scale and sign of every component without the ground truth: the bias gradient of the
  same layer is ``A 1``, so with the total unmixing ``M`` (whitening then U) applied to the UNcentred G,
  ``(M G)_i / (M g_b)_i`` is the i-th source itself (Sec. 3's linear model; the analytic relation of
  Phong et al. / Geiping et al.'s imprint attacks), its mean, scale and sign included.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor


def whiten(g: Tensor, k: int, noise_var: float = 0.0, eps: float = 1e-10) -> tuple[Tensor, Tensor, Tensor]:
    """``(Z, W, mean)``: ``Z = W (g - mean)`` is ``(k, d)`` with identity covariance; ``W`` is ``(k, m)``."""
    m, d = g.shape
    if not 1 <= k <= m:
        raise ValueError(f"whiten: need 1 <= k <= {m} components (got {k})")
    g = g.double()
    mean = g.mean(1, keepdim=True)
    gc = g - mean
    cov = gc @ gc.T / max(d - 1, 1)
    vals, vecs = torch.linalg.eigh(cov)  # ascending
    vals, vecs = vals.flip(0)[:k], vecs.flip(1)[:, :k]
    vals = torch.maximum(vals - noise_var, eps * vals[0].clamp_min(eps))  # a floor, no host sync
    w = vecs.T / vals.sqrt()[:, None]
    return (w @ gc).float(), w.float(), mean.float()


def _log_cosh_sq(x: Tensor, a: float) -> Tensor:
    """``log cosh^2(a x) / a^2``, numerically stable."""
    ax = (a * x).abs()
    return 2 * (ax + F.softplus(-2 * ax) - math.log(2.0)) / a**2


@functools.lru_cache(maxsize=16)
def gaussian_reference(a: float) -> float:
    """``E[log cosh^2(a v) / a^2]`` for v ~ N(0, 1) (Gauss-Hermite quadrature, deterministic)."""
    nodes, weights = np.polynomial.hermite_e.hermegauss(80)
    values = 2 * np.log(np.cosh(a * nodes)) / a**2
    return float((weights * values).sum() / weights.sum())


def negentropy(s: Tensor, a: float = 1.0, form: str = "hyvarinen") -> Tensor:
    """Per row of ``s`` (unit variance), larger = less Gaussian.

    ``hyvarinen`` (default): ``|E[G(s)] - E[G(v)]|`` with ``G(u) = log cosh^2(a u) / a^2`` and v standard
    normal: Hyvarinen & Oja's approximation (which the paper cites; they square the difference, we take
    its absolute value, the same ordering at the magnitude of Eq. 7, so the paper's weights of the other
    terms keep their meaning); it rewards departure from Gaussianity in either direction. ``paper``: Eq. 7 as printed, ``E[G(s)]`` alone, which rewards only sub-Gaussian
    sources (flat-histogram images) and pushes super-Gaussian ones (sparse ReLU embeddings) the wrong way.
    """
    e = _log_cosh_sq(s, a).mean(1)
    if form == "paper":
        return e
    return (e - gaussian_reference(a)).abs()


def mutual_independence(u: Tensor, temperature: float) -> Tensor:
    """Eq. 8: mean over i != j of ``exp(T |cos(u_i, u_j)|) - 1`` (0 for orthogonal rows)."""
    k = u.shape[0]
    if k < 2:
        return u.new_zeros(())
    un = F.normalize(u, dim=1)
    cos = (un @ un.T).abs()
    off = ~torch.eye(k, dtype=torch.bool, device=u.device)
    return (torch.exp(temperature * cos[off]) - 1).mean()


def sign_regulariser(s: Tensor) -> Tensor:
    """The ReLU-embedding prior (Sec. 4.2): ``mean(min(|relu(-s)|, |relu(s)|))`` pushes every component
    to one sign (either: the sign is settled afterwards)."""
    return torch.minimum(F.relu(-s), F.relu(s)).mean()


def bias_scale(unmix: Tensor, g: Tensor, g_bias: Tensor, eps: float = 1e-12) -> Tensor:
    """The sources from the total unmixing ``unmix`` (k x m), the layer's weight update ``g`` (m x d) and
    its bias update ``g_bias`` (m,): row i is ``(unmix g)_i / (unmix g_bias)_i``."""
    num = unmix.double() @ g.double()
    den = unmix.double() @ g_bias.double()
    den = torch.where(den.abs() > eps, den, torch.full_like(den, eps))
    return (num / den[:, None]).float()


def skew_sign(s: Tensor) -> Tensor:
    """Fallback sign without a bias (documented heuristic): +1 where a row's skewness is >= 0. Natural
    images and ReLU embeddings are mostly right-skewed (few bright pixels, few active units)."""
    c = s - s.mean(1, keepdim=True)
    skew = (c**3).mean(1) / c.pow(2).mean(1).clamp_min(1e-12).pow(1.5)
    return torch.where(skew >= 0, 1.0, -1.0).to(s.dtype)
