"""The certificate: what a red-team run found, as a dataclass the report and ``certificate.json`` read.

``untimed`` strips the timings, so that two runs of one config compare equal (resumed or not, any worker
count).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

@dataclass
class Certificate:
    certified: bool
    checks: list[dict[str, Any]]
    results: list[dict[str, Any]]
    config: dict[str, Any]
    config_hash: str
    environment: dict[str, Any]
    wall_time_s: float
    lpips: dict[str, Any]
    #: what was attacked: a simulated client, or the user's ClientApp / train_fn (per batch: steps, samples)
    client: dict[str, Any] = field(default_factory=dict)
    #: 'quick' or 'paper' (the budgets every attack ran with)
    strength: str = "quick"
    #: every registered attack: ran / not applicable (reason) / not requested, its budget vs the paper's;
    #: ``reused`` on a line that ran: the batches where its run was another attack's exactly (``repeats``)
    attacks: list[dict[str, Any]] = field(default_factory=list)
    #: once-per-setting preparations (e.g. the trained inverter): key, cached, seconds, what was learned
    preparations: dict[str, Any] = field(default_factory=dict)
    #: DP-SGD accounting of the deployment (epsilon at delta), None without DP-SGD
    privacy: dict[str, Any] | None = None
    #: what a reviewer should know that the thresholds do not say, e.g. layers the defense never changes
    warnings: list[str] = field(default_factory=list)
    #: per batch, the metrics of the attacker's prior guess (mean auxiliary image, no update used)
    priors: dict[str, Any] = field(default_factory=dict)
    #: sha256 of every file the run read, by config field (``fingerprint``): what was certified
    inputs: dict[str, str] = field(default_factory=dict)
    #: CERTIFIED, NOT CERTIFIED or INCONCLUSIVE (no claim refuted, not every claim certified, within the budget)
    status: str = ""
    #: the population the claim is about (source, offset, size) and the samples drawn from it
    population: dict[str, Any] = field(default_factory=dict)
    #: the population claim: leak rate with its confidence bound, per attack, per class, per update
    evidence: dict[str, Any] = field(default_factory=dict)
    #: per image threshold, the single most leaking (attack, image): shown first in the report
    worst: list[dict[str, Any]] = field(default_factory=list)
    #: the proven bound beside the empirical verdict (``certification.bound``: status PROVEN / NOT PROVEN /
    #: NO MECHANISM, rero, kappa, mechanism, accountant, rounds, assumption, reason, curves)
    bound: dict[str, Any] = field(default_factory=dict)
    reconstructions: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    originals: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def verdict(self) -> str:
        return self.status or ("CERTIFIED" if self.certified else "NOT CERTIFIED")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("reconstructions")
        d.pop("originals")
        d["verdict"] = self.verdict
        return d


def untimed(obj: Any, ignore: tuple[str, ...] = ()) -> Any:
    """A certificate (``to_dict()`` or a part of it) without its timings: ``wall_time_s`` and every key
    ending in ``seconds``, and the keys in ``ignore``. Two runs of one config with a seeded defense give
    equal ``untimed`` certificates (resumed or not, any worker count)."""
    if isinstance(obj, dict):
        return {k: untimed(v, ignore) for k, v in obj.items()
                if k != "wall_time_s" and not k.endswith("seconds") and k not in ignore}
    if isinstance(obj, list):
        return [untimed(v, ignore) for v in obj]
    return obj
