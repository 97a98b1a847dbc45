"""Numbers in defense configs are taken at face value and kept finite (issue 13, "Noise must be finite"):
inf / nan / booleans are refused in every numeric field, noise and DP settings are bounded, and seeds are
limited to the range in which every seed gives its own stream. Each refusal is one line naming the field
and the allowed range."""

import math
import typing

import pytest
import torch

import guardfl.defenses as d
from guardfl.config import _numeric
from guardfl.defenses import REGISTRY, from_config
from guardfl.errors import ConfigError

MINIMAL = {
    "gradprune": {"ratio": 0.5}, "gaussian": {"sigma": 1.0}, "laplace": {"scale": 1.0},
    "dpsgd": {"noise_multiplier": 1.0}, "stack": {"defenses": [{"kind": "sign"}]},
}


def _fields(kind):
    config = REGISTRY[kind].Config
    return [(name, f, _numeric(f.annotation)) for name, f in config.model_fields.items() if _numeric(f.annotation)]


def _refused(cfg) -> str:
    with pytest.raises(ConfigError) as info:
        from_config(cfg)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize("make, field, allowed", [
    (lambda: d.GaussianNoise(1e39), "gaussian.sigma", "allowed: finite, in (0, 1e6]"),
    (lambda: d.GaussianNoise(math.inf), "gaussian.sigma", "allowed: finite, in (0, 1e6]"),
    (lambda: d.LaplaceNoise(1e7), "laplace.scale", "allowed: finite, in (0, 1e6]"),
    (lambda: d.DPSGD(noise_multiplier=math.inf), "dpsgd.noise_multiplier", "allowed: null or finite, in [0, 1000]"),
    (lambda: d.DPSGD(noise_multiplier=1e4), "dpsgd.noise_multiplier", "allowed: null or finite, in [0, 1000]"),
    (lambda: d.DPSGD(noise_multiplier=1.0, max_grad_norm=math.inf), "dpsgd.max_grad_norm", "allowed: finite, in (0, 1e6]"),
    (lambda: d.DPSGD(target_epsilon=math.inf, epochs=1), "dpsgd.target_epsilon", "allowed: null or finite, in (0, 100]"),
    (lambda: d.DPSGD(target_epsilon=1e3, epochs=1), "dpsgd.target_epsilon", "allowed: null or finite, in (0, 100]"),
    (lambda: d.GaussianNoise(1.0, seed=2**64), "gaussian.seed", "allowed: null (OS entropy) or an integer in [0, 2**32 - 1]"),
    (lambda: d.GaussianNoise(1.0, seed=2**32), "gaussian.seed", "allowed: null (OS entropy) or an integer in [0, 2**32 - 1]"),
    (lambda: d.GradPrune(True), "gradprune.ratio", "not a boolean"),
    (lambda: d.MixUp(k=True), "mixup.k", "not a boolean"),
    (lambda: d.Outpost(noise=1e7), "outpost.noise", "allowed: finite, in [0, 1e6]"),
    (lambda: d.GradDefense(noise=math.nan), "graddefense.noise", "allowed: finite, in [0, 1e6]"),
])
def test_the_audits_api_cases_are_one_line_naming_the_field_and_range(make, field, allowed):
    with pytest.raises(ConfigError) as info:
        make()
    msg = str(info.value)
    assert msg.startswith(field + ": ") and allowed in msg and "\n" not in msg, msg


@pytest.mark.parametrize("kind", sorted(REGISTRY))
def test_every_numeric_field_refuses_inf_nan_and_booleans(kind):
    base = {"kind": kind, **MINIMAL.get(kind, {})}
    from_config(base)  # the base is valid
    for name, field, wanted in _fields(kind):
        assert f"{kind}.{name}: expected {wanted}, not a boolean (got True)" in _refused({**base, name: True})
        if wanted == "a number":
            for bad in (math.inf, -math.inf, math.nan):
                assert f"{kind}.{name}: Input should be a finite number" in _refused({**base, name: bad})


def test_numeric_detection():
    assert _numeric(int) == "an integer" and _numeric(float) == "a number"
    assert _numeric(typing.Optional[int]) == "an integer" and _numeric(float | None) == "a number"
    assert _numeric(list[int]) == "a list of integers"
    assert _numeric(bool) is None and _numeric(str) is None and _numeric(bool | int) is None


def test_the_largest_noise_is_finite_in_float32():
    for defense in (d.GaussianNoise(1e6, seed=0), d.LaplaceNoise(1e6, seed=0)):
        out, _ = defense([torch.zeros(1_000_000)])
        assert bool(torch.isfinite(out[0]).all()) and bool(torch.isfinite(out[0].square().sum()))


def test_every_seed_in_range_has_its_own_stream():
    """torch's CPU generator keeps the low 32 bits of a seed: 2**32 (and 2**64) gave the stream of 0."""
    gen = torch.Generator()
    assert torch.equal(torch.rand(8, generator=gen.manual_seed(0)), torch.rand(8, generator=gen.manual_seed(2**32)))
    draws = [d.GaussianNoise(1.0, seed=s)([torch.zeros(16)])[0][0] for s in (0, 1, 2**31, 2**32 - 1)]
    assert all(not torch.equal(a, b) for i, a in enumerate(draws) for b in draws[i + 1:])
    a, b = d.GaussianNoise(1.0, seed=2**32 - 1), d.GaussianNoise(1.0, seed=2**32 - 1)
    assert torch.equal(a([torch.zeros(16)])[0][0], b([torch.zeros(16)])[0][0])


def test_reseed_takes_63_bit_seeds_and_refuses_the_rest():
    noise = d.GaussianNoise(1.0)
    noise.reseed(2**63 - 1)
    noise.reseed(None)
    for bad in (2**63, 2**64, -1, True, 1.5):
        with pytest.raises(ConfigError, match=r"gaussian.reseed: seed must be null or an integer in \[0, 2\*\*63 - 1\]"):
            noise.reseed(bad)
