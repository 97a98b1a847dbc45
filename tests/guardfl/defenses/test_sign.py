import torch
from hypothesis import given

from guardfl.defenses import SignCompression
from tests.strategies import gradient_lists


@given(grads=gradient_lists())
def test_sign_output_is_the_sign(grads):
    out, stats = SignCompression()(grads)
    for g, o in zip(grads, out):
        assert torch.equal(o, torch.sign(g))
        assert set(o.unique().tolist()) <= {-1.0, 0.0, 1.0}
    # fired exactly when some entry was not already -1, 0 or 1
    assert stats.fired == any(bool(((g != 0) & (g.abs() != 1)).any()) for g in grads)
