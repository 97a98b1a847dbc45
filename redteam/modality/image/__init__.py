"""Images: data loaders, models and metrics, and the image modality's entry in the registry."""

from __future__ import annotations

import torch.nn.functional as F

from guardfl.redteam.modality.image import data, models
from guardfl.redteam.modality.registry import Modality, Recovery, register

#: the per-image thresholds: metric -> (config field, "max" when a larger value leaks more)
IMAGE_THRESHOLDS = {"ssim": ("max_ssim", "max"), "psnr": ("max_psnr", "max"), "lpips": ("min_lpips", "min")}
#: SSIM from which a reconstruction counts as the private image itself (Robbing the Fed's "exact" recoveries)
EXACT_SSIM = 0.95


def _model_inputs(x):
    """An image model takes the images themselves."""
    return (x,), {}


def _no_vocabulary(tokenizer: str) -> None:
    """An image model has no vocabulary."""


def _no_check(path, field: str) -> None:
    """Image files are bounded as they are read (``data._check_bytes``)."""


def _evaluate(reconstruction, inputs, labels, *, input_range, lpips_weights=None, **_text) -> dict:
    """``metrics.evaluate``: SSIM, PSNR, LPIPS per image after matching, no exact recovery (``EXACT_SSIM``)
    hidden by the matching (the text options are not an image's)."""
    from guardfl.redteam.modality.image import metrics  # scikit-image and LPIPS: imported when measuring

    return metrics.evaluate(reconstruction, inputs, labels, data_range=input_range, lpips_weights=lpips_weights,
                            exact_ssim=EXACT_SSIM)


def _built_from_data(name: str, num_classes: int, **_text) -> None:
    """An image model is built from its data's shape, after the data (``models.build_model``)."""


def _labels_are_classes(model) -> bool:
    """An image client's targets are class labels, never its images."""
    return False


IMAGE = register(Modality(
    name="image", unit="image", units="images", noun="images", model_kind="an image model",
    thresholds=IMAGE_THRESHOLDS, models=frozenset(models.MODELS), tokenized=False, loader=data.load_section,
    model_inputs=_model_inputs, loss=F.cross_entropy, vocab_size=_no_vocabulary, check_path=_no_check,
    evaluate=_evaluate, recovery=Recovery("ssim", "max_ssim", "ssim", EXACT_SSIM), client_model=_built_from_data,
    targets_are_inputs=_labels_are_classes,
))
