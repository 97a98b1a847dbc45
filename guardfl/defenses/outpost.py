"""Outpost (Wang et al. 2024, "Outpost: adaptive defense against gradient leakage", Algorithm 1;
``../shared/papers/wang2024-outpost-adaptive-defense.txt``, Sec. IV).

At local iteration ``i`` (1-based, counted per FL round: ``GuardedOptimizer.new_round()`` restarts it),
the client perturbs its batch gradient with probability ``1 / (1 + beta * i)``, and always at ``i = 1``.
When it does, for every layer ``l`` (each parameter tensor):

1. risk ``r_l = Var(w_l)`` of the layer's current weights;
2. prune: the ``prune`` fraction (the paper's rho, default 80%) of entries with the smallest |g| is zeroed;
3. noise: ``N(0, (noise * r_l)^2)`` (the paper's lambda, default 0.8) is added to the ``phi`` fraction
   (default 40%) of entries with the largest empirical Fisher information.

Interpretation and deviations (documented because the paper leaves them open):

- Empirical Fisher: the paper defines it over per-sample gradients (Eq. 4) but says it is computed "based
  on average gradients over this batch of data". We follow the text: the diagonal Fisher of an entry is
  ``g^2`` of the batch-mean gradient, taken *before* pruning, so its ranking is the ranking of |g|.
  With the defaults (phi = 0.4 > 1 - rho = 0.2) the noised set is the 20% of entries that survive
  pruning plus the next 20% by magnitude, which pruning had zeroed and which then carry pure noise.
- Steps 2 and 3 are in the paper's order (Algorithm 1, lines 8-9): prune first, then add noise.
- ``Var`` is the population variance (ddof = 0), so a one-element layer has risk 0 rather than NaN.
  A layer whose weights are all equal (a fresh BatchNorm weight, a zero bias) has risk 0 and gets no
  noise; pruning still applies. ``last_stats`` shows the per-layer noise std.
- Counts are exact: ``floor(prune * n)`` entries zeroed and ``ceil(phi * n)`` entries noised per layer.
  Rounding the noised count up is our choice: with ``floor``, a small layer (a 10-class bias, which
  reveals the labels) could receive no noise at all; with ``ceil`` any ``phi > 0`` reaches every layer.

Bugs of the public reference implementation that this one does not have (see ``../shared/NOTES.md``):
the perturbation is written back to the gradient (the reference assigned it to a loop variable); the
noise comes from this defense's own generator, seeded from OS entropy (the reference reseeded the
global RNG with a fixed seed); the Fisher ranking and both thresholds are per layer (the reference used
a global threshold and a mean over the first dimension); the iteration counter is the number of local
steps in the round (the reference used ``epoch * (batch_idx + 1)``).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from guardfl.defenses.base import Defense, DefenseConfig, StepContext, register
from guardfl.errors import ConfigError
from guardfl.ops.selection import cover_count, largest_k_mask, prune_count, zero_smallest_
from guardfl.stats import LayerStats, StageStats


class OutpostConfig(DefenseConfig):
    kind: Literal["outpost"] = "outpost"
    beta: float = Field(default=0.1, ge=0.0, allow_inf_nan=False, json_schema_extra={"allowed": "finite, >= 0"})
    phi: float = Field(default=0.4, ge=0.0, le=1.0, json_schema_extra={"allowed": "[0, 1]"})
    prune: float = Field(default=0.8, ge=0.0, lt=1.0, json_schema_extra={"allowed": "[0, 1)"})
    noise: float = Field(default=0.8, ge=0.0, allow_inf_nan=False, json_schema_extra={"allowed": "finite, >= 0"})


def perturb_probability(iteration: int, beta: float) -> float:
    """Algorithm 1, line 6: the probability of perturbing at local iteration ``iteration`` (1-based)."""
    if iteration < 1:
        raise ValueError(f"iteration is 1-based (got {iteration})")
    return 1.0 if iteration == 1 else 1.0 / (1.0 + beta * iteration)


def layer_risk(weight: Tensor) -> float:
    """Privacy-leakage risk of a layer: the (population) variance of its current weights."""
    return float(weight.detach().var(unbiased=False)) if weight.numel() else 0.0


def outpost_layer_(grad: Tensor, std: float, prune: float, phi: float, generator: torch.Generator) -> tuple[int, int]:
    """Lines 8-9 of Algorithm 1 on one layer, in place. Returns (entries zeroed, entries noised)."""
    n = grad.numel()
    magnitude = grad.abs()  # the diagonal empirical Fisher g^2 ranks entries as |g| does
    k_prune = prune_count(prune, n)
    m_noise = cover_count(phi, n) if std > 0 else 0
    top_fisher = largest_k_mask(magnitude, m_noise) if m_noise else None
    zero_smallest_(grad, k_prune, magnitude)
    if top_fisher is not None:
        values = torch.randn(m_noise, generator=generator, dtype=grad.dtype, device=grad.device).mul_(std)
        grad.add_(torch.zeros_like(grad).masked_scatter_(top_fisher, values))
    return k_prune, m_noise


@register
class Outpost(Defense):
    """Outpost, Algorithm 1 of Wang et al. 2024 (defaults: beta 0.1, phi 40%, rho 80%, lambda 0.8)."""
    randomized = True

    Config = OutpostConfig
    needs_params = True

    def __init__(
        self,
        beta: float = 0.1,
        phi: float = 0.4,
        prune: float = 0.8,
        noise: float = 0.8,
        *,
        seed: int | None = None,
        nonfinite: str = "raise",
    ) -> None:
        super().__init__(beta=beta, phi=phi, prune=prune, noise=noise, seed=seed, nonfinite=nonfinite)

    def _check_config(self) -> None:
        c = self.config
        if c.prune == 0 and (c.noise == 0 or c.phi == 0):
            raise ConfigError(
                "outpost: prune=0 with noise=0 or phi=0 never changes the gradient; "
                "allowed: prune in (0, 1) or both noise > 0 and phi > 0"
            )

    def fires(self, iteration: int) -> bool:
        """Draw the coin of Algorithm 1, line 6 (no draw at iteration 1, where it always fires)."""
        if iteration == 1:
            return True
        u = torch.rand((), generator=self.generator("cpu")).item()  # uniform in [0, 1)
        return u <= perturb_probability(iteration, self.config.beta)

    def _apply_(self, grads: list[Tensor], ctx: StepContext) -> StageStats:
        c = self.config
        if not self.fires(ctx.iteration):
            return StageStats(self.kind, False, tuple(LayerStats(ctx.name(i), g.numel()) for i, g in enumerate(grads)))
        layers = []
        for i, (g, w) in enumerate(zip(grads, ctx.params)):
            std = c.noise * layer_risk(w)
            zeroed, noised = outpost_layer_(g, std, c.prune, c.phi, self.generator(g.device))
            n = max(g.numel(), 1)
            layers.append(
                LayerStats(ctx.name(i), g.numel(), zeroed / n, noised / n, std if noised else 0.0)
            )
        return StageStats(self.kind, True, tuple(layers))
