import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from guardfl.ops.selection import (
    DIRECT_SELECTION_MAX,
    cover_count,
    kth_smallest,
    largest_k_mask,
    prune_count,
    smallest_k_mask,
    zero_smallest_,
)
from tests.strategies import tensors


@given(t=tensors(), data=st.data())
def test_smallest_k_mask_marks_exactly_k_smallest(t, data):
    flat = t.reshape(-1)
    k = data.draw(st.integers(0, flat.numel()))
    mask = smallest_k_mask(t, k).reshape(-1)
    assert mask.shape == flat.shape and mask.dtype == torch.bool
    assert int(mask.sum()) == k
    if 0 < k < flat.numel():
        assert flat[mask].max() <= flat[~mask].min()
    # ties are broken by position: the chosen entries are the first k of a stable sort
    order = torch.sort(flat, stable=True).indices[:k]
    expected = torch.zeros_like(mask)
    expected[order] = True
    assert torch.equal(mask, expected)


@pytest.mark.parametrize("n", [DIRECT_SELECTION_MAX + 1, 200_003])
@pytest.mark.parametrize("layout", ["normal", "sorted", "reversed", "ties", "zeros", "heavy"])
def test_kth_smallest_is_exact_on_large_tensors(n, layout):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g)
    if layout == "sorted":  # adversarial for a strided sample
        x = x.sort().values
    elif layout == "reversed":
        x = x.sort(descending=True).values
    elif layout == "ties":
        x = torch.randint(0, 5, (n,), generator=g).float()
    elif layout == "zeros":
        x[: n // 2] = 0.0
    elif layout == "heavy":
        x = x.pow(9)
    for q in (1 / n, 0.1, 0.5, 0.8, 0.99, 1.0):
        k = max(1, math.floor(q * n))
        assert torch.equal(kth_smallest(x, k), x.kthvalue(k).values), (layout, k)


def test_kth_smallest_rejects_bad_k():
    with pytest.raises(ValueError, match="k must be in"):
        kth_smallest(torch.ones(3), 0)
    with pytest.raises(ValueError, match="1-D"):
        kth_smallest(torch.ones(3, 3), 1)


@given(num=st.integers(0, 1000), n=st.integers(0, 10_000))
def test_prune_count_is_the_exact_quantile_count_of_the_decimal_ratio(num, n):
    ratio = num / 1000
    expected = -((-num * (n - 1)) // 1000) if n else 0  # ceil(ratio * (n - 1))
    assert prune_count(ratio, n) == expected
    if num < 1000:  # a ratio below 1: floor(ratio * n) or one more
        assert (num * n) // 1000 <= expected <= (num * n) // 1000 + 1
    assert cover_count(ratio, n) == -((-num * n) // 1000)


@given(ratio=st.floats(0.0, 0.999), n=st.integers(1, 300), seed=st.integers(0, 2**16))
def test_prune_count_is_what_the_reference_quantile_rule_zeroes_on_distinct_values(ratio, n, seed):
    """Huang et al.'s GradPrune code zeroes |g| < torch.quantile(|g|, ratio); with distinct magnitudes
    that is exactly prune_count entries (up to the float rounding of the quantile position)."""
    values = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).double() + 1
    reference = int((values < torch.quantile(values, ratio)).sum())
    assert abs(prune_count(ratio, n) - reference) <= (1 if (ratio * (n - 1)) % 1 < 1e-9 else 0)


@pytest.mark.parametrize("n", [2, 3, 10, 99])
def test_any_positive_ratio_prunes_a_layer_of_two_or_more(n):
    assert prune_count(0.001, n) == 1 and prune_count(0.999, 1) == 0 and prune_count(0.5, 0) == 0


def test_prune_count_known_float_traps():
    assert prune_count(0.29, 100) == 29  # 0.29 * 99 == 28.71: ceil 29
    assert prune_count(0.3, 11) == 3  # 0.3 * 10 == 3.0000000000000004 in floats: ceil would give 4
    assert prune_count(0.7, 10) == 7
    assert prune_count(0.99, 10) == 9


@given(t=tensors(), data=st.data())
def test_largest_k_mask_is_the_complement(t, data):
    m = data.draw(st.integers(0, t.numel()))
    mask = largest_k_mask(t, m)
    assert int(mask.sum()) == m
    assert torch.equal(mask, ~smallest_k_mask(t, t.numel() - m))


@given(t=tensors(), data=st.data())
def test_zero_smallest_matches_the_exact_mask(t, data):
    k = data.draw(st.integers(0, t.numel()))
    out = t.clone()
    zero_smallest_(out, k)
    assert torch.equal(out, t.masked_fill(smallest_k_mask(t.abs(), k), 0))


@pytest.mark.parametrize("layout", ["normal", "ties", "centre-tap"])
def test_fast_paths_on_large_tensors(layout):
    g = torch.Generator().manual_seed(3)
    n = 9 * 40_000
    x = torch.randn(n, generator=g)
    if layout == "ties":
        x = torch.randint(-3, 4, (n,), generator=g).float()
    elif layout == "centre-tap":  # a 3x3 conv on a 1x1 map: only every 9th entry is non-zero
        x = x * (torch.arange(n) % 9 == 4)
    for k in (n // 10, n // 2, (9 * n) // 10, n - 1):
        out = x.clone()
        zero_smallest_(out, k)
        assert torch.equal(out, x.masked_fill(smallest_k_mask(x.abs(), k), 0))
        assert int(largest_k_mask(x, n - k).sum()) == n - k
