"""How much of the private data came back: image metrics after one-to-one matching.

``evaluate(reconstruction, inputs, labels)`` matches reconstructions to the true images one to one (the
Hungarian algorithm, :func:`match`), then reports per image and in summary (mean, best = the worst case for
privacy, worst): MSE, PSNR, SSIM (scikit-image), LPIPS (the ``lpips`` package, AlexNet) and label accuracy.

The matching never hides an exact recovery: given the SSIM of one (``exact_ssim``), it is the one-to-one
assignment with the most pairs at that SSIM, among those the least total MSE. Matching on MSE alone (what
it did before 2026-11-28) could hand a reconstruction that recovers one image exactly to another image when
that lowered the total error (measured: a trap's 33 recovered faces counted as 32). One to one, a
reconstruction still counts for one private image at most: an attack claims no more images than it sends.

Partial similarity (a pair past the certificate's ``max_ssim``, 0.4) is not maximised, on purpose: a
matching chosen for the most such pairs finds them by chance. Measured on the 64 LFW faces of
``cpa-fc2-b64.yaml`` (25 x 25, aligned): 64 *other* people's faces, which hold nothing of the private batch,
pass 0.4 for 27 of them when matched for the most such pairs, 12 by least MSE, and GradInversion's
reconstructions, no better than those faces there, would count 21 instead of 5. Exact pairs do not arise
by chance.

Copies of one read (``fill_batch`` repeats an attack's ``k`` reads to the batch size) are each matched, so
that a read meets every image it might fit, and each row names the read it copies (``read``: the index of
the first identical reconstruction). The judge counts a read against one private image at most, the one it
leaks most: one picture is not many people's, and a face-like read passes 0.4 against several faces
(measured: ``sign_bits``' 12 reads counted against 18 of 64 faces before 2026-11-29).

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


#: SSIM's constants (Wang et al. 2004; scikit-image's defaults)
_K1, _K2, _SIGMA, _TRUNCATE = 0.01, 0.03, 1.5, 3.5
#: elements of one block of image pairs in :func:`ssim_matrix` (float32: 64 MB per intermediate)
_PAIR_BLOCK = 16 * 2**20


def _ssim_window(h: int, w: int) -> tuple[Tensor, float]:
    """The 1-D window :func:`ssim` uses at this image size and its covariance normalisation: a gaussian
    (sigma 1.5, radius 5) with population covariance, or below 11 pixels a uniform window with sample
    covariance (scikit-image's ``structural_similarity`` with those arguments)."""
    if min(h, w) < 11:
        size = (min(h, w) // 2) * 2 - 1 or 1
        return torch.full((size,), 1.0 / size, dtype=torch.float64), (size * size / (size * size - 1) if size > 1 else 1.0)
    radius = int(_TRUNCATE * _SIGMA + 0.5)
    x = torch.arange(-radius, radius + 1, dtype=torch.float64)
    g = torch.exp(-0.5 * (x / _SIGMA) ** 2)
    return g / g.sum(), 1.0


def _band(n: int, window: Tensor) -> Tensor:
    """The ``(n - k + 1, n)`` matrix that applies the ``k``-tap ``window`` along an axis of length ``n``
    where it fits: a filter as a matrix product, an order of magnitude faster than ``conv2d`` here."""
    k = window.numel()
    band = torch.zeros(n - k + 1, n, dtype=window.dtype)
    for i in range(n - k + 1):
        band[i, i:i + k] = window
    return band


def _filter(images: Tensor, window: Tensor) -> Tensor:
    """``images`` ``(..., H, W)`` filtered by the separable ``window``, only where it fits (the region
    scikit-image averages after cropping the border: its padding never enters)."""
    return _band(images.shape[-2], window) @ images @ _band(images.shape[-1], window).T


def _moments(recon: Tensor, truth: Tensor, data_range: float) -> tuple:
    """What :func:`ssim_matrix` and :func:`ssim_pairs` share: both stacks as float32 on the CPU, the window,
    its covariance normalisation, SSIM's two constants, and each image's local means and variances."""
    t = truth.detach().to("cpu", torch.float32)
    r = recon.detach().to("cpu", torch.float32)
    window, cov_norm = _ssim_window(*t.shape[-2:])
    window = window.float()
    c1, c2 = (_K1 * data_range) ** 2, (_K2 * data_range) ** 2
    mu_t, mu_r = _filter(t, window), _filter(r, window)
    var_t = cov_norm * (_filter(t * t, window) - mu_t * mu_t)
    var_r = cov_norm * (_filter(r * r, window) - mu_r * mu_r)
    return t, r, window, cov_norm, c1, c2, mu_t, mu_r, var_t, var_r


def ssim_matrix(recon: Tensor, truth: Tensor, data_range: float) -> np.ndarray:
    """``S[i, j]``: the SSIM of ``recon[j]`` against ``truth[i]`` for every pair (images ``(C, H, W)``), as
    :func:`ssim` computes it (the mean over channels of the mean SSIM map inside the border), vectorised
    over pairs, in float32 as scikit-image computes float32 images: it agrees with :func:`ssim` to ~1e-6."""
    t, r, window, cov_norm, c1, c2, mu_t, mu_r, var_t, var_r = _moments(recon, truth, data_range)
    out = np.empty((len(t), len(r)))
    rows = max(1, _PAIR_BLOCK // max(1, r[0].numel() * len(r)))
    mu_r, var_r, sq_r = mu_r[None], var_r[None], mu_r[None] ** 2
    for i in range(0, len(t), rows):
        ti, mi, vi = t[i:i + rows, None], mu_t[i:i + rows, None], var_t[i:i + rows, None]
        num = _filter(ti * r[None], window).sub_(mi * mu_r).mul_(2 * cov_norm).add_(c2)  # 2 cov + c2
        num.mul_((2 * mi * mu_r).add_(c1))
        den = (mi * mi + sq_r).add_(c1).mul_((vi + var_r).add_(c2))
        out[i:i + rows] = num.div_(den).flatten(2).mean(2, dtype=torch.float64).numpy()
    return out


def ssim_pairs(recon: Tensor, truth: Tensor, data_range: float) -> np.ndarray:
    """The SSIM of ``recon[i]`` against ``truth[i]`` for each ``i`` (:func:`ssim_matrix`'s diagonal, computed
    without the other pairs)."""
    t, r, window, cov_norm, c1, c2, mu_t, mu_r, var_t, var_r = _moments(recon, truth, data_range)
    cov = cov_norm * (_filter(t * r, window) - mu_t * mu_r)
    ratio = (2 * mu_t * mu_r + c1) * (2 * cov + c2) / ((mu_t ** 2 + mu_r ** 2 + c1) * (var_t + var_r + c2))
    return ratio.flatten(1).mean(1, dtype=torch.float64).numpy()


def first_copies(recon: Tensor) -> list[int]:
    """For each reconstruction, the index of the first one identical to it (bit for bit): the attack's
    distinct reads, which ``fill_batch`` repeats to the batch size. A read is one picture, however many
    copies stand for it, and the judge counts it against one private image at most."""
    flat = recon.detach().flatten(1).cpu()
    _, inverse = torch.unique(flat, dim=0, return_inverse=True)
    first: dict[int, int] = {}
    return [first.setdefault(int(g), j) for j, g in enumerate(inverse.tolist())]


def match(recon: Tensor, truth: Tensor, *, data_range: tuple[float, float] = (0.0, 1.0),
          exact_ssim: float | None = None) -> np.ndarray:
    """``perm`` with ``recon[perm[i]]`` matched to ``truth[i]``, one to one (Hungarian): with ``exact_ssim``
    the assignment with the most pairs at that SSIM or more (:func:`ssim_matrix`), among those the least
    total MSE; without it, the least total MSE."""
    r = recon.detach().float().flatten(1).cpu()
    t = truth.detach().float().flatten(1).cpu()
    mse = (torch.cdist(t.double(), r.double()).pow(2) / r.shape[1]).numpy()
    cost = mse
    if exact_ssim is not None:
        exact = ssim_matrix(recon, truth, float(data_range[1] - data_range[0])) >= exact_ssim
        scaled = mse / mse.max() if mse.max() > 0 else mse  # in [0, 1]: a whole assignment sums to under n + 1
        cost = scaled - (len(t) + 1) * exact  # one more exact pair outweighs any difference in error
    _, cols = linear_sum_assignment(cost)
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
    exact_ssim: float | None = None,
) -> dict[str, Any]:
    """Per-image and summary metrics of ``reconstruction`` (a Reconstruction or a tensor) vs the truth,
    matched by :func:`match` (with ``exact_ssim``: no exact recovery hidden; the module docstring)."""
    recon = reconstruction.inputs if hasattr(reconstruction, "inputs") else reconstruction
    rec_labels = getattr(reconstruction, "labels", None)
    if recon.shape != inputs.shape:
        raise ValueError(f"reconstruction shape {tuple(recon.shape)} differs from the inputs' {tuple(inputs.shape)}")
    recon, truth = recon.detach().float().cpu(), inputs.detach().float().cpu()
    span = data_range[1] - data_range[0]
    perm = match(recon, truth, data_range=data_range, exact_ssim=exact_ssim)
    reads = first_copies(recon)
    recon = recon[perm]
    per_image: list[dict[str, Any]] = []
    for i in range(len(truth)):
        mse = float((recon[i] - truth[i]).pow(2).mean())
        per_image.append({"index": i, "matched": int(perm[i]), "read": reads[int(perm[i])], "mse": mse,
                          "psnr": psnr(mse, span), "ssim": ssim(recon[i], truth[i], span)})
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
        "notes": "best = the worst case for privacy (most leakage); matching: Hungarian, "
                 + (f"the most pairs at SSIM >= {exact_ssim:g}, then the least MSE" if exact_ssim is not None else "on MSE"),
    }
