"""Measuring one reconstruction against the private batch: the metrics of its modality, how many private
samples came back past the main threshold, and (diagnostic) the reconstructed encodings of an encoding
client.
"""

from __future__ import annotations

from typing import Any

import torch

from guardfl.redteam.client.simulate import Observation
from guardfl.redteam.config import RedTeamConfig
from guardfl.redteam.modality.image import metrics

#: SSIM from which a reconstruction counts as the private image itself (Robbing the Fed's "exact" recoveries)
EXACT_SSIM = 0.95


def measure(cfg: RedTeamConfig, reconstruction, inputs: torch.Tensor, labels: torch.Tensor | None,
            input_range: tuple[float, float]) -> dict[str, Any]:
    """Per-sample and summary metrics of a reconstruction (a ``Reconstruction`` or a tensor) against the
    private batch: ``metrics.evaluate`` for images; for text ``textmetrics.evaluate_text`` (ROUGE, token
    accuracy, bag of words, after matching) and, for a classifier, the restored labels' accuracy."""
    if cfg.modality != "text":
        return metrics.evaluate(reconstruction, inputs, labels, data_range=input_range,
                                lpips_weights=cfg.certify.lpips_weights)
    from guardfl.redteam.modality.text import metrics as textmetrics
    from guardfl.redteam.modality.text.tokenizer import load_tokenizer

    recon = reconstruction.inputs if hasattr(reconstruction, "inputs") else reconstruction
    if recon.dim() == 1:  # one guess for every sample (the prior)
        recon = recon.expand_as(inputs)
    tok = load_tokenizer(cfg.data.tokenizer)
    classifier = labels is not None and labels.dim() == 1
    # a classifier's sentences are padded with end-of-text: padding is no private token
    ignore = (tok.eos_id,) if classifier and tok.eos_id is not None else ()
    m = textmetrics.evaluate_text(recon.cpu(), inputs.cpu(), tok, ignore_ids=ignore)
    rec_labels = getattr(reconstruction, "labels", None)
    if rec_labels is not None and classifier:
        rl = rec_labels.detach().cpu().reshape(-1)
        for row in m["per_image"]:
            j = row.get("matched", row["index"])
            row["label_correct"] = bool(rl[j] == labels[row["index"]]) if j < len(rl) else False
        m["summary"]["label_acc"] = sum(r["label_correct"] for r in m["per_image"]) / max(1, len(m["per_image"]))
    return m


def recovered(m: dict, cfg: RedTeamConfig) -> dict[str, Any] | None:
    """How many private samples came back past the main threshold (the fraction a reviewer reads): SSIM for
    images, ROUGE-1 for text; "exact": SSIM >= 0.95, or every token right."""
    metric, limit, exact_at = ("ssim", cfg.certify.max_ssim, EXACT_SSIM) if cfg.modality != "text" else \
        ("rouge1", cfg.certify.max_rouge1, None)
    if limit is None:
        return None
    above = sum(1 for p in m["per_image"] if p.get(metric) is not None and p[metric] > limit)
    if exact_at is None:
        exact = sum(1 for p in m["per_image"] if p.get("token_acc") == 1.0)
    else:
        exact = sum(1 for p in m["per_image"] if p.get(metric) is not None and p[metric] >= exact_at)
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
