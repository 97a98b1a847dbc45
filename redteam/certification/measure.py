"""Measuring one reconstruction against the private batch: the metrics of its modality, how many private
samples came back past the main threshold, and (diagnostic) the reconstructed encodings of an encoding
client.
"""

from __future__ import annotations

from typing import Any

import torch

from guardfl.redteam.client.simulate import Observation
from guardfl.redteam import modality
from guardfl.redteam.config import RedTeamConfig
from guardfl.redteam.modality.image import metrics


def measure(cfg: RedTeamConfig, reconstruction, inputs: torch.Tensor, labels: torch.Tensor | None,
            input_range: tuple[float, float]) -> dict[str, Any]:
    """Per-sample and summary metrics of a reconstruction (a ``Reconstruction`` or a tensor) against the
    private batch: its modality's (``Modality.evaluate``): ``metrics.evaluate`` for images; for text
    ``evaluate_text`` (ROUGE, token accuracy, bag of words, after matching) and, for a classifier, the
    restored labels' accuracy."""
    return modality.of(cfg).evaluate(reconstruction, inputs, labels, input_range=input_range,
                                     lpips_weights=cfg.certify.lpips_weights, tokenizer=cfg.data.tokenizer)


def recovered(m: dict, cfg: RedTeamConfig) -> dict[str, Any] | None:
    """How many private samples came back past the main threshold (the fraction a reviewer reads): SSIM for
    images, ROUGE-1 for text; "exact": SSIM >= 0.95, or every token right (``Modality.recovery``). Each of
    the attack's reads counts once, however many copies of it were matched."""
    rec = modality.of(cfg).recovery
    metric, limit = rec.metric, getattr(cfg.certify, rec.threshold)
    if limit is None:
        return None
    rows = m["per_image"]  # a read repeated to the batch size counts once (the ``read`` it copies)
    above = len({p.get("read", ("row", p["index"])) for p in rows if p.get(metric) is not None and p[metric] > limit})
    exact = len({p.get("read", ("row", p["index"])) for p in rows
                 if p.get(rec.exact_metric) is not None and p[rec.exact_metric] >= rec.exact_at})
    return {f"above_max_{metric}": above, "exact": exact, "of": len(m["per_image"]),
            "fraction": above / max(1, len(m["per_image"]))}


def encoding_metrics(encodings: torch.Tensor, obs: Observation, view: Observation) -> dict[str, Any] | None:
    """Diagnostic, not part of the verdict: the reconstructed encodings against those the client really
    trained on (first step of the decode chain; the verdict compares private images only)."""
    if not obs.side.trained:
        return None
    truth = torch.cat([x for x, _ in obs.side.trained]).cpu()
    if truth.shape != encodings.shape:
        return {"note": f"the client trained on {truth.shape[0]} encodings, the attack reconstructed {encodings.shape[0]}"}
    summary = metrics.evaluate(encodings, truth, data_range=view.input_range)["summary"]
    return {"vs": "the encodings the client trained on (diagnostic)", "ssim": summary["ssim"], "mse": summary["mse"]}
