"""Noise must be finite (issue 13): the Laplace sampler never reaches its pole, in any dtype; a defended
gradient that is not finite is refused before the inner optimizer steps, naming the defense."""

import pytest
import torch
import torch.nn.functional as F

import guardfl
from guardfl.defenses import GaussianNoise, GradPrune, LaplaceNoise, Stack
from guardfl.errors import NonFiniteGradientError


def _bf16_layer_step(defense):
    torch.manual_seed(0)
    layer = torch.nn.Linear(256, 256).to(torch.bfloat16)
    opt = guardfl.wrap(torch.optim.SGD(layer.parameters(), lr=0.1), defense, model=layer)
    x = torch.randn(8, 256, dtype=torch.bfloat16)
    opt.zero_grad()
    layer(x).float().pow(2).mean().backward()
    opt.step()
    return layer


def test_one_sgd_step_with_laplace_on_a_bfloat16_layer_leaves_finite_weights():
    """The audit's case: LaplaceNoise(2.0), one SGD step on a bfloat16 layer left 2,926 non-finite weights."""
    for seed in range(3):
        layer = _bf16_layer_step(LaplaceNoise(2.0, seed=seed))
        assert all(bool(torch.isfinite(p).all()) for p in layer.parameters())


def test_laplace_defense_output_is_finite_in_16_bit_dtypes():
    for dtype in (torch.bfloat16, torch.float16):
        out, stats = LaplaceNoise(2.0, seed=1)([torch.zeros(2_000_000, dtype=dtype)])
        assert bool(torch.isfinite(out[0]).all()) and stats.fired


class _Inf(GradPrune):
    """A user defense that writes inf past the leaf check (it overrides apply_ itself)."""

    def __init__(self):
        super().__init__(0.5)

    def apply_(self, grads, ctx=None):
        stats = super().apply_(grads, ctx)
        grads[-1].view(-1)[0] = float("inf")
        return stats


def test_guarded_optimizer_refuses_a_nonfinite_defended_gradient_naming_the_defense(small_model, small_batch):
    opt = guardfl.wrap(torch.optim.SGD(small_model.parameters(), lr=0.1), _Inf(), model=small_model)
    F.cross_entropy(small_model(small_batch[0]), small_batch[1]).backward()
    before = [p.detach().clone() for p in small_model.parameters()]
    with pytest.raises(NonFiniteGradientError, match=r"^gradprune: the defended gradient has non-finite entries in "
                                                     r"3\.bias \(1 of 5, float32\); the optimizer step is refused"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, small_model.parameters()))


def test_a_noise_that_overflows_float16_is_refused_naming_the_member(small_model):
    """GaussianNoise(1e5) is finite in float32 but overflows float16 (65504): refused, naming the stage."""
    model = torch.nn.Linear(8, 4).half()
    opt = guardfl.wrap(torch.optim.SGD(model.parameters(), lr=0.1), Stack(GradPrune(0.5), GaussianNoise(1e5, seed=0)),
                       model=model)
    model(torch.randn(2, 8, dtype=torch.float16)).float().sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(NonFiniteGradientError, match=r"^gaussian: the defended gradient has non-finite entries in "
                                                     r"weight \(\d+ of 32, float16\).*float16 ends at 65504"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with pytest.raises(NonFiniteGradientError, match="^gaussian: "):  # the functional form, too
        GaussianNoise(1e5, seed=0)([torch.zeros(100, dtype=torch.float16)])


def test_the_output_check_ignores_the_input_policy():
    """nonfinite='zero' is about the gradient handed in; a defense's own non-finite output always raises."""
    with pytest.raises(NonFiniteGradientError, match="^laplace: "):
        LaplaceNoise(1e6, seed=0, nonfinite="zero")([torch.zeros(1000, dtype=torch.float16)])


def test_dpsgd_alone_refuses_a_nonfinite_privatised_gradient():
    """An inf per-sample gradient becomes NaN in Opacus's clipping: before, the weights turned NaN silently."""
    from torch.utils.data import DataLoader, TensorDataset

    from guardfl.defenses import DPSGD

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    data = TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    model, opt, loader = guardfl.protect(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                         DataLoader(data, batch_size=8), DPSGD(noise_multiplier=1.0, seed=0))
    before = [p.detach().clone() for p in model.parameters()]
    for x, y in loader:
        if len(x):
            break
    opt.zero_grad()
    (model(x).sum() * float("inf")).backward()
    with pytest.raises(NonFiniteGradientError, match=r"^dpsgd: the defended gradient has non-finite entries in weight"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert "state" in opt.state_dict()  # the guard is transparent to state dicts


def test_dpsgd_with_a_gradient_defense_names_both():
    from torch.utils.data import DataLoader, TensorDataset

    from guardfl.defenses import DPSGD

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    data = TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    model, opt, loader = guardfl.protect(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                         DataLoader(data, batch_size=8),
                                         Stack(DPSGD(noise_multiplier=1.0, seed=0), _Inf()))
    for x, y in loader:
        if len(x):
            break
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(NonFiniteGradientError, match=r"^dpsgd, then gradprune: the defended gradient"):
        opt.step()
