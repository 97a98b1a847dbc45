"""Gradient pruning (Zhu et al. 2019, "Deep Leakage from Gradients", Sec. 5; evaluated as GradPrune by
Huang et al. 2021, ``../shared/papers/huang2021-...``): zero the ``ratio`` fraction of gradient entries with
the smallest magnitude, per layer (each parameter tensor) or over the whole model.

The count zeroed is exactly ``floor(ratio * n)`` (n: entries of the layer, or of the model for
``scope="global"``); ties at the threshold are broken by position. Selection is exact (``guardfl.ops``).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from guardfl.defenses.base import Defense, DefenseConfig, StepContext, register
from guardfl.ops.selection import prune_count, smallest_k_mask, zero_smallest_
from guardfl.stats import LayerStats, StageStats


class GradPruneConfig(DefenseConfig):
    kind: Literal["gradprune"] = "gradprune"
    ratio: float = Field(ge=0.0, lt=1.0, json_schema_extra={"allowed": "[0, 1)"})
    scope: Literal["layer", "global"] = Field(default="layer", json_schema_extra={"allowed": "'layer' or 'global'"})


@register
class GradPrune(Defense):
    """Zero the ``ratio`` fraction of smallest-|g| entries, per layer or globally."""

    Config = GradPruneConfig

    def __init__(
        self, ratio: float, scope: str = "layer", *, seed: int | None = None, nonfinite: str = "raise"
    ) -> None:
        super().__init__(ratio=ratio, scope=scope, seed=seed, nonfinite=nonfinite)

    def _apply_(self, grads: list[Tensor], ctx: StepContext) -> StageStats:
        ratio = self.config.ratio
        if self.config.scope == "layer":
            zeroed = [prune_layer_(g, prune_count(ratio, g.numel())) for g in grads]
        else:
            zeroed = prune_global_(grads, ratio)
        layers = tuple(
            LayerStats(ctx.name(i), g.numel(), fraction_zeroed=z / max(g.numel(), 1))
            for i, (g, z) in enumerate(zip(grads, zeroed))
        )
        return StageStats(self.kind, fired=True, layers=layers)


def prune_layer_(grad: Tensor, k: int) -> int:
    """Zero, in place, the ``k`` entries of ``grad`` with the smallest magnitude. Returns ``k``."""
    zero_smallest_(grad, k)
    return k


def prune_global_(grads: list[Tensor], ratio: float) -> list[int]:
    """Zero, in place, the ``ratio`` fraction of smallest-|g| entries over all ``grads`` together.
    Returns the count zeroed in each tensor."""
    sizes = [g.numel() for g in grads]
    magnitudes = torch.cat([g.detach().reshape(-1).abs() for g in grads])
    mask = smallest_k_mask(magnitudes, prune_count(ratio, magnitudes.numel()))
    counts = []
    for g, m in zip(grads, mask.split(sizes)):
        g.masked_fill_(m.view_as(g), 0)
        counts.append(int(torch.count_nonzero(m)))
    return counts
