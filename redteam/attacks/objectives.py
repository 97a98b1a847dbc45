"""Pure functions for the attack objectives: gradient distances, image priors, BatchNorm prior.

References: L2 distance (Zhu et al. 2019, DLG); cosine distance + total variation (Geiping et al. 2020,
"Inverting Gradients"); BatchNorm prior R_BN (Yin et al. 2021; Huang et al. 2021, Eq. 3); sign-matching
loss (Wu et al. 2023, appendix A, Eq. 4); cosine over the non-zero coordinates for pruned updates (ibid.);
TV on |x| against InstaHide's sign flips (Huang et al. 2021, Sec. 4).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


def l2_distance(sim: Sequence[Tensor], obs: Sequence[Tensor], masks: Sequence[Tensor] | None = None) -> Tensor:
    """sum ||sim - obs||^2 over all coordinates (only where ``masks`` is True, when given)."""
    total = 0.0
    for i, (a, b) in enumerate(zip(sim, obs)):
        d = (a - b).pow(2)
        total = total + (d * masks[i] if masks is not None else d).sum()
    return total


def cosine_distance(sim: Sequence[Tensor], obs: Sequence[Tensor], masks: Sequence[Tensor] | None = None) -> Tensor:
    """1 - cos(sim, obs) of the whole concatenated update (only over ``masks`` when given)."""
    dot, ns, no = 0.0, 0.0, 0.0
    for i, (a, b) in enumerate(zip(sim, obs)):
        if masks is not None:
            a = a * masks[i]
        dot = dot + (a * b).sum()
        ns = ns + a.pow(2).sum()
        no = no + b.pow(2).sum()
    return 1.0 - dot / (ns.sqrt() * no.sqrt() + 1e-12)


def sign_hinge_distance(sim: Sequence[Tensor], obs_sign: Sequence[Tensor]) -> Tensor:
    """Wu et al. 2023, Eq. 4: sum_i max(-g_i * sign_i, 0)^2; zero when every sign agrees."""
    total = 0.0
    for a, s in zip(sim, obs_sign):
        total = total + torch.relu(-a * s).pow(2).sum()
    return total


def soft_sign(g: Tensor) -> Tensor:
    """Differentiable surrogate of sign(g): tanh(g / mean|g|), the scale detached (our choice of scale:
    LTI does not give one; this puts a typical entry in tanh's transition region)."""
    scale = g.detach().abs().mean() + 1e-12
    return torch.tanh(g / scale)


def total_variation(x: Tensor) -> Tensor:
    """Anisotropic total variation of images ``(..., H, W)``: mean |dx| + mean |dy|."""
    dx = (x[..., :, 1:] - x[..., :, :-1]).abs().mean()
    dy = (x[..., 1:, :] - x[..., :-1, :]).abs().mean()
    return dx + dy


def bn_prior(stats: Sequence[tuple[Tensor, Tensor]], targets: Sequence[tuple[Tensor, Tensor]]) -> Tensor:
    """R_BN = sum_l ||mean_l - mu_l||_2 + ||var_l - sigma_l^2||_2 (Huang et al. 2021, Eq. 3)."""
    total = 0.0
    for (m, v), (mt, vt) in zip(stats, targets):
        total = total + (m - mt).norm() + (v - vt).norm()
    return total
