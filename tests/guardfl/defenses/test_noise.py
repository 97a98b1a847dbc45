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


@pytest.mark.parametrize("make", [lambda clip: GaussianNoise(0.01, clip=clip, seed=1),
                                  lambda clip: LaplaceNoise(0.01, clip=clip, seed=1)])
def test_clip_bounds_the_gradients_norm_over_all_layers_before_the_noise(make):
    grads = [torch.randn(100, 30) * 5, torch.randn(40) * 5]
    norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads)))
    quiet, _ = GaussianNoise(1e-9, clip=1.0, seed=1)(grads)  # the clip alone, as good as: scaled to norm 1
    assert all(torch.allclose(q, g / norm, atol=1e-6) for q, g in zip(quiet, grads))
    out, stats = make(1.0)(grads)
    noise = torch.cat([(o - g / norm).reshape(-1) for g, o in zip(grads, out)])
    assert float(noise.std()) == pytest.approx(0.01 * (1 if isinstance(make(1.0), GaussianNoise) else math.sqrt(2)), rel=0.1)
    assert all(layer.fraction_changed == 1.0 for layer in stats.stages[0].layers)
    # a gradient within the bound is not scaled: the noise alone
    small = [g / norm * 0.5 for g in grads]
    out, _ = make(1.0)(small)
    assert float((torch.cat([(o - g).reshape(-1) for g, o in zip(small, out)])).std()) < 0.05


def test_clip_takes_the_servers_scale_away():
    """A malicious server that makes the gradient k times larger (``seer``'s boost) drowns fixed noise;
    with ``clip`` the defended update of the boosted gradient is the unboosted one's, noise for noise."""
    g = [torch.randn(64, 64)]
    plain = GaussianNoise(0.01, clip=1.0, seed=5)([g[0] / g[0].norm()])[0][0]
    boosted = GaussianNoise(0.01, clip=1.0, seed=5)([100 * g[0] / g[0].norm()])[0][0]
    assert torch.allclose(plain, boosted, atol=1e-5)
    unclipped = GaussianNoise(0.01, seed=5)([100 * g[0] / g[0].norm()])[0][0]
    assert float(torch.nn.functional.cosine_similarity(unclipped.flatten(), g[0].flatten(), 0)) > 0.99


@pytest.mark.parametrize("clip", [0, -1.0, float("inf"), float("nan"), "x", 2e6])
def test_a_bad_clip_is_one_line_naming_the_field(clip):
    from guardfl.defenses import from_config
    from guardfl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"gaussian\.clip.*null \(no clipping\) or finite, in \(0, 1e6\]") as err:
        from_config({"kind": "gaussian", "sigma": 0.1, "clip": clip})
    assert "\n" not in str(err.value)
