import math

import pytest
import torch

from guardfl.defenses import GaussianNoise, LaplaceNoise


@pytest.mark.parametrize(
    "defense, std", [(GaussianNoise(0.2, seed=3), 0.2), (LaplaceNoise(0.1, seed=3), 0.1 * math.sqrt(2))]
)
def test_additive_noise_has_the_requested_std(defense, std):
    grads = [torch.randn(300, 300), torch.randn(50_000)]
    out, stats = defense(grads)
    noise = torch.cat([(o - g).reshape(-1) for g, o in zip(grads, out)]).double()
    assert abs(float(noise.mean())) < 0.01 * std * 10
    assert abs(float(noise.std()) - std) < 0.02 * std
    for layer in stats.stages[0].layers:
        assert layer.noise_std == pytest.approx(std) and layer.fraction_noised == 1.0
    assert all(bool((o != g).all()) for g, o in zip(grads, out))


def test_laplace_is_not_gaussian():
    g = [torch.zeros(200_000)]
    x = LaplaceNoise(1.0, seed=0)(g)[0][0].double()
    kurt = float(((x - x.mean()) ** 4).mean() / x.var() ** 2)
    assert 5.5 < kurt < 6.5  # Laplace excess kurtosis 3; a Gaussian would give 3.0
