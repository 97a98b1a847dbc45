"""Sign compression (signSGD; Bernstein et al. 2018), one of the defenses attacked with a sign-matching
objective in Wu et al. 2023 (LTI, appendix A): the gradient is replaced by its sign, so what the client
transmits is in {-1, 0, +1} (times the learning rate, after the optimizer)."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from guardfl.defenses.base import Defense, DefenseConfig, StepContext, register
from guardfl.stats import LayerStats, StageStats


class SignCompressionConfig(DefenseConfig):
    kind: Literal["sign"] = "sign"


@register
class SignCompression(Defense):
    """Replace every gradient entry by its sign."""

    Config = SignCompressionConfig

    def __init__(self, *, seed: int | None = None, nonfinite: str = "raise") -> None:
        super().__init__(seed=seed, nonfinite=nonfinite)

    def _apply_(self, grads: list[Tensor], ctx: StepContext) -> StageStats:
        torch._foreach_sign_(grads)
        layers = tuple(LayerStats(ctx.name(i), g.numel()) for i, g in enumerate(grads))
        return StageStats(self.kind, fired=True, layers=layers)
