import math

import pytest
import torch
import torchvision

from guardfl.redteam.modality.image import metrics


def test_matching_undoes_a_permutation(faces):
    x = faces[:5]
    out = metrics.evaluate(x[[3, 0, 4, 1, 2]], x)
    s = out["summary"]
    assert s["mse"]["worst"] == 0 and s["ssim"]["mean"] == pytest.approx(1.0)
    assert [r["matched"] for r in out["per_image"]] == [1, 3, 4, 0, 2]


def test_summary_best_is_the_most_leaking(faces):
    x = faces[:3]
    noisy = (x + torch.tensor([0.0, 0.1, 0.3]).view(3, 1, 1, 1) * torch.randn_like(x)).clamp(0, 1)
    out = metrics.evaluate(noisy, x)
    ssims = [r["ssim"] for r in out["per_image"]]
    assert out["summary"]["ssim"]["best"] == max(ssims) == pytest.approx(1.0)
    assert out["summary"]["psnr"]["best"] == math.inf
    assert out["summary"]["ssim"]["worst"] == min(ssims)


def test_lpips_unavailable_offline_is_reported_not_faked(faces, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    metrics._lpips_model.cache_clear()
    out = metrics.evaluate(faces[:2], faces[:2])
    assert out["lpips"]["available"] is False and "AlexNet" in out["lpips"]["reason"]
    assert out["summary"]["lpips"] is None and out["per_image"][0]["lpips"] is None
    metrics._lpips_model.cache_clear()


def test_lpips_loads_alexnet_weights_from_a_path(faces, tmp_path):
    """Plumbing only: a randomly initialised AlexNet saved to disk stands in for the ImageNet weights."""
    path = tmp_path / metrics.ALEXNET_FILE
    torch.save(torchvision.models.alexnet(weights=None).state_dict(), path)
    metrics._lpips_model.cache_clear()
    out = metrics.evaluate(faces[:2], faces[:2], lpips_weights=str(path))
    assert out["lpips"]["available"] is True
    assert out["summary"]["lpips"]["mean"] == pytest.approx(0.0, abs=1e-6)
    metrics._lpips_model.cache_clear()


def test_shape_mismatch_is_an_error(faces):
    with pytest.raises(ValueError, match="shape"):
        metrics.evaluate(faces[:2], faces[:3])
