"""guardfl.ops.scratch and the counting forms of guardfl.ops.change: the fused, allocation-free paths give
bit for bit what the plain tensor code gives, and their counts are exact."""

import copy
import pickle

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from guardfl.ops.change import add_counting_, changed_count, sign_counting_, signs_counting_
from guardfl.ops.noise import gaussian_like, laplace_like
from guardfl.ops.scratch import Scratch

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def tensor(seed, n, dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 3
    special = torch.tensor([0.0, 1.0, -1.0, 1.0, float("nan")])
    x[: min(n, 5)] = special[: min(n, 5)]
    return x.to(dtype)


@settings(deadline=None, max_examples=40)
@given(st.integers(0, 2**16), st.integers(1, 3000), st.sampled_from(DTYPES))
def test_sign_counting_equals_sign_and_counts_the_entries_it_changed(seed, n, dtype):
    x = tensor(seed, n, dtype)
    expected = torch.sign(x)
    count = int(torch.count_nonzero(x != expected))  # NaN != NaN: counted, as the old code counted it
    scratch = Scratch()
    y = x.clone()
    assert int(sign_counting_(y, scratch)) == count
    assert torch.equal(y.nan_to_num(7.0), expected.nan_to_num(7.0))


@settings(deadline=None, max_examples=60)
@given(st.integers(0, 2**16), st.lists(st.tuples(st.integers(1, 500), st.sampled_from([0.0, 0.3, 1.0, 3.0]),
                                                 st.booleans()), min_size=1, max_size=4), st.sampled_from(DTYPES))
def test_signs_counting_counts_exactly_on_both_paths(seed, layers, dtype):
    """Layers inside (-1, 1) take the min/max shortcut; the others (an entry of exactly +-1, or larger, or
    an inf) are compared entry by entry; both count exactly what the sign changed."""
    g = torch.Generator().manual_seed(seed)
    xs = []
    for n, scale, special in layers:
        x = (torch.rand(n, generator=g) * 2 - 1) * scale
        if special:
            x[0] = [1.0, -1.0, float("inf"), 0.0][n % 4]
        xs.append(x.to(dtype))
    expected = [int(torch.count_nonzero(x != torch.sign(x))) for x in xs]
    signs = [torch.sign(x) for x in xs]
    assert [int(c) for c in signs_counting_(xs, Scratch())] == expected
    assert all(torch.equal(x, s) for x, s in zip(xs, signs))


@settings(deadline=None, max_examples=40)
@given(st.integers(0, 2**16), st.integers(1, 3000), st.sampled_from(DTYPES))
def test_add_counting_with_scratch_equals_the_plain_form(seed, n, dtype):
    x = tensor(seed, n, dtype).nan_to_num(0.0)
    delta = tensor(seed + 1, n, dtype).nan_to_num(0.0) * 1e-3
    a, b = x.clone(), x.clone()
    plain = int(add_counting_(a, delta.clone()))
    fused = int(add_counting_(b, delta.clone(), Scratch()))
    assert plain == fused and torch.equal(a, b)


@given(st.integers(0, 2**16), st.sampled_from(DTYPES))
def test_noise_drawn_into_scratch_is_the_same_stream(seed, dtype):
    x = torch.zeros(257, 3, dtype=dtype)
    for draw in (lambda g, s: gaussian_like(x, 0.5, g, s), lambda g, s: laplace_like(x, 0.5, g, s)):
        plain = draw(torch.Generator().manual_seed(seed), None)
        fused = draw(torch.Generator().manual_seed(seed), Scratch())
        assert plain.dtype == fused.dtype == dtype and torch.equal(plain, fused)


def test_scratch_reuses_one_buffer_per_dtype_and_grows():
    scratch = Scratch()
    a = scratch.like(torch.zeros(10, 10))
    b = scratch.like(torch.zeros(4, 5))
    assert a.shape == (10, 10) and b.shape == (4, 5) and a.data_ptr() == b.data_ptr()
    m = scratch.like(torch.zeros(3), torch.bool)
    assert m.dtype == torch.bool and m.data_ptr() != a.data_ptr()
    big = scratch.like(torch.zeros(1000))
    assert big.numel() == 1000 and scratch.like(torch.zeros(7)).data_ptr() == big.data_ptr()


def test_scratch_copies_start_empty():
    scratch = Scratch()
    scratch.like(torch.zeros(1000))
    assert pickle.loads(pickle.dumps(scratch))._buffers == {}
    assert copy.deepcopy(scratch)._buffers == {}


def test_changed_count_with_scratch_matches():
    a, b = torch.arange(10.0), torch.arange(10.0)
    b[3] = 0.5
    assert int(changed_count(a, b, Scratch())) == int(changed_count(a, b)) == 1


@settings(deadline=None, max_examples=60)
@given(st.integers(0, 2**16), st.lists(st.tuples(st.integers(0, 500), st.sampled_from([0.0, 0.3, 1.0, 3.0]),
                                                 st.booleans()), min_size=1, max_size=4), st.sampled_from(DTYPES))
def test_signs_by_magnitude_counts_and_verifies_exactly_as_the_compared_form(seed, layers, dtype):
    """The sign path of issue 66 (one min/max pass that also finds non-finite entries, one foreach sign, one
    dot per layer inside (-1, 1)) gives the sign, the exact count of changed entries, and marks as verified
    only layers whose reduction over the signs ran (finite)."""
    from guardfl.ops.change import largest_magnitudes, signs_by_magnitude_

    g = torch.Generator().manual_seed(seed)
    xs = []
    for n, scale, special in layers:
        x = (torch.rand(n, generator=g) * 2 - 1) * scale
        if special and n:
            x[0] = [1.0, -1.0, 0.5, 0.0][n % 4]
        xs.append(x.to(dtype))
    expected = [int(torch.count_nonzero(x != torch.sign(x))) for x in xs]
    signs = [torch.sign(x) for x in xs]
    top = largest_magnitudes(xs)
    assert top == [float(x.abs().max().double()) if x.numel() else 0.0 for x in xs]
    counts, verified = signs_by_magnitude_(xs, top, Scratch())
    assert counts == expected and all(torch.equal(x, s) for x, s in zip(xs, signs))
    assert verified == [t < 1 and x.dtype in (torch.float32, torch.float64) and x.numel() > 0 for x, t in zip(xs, top)]


def test_largest_magnitudes_are_nan_or_inf_exactly_where_an_entry_is():
    from guardfl.ops.change import largest_magnitudes

    xs = [torch.tensor([0.5, float("nan"), 0.1]), torch.tensor([0.2, float("-inf")]), torch.tensor([0.3, -0.9]),
          torch.tensor([float("inf"), float("nan")]), torch.zeros(0)]
    top = largest_magnitudes(xs)
    assert top[0] != top[0] and top[1] == float("inf") and top[2] == float(torch.tensor(0.9)) and top[3] != top[3] and top[4] == 0.0
