"""What a defense did in one step: for logs, for ``GuardedOptimizer.last_stats`` and for the red team.

Every number is counted on the gradient, never inferred from the settings: a stage that changed no entry
(noise too small for the dtype, pruning of entries already zero, a small layer its count rounds to zero)
reports ``fired=False`` and zero fractions.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class LayerStats:
    """One parameter tensor in one defense stage.

    ``fraction_zeroed``: fraction of its entries the stage set to zero that were not zero before (pruning).
    ``fraction_noised``: fraction of its entries whose value the stage's noise changed (an entry whose noise
    is too small to move it in the gradient's dtype is not counted). ``noise_std``: standard deviation of
    that noise (Laplace: ``scale * sqrt(2)``; 0 when no entry was noised). ``fraction_changed``: fraction of
    its entries whose value differs after the stage, by any means (pruning, noise, clipping, sign).
    """

    name: str
    numel: int
    fraction_zeroed: float = 0.0
    fraction_noised: float = 0.0
    noise_std: float = 0.0
    fraction_changed: float = 0.0

    @classmethod
    def counted(
        cls, name: str, numel: int, *, changed: int, zeroed: int = 0, noised: int = 0, noise_std: float = 0.0
    ) -> "LayerStats":
        """Stats from entry counts (fractions of ``numel``)."""
        n = max(numel, 1)
        return cls(name, numel, zeroed / n, noised / n, noise_std if noised else 0.0, changed / n)


@dataclass(frozen=True)
class StageStats:
    """One defense in one step. ``fired``: whether the stage changed at least one gradient entry in this
    step (False for the identity, an Outpost iteration whose coin said not to perturb, or a setting that
    happened to change nothing)."""

    kind: str
    fired: bool
    layers: tuple[LayerStats, ...] = ()

    @classmethod
    def from_layers(cls, kind: str, layers: tuple[LayerStats, ...]) -> "StageStats":
        """``fired`` exactly when some layer changed."""
        return cls(kind, any(layer.fraction_changed > 0 for layer in layers), tuple(layers))


@dataclass(frozen=True)
class StepStats:
    """Everything the defense (a single one or a stack) did in one optimizer step."""

    iteration: int
    stages: tuple[StageStats, ...] = field(default_factory=tuple)

    @property
    def fired(self) -> bool:
        """Whether any stage changed the gradient it received in this step. Each stage is counted against
        its own input, so in a stack whose later stage undoes an earlier one (tiny noise on zero entries, then
        pruning of exactly those) this can be True while the step's output equals its input."""
        return any(s.fired for s in self.stages)

    def to_dict(self) -> dict:
        return {"iteration": self.iteration, "fired": self.fired, "stages": [asdict(s) for s in self.stages]}
