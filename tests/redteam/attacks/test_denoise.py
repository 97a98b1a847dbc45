"""The server's denoiser for linear reads: its noise estimate, its calibration on the attacker's own
images, and that it reads noisy images better without ever seeing the private ones."""

import torch
from hypothesis import given, settings, strategies as st

from guardfl.redteam.attacks.denoise import FILTERS, LEVELS, apply, calibrate, denoise, noise_level
from guardfl.redteam.modality.image.data import load
from guardfl.redteam.modality.image.metrics import ssim_matrix, ssim_pairs


def faces():
    x, _ = load("lfw-faces")
    return x[64:].double(), x[:32].double()  # the attacker's and the "client's": disjoint


def test_ssim_pairs_is_the_diagonal_of_the_matrix():
    a = torch.rand(6, 3, 32, 32)
    b = (a + 0.2 * torch.randn_like(a)).clamp(0, 1)
    assert abs(ssim_pairs(b, a, 1.0) - ssim_matrix(b, a, 1.0).diagonal()).max() < 1e-6


@settings(max_examples=20, deadline=None)
@given(sigma=st.floats(0.01, 0.5), seed=st.integers(0, 2**31 - 1))
def test_noise_level_reads_white_noise_on_a_flat_image(sigma, seed):
    noise = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * sigma
    assert abs(float(noise_level(0.5 + noise)[0]) / sigma - 1) < 0.1


def test_the_calibration_leaves_clean_images_alone_and_filters_noisy_ones():
    aux, _ = faces()
    calibration = calibrate(aux, (0.0, 1.0), torch.Generator().manual_seed(0))
    assert len(calibration.filters) == len(LEVELS) and set(calibration.filters) <= set(FILTERS)
    assert calibration.filters[0] == ("none", 0.0) and calibration.gains[0] == 0.0
    assert all(kind != "none" and gain > 0.1 for (kind, _), gain in zip(calibration.filters[5:], calibration.gains[5:]))
    assert list(calibration.estimates) == sorted(calibration.estimates)  # the estimate rises with the noise


def test_denoising_reads_images_it_never_saw_better_and_leaves_clean_ones():
    aux, private = faces()
    calibration = calibrate(aux, (0.0, 1.0), torch.Generator().manual_seed(0))
    clean, counts = denoise(private, calibration, (0.0, 1.0))
    assert counts == {("none", 0.0): len(private)} and torch.equal(clean, private)
    noise = torch.randn(private.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for sigma in (0.15, 0.3, 0.5):
        noisy = (private + sigma * noise).clamp(0, 1)
        filtered, counts = denoise(noisy, calibration, (0.0, 1.0))
        raw, better = ssim_pairs(noisy, private, 1.0), ssim_pairs(filtered, private, 1.0)
        assert ("none", 0.0) not in counts and better.mean() > raw.mean() + 0.1, (sigma, raw.mean(), better.mean())


def test_a_filter_keeps_the_input_range_and_the_shape():
    images = torch.rand(3, 3, 20, 20) * 4 - 2
    for kind, strength in FILTERS:
        out = apply(images, kind, strength, (-2.0, 2.0))
        assert out.shape == images.shape and out.min() >= -2 and out.max() <= 2 and out.dtype == images.dtype
