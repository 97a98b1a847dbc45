"""Sign compression (signSGD; Bernstein et al. 2018), one of the defenses attacked with a sign-matching
objective in Wu et al. 2023 (LTI, appendix A): the gradient is replaced by its sign, so what the client
transmits is in {-1, 0, +1} (times the learning rate, after the optimizer). Entries already in {-1, 0, +1}
are left as they are, and ``last_stats`` counts only the others (a gradient of signs: ``fired=False``)."""

from __future__ import annotations

from typing import Literal

from torch import Tensor

from guardfl.defenses.base import Defense, DefenseConfig, StepContext, register
from guardfl.errors import NonFiniteGradientError
from guardfl.ops.change import largest_magnitudes, signs_by_magnitude_
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
    #: the input's finiteness is read from the min/max pass that decides each layer's path (``Defense.apply_``
    #: does not scan it again), and the count of a layer inside (-1, 1) is a reduction over its signs that
    #: proves the output finite: ``GuardedOptimizer`` skips its own check of those (issue 66: those two
    #: passes over every gradient took the step from 0.9x to 1.15x a plain step on ResNet-18, CPU)
    checks_input_itself = True
    verifies_output = True

    def __init__(self, *, seed: int | None = None, nonfinite: str = "raise") -> None:
        super().__init__(seed=seed, nonfinite=nonfinite)

    def _apply_(self, grads: list[Tensor], ctx: StepContext) -> StageStats:
        top = largest_magnitudes(grads)
        if any(t != t or t == float("inf") for t in top) and not ctx.known_finite(grads):
            self._handle_nonfinite(grads, ctx)  # raises, or zeroes the non-finite entries (``nonfinite``)
            top = largest_magnitudes(grads)
        changed, verified = signs_by_magnitude_(grads, top, self.scratch)
        if any(c < 0 for c in changed):  # a reduction over the signs was not finite: never leaves the defense
            raise NonFiniteGradientError(f"{self.kind}: the defended gradient has non-finite entries; refused")
        ctx.verify_output([g for g, ok in zip(grads, verified) if ok])
        return StageStats.from_layers(self.kind, tuple(
            LayerStats.counted(ctx.name(i), g.numel(), changed=c) for i, (g, c) in enumerate(zip(grads, changed))
        ))
