"""What a defense did in one step: for logs, for ``GuardedOptimizer.last_stats`` and for the red team."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class LayerStats:
    """One parameter tensor in one defense stage.

    ``fraction_zeroed``: fraction of its entries the stage forced to zero (pruning), not counting entries
    that were already zero. ``fraction_noised``: fraction of its entries that received noise.
    ``noise_std``: standard deviation of that noise (Laplace: ``scale * sqrt(2)``).
    """

    name: str
    numel: int
    fraction_zeroed: float = 0.0
    fraction_noised: float = 0.0
    noise_std: float = 0.0


@dataclass(frozen=True)
class StageStats:
    """One defense in one step. ``fired`` is False when the defense left the gradient as it was
    (identity, or an Outpost iteration whose coin said not to perturb)."""

    kind: str
    fired: bool
    layers: tuple[LayerStats, ...] = ()


@dataclass(frozen=True)
class StepStats:
    """Everything the defense (a single one or a stack) did in one optimizer step."""

    iteration: int
    stages: tuple[StageStats, ...] = field(default_factory=tuple)

    @property
    def fired(self) -> bool:
        """Whether any stage changed the gradient in this step."""
        return any(s.fired for s in self.stages)

    def to_dict(self) -> dict:
        return {"iteration": self.iteration, "fired": self.fired, "stages": [asdict(s) for s in self.stages]}
