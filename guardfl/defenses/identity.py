"""The identity defense: sends the gradient as it is. The baseline for benchmarks and the red team.

It is the one deliberate way to train undefended: zero-strength settings of the other defenses
(``GradPrune(0)``, ``GaussianNoise(0)``...) are refused and point here, and it is refused as a member of a
stack, where it would do nothing. ``last_stats`` reports ``fired=False``.
"""

from __future__ import annotations

from typing import Literal

from torch import Tensor

from guardfl.defenses.base import Defense, DefenseConfig, StepContext, register
from guardfl.stats import LayerStats, StageStats


class IdentityConfig(DefenseConfig):
    kind: Literal["identity"] = "identity"


@register
class Identity(Defense):
    """No defense. ``wrap(opt, Identity())`` trains bit-for-bit like ``opt``.

    Args:
        seed: an integer in [0, 2**32 - 1] for a reproducible stream; ``None`` (the default, as deployed): OS
            entropy.
        nonfinite: ``"raise"`` (default): a NaN or inf in the gradient raises; ``"zero"``: such entries are
            zeroed.
    """

    Config = IdentityConfig
    keeps_finite = True  # nothing changes

    def __init__(self, *, seed: int | None = None, nonfinite: str = "raise") -> None:
        super().__init__(seed=seed, nonfinite=nonfinite)

    def _apply_(self, grads: list[Tensor], ctx: StepContext) -> StageStats:
        layers = tuple(LayerStats(ctx.name(i), g.numel()) for i, g in enumerate(grads))
        return StageStats(self.kind, fired=False, layers=layers)
