"""No finiteness check repeated where one suffices, and never one too few (issue 33, item 6).

``Defense.apply_`` records in ``StepContext`` which gradients it found (or left) finite, with their version
counters; a stack's next stage skips checking them again only while they are the same tensors, unchanged,
and ``GuardedOptimizer`` checks the final gradients always. These tests try to slip a NaN past them.
"""

import pytest
import torch

import guardfl.defenses.base as base
import guardfl.ops.finite as finite
from guardfl import wrap
from guardfl.defenses import GaussianNoise, GradPrune, LaplaceNoise, Outpost, SignCompression, Stack, StepContext
from guardfl.errors import NonFiniteGradientError


def grads(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(40, 30, generator=g).to(dtype), torch.randn(30, generator=g).to(dtype)]


def test_a_reused_context_does_not_vouch_for_new_gradients():
    ctx = StepContext()
    SignCompression().apply_(grads(), ctx)
    bad = grads()
    bad[1][3] = float("inf")  # sign would turn it into a silent +1
    with pytest.raises(NonFiniteGradientError, match="param1"):
        SignCompression().apply_(bad, ctx)


def test_an_in_place_edit_after_the_check_is_seen():
    ctx, g = StepContext(), grads()
    SignCompression().apply_(g, ctx)
    g[0][0, 0] = float("nan")
    with pytest.raises(NonFiniteGradientError, match="param0"):
        GradPrune(0.5).apply_(g, ctx)


class LateNaN(SignCompression):
    """A user's subclass that edits the gradient after guardfl's apply_ has checked it."""

    def apply_(self, grads, ctx=None):
        stages = super().apply_(grads, ctx)
        grads[0].view(-1)[0] = float("nan")
        return stages


class DataNaN(SignCompression):
    """Edits through ``.data``, whose version counter is not the tensor's."""

    def apply_(self, grads, ctx=None):
        stages = super().apply_(grads, ctx)
        grads[0].data.view(-1)[0] = float("inf")
        return stages


@pytest.mark.parametrize("defense", [LateNaN(), DataNaN(), Stack(DataNaN(), SignCompression())], ids=repr)
def test_the_optimizer_checks_what_a_subclass_changed_after_its_checks(defense):
    model = torch.nn.Linear(4, 2)
    before = [p.detach().clone() for p in model.parameters()]
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.1), defense, model=model)
    model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(NonFiniteGradientError, match="weight"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_a_stack_member_after_a_late_nan_checks_its_input():
    with pytest.raises(NonFiniteGradientError):
        Stack(LateNaN(), GradPrune(0.5)).apply_(grads(), StepContext())


def test_noise_that_overflows_float16_is_caught_before_a_sign_hides_it():
    with pytest.raises(NonFiniteGradientError, match="gaussian"):
        Stack(GaussianNoise(sigma=1e5), SignCompression()).apply_(grads(torch.float16), StepContext())


# passes = the input check, the output check of each stage that can make entries non-finite (noise can
# overflow float16; sign and pruning cannot), and GuardedOptimizer's last check before the weights move.
# SignCompression alone scans nothing apart (issue 66): its min/max pass finds non-finite inputs, and its
# count over each layer's signs (all |g| < 1 here) proves the output finite, which the optimizer trusts from it
@pytest.mark.parametrize("defense, passes", [
    (SignCompression(), 0),
    (GradPrune(0.9), 2),
    (Stack(GradPrune(0.9), SignCompression()), 2),
    (GaussianNoise(0.1), 3),
    (LaplaceNoise(0.1), 3),
    (Stack(GradPrune(0.9), GaussianNoise(0.1)), 3),
    (Stack(GaussianNoise(0.1), GradPrune(0.9), LaplaceNoise(0.1)), 4),
    (Outpost(), 3),
])
def test_a_step_checks_finiteness_once_per_change_that_can_break_it(monkeypatch, defense, passes):
    calls = []
    real = finite.nonfinite_counts

    def spy(tensors):
        calls.append(len(tensors))
        return real(tensors)

    monkeypatch.setattr(base, "nonfinite_counts", spy)
    monkeypatch.setattr(finite, "nonfinite_counts", spy)  # nonfinite_where (output and optimizer checks)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.1), defense, model=model)
    torch.nn.functional.cross_entropy(model(torch.randn(5, 8)), torch.tensor([0, 1, 2, 0, 1])).backward()
    opt.step()
    assert calls == [4] * passes
