"""Images: data loaders, models and metrics, and the image modality's entry in the registry."""

from __future__ import annotations

import torch.nn.functional as F

from guardfl.redteam.modality.image import data, models
from guardfl.redteam.modality.registry import Modality, register

#: the per-image thresholds: metric -> (config field, "max" when a larger value leaks more)
IMAGE_THRESHOLDS = {"ssim": ("max_ssim", "max"), "psnr": ("max_psnr", "max"), "lpips": ("min_lpips", "min")}


def _model_inputs(x):
    """An image model takes the images themselves."""
    return (x,), {}


def _no_vocabulary(tokenizer: str) -> None:
    """An image model has no vocabulary."""


def _no_check(path, field: str) -> None:
    """Image files are bounded as they are read (``data._check_bytes``)."""


IMAGE = register(Modality(
    name="image", unit="image", units="images", noun="images", model_kind="an image model",
    thresholds=IMAGE_THRESHOLDS, models=frozenset(models.MODELS), tokenized=False, loader=data.load_section,
    model_inputs=_model_inputs, loss=F.cross_entropy, vocab_size=_no_vocabulary, check_path=_no_check,
))
