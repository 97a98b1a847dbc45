"""Bins read as hulls and met across directions (``bin_lines``): the points where two bins that share one
sample meet, from the attacker's view of two updates each."""

import torch

from guardfl.redteam.attacks.malicious.bin_lines import bin_hull, crossings, meet


def _bin(x: torch.Tensor, members: list[int], coefficients: torch.Tensor, base: torch.Tensor) -> tuple:
    """Two first-layer updates (weights, biases) whose difference holds ``members`` with per-unit
    ``coefficients`` (units x members): what consecutive thresholds send back."""
    w0, b0 = base, torch.zeros(base.shape[0], dtype=torch.float64)
    dw = coefficients @ x[members]
    return w0, b0, w0 + dw, b0 + coefficients.sum(1)


def test_two_bins_of_two_directions_meet_in_the_sample_they_share():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(6, 50, generator=g, dtype=torch.float64)
    base = torch.randn(16, 50, generator=g, dtype=torch.float64)
    coeff = 1 + 0.3 * torch.rand(16, 2, generator=g, dtype=torch.float64)  # every unit its own mix, none dominated
    a, b = bin_hull(*_bin(x, [0, 1], coeff, base)), bin_hull(*_bin(x, [1, 2], coeff, base))
    assert a[1].shape[1] == 1 and b[1].shape[1] == 1  # each bin a line through its two samples
    assert torch.allclose(meet(a, b), x[1], atol=1e-8)
    assert meet(a, bin_hull(*_bin(x, [3, 4], coeff, base))) is None  # no shared sample: the lines do not meet
    assert meet(a, a) is None  # the same line: more than a point
    found = crossings([[a, bin_hull(*_bin(x, [3, 4], coeff, base))], [b, bin_hull(*_bin(x, [4, 5], coeff, base))]])
    assert len(found) == 2 and {int((x - p).norm(dim=1).argmin()) for p in found} == {1, 4}


def test_a_bin_whose_samples_share_one_coefficient_profile_gives_its_mean_only():
    """Every unit mixes the two samples alike (they left the same class): the points coincide, the hull is
    the weighted mean, no line, and it meets nothing."""
    g = torch.Generator().manual_seed(1)
    x = torch.rand(4, 30, generator=g, dtype=torch.float64)
    base = torch.randn(8, 30, generator=g, dtype=torch.float64)
    profile = torch.rand(8, 1, generator=g, dtype=torch.float64) + 0.5
    hull = bin_hull(*_bin(x, [0, 1], profile * torch.tensor([[1.0, 1.0]], dtype=torch.float64), base))
    assert hull[1].shape[1] == 0 and torch.allclose(hull[0], x[:2].mean(0))
    line = bin_hull(*_bin(x, [1, 2], 1 + 0.3 * torch.rand(8, 2, generator=g, dtype=torch.float64), base))
    assert meet(hull, line) is None
    assert bin_hull(base, torch.zeros(8, dtype=torch.float64), base, torch.zeros(8, dtype=torch.float64)) is None  # empty bin


def test_two_bins_that_share_a_line_meet_a_third_bin_in_one_sample_at_depth_two():
    """Bins {0, 1, 2}, {0, 1, 3} and {0, 2, 3, 4}: every two share a line (no point: a client that refuses
    point meets accepts all three), and the line the first two share cuts the third in sample 0: six updates
    combined."""
    from guardfl.redteam.attacks.malicious.bin_lines import shared

    g = torch.Generator().manual_seed(2)
    x = torch.rand(5, 40, generator=g, dtype=torch.float64)
    base = torch.randn(16, 40, generator=g, dtype=torch.float64)
    a, b, c = (bin_hull(*_bin(x, s, 1 + 0.3 * torch.rand(16, len(s), generator=g, dtype=torch.float64), base))
               for s in ([0, 1, 2], [0, 1, 3], [0, 2, 3, 4]))
    assert meet(a, b) is None and meet(a, c) is None and meet(b, c) is None
    line = shared(a, b)
    assert line[1].shape[1] == 1 and torch.allclose(meet(line, c), x[0], atol=1e-8)
    assert crossings([[a], [b], [c]], depth=1) == []
    found = crossings([[a], [b], [c]])
    assert len(found) == 1 and torch.allclose(found[0], x[0], atol=1e-8)


def test_a_line_through_two_samples_ends_in_the_box_at_a_sample_with_a_pixel_on_its_edge():
    """Sample 0 has a pixel at 0 where sample 1's is 0.5: the line through them leaves [0, 1] at sample 0;
    sample 1 has none, so the other end lies past it."""
    from guardfl.redteam.attacks.malicious.bin_lines import box_ends

    g = torch.Generator().manual_seed(3)
    x = 0.2 + 0.6 * torch.rand(2, 30, generator=g, dtype=torch.float64)
    x[0, 4], x[1, 4] = 0.0, 0.5
    base = torch.randn(8, 30, generator=g, dtype=torch.float64)
    line = bin_hull(*_bin(x, [0, 1], 1 + 0.3 * torch.rand(8, 2, generator=g, dtype=torch.float64), base))
    ends = box_ends(line, 0.0, 1.0)
    assert len(ends) == 2 and min(float((e - x[0]).norm()) for e in ends) < 1e-8
    assert min(float((e - x[1]).norm()) for e in ends) > 0.1
    assert box_ends((line[0], line[1][:, :0]), 0.0, 1.0) == []  # no line: no ends
