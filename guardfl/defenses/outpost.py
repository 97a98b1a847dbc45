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
- Counts are exact: ``ceil(prune * (n - 1))`` entries zeroed (``guardfl.ops.selection.prune_count``: the
  entries below the ``prune``-quantile, the public code's ``np.percentile`` rule with ties broken by
  position) and ``ceil(phi * n)`` entries noised per layer. Both reach small layers: any ``prune > 0``
  prunes at least one entry of a layer of two or more (with ``floor(prune * n)``, ``prune=0.01`` left every
  layer under 100 entries as it was, a 10-class bias that reveals the labels among them), and any
  ``phi > 0`` noises at least one entry. A one-entry tensor is never pruned and has risk 0, so Outpost
  never changes it (``guardfl.defenses.untouched_layers`` lists such tensors).
- Settings that can never change the gradient are refused: ``prune=0`` with ``noise=0`` or ``phi=0``.
  ``last_stats`` counts what changed: entries zeroed that were not zero, entries the noise moved; an
  iteration that changed nothing (risk 0 and nothing to prune) reports ``fired=False``.

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
from pydantic import Field, model_validator
from torch import Tensor

from guardfl.defenses.base import Defense, DefenseConfig, StepContext, register
from guardfl.defenses.noise import NOISE_MAX
from guardfl.defenses.strength import never_changes
from guardfl.ops.change import add_counting_, changed_count
from guardfl.ops.selection import (cover_count, largest_k_mask, largest_k_mask_rows, prune_count,
                                    smallest_k_mask_rows, zero_smallest_)
from guardfl.stats import LayerStats, StageStats


class OutpostConfig(DefenseConfig):
    kind: Literal["outpost"] = "outpost"
    beta: float = Field(default=0.1, ge=0.0, allow_inf_nan=False, json_schema_extra={"allowed": "finite, >= 0"})
    phi: float = Field(default=0.4, ge=0.0, le=1.0, json_schema_extra={"allowed": "[0, 1]"})
    prune: float = Field(default=0.8, ge=0.0, lt=1.0, json_schema_extra={"allowed": "[0, 1)"})
    noise: float = Field(default=0.8, ge=0.0, le=NOISE_MAX, allow_inf_nan=False,
                         json_schema_extra={"allowed": "finite, in [0, 1e6] (times the layer's weight variance)"})

    @model_validator(mode="after")
    def _changes_something(self):
        if self.prune == 0 and (self.noise == 0 or self.phi == 0):
            raise never_changes(f"prune=0 with {'noise' if self.noise == 0 else 'phi'}=0",
                                "prune in (0, 1), or both noise > 0 and phi > 0")
        return self


def perturb_probability(iteration: int, beta: float) -> float:
    """Algorithm 1, line 6: the probability of perturbing at local iteration ``iteration`` (1-based)."""
    if iteration < 1:
        raise ValueError(f"iteration is 1-based (got {iteration})")
    return 1.0 if iteration == 1 else 1.0 / (1.0 + beta * iteration)


def layer_risk(weight: Tensor) -> float:
    """Privacy-leakage risk of a layer: the (population) variance of its current weights."""
    return float(weight.detach().var(unbiased=False)) if weight.numel() else 0.0


def outpost_layer_(grad: Tensor, std: float, prune: float, phi: float, generator: torch.Generator) -> tuple[int, int, int]:
    """Lines 8-9 of Algorithm 1 on one layer, in place. Returns the entries (zeroed that were not zero,
    moved by the noise, changed in all)."""
    n = grad.numel()
    magnitude = grad.abs()  # the diagonal empirical Fisher g^2 ranks entries as |g| does
    k_prune = prune_count(prune, n)
    m_noise = cover_count(phi, n) if std > 0 else 0
    top_fisher = largest_k_mask(magnitude, m_noise) if m_noise else None
    before = grad.clone() if top_fisher is not None else None
    zeroed = zero_smallest_(grad, k_prune, magnitude)
    if top_fisher is None:
        return zeroed, 0, zeroed
    values = torch.randn(m_noise, generator=generator, dtype=grad.dtype, device=grad.device).mul_(std)
    noised = int(add_counting_(grad, torch.zeros_like(grad).masked_scatter_(top_fisher, values)))
    return zeroed, noised, int(changed_count(before, grad))


@register
class Outpost(Defense):
    """Outpost, Algorithm 1 of Wang et al. 2024 (defaults: beta 0.1, phi 40%, rho 80%, lambda 0.8).

    Args:
        beta: the perturbation probability's decay: ``1 / (1 + beta * i)`` at local iteration ``i``.
        phi: the fraction of entries (largest Fisher information) that get noise.
        prune: the fraction of smallest-|g| entries zeroed (the paper's rho).
        noise: the noise's std as a multiple of the layer's weight variance (the paper's lambda).
        seed: an integer in [0, 2**32 - 1] for a reproducible stream; ``None`` (the default, as deployed): OS
            entropy.
        nonfinite: ``"raise"`` (default): a NaN or inf in the gradient raises; ``"zero"``: such entries are
            zeroed.
    """
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
            zeroed, noised, changed = outpost_layer_(g, std, c.prune, c.phi, self.generator(g.device))
            layers.append(LayerStats.counted(ctx.name(i), g.numel(), changed=changed, zeroed=zeroed, noised=noised,
                                             noise_std=std))
        return StageStats.from_layers(self.kind, tuple(layers))

    def _apply_batch_(self, grads: list[Tensor], iteration: int, params, batched_params: bool) -> None:
        """``_apply_`` for N clients at once: one coin per client (Algorithm 1, line 6), then per layer
        and client the same masks (the ``prune`` smallest and the ``phi`` largest of the ORIGINAL
        magnitudes, ties by position) and N(0, (lambda * Var(w))^2) noise on the latter; ``Var(w)`` per
        client when each has its own weights (FedAvg), else shared. The noise is drawn as ``outpost_layer_``
        draws it: only for the clients whose coin fired, only the ``phi`` share, in position order; so one
        client seeded like a client's Outpost draws the same stream (the red team's seeded tests)."""
        c = self.config
        n = grads[0].shape[0]
        fire = None
        if iteration != 1:
            u = torch.rand(n, generator=self.generator("cpu"))
            fire = u <= perturb_probability(iteration, c.beta)
        for g, w in zip(grads, params):
            rows = g.reshape(n, -1)
            size = rows.shape[1]
            weights = w.reshape(n, -1) if batched_params else w.reshape(1, -1)
            std = c.noise * weights.var(dim=1, unbiased=False) if weights.numel() else torch.zeros(1, device=g.device)
            magnitude = rows.abs()
            defended = rows.masked_fill(smallest_k_mask_rows(magnitude, prune_count(c.prune, size)), 0.0)
            m_noise = cover_count(c.phi, size)
            if m_noise and c.noise > 0:
                top = largest_k_mask_rows(magnitude, m_noise)
                active = torch.arange(n) if fire is None else fire.nonzero().flatten()
                if len(active):
                    active = active.to(g.device)
                    values = torch.randn(len(active), m_noise, generator=self.generator(g.device), dtype=g.dtype,
                                         device=g.device)
                    noise = torch.zeros_like(rows)
                    noise[active] = torch.zeros_like(rows[active]).masked_scatter_(top[active], values)
                    defended.add_(noise.mul_(std.to(g.dtype)[:, None]))
            if fire is not None:
                defended = torch.where(fire.to(g.device)[:, None], defended, rows)
            g.copy_(defended.view_as(g))
