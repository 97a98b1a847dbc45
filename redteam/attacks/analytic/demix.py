"""Demixing: from reconstructed MixUp / InstaHide encodings back to the private images (pure functions).

Setting (Huang et al. 2021, Sec. 4; Carlini et al. 2020): the gradient attack returns m encodings, each a
mix of k DISTINCT private images with non-negative coefficients summing to 1, each at most ``cap``
(InstaHide additionally flips signs: taking |.| undoes that exactly when images are non-negative, as
they are in guardfl's [0, 1] inputs). The attacker knows k and the cap (the configuration), not which
images were mixed nor the coefficients (the randomness). Writing Y (m x d) for the encodings, the model is

    Y = C X,   C >= 0, rows of C sum to 1, <= k non-zeros per row, every entry <= cap,   X in the input box.

``demix`` solves it blind, in the spirit of Carlini et al.'s decode: (1) candidates for the n private
images (the encodings themselves when m = n, else farthest-point seeds refined by k-means: each private
image sits in many encodings, so encodings cluster around it), (2) a soft assignment of each encoding to
k candidates from their similarity, projected onto the capped simplex (the cap is what forbids the
trivial answer X = Y: no encoding can be a single image), (3) least squares for the originals given the
assignment, clipped to the input box, alternated with (2). Deviations from Carlini et al.: no learned
similarity network (we use the Euclidean distance between |encodings|), no combinatorial clique search
(the sparse projection plays its role), and the regression uses the images only (not the soft labels).
Huang et al. instead GRANT the attacker the mixing indices and coefficients (an upper bound that uses the
defense's randomness); ``oracle_demix`` is that bound, for reports labelled as an oracle only.
"""

from __future__ import annotations

import torch
from torch import Tensor


def project_capped_simplex(v: Tensor, cap: float, k: int) -> Tensor:
    """Rows of ``v`` projected onto {c >= 0, sum c = 1, c <= cap} restricted to each row's k largest
    entries (Euclidean projection on that support, by bisection on the shift). Needs k * cap >= 1."""
    if k * cap < 1 - 1e-9:
        raise ValueError(f"k * cap must be >= 1 (got k={k}, cap={cap})")
    k = min(k, v.shape[1])
    top, idx = v.topk(k, dim=1)
    lo = top.min(1, keepdim=True).values - 1.0
    hi = top.max(1, keepdim=True).values
    for _ in range(60):
        mid = (lo + hi) / 2
        total = (top - mid).clamp(0, cap).sum(1, keepdim=True)
        lo = torch.where(total > 1, mid, lo)
        hi = torch.where(total > 1, hi, mid)
    vals = (top - (lo + hi) / 2).clamp(0, cap)
    vals = vals / vals.sum(1, keepdim=True).clamp_min(1e-12)  # exact sum despite bisection tolerance
    return torch.zeros_like(v).scatter_(1, idx, vals)


def _seeds(y: Tensor, n: int, iterations: int = 10) -> Tensor:
    """n candidate rows: farthest-point seeds (the first: the row closest to the mean), refined by k-means."""
    d = torch.cdist(y, y.mean(0, keepdim=True))[:, 0]
    chosen = [int(d.argmin())]
    dist = torch.cdist(y, y[chosen[-1]][None])[:, 0]
    for _ in range(1, n):
        chosen.append(int(dist.argmax()))
        dist = torch.minimum(dist, torch.cdist(y, y[chosen[-1]][None])[:, 0])
    centres = y[chosen].clone()
    for _ in range(iterations):
        assign = torch.cdist(y, centres).argmin(1)
        for j in range(n):
            members = y[assign == j]
            if len(members):
                centres[j] = members.mean(0)
    return centres


def _assign(y: Tensor, x: Tensor, k: int, cap: float) -> Tensor:
    """Initial soft assignment: similarity = -squared distance, scaled per row, projected."""
    dist = torch.cdist(y, x).pow(2)
    scale = dist.mean(1, keepdim=True).clamp_min(1e-12)
    return project_capped_simplex(-dist / scale, cap, k)


def demix(y: Tensor, n: int, k: int, cap: float, value_range: tuple[float, float], *, iterations: int = 200,
          inner: int = 5, ridge: float = 1e-3) -> tuple[Tensor, Tensor, float]:
    """Blind demixing of ``y`` (m x d encodings, already made non-negative for InstaHide) into ``n``
    images. Returns (X: n x d, C: m x n, mean squared residual ||Y - C X||^2 / (m d))."""
    y = y.double()
    lo, hi = value_range
    x = (y.clone() if y.shape[0] == n else _seeds(y, n)).clamp(lo, hi)
    c = _assign(y, x, k, cap)
    eye = torch.eye(n, dtype=y.dtype)
    for _ in range(iterations):
        # (2) assignment: projected gradient steps on C (step 1/L, L = ||X X^T||_2)
        gram = x @ x.T
        step = 1.0 / (torch.linalg.matrix_norm(gram, ord=2) + 1e-12)
        cross = y @ x.T
        for _ in range(inner):
            c = project_capped_simplex(c - step * (c @ gram - cross), cap, k)
        # (3) originals by (ridge-regularised, toward the current estimate) least squares, in the box
        a = c.T @ c + ridge * eye
        x = torch.linalg.solve(a, c.T @ y + ridge * x).clamp(lo, hi)
    residual = float((y - c @ x).pow(2).mean())
    return x.float(), c.float(), residual


def oracle_demix(y: Tensor, c_true: Tensor, value_range: tuple[float, float]) -> Tensor:
    """Huang et al. 2021's upper bound: the mixing matrix is GRANTED (uses the defense's randomness), the
    originals are its least-squares solution in the box. For reports labelled as an oracle only."""
    x = torch.linalg.lstsq(c_true.double(), y.double()).solution
    return x.clamp(*value_range).float()
