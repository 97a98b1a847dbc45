"""A sweep's result as the page and ``sweep.json`` read it: ``SweepResult`` (the evaluated points, the
chosen one, the frontier per axis) and the names of a finished sweep's files."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from guardfl.redteam.sweep.config import SweepPlan

#: the files of a finished sweep (deleted when a new sweep starts in the same folder)
SWEEP_JSON, PLOT, REPORT, CHOSEN = "sweep.json", "tradeoff.png", "report.html", "chosen-defense.yaml"


@dataclass
class SweepResult:
    plan: SweepPlan
    points: list[dict[str, Any]]
    baseline: dict[str, Any]
    chosen: dict[str, Any] | None
    frontier: dict[int, dict | None]
    violations: list[tuple[dict, dict]]
    backend: dict[str, Any]
    wall_time_s: float
    warnings: list[str]
    metric: tuple[str, float | None]  # the plotted metric and its threshold

    def to_dict(self) -> dict[str, Any]:
        plan = self.plan
        axes = []
        for a, (points, direction) in enumerate(zip(plan.axes, plan.directions)):
            axis = plan.config.axes[a]
            best = self.frontier.get(a)
            axes.append({"label": axis.name(), "kind": axis.defense.get("kind"), "param": axis.param,
                         "stronger": direction, "values": [p.value for p in points],
                         "evaluated": sorted(p["index"] for p in self.points if p["axis"] == a),
                         "weakest_certified": None if best is None else best["value"]})
        grid = sum(len(points) for points in plan.axes)
        return {
            "sweep": plan.config.model_dump(mode="json"), "digest": plan.digest, "source": plan.source,
            "base": plan.base, "axes": axes, "autotune": plan.config.autotune,
            "evaluations": sum(1 for p in self.points if p["axis"] >= 0), "grid_size": grid,
            "metric": {"name": self.metric[0], "threshold": self.metric[1]},
            "baseline": self.baseline, "points": self.points,
            "chosen": self.chosen, "chosen_defense": CHOSEN if self.chosen else None,
            "violations": [{"weaker": w["id"], "stronger": s["id"]} for w, s in self.violations],
            "backend": self.backend, "wall_time_s": self.wall_time_s, "warnings": self.warnings,
        }
