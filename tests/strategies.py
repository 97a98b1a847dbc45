"""Hypothesis strategies shared by the defense tests."""

import torch
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
import numpy as np

finite = st.floats(min_value=-1e3, max_value=1e3, allow_nan=False, allow_infinity=False, width=32)


@st.composite
def tensors(draw, min_size=1, max_size=200, elements=finite):
    """A float32 tensor of 1-3 dims, with duplicates and zeros likely (ties matter for pruning)."""
    n = draw(st.integers(min_size, max_size))
    pool = draw(st.lists(elements, min_size=1, max_size=8))
    values = draw(
        arrays(np.float32, n, elements=st.one_of(elements, st.sampled_from(pool), st.just(0.0)))
    )
    shape = draw(st.sampled_from([(n,), (1, n), (n, 1)]))
    return torch.from_numpy(values.copy()).reshape(shape)


@st.composite
def gradient_lists(draw, max_layers=4, max_size=120):
    return [draw(tensors(max_size=max_size)) for _ in range(draw(st.integers(1, max_layers)))]
