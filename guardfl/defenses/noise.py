"""Additive gradient perturbation: Gaussian and Laplace noise of a fixed scale on every entry.

These are the "DP" baselines of the Outpost paper (Wang et al. 2024, Sec. V) and of LTI (Wu et al. 2023):
noise without clipping (unless ``clip`` is given, below) and without privacy accounting. They give NO
differential-privacy guarantee; use ``DPSGD`` (Opacus) for that.

Against a malicious server the noise's scale is fixed and the gradient's is the server's to choose: a
model rescaled where the forward pass does not see it (a layer before BatchNorm divided by ``k``, or a
ReLU layer divided by ``k`` and the next multiplied by it) sends a gradient ``k`` times larger, and the
noise vanishes beside it (the red team's ``seer`` and ``trap_weights`` do so: ``boost``; no check of
``inspect_model`` sees a layer's scale). ``clip`` bounds the gradient's norm before the noise, so that
what the noise hides no longer depends on the server's scale (a deviation from the papers, which clip
nothing; DP-SGD clips each sample). It still falls with repetition: a server that sends one model K times
and averages the updates of the same batch divides the noise by ``sqrt(K)`` (the red team's ``repeats``:
Gaussian 0.01 with ``clip`` 1 held SEER at one round and not at 16), and nothing here counts the rounds.
A read of one image from the first layer's gradient keeps noise of about ``sigma * |x| / (clip * sqrt(K))``
per pixel. Choose ``clip`` at or below the norm of the client's honest updates and certify it for the
rounds a batch is answered (README, "Noise of a fixed scale ..."; docs/research/malicious-server.md sections 20-21).

``sigma`` / ``scale`` must be > 0 (0 would send the gradient as it is; ``Identity()`` is the deliberate
undefended baseline). A positive scale too small to move an entry in the gradient's dtype changes nothing
there: ``last_stats`` counts only the entries whose value changed (``fired`` is False if none did).

The noise is drawn in float32 (float64 for float64 gradients) and cast to the gradient's dtype; every draw
is finite (``guardfl.ops.noise``). A scale that overflows the dtype after the cast (float16 ends at 65504)
is refused at ``apply_`` with ``NonFiniteGradientError`` naming the defense.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, field_validator
from torch import Tensor

from guardfl.defenses.base import Defense, DefenseConfig, StepContext, register
from guardfl.defenses.strength import refuse_zero
from guardfl.ops.change import add_counting_, changed_count, to_ints
from guardfl.ops.sensitivity import clip_joint_, joint_norm
from guardfl.ops.noise import gaussian_like, laplace_like
from guardfl.ops.scratch import Scratch
from guardfl.stats import LayerStats, StageStats


#: The largest noise std / Laplace scale accepted. The noise must stay finite arithmetic in float32: the
#: largest draw is about 6 sigma (Gaussian) or 16.6 scale (Laplace), so 1e6 keeps every entry below 2e7 and
#: a squared norm over 1e10 entries below 4e24, far from float32's 3.4e38 (GaussianNoise(1e39) was inf).
#: Noise of 1e6 already drowns any gradient (entries are rarely above 1e3). float16 layers end at 65504:
#: there a scale above a few thousand overflows, and ``apply_`` refuses the result naming the defense.
NOISE_MAX = 1e6
NOISE_RANGE = "finite, in (0, 1e6]"


class _NoiseConfig(DefenseConfig):
    #: null: the noise alone (the papers' baseline). A bound: the gradient is first scaled, over all its
    #: layers together, to an L2 norm of at most ``clip`` (the whole update's step, not each sample's: no DP)
    clip: float | None = Field(default=None, gt=0.0, le=NOISE_MAX, allow_inf_nan=False,
                               json_schema_extra={"allowed": "null (no clipping) or finite, in (0, 1e6]"})


class GaussianNoiseConfig(_NoiseConfig):
    kind: Literal["gaussian"] = "gaussian"
    sigma: float = Field(ge=0.0, le=NOISE_MAX, allow_inf_nan=False, json_schema_extra={"allowed": NOISE_RANGE})

    sigma_not_zero = field_validator("sigma")(refuse_zero(NOISE_RANGE, "adds no noise"))


class LaplaceNoiseConfig(_NoiseConfig):
    kind: Literal["laplace"] = "laplace"
    scale: float = Field(ge=0.0, le=NOISE_MAX, allow_inf_nan=False, json_schema_extra={"allowed": NOISE_RANGE})

    scale_not_zero = field_validator("scale")(refuse_zero(NOISE_RANGE, "adds no noise"))


class _AdditiveNoise(Defense):
    randomized = True
    def _std(self) -> float:
        raise NotImplementedError

    def _sample(self, g: Tensor, scratch: Scratch | None = None) -> Tensor:
        raise NotImplementedError

    def _apply_(self, grads: list[Tensor], ctx: StepContext) -> StageStats:
        scratch = self.scratch
        clip = self.config.clip
        # a clip that binds scales every entry: the copies that count what changed only then (the hot path)
        before = [g.clone() for g in grads] if clip is not None and joint_norm(grads) > clip else None
        if before is not None:
            clip_joint_(grads, clip)
        noised = to_ints([add_counting_(g, self._sample(g, scratch), scratch) for g in grads])
        changed = noised if before is None else to_ints([changed_count(b, g) for b, g in zip(before, grads)])
        std = self._std()
        return StageStats.from_layers(self.kind, tuple(
            LayerStats.counted(ctx.name(i), g.numel(), changed=c, noised=m, noise_std=std)
            for i, (g, c, m) in enumerate(zip(grads, changed, noised))
        ))


@register
class GaussianNoise(_AdditiveNoise):
    """g + N(0, sigma^2) on every entry (after scaling g to norm ``clip`` when given). No accounting: not DP.

    Args:
        sigma: the noise's standard deviation.
        clip: ``None``: noise alone; a bound: the whole gradient is first scaled to this L2 norm (not per
            sample: no DP).
        seed: an integer in [0, 2**32 - 1] for a reproducible stream; ``None`` (the default, as deployed): OS
            entropy.
        nonfinite: ``"raise"`` (default): a NaN or inf in the gradient raises; ``"zero"``: such entries are
            zeroed.
    """

    Config = GaussianNoiseConfig

    def __init__(self, sigma: float, *, clip: float | None = None, seed: int | None = None, nonfinite: str = "raise") -> None:
        super().__init__(sigma=sigma, clip=clip, seed=seed, nonfinite=nonfinite)

    def _std(self) -> float:
        return self.config.sigma

    def _sample(self, g: Tensor, scratch: Scratch | None = None) -> Tensor:
        return gaussian_like(g, self.config.sigma, self.generator(g.device), scratch)


@register
class LaplaceNoise(_AdditiveNoise):
    """g + Laplace(0, scale) on every entry (std = scale * sqrt(2)), after scaling g to norm ``clip`` when
    given. No accounting: not DP.

    Args:
        scale: the Laplace scale (std ``scale * sqrt(2)``).
        clip: ``None``: noise alone; a bound: the whole gradient is first scaled to this L2 norm (not per
            sample: no DP).
        seed: an integer in [0, 2**32 - 1] for a reproducible stream; ``None`` (the default, as deployed): OS
            entropy.
        nonfinite: ``"raise"`` (default): a NaN or inf in the gradient raises; ``"zero"``: such entries are
            zeroed.
    """

    Config = LaplaceNoiseConfig

    def __init__(self, scale: float, *, clip: float | None = None, seed: int | None = None, nonfinite: str = "raise") -> None:
        super().__init__(scale=scale, clip=clip, seed=seed, nonfinite=nonfinite)

    def _std(self) -> float:
        return self.config.scale * math.sqrt(2.0)

    def _sample(self, g: Tensor, scratch: Scratch | None = None) -> Tensor:
        return laplace_like(g, self.config.scale, self.generator(g.device), scratch)
