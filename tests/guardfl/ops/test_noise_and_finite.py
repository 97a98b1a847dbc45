import math

import torch

from guardfl.ops.finite import nonfinite_counts
from guardfl.ops.noise import gaussian_like, laplace_like


def _moments(x):
    x = x.double()
    m, s = x.mean(), x.std()
    kurt = ((x - m) ** 4).mean() / s**4
    return float(m), float(s), float(kurt)


def test_gaussian_has_requested_std_and_gaussian_tails():
    x = gaussian_like(torch.empty(400_000), 0.3, torch.Generator().manual_seed(0))
    m, s, kurt = _moments(x)
    assert abs(m) < 0.003 and abs(s - 0.3) < 0.003 and abs(kurt - 3.0) < 0.1


def test_laplace_has_requested_scale_and_laplace_tails():
    x = laplace_like(torch.empty(400_000), 0.5, torch.Generator().manual_seed(0))
    m, s, kurt = _moments(x)
    assert abs(m) < 0.005 and abs(s - 0.5 * math.sqrt(2)) < 0.01 and abs(kurt - 6.0) < 0.4
    assert torch.isfinite(x).all()


def test_samplers_never_touch_the_global_rng():
    before = torch.get_rng_state()
    gaussian_like(torch.empty(100), 1.0, torch.Generator().manual_seed(1))
    laplace_like(torch.empty(100), 1.0, torch.Generator().manual_seed(1))
    assert torch.equal(before, torch.get_rng_state())


def test_nonfinite_counts_are_exact():
    a = torch.ones(10)
    b = torch.ones(5)
    b[1] = float("nan")
    b[3] = float("inf")
    c = torch.full((4,), 3e38)  # finite entries whose sum overflows float32: not counted
    assert nonfinite_counts([a, b, c]) == [0, 2, 0]
    assert nonfinite_counts([]) == []
