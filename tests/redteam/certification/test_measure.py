"""Measuring a reconstruction as the judge will judge it: the matching counts the pairs past each private
image's own limit (the threshold, raised by the attacker's prior guess on that image)."""

import pytest
import torch

from guardfl.redteam.certification import judge
from guardfl.redteam.certification.measure import measure, recovered
from guardfl.redteam.config import load_config


def _cfg(**certify):
    return load_config({"model": {"name": "lenet"}, "data": {"source": "lfw-faces", "limit": 4},
                        "attacks": [{"name": "dlg"}], "certify": {"max_ssim": 0.4, **certify}})


def test_match_limits_are_the_judges_limits():
    cfg = _cfg(max_psnr=30.0, prior_margin=0.05)
    prior = [{"ssim": 0.1, "psnr": 10.0}, {"ssim": 0.6, "psnr": 29.5}]
    limits = judge.match_limits(cfg, prior, 2)
    assert limits["ssim"] == pytest.approx([0.4, 0.65]) and limits["psnr"] == pytest.approx([30.0, 31.5])
    assert judge.match_limits(cfg, None, 2)["ssim"] == [0.4, 0.4]
    assert "lpips" not in judge.match_limits(_cfg(min_lpips=0.3), None, 2)


def test_a_prior_that_raises_an_images_limit_moves_the_reconstruction_to_where_it_leaks(faces):
    """One reconstruction close to face 0 and fairly close to face 1, one grey guess. Without a prior the
    reconstruction goes to face 0; when the attacker's prior alone already comes close to face 0 (its limit
    raised out of the reconstruction's reach), the reconstruction leaks face 1 instead, and the judge sees
    that leak."""
    x = torch.stack([faces[0], 0.5 * faces[0] + 0.5 * faces[1]])
    rec = torch.stack([0.85 * faces[0] + 0.15 * faces[1], torch.full_like(faces[0], 0.5)])
    cfg = _cfg(prior_margin=0.05)
    plain = measure(cfg, rec, x, None, (0.0, 1.0))
    assert plain["per_image"][0]["matched"] == 0
    on_face0 = plain["per_image"][0]["ssim"]
    prior = [{"ssim": on_face0, "psnr": 10.0}, {"ssim": 0.0, "psnr": 10.0}]  # face 0: limit past the reconstruction
    m = measure(cfg, rec, x, None, (0.0, 1.0), prior=prior)
    assert m["per_image"][1]["matched"] == 0 and m["per_image"][1]["ssim"] > 0.4
    leaks = judge.sample_leaks(cfg, [{"batch": 0, "attack": "dlg", "metrics": m}], {0: prior})
    assert leaks[(0, 1)] and not leaks[(0, 0)]
    assert not any(judge.sample_leaks(cfg, [{"batch": 0, "attack": "dlg", "metrics": plain}], {0: prior}).values())
    # "exact" counts the images some distinct reconstruction recovers exactly, wherever the rows sent it
    assert on_face0 >= 0.95 and recovered(m, cfg)["exact"] == m["exact_recovered"] == 1
