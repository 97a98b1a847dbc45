"""DP-SGD (Abadi et al. 2016) through Opacus, with real (epsilon, delta) accounting.

Per-sample gradients are clipped to ``max_grad_norm`` and Gaussian noise of std
``noise_multiplier * max_grad_norm`` is added to their sum; Poisson sampling of the batches; the
accountant (``rdp`` or ``prv``) tracks epsilon. Give ``noise_multiplier``, or ``target_epsilon`` with
``epochs`` (Opacus ``make_private_with_epsilon`` then picks the noise). It needs per-sample gradients, so
it is applied by ``guardfl.protect(model, optimizer, loader, defense)``, not by ``guardfl.wrap``.

``noise_multiplier=0`` is accepted, as clipping only: per-sample clipping still changes the update whenever
a sample's gradient norm exceeds ``max_grad_norm`` (and reweights the samples of a batch), but it gives no
privacy guarantee (epsilon is infinite), and for a batch of one it only rescales the gradient, which a
cosine-similarity attack ignores. It is the noiseless reference the red team compares DP runs with; for a
deliberate undefended baseline use ``Identity()``. Unlike the gradient defenses, DP-SGD's effect is not
reported in ``last_stats`` (Opacus applies it inside its optimizer); its accountant reports epsilon.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from torch import Tensor

from guardfl.defenses.base import Defense, DefenseConfig, StepContext, register
from guardfl.errors import ConfigError
from guardfl.stats import StageStats


#: Bounds that keep DP-SGD's arithmetic finite and its accountants quick (every float is also finite):
#: - noise_multiplier <= 1000: noise_multiplier=inf hung the RDP accountant for minutes; beyond ~100 the RDP
#:   epsilon no longer decreases (it sits at its floor for the largest order) and the update is pure noise;
#:   at 1000 both accountants answer in well under a second.
#: - max_grad_norm <= 1e6: inf gave NaN weights (and a finite epsilon); the noise std is
#:   noise_multiplier * max_grad_norm <= 1e9, finite in float32.
#: - target_epsilon <= 100: inf silently became noise multiplier 10 (Opacus's search starts there); an
#:   epsilon above 100 (a likelihood ratio of e^100) certifies nothing, and the PRV accountant's noise search
#:   slows sharply for large targets (about 20 s at 100, minutes at 1000). For weaker settings give
#:   noise_multiplier.
NOISE_MULTIPLIER_MAX = 1000.0
MAX_GRAD_NORM_MAX = 1e6
TARGET_EPSILON_MAX = 100.0


class DPSGDConfig(DefenseConfig):
    kind: Literal["dpsgd"] = "dpsgd"
    noise_multiplier: float | None = Field(default=None, ge=0, le=NOISE_MULTIPLIER_MAX,
                                           json_schema_extra={"allowed": "null or finite, in [0, 1000]"})
    max_grad_norm: float = Field(default=1.0, gt=0, le=MAX_GRAD_NORM_MAX, json_schema_extra={"allowed": "finite, in (0, 1e6]"})
    target_epsilon: float | None = Field(default=None, gt=0, le=TARGET_EPSILON_MAX,
                                         json_schema_extra={"allowed": "null or finite, in (0, 100]"})
    delta: float = Field(default=1e-5, gt=0, lt=1, json_schema_extra={"allowed": "(0, 1)"})
    epochs: int | None = Field(default=None, ge=1, json_schema_extra={"allowed": "null or an integer >= 1"})
    accountant: Literal["rdp", "prv"] = Field(default="rdp", json_schema_extra={"allowed": "'rdp' or 'prv'"})
    poisson_sampling: bool = True

    @model_validator(mode="after")
    def _one_way(self):
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError("give exactly one of noise_multiplier or target_epsilon (with epochs)")
        if self.target_epsilon is not None and self.epochs is None:
            raise ValueError("target_epsilon needs epochs (the number of passes the privacy budget covers)")
        return self


@register
class DPSGD(Defense):
    """DP-SGD through Opacus (clipping, Gaussian noise, Poisson sampling, epsilon accounting).

    Args:
        noise_multiplier: the noise's std as a multiple of ``max_grad_norm``; ``None``: chosen from
            ``target_epsilon``.
        max_grad_norm: each sample's gradient is clipped to this L2 norm.
        target_epsilon: the epsilon to reach after ``epochs`` (with ``noise_multiplier=None``).
        delta: the delta of the (epsilon, delta) guarantee.
        epochs: the epochs ``target_epsilon`` is spread over.
        accountant: ``"rdp"`` or ``"prv"``: Opacus's accountant.
        poisson_sampling: draw the batches by Poisson sampling (the accounting assumes it).
        seed: an integer in [0, 2**32 - 1] for a reproducible stream; ``None`` (the default, as deployed): OS
            entropy.
        nonfinite: ``"raise"`` (default): a NaN or inf in the gradient raises; ``"zero"``: such entries are
            zeroed.
    """
    randomized = True

    Config = DPSGDConfig
    stage = "dp"

    def __init__(
        self, noise_multiplier: float | None = None, max_grad_norm: float = 1.0, target_epsilon: float | None = None,
        delta: float = 1e-5, epochs: int | None = None, accountant: str = "rdp", *, poisson_sampling: bool = True,
        seed: int | None = None, nonfinite: str = "raise",
    ) -> None:
        super().__init__(noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm, target_epsilon=target_epsilon,
                         delta=delta, epochs=epochs, accountant=accountant, poisson_sampling=poisson_sampling,
                         seed=seed, nonfinite=nonfinite)

    def _apply_(self, grads: list[Tensor], ctx: StepContext) -> StageStats:
        raise ConfigError("dpsgd needs per-sample gradients: use guardfl.protect(model, optimizer, loader, defense)")
