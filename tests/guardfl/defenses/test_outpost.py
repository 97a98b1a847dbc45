import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from guardfl.defenses import Outpost
from guardfl.defenses.outpost import perturb_probability
from guardfl.errors import ConfigError
from guardfl.ops.selection import cover_count, prune_count, smallest_k_mask


def _layers(seed=0, sizes=(5000, 40, 7)):
    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(n, generator=g) for n in sizes]
    params = [torch.randn(n, generator=g) * (0.1 + i) for i, n in enumerate(sizes)]
    return grads, params


def test_probability_schedule():
    assert perturb_probability(1, 0.1) == 1.0
    assert perturb_probability(1, 1e9) == 1.0
    assert perturb_probability(10, 0.1) == pytest.approx(0.5)
    assert perturb_probability(7, 0.0) == 1.0
    with pytest.raises(ValueError):
        perturb_probability(0, 0.1)


@given(seed=st.integers(0, 2**32 - 1), beta=st.floats(0, 100))
def test_fires_at_first_iteration_always(seed, beta):
    assert Outpost(beta=beta, seed=seed).fires(1)


@pytest.mark.parametrize("i, beta", [(2, 0.1), (5, 0.1), (20, 0.1), (4, 1.0)])
def test_fire_frequency_follows_the_schedule(i, beta):
    d = Outpost(beta=beta, seed=i)
    trials = 4000
    freq = sum(d.fires(i) for _ in range(trials)) / trials
    p = 1 / (1 + beta * i)
    assert abs(freq - p) < 4 * math.sqrt(p * (1 - p) / trials)


@given(seed=st.integers(0, 2**16), prune=st.sampled_from([0.0, 0.5, 0.8, 0.95]), phi=st.sampled_from([0.1, 0.4, 1.0]))
def test_perturbs_exactly_the_top_fisher_entries_after_pruning(seed, prune, phi):
    grads, params = _layers(seed, sizes=(300, 40, 7))
    out, stats = Outpost(prune=prune, phi=phi, noise=0.8, seed=seed)(grads, params)
    (stage,) = stats.stages
    assert stage.fired
    for g, w, o, layer in zip(grads, params, out, stage.layers):
        n = g.numel()
        k, m = prune_count(prune, n), cover_count(phi, n)
        pruned_set = smallest_k_mask(g.abs(), k)
        top_set = ~smallest_k_mask(g.abs(), n - m)
        base = g.masked_fill(pruned_set, 0)
        diff = o - base
        assert torch.all(diff[~top_set] == 0)  # nothing outside the top-phi Fisher set moves
        assert int((diff[top_set] != 0).sum()) == m  # every top-phi entry gets noise
        assert torch.all(o[pruned_set & ~top_set] == 0)  # pruned, not noised: zero
        assert layer.fraction_zeroed == k / n and layer.fraction_noised == m / n
        assert m >= 1 and layer.noise_std == pytest.approx(0.8 * float(w.var(unbiased=False)))
        assert not torch.equal(o, g)  # it fired, so the gradient changed


def test_noise_std_is_lambda_times_weight_variance():
    g = [torch.randn(200_000)]
    w = [torch.randn(200_000) * 0.5]  # Var(w) ~ 0.25
    out, stats = Outpost(prune=0.8, phi=0.4, noise=0.8, seed=1)(g, w)
    expected = 0.8 * float(w[0].var(unbiased=False))
    top = ~smallest_k_mask(g[0].abs(), 200_000 - 80_000)
    base = g[0].masked_fill(smallest_k_mask(g[0].abs(), 160_000), 0)
    noise = (out[0] - base)[top].double()
    assert abs(float(noise.std()) - expected) < 0.01 * expected
    assert abs(float(noise.mean())) < 0.01 * expected


def test_not_firing_leaves_gradients_untouched():
    grads, params = _layers()
    d = Outpost(beta=1e6, seed=0)  # probability ~1e-6 after the first iteration
    out, stats = d(grads, params, iteration=2)
    assert not stats.fired
    assert all(torch.equal(o, g) for o, g in zip(out, grads))


def test_reference_bug_regressions():
    """NOTES.md: the public reference wrote the noise to a loop variable (no-op) and reseeded the global
    RNG with a fixed seed (identical noise every call)."""
    grads, params = _layers()
    d = Outpost()
    rng = torch.get_rng_state()
    a, _ = d(grads, params)
    b, _ = d(grads, params)
    assert torch.equal(rng, torch.get_rng_state())
    assert any(not torch.equal(x, g) for x, g in zip(a, grads))
    assert not torch.equal(a[0], b[0])  # fresh noise each call


def test_zero_variance_layer_gets_no_noise_but_is_still_pruned():
    g = [torch.randn(100)]
    out, stats = Outpost(seed=0)(g, [torch.ones(100)])
    assert int((out[0] != 0).sum()) == 20
    assert stats.stages[0].layers[0].noise_std == 0.0


def test_needs_params_and_rejects_noop_settings():
    with pytest.raises(ConfigError, match="needs the current weights"):
        Outpost()([torch.randn(3)])
    with pytest.raises(ConfigError, match="never changes the gradient"):
        Outpost(prune=0.0, noise=0.0)
    with pytest.raises(ConfigError, match="outpost.phi"):
        Outpost(phi=1.5)
