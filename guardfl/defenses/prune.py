"""Gradient pruning (Zhu et al. 2019, "Deep Leakage from Gradients", Sec. 5; evaluated as GradPrune by
Huang et al. 2021, ``../shared/papers/huang2021-...``): zero the ``ratio`` fraction of gradient entries with
the smallest magnitude, per layer (each parameter tensor) or over the whole model.

Count: exactly ``ceil(ratio * (n - 1))`` entries (n: entries of the layer, or of the model for
``scope="global"``; ``guardfl.ops.selection.prune_count``), the number of entries below the
``ratio``-quantile that Huang et al.'s public code (GradAttack: ``|g| < torch.quantile(|g|, ratio)``)
zeroes when magnitudes are distinct; ties at the threshold are broken by position instead of pruning
fewer. It is ``floor(ratio * n)`` or one more; unlike ``floor`` it prunes at least one entry of every layer
of two or more entries for any ``ratio > 0`` (``floor`` left every layer under ``1 / ratio`` entries as it
was). A one-entry tensor is never pruned (ratio < 1): ``guardfl.defenses.untouched_layers`` lists such
tensors, and ``last_stats`` counts only entries that were not already zero.

``ratio`` must be > 0: ``GradPrune(0)`` would never change anything (``Identity()`` is the deliberate
undefended baseline).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, field_validator
from torch import Tensor

from guardfl.defenses.base import Defense, DefenseConfig, StepContext, register
from guardfl.defenses.strength import refuse_zero
from guardfl.ops.selection import prune_count, smallest_k_mask, smallest_k_mask_rows, zero_smallest_
from guardfl.stats import LayerStats, StageStats


class GradPruneConfig(DefenseConfig):
    kind: Literal["gradprune"] = "gradprune"
    ratio: float = Field(ge=0.0, lt=1.0, json_schema_extra={"allowed": "(0, 1)"})
    scope: Literal["layer", "global"] = Field(default="layer", json_schema_extra={"allowed": "'layer' or 'global'"})

    _ratio_not_zero = field_validator("ratio")(refuse_zero("(0, 1)", "prunes nothing"))


@register
class GradPrune(Defense):
    """Zero the ``ratio`` fraction of smallest-|g| entries, per layer or globally.

    Args:
        ratio: the fraction of entries zeroed, in (0, 1).
        scope: ``"layer"``: per parameter tensor; ``"global"``: over the whole model.
        seed: an integer in [0, 2**32 - 1] for a reproducible stream; ``None`` (the default, as deployed): OS
            entropy.
        nonfinite: ``"raise"`` (default): a NaN or inf in the gradient raises; ``"zero"``: such entries are
            zeroed.
    """

    Config = GradPruneConfig
    keeps_finite = True  # pruning only writes zeros

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
        return StageStats.from_layers(self.kind, tuple(
            LayerStats.counted(ctx.name(i), g.numel(), changed=z, zeroed=z) for i, (g, z) in enumerate(zip(grads, zeroed))
        ))

    def _apply_batch_(self, grads: list[Tensor], iteration: int, params, batched_params: bool) -> None:
        """``_apply_`` for N clients at once: the same entries of each row (ties by position)."""
        n = grads[0].shape[0]
        ratio = self.config.ratio
        if self.config.scope == "layer":
            for g in grads:
                rows = g.reshape(n, -1)
                g.copy_(rows.masked_fill(smallest_k_mask_rows(rows.abs(), prune_count(ratio, rows.shape[1])), 0.0).view_as(g))
            return
        flat = torch.cat([g.reshape(n, -1) for g in grads], 1)
        flat = flat.masked_fill(smallest_k_mask_rows(flat.abs(), prune_count(ratio, flat.shape[1])), 0.0)
        for g, part in zip(grads, flat.split([g[0].numel() for g in grads], 1)):
            g.copy_(part.reshape(g.shape))


def prune_layer_(grad: Tensor, k: int) -> int:
    """Zero, in place, the ``k`` entries of ``grad`` with the smallest magnitude. Returns how many of them
    were not zero already (the entries that changed)."""
    return zero_smallest_(grad, k)


def prune_global_(grads: list[Tensor], ratio: float) -> list[int]:
    """Zero, in place, the ``ratio`` fraction of smallest-|g| entries over all ``grads`` together.
    Returns, per tensor, how many entries changed (were not zero already)."""
    sizes = [g.numel() for g in grads]
    magnitudes = torch.cat([g.detach().reshape(-1).abs() for g in grads])
    mask = smallest_k_mask(magnitudes, prune_count(ratio, magnitudes.numel()))
    changed = torch.stack([torch.count_nonzero(m) for m in (mask & (magnitudes != 0)).split(sizes)]).tolist()
    for g, m in zip(grads, mask.split(sizes)):
        g.masked_fill_(m.view_as(g), 0)
    return changed
