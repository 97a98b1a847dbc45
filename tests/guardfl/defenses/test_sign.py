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


def test_sign_finds_non_finite_input_in_its_own_pass_and_follows_nonfinite():
    """Issue 66: the separate input scan is gone; the min/max pass finds the bad tensors."""
    import pytest

    from guardfl.defenses import StepContext
    from guardfl.errors import NonFiniteGradientError

    bad = [torch.tensor([0.5, float("nan"), -0.2]), torch.tensor([0.1, 0.3]), torch.tensor([float("inf"), 0.2])]
    with pytest.raises(NonFiniteGradientError, match=r"param0 \(1 of 3\), param2 \(1 of 2\)"):
        SignCompression().apply_([t.clone() for t in bad], StepContext())
    zeroed = [t.clone() for t in bad]
    SignCompression(nonfinite="zero").apply_(zeroed, StepContext())
    assert [z.tolist() for z in zeroed] == [[1.0, 0.0, -1.0], [1.0, 1.0], [0.0, 1.0]]


def test_the_optimizer_does_not_trust_a_subclass_that_writes_after_the_sign():
    """A subclass inherits ``verifies_output`` but not the optimizer's trust: its NaN written through ``.data``
    after the sign (no version bump) is still caught before the weights move."""
    import pytest

    from guardfl import wrap
    from guardfl.errors import NonFiniteGradientError

    class LateNaN(SignCompression):
        def _apply_(self, grads, ctx):
            stats = super()._apply_(grads, ctx)
            grads[0].data[0] = float("nan")
            return stats

    model = torch.nn.Linear(4, 2)
    before = model.weight.detach().clone()
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.1), LateNaN(), model=model)
    model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(NonFiniteGradientError):
        opt.step()
    assert torch.equal(model.weight.detach(), before)
    ok = wrap(torch.optim.SGD(model.parameters(), lr=0.1), SignCompression(), model=model)
    model.zero_grad()
    model(torch.randn(3, 4)).sum().backward()
    ok.step()  # the library's own sign: trusted, and finite
    assert torch.isfinite(model.weight).all()
