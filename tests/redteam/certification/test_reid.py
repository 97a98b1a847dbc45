"""Re-identification (``certification.reid``): the attacker's answer names the private sample when its
reconstructions resemble it, and a guess that knows nothing names it at the chance rate."""

from __future__ import annotations

import numpy as np
import torch
from skimage.data import lfw_subset

from guardfl.redteam.certification import reid


def _faces() -> torch.Tensor:
    return torch.tensor(lfw_subset()[:100], dtype=torch.float32)[:, None]


def test_an_exact_reconstruction_is_identified_and_ranked_first():
    faces = _faces()
    g = reid.gallery(faces[:64], faces[64:], None, (0.0, 1.0))
    assert g.size == 100 and g.population == 64 and g.basis is not None and g.basis.shape[0] == 24
    out = reid.identify(g, {"exact": faces[[5]], "noise": torch.rand(1, 1, 25, 25)}, [5])
    assert out["reidentified"] == [True] and out["named"] == [5]
    assert out["ranks"]["exact"] == {"ssim": [1], "eigenfaces": [1]}


def test_a_blurred_reconstruction_still_names_its_face():
    """A heavily smoothed face (what a grey-blob reconstruction keeps: the coarse layout) is named among
    the 100 faces for most of the population."""
    faces = _faces()
    g = reid.gallery(faces[:64], faces[64:], None, (0.0, 1.0))
    blur = torch.nn.functional.avg_pool2d(faces[:64], 5, stride=1, padding=2, count_include_pad=False)
    hits = [reid.identify(g, {"blur": blur[[i]]}, [i])["reidentified"][0] for i in range(64)]
    assert np.mean(hits) > 0.5


def test_knowing_nothing_names_a_sample_at_about_the_chance_rate():
    """Noise reconstructions (and the same grey image for everyone) name the true sample about 1 in 100
    times: the chance rate the certificate gives beside the claim."""
    faces = _faces()
    g = reid.gallery(faces[:64], faces[64:], None, (0.0, 1.0))
    gen = torch.Generator().manual_seed(0)
    hits = [reid.identify(g, {"a": torch.rand(1, 1, 25, 25, generator=gen), "b": torch.rand(1, 1, 25, 25, generator=gen)},
                          [i % 64])["reidentified"][0] for i in range(640)]
    assert np.mean(hits) < 0.05
    grey = [reid.identify(g, {"a": torch.full((1, 1, 25, 25), 0.5)}, [i])["reidentified"][0] for i in range(64)]
    assert sum(grey) <= 1  # one fixed answer: right for one face at most
    assert g.chance(1) == 0.01


def test_an_update_of_several_samples_names_as_many_candidates():
    faces = _faces()
    g = reid.gallery(faces[:64], faces[64:], None, (0.0, 1.0))
    out = reid.identify(g, {"exact": faces[[3, 9, 20, 40]]}, [3, 9, 20, 40])
    assert sorted(out["named"]) == [3, 9, 20, 40] and all(out["reidentified"]) and out["fraction"] == 1.0
    assert g.chance(4) == 0.04


def test_without_auxiliary_images_only_ssim_is_used():
    faces = _faces()
    g = reid.gallery(faces[:64], None, None, (0.0, 1.0))
    assert g.basis is None and g.describe()["similarities"] == ["ssim"]
    assert reid.identify(g, {"exact": faces[[7]]}, [7])["reidentified"] == [True]
