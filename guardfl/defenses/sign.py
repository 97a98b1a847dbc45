"""Sign compression (signSGD; Bernstein et al. 2018), one of the defenses attacked with a sign-matching
objective in Wu et al. 2023 (LTI, appendix A): the gradient is replaced by its sign, so what the client
transmits is in {-1, 0, +1} (times the learning rate, after the optimizer). Entries already in {-1, 0, +1}
are left as they are, and ``last_stats`` counts only the others (a gradient of signs: ``fired=False``)."""

from __future__ import annotations

from typing import Literal

from torch import Tensor

from guardfl.defenses.base import Defense, DefenseConfig, StepContext, register
from guardfl.ops.change import signs_counting_, to_ints
from guardfl.stats import LayerStats, StageStats


class SignCompressionConfig(DefenseConfig):
    kind: Literal["sign"] = "sign"


@register
class SignCompression(Defense):
    """Replace every gradient entry by its sign.

    Args:
        seed: an integer in [0, 2**32 - 1] for a reproducible stream; ``None`` (the default, as deployed): OS
            entropy.
        nonfinite: ``"raise"`` (default): a NaN or inf in the gradient raises; ``"zero"``: such entries are
            zeroed.
    """

    Config = SignCompressionConfig
    keeps_finite = True  # sign maps finite entries to -1, 0 or +1

    def __init__(self, *, seed: int | None = None, nonfinite: str = "raise") -> None:
        super().__init__(seed=seed, nonfinite=nonfinite)

    def _apply_(self, grads: list[Tensor], ctx: StepContext) -> StageStats:
        changed = to_ints(signs_counting_(grads, self.scratch))
        return StageStats.from_layers(self.kind, tuple(
            LayerStats.counted(ctx.name(i), g.numel(), changed=c) for i, (g, c) in enumerate(zip(grads, changed))
        ))
