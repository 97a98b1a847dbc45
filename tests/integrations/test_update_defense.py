"""guardfl.integrations.update: defenses on the model delta (shared by the Flower mod and NumPyClient)."""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from guardfl.defenses import GaussianNoise, GradPrune, Identity, Outpost, SignCompression, Stack
from guardfl.errors import ConfigError, NonFiniteGradientError
from guardfl.integrations.update import UpdateDefense


def arrays(seed=0):
    rng = np.random.default_rng(seed)
    names = ["conv.weight", "conv.bias", "bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]
    received = [rng.normal(size=(4, 3, 3)).astype(np.float32), rng.normal(size=4).astype(np.float32),
                np.zeros(4, np.float32), np.ones(4, np.float32), np.array(3)]
    new = [a + rng.normal(size=a.shape).astype(a.dtype) if a.dtype.kind == "f" else a + 1 for a in received]
    return names, received, new


@given(st.floats(0.0, 0.99, exclude_min=True), st.integers(0, 2**16))
def test_pruned_update_has_the_promised_sparsity(ratio, seed):
    names, received, new = arrays(seed)
    out, stats = UpdateDefense(GradPrune(ratio))(received, new, names)
    for name, a, b in zip(names[:2], received, out):
        delta = b - a
        assert (delta == 0).sum() >= math.floor(ratio * delta.size)
        assert b.dtype == a.dtype
    assert stats.defended == 2


def test_buffers_and_integers_pass_through_and_dtypes_are_kept():
    names, received, new = arrays()
    out, _ = UpdateDefense(GaussianNoise(sigma=10.0))(received, new, names)
    for i in (2, 3, 4):
        assert np.array_equal(out[i], new[i]) and out[i].dtype == new[i].dtype
    assert not np.allclose(out[0], new[0], atol=1.0)  # sigma 10 really perturbs


def test_clip_bounds_the_delta_norm_before_the_defense():
    names, received, new = arrays()
    out, stats = UpdateDefense(Identity(), clip_norm=0.5)(received, new, names)
    norm = math.sqrt(sum(float(((b.astype(np.float64) - a) ** 2).sum()) for a, b in zip(received[:2], out[:2])))
    assert norm == pytest.approx(0.5, rel=1e-5) and stats.clip_factor < 1


def test_refuses_defenses_that_are_not_defined_on_updates():
    for bad in (SignCompression(), Outpost(), Stack(GradPrune(0.5), SignCompression())):
        with pytest.raises(ConfigError, match="cannot act on a model update"):
            UpdateDefense(bad)
    with pytest.raises(ConfigError, match="clip_norm"):
        UpdateDefense(GradPrune(0.5), clip_norm=-1)


def test_shape_change_and_nan_are_clear_errors():
    names, received, new = arrays()
    with pytest.raises(ValueError, match="conv.bias came back with shape"):
        UpdateDefense(GradPrune(0.5))(received, [new[0], new[1][:2], *new[2:]], names)
    new[0][0, 0, 0] = np.nan
    with pytest.raises(NonFiniteGradientError, match="conv.weight"):
        UpdateDefense(GradPrune(0.5))(received, new, names)


def test_noise_on_the_update_has_the_configured_scale():
    from guardfl.defenses import LaplaceNoise

    received = [np.zeros(200_000, np.float32)]
    new = [np.ones(200_000, np.float32)]
    out, _ = UpdateDefense(GaussianNoise(sigma=0.3))(received, new, ["w"])
    assert np.std(out[0] - new[0]) == pytest.approx(0.3, rel=0.02)
    out, _ = UpdateDefense(LaplaceNoise(scale=0.2))(received, new, ["w"])
    assert np.mean(np.abs(out[0] - new[0])) == pytest.approx(0.2, rel=0.02)  # E|Laplace(b)| = b


def test_seeded_update_defense_differs_between_rounds():
    received, new = [np.zeros(1000, np.float32)], [np.ones(1000, np.float32)]
    d = UpdateDefense(GaussianNoise(sigma=1.0, seed=3))
    r0, _ = d(received, new, ["w"], round_index=0)
    r1, _ = d(received, new, ["w"], round_index=1)
    again, _ = d(received, new, ["w"], round_index=1)
    assert not np.array_equal(r0[0], r1[0]) and np.array_equal(r1[0], again[0])
