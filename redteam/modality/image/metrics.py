"""How much of the private data came back: image metrics after one-to-one matching.

``evaluate(reconstruction, inputs, labels)`` matches reconstructions to the true images with the Hungarian
algorithm (minimum total MSE), then reports per image and in summary (mean, best = the worst case for
privacy, worst): MSE, PSNR, SSIM (scikit-image), LPIPS (the ``lpips`` package, AlexNet) and label accuracy.

LPIPS needs AlexNet's ImageNet weights. They are looked for at ``lpips_weights`` (a path), else in the
torch hub cache; with ``download=True`` torchvision fetches them. Without them LPIPS is reported as
unavailable, with the reason: never a crash, and never a random backbone passed off as LPIPS.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from skimage.metrics import structural_similarity
from torch import Tensor

ALEXNET_FILE = "alexnet-owt-7be5be79.pth"
#: metric -> True when a higher value means more leakage
HIGHER_LEAKS = {"mse": False, "psnr": True, "ssim": True, "lpips": False, "label_acc": True}


def match(recon: Tensor, truth: Tensor) -> np.ndarray:
    """``perm`` with ``recon[perm[i]]`` matched to ``truth[i]`` (Hungarian, minimum total MSE)."""
    r = recon.detach().float().flatten(1).cpu()
    t = truth.detach().float().flatten(1).cpu()
    cost = torch.cdist(t, r).pow(2) / r.shape[1]
    _, cols = linear_sum_assignment(cost.numpy())
    return cols


def psnr(mse: float, data_range: float) -> float:
    return float("inf") if mse == 0 else 10.0 * math.log10(data_range**2 / mse)


def ssim(a: Tensor, b: Tensor, data_range: float) -> float:
    """SSIM of two ``(C, H, W)`` images (gaussian-weighted, as in Wang et al. 2004)."""
    x = a.detach().float().cpu().numpy()
    y = b.detach().float().cpu().numpy()
    kwargs: dict[str, Any] = {"data_range": data_range, "gaussian_weights": True, "sigma": 1.5, "use_sample_covariance": False}
    h, w = x.shape[-2:]
    if min(h, w) < 11:
        kwargs = {"data_range": data_range, "win_size": (min(h, w) // 2) * 2 - 1 or 1}
    if x.shape[0] == 1:
        return float(structural_similarity(x[0], y[0], **kwargs))
    return float(structural_similarity(x, y, channel_axis=0, **kwargs))


@dataclass
class LPIPSStatus:
    available: bool
    reason: str = ""


def _alexnet_weights(weights: str | os.PathLike | None) -> Path | None:
    candidates = [Path(weights)] if weights else []
    candidates.append(Path(torch.hub.get_dir()) / "checkpoints" / ALEXNET_FILE)
    return next((p for p in candidates if p.is_file()), None)


@lru_cache(maxsize=2)
def _lpips_model(weights: str | None, download: bool):
    import lpips

    path = _alexnet_weights(weights)
    if path is None and not download:
        where = weights or str(Path(torch.hub.get_dir()) / "checkpoints" / ALEXNET_FILE)
        return None, (
            f"AlexNet ImageNet weights not found ({where}); pass lpips_weights=PATH or download=True when online"
        )
    with warnings.catch_warnings():  # lpips passes torchvision's deprecated pretrained=False
        warnings.simplefilter("ignore", UserWarning)
        model = lpips.LPIPS(net="alex", pnet_rand=True, verbose=False)  # trunk filled below, lin layers shipped
    if path is None:
        import torchvision

        state = torchvision.models.alexnet(weights="IMAGENET1K_V1").state_dict()  # downloads (asked for)
    else:
        state = torch.load(path, map_location="cpu")
    features = {k[len("features."):]: v for k, v in state.items() if k.startswith("features.")}
    for slice_ in (model.net.slice1, model.net.slice2, model.net.slice3, model.net.slice4, model.net.slice5):
        for idx, module in slice_.named_children():
            if hasattr(module, "weight"):
                module.weight.data.copy_(features[f"{idx}.weight"])
                module.bias.data.copy_(features[f"{idx}.bias"])
    return model.eval(), ""


def lpips_status(weights: str | None = None, download: bool = False) -> LPIPSStatus:
    try:
        model, reason = _lpips_model(str(weights) if weights else None, download)
    except Exception as err:  # offline download, corrupt file...
        return LPIPSStatus(False, f"LPIPS could not be loaded: {err}")
    return LPIPSStatus(model is not None, reason)


def lpips_distance(recon: Tensor, truth: Tensor, data_range: tuple[float, float], weights=None, download=False) -> list[float] | None:
    """Per-image LPIPS (AlexNet), or None when unavailable."""
    model, _ = _lpips_model(str(weights) if weights else None, download)
    if model is None:
        return None
    lo, hi = data_range
    to_unit = lambda t: ((t.detach().float().cpu() - lo) / (hi - lo)) * 2 - 1  # noqa: E731  lpips wants [-1, 1]
    a, b = to_unit(recon), to_unit(truth)
    if a.shape[1] == 1:
        a, b = a.repeat(1, 3, 1, 1), b.repeat(1, 3, 1, 1)
    if min(a.shape[-2:]) < 32:  # AlexNet's strides need at least 32 pixels
        a = torch.nn.functional.interpolate(a, size=32, mode="bilinear", align_corners=False)
        b = torch.nn.functional.interpolate(b, size=32, mode="bilinear", align_corners=False)
    with torch.no_grad():
        return model(a, b).flatten().tolist()


def evaluate(
    reconstruction,
    inputs: Tensor,
    labels: Tensor | None = None,
    *,
    data_range: tuple[float, float] = (0.0, 1.0),
    lpips_weights: str | None = None,
    download: bool = False,
) -> dict[str, Any]:
    """Per-image and summary metrics of ``reconstruction`` (a Reconstruction or a tensor) vs the truth."""
    recon = reconstruction.inputs if hasattr(reconstruction, "inputs") else reconstruction
    rec_labels = getattr(reconstruction, "labels", None)
    if recon.shape != inputs.shape:
        raise ValueError(f"reconstruction shape {tuple(recon.shape)} differs from the inputs' {tuple(inputs.shape)}")
    recon, truth = recon.detach().float().cpu(), inputs.detach().float().cpu()
    perm = match(recon, truth)
    recon = recon[perm]
    span = data_range[1] - data_range[0]
    per_image: list[dict[str, Any]] = []
    for i in range(len(truth)):
        mse = float((recon[i] - truth[i]).pow(2).mean())
        per_image.append({"index": i, "matched": int(perm[i]), "mse": mse, "psnr": psnr(mse, span), "ssim": ssim(recon[i], truth[i], span)})
    status = lpips_status(lpips_weights, download)
    lp = lpips_distance(recon, truth, data_range, lpips_weights, download) if status.available else None
    for i, row in enumerate(per_image):
        row["lpips"] = lp[i] if lp is not None else None
    if rec_labels is not None and labels is not None:
        rl = rec_labels.detach().cpu().reshape(-1)
        rl = rl[perm] if rl.numel() == len(perm) else rl
        for i, row in enumerate(per_image):
            row["label_correct"] = bool(rl[i] == labels.detach().cpu().reshape(-1)[i])
    summary: dict[str, Any] = {}
    for key in ("mse", "psnr", "ssim", "lpips"):
        values = [r[key] for r in per_image if r.get(key) is not None]
        if not values:
            summary[key] = None
            continue
        best = max(values) if HIGHER_LEAKS[key] else min(values)
        worst = min(values) if HIGHER_LEAKS[key] else max(values)
        summary[key] = {"mean": float(np.mean(values)), "best": best, "worst": worst}
    if per_image and "label_correct" in per_image[0]:
        summary["label_acc"] = float(np.mean([r["label_correct"] for r in per_image]))
    return {
        "per_image": per_image,
        "summary": summary,
        "lpips": {"available": status.available, "reason": status.reason},
        "notes": "best = the worst case for privacy (most leakage); matching: Hungarian on MSE",
    }
