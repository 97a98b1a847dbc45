"""calibrate: the least noise whose bound is at most the target, for each mechanism; bad input."""

import math

import pytest

import guardfl
from guardfl.bounds import gdp_rero
from guardfl.bounds.calibrate import _gaussian, _laplace
from guardfl.bounds.rero import rero
from guardfl.errors import ConfigError


def test_dpsgd_full_batch_against_the_closed_form():
    z = guardfl.calibrate(rero=0.2, kappa=0.1, rounds=16)
    assert gdp_rero(0.1, 4 / z) <= 0.2 + 1e-6  # proven at the answer
    assert gdp_rero(0.1, 4 / (z * (1 - 3e-3))) > 0.2  # and not with visibly less noise


@pytest.mark.parametrize("kwargs", [
    dict(mechanism="dpsgd", sample_rate=0.05, steps_per_round=20),
    dict(mechanism="gaussian", clip=0.1),
    dict(mechanism="laplace", clip=0.1, dimension=1000),
])
def test_the_answer_is_the_least_noise_that_proves_the_target(kwargs):
    target, kappa, rounds = 0.25, 0.1, 4
    x = guardfl.calibrate(rero=target, kappa=kappa, rounds=rounds, **kwargs)
    steps = kwargs.get("steps_per_round", 1)

    def bound(v):
        if kwargs["mechanism"] == "dpsgd":
            return rero(_gaussian(v, kwargs["sample_rate"], steps), kappa, rounds)
        if kwargs["mechanism"] == "gaussian":
            return rero(_gaussian(v / kwargs["clip"], 1.0, steps), kappa, rounds)
        return rero(_laplace(math.sqrt(kwargs["dimension"]) * kwargs["clip"] / v, steps), kappa, rounds)

    assert bound(x) <= target
    assert bound(x * (1 - 3e-3)) > target


@pytest.mark.parametrize("kwargs, field", [
    (dict(rero=0.05, kappa=0.1, rounds=1), "rero"),
    (dict(rero=0.5, kappa=1.2, rounds=1), "kappa"),
    (dict(rero=0.5, kappa=0.1, rounds=0), "rounds"),
    (dict(rero=0.5, kappa=0.1, rounds=1, mechanism="gaussian"), "clip"),
    (dict(rero=0.5, kappa=0.1, rounds=1, mechanism="gaussian", clip=0.0), "clip"),
    (dict(rero=0.5, kappa=0.1, rounds=1, mechanism="laplace", clip=1.0), "dimension"),
    (dict(rero=0.5, kappa=0.1, rounds=1, mechanism="sign"), "mechanism"),
    (dict(rero=0.5, kappa=0.1, rounds=1, sample_rate=0.0), "sample_rate"),
])
def test_bad_input_is_one_line_naming_the_field(kwargs, field):
    with pytest.raises(ConfigError) as info:
        guardfl.calibrate(**kwargs)
    assert str(info.value).startswith(field) and "\n" not in str(info.value)
