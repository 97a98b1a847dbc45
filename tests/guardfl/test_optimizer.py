import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import guardfl
from guardfl.defenses import GaussianNoise, GradPrune, Identity, Outpost, SignCompression, Stack
from guardfl.errors import NonFiniteGradientError, UnsupportedOptimizerError
from guardfl.ops.selection import prune_count

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd_momentum_wd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=5e-4, nesterov=True),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.5),
}


def _train(model, opt, batch, steps, scheduler=None, closure=False):
    x, y = batch
    for _ in range(steps):
        opt.zero_grad()
        if closure:
            opt.step(lambda: F.cross_entropy(model(x), y).backward())
        else:
            F.cross_entropy(model(x), y).backward()
            opt.step()
        if scheduler is not None:
            scheduler.step()


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_identity_wrapper_is_bit_identical(name, small_model, small_batch):
    a, b = small_model, copy.deepcopy(small_model)
    opt_a = OPTIMIZERS[name](a.parameters())
    opt_b = guardfl.wrap(OPTIMIZERS[name](b.parameters()), Identity())
    sched_a = torch.optim.lr_scheduler.StepLR(opt_a, 2, 0.5)
    sched_b = torch.optim.lr_scheduler.StepLR(opt_b, 2, 0.5)
    _train(a, opt_a, small_batch, 5, sched_a)
    _train(b, opt_b, small_batch, 5, sched_b)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    # the scheduler drove the guarded optimizer's learning rate like the plain one's (two decays)
    assert opt_b.param_groups[0]["lr"] == opt_a.param_groups[0]["lr"] == pytest.approx(opt_a.defaults["lr"] * 0.25)


@given(lr=st.floats(1e-4, 1.0), momentum=st.floats(0, 0.99), wd=st.floats(0, 0.1), steps=st.integers(1, 4))
def test_identity_bit_identical_property(lr, momentum, wd, steps):
    torch.manual_seed(0)
    a = torch.nn.Linear(6, 3)
    b = copy.deepcopy(a)
    batch = (torch.randn(4, 6), torch.tensor([0, 1, 2, 1]))
    _train(a, torch.optim.SGD(a.parameters(), lr=lr, momentum=momentum, weight_decay=wd), batch, steps)
    _train(b, guardfl.wrap(torch.optim.SGD(b.parameters(), lr=lr, momentum=momentum, weight_decay=wd), Identity()), batch, steps)
    assert all(torch.equal(pa, pb) for pa, pb in zip(a.parameters(), b.parameters()))


def test_model_moves_by_the_defended_gradient(small_model, small_batch):
    """Plain SGD: the delta that leaves the client is -lr * sign(g) for SignCompression."""
    model = small_model
    before = [p.detach().clone() for p in model.parameters()]
    x, y = small_batch
    F.cross_entropy(model(x), y).backward()
    raw = [p.grad.clone() for p in model.parameters()]
    opt = guardfl.wrap(torch.optim.SGD(model.parameters(), lr=0.5), SignCompression())
    opt.step()
    for p, b, g in zip(model.parameters(), before, raw):
        assert torch.equal(p.grad, g.sign())  # p.grad holds the defended gradient
        assert torch.allclose(p.detach() - b, -0.5 * g.sign())


def test_stats_agree_with_what_happened(small_model, small_batch):
    model = small_model
    opt = guardfl.wrap(torch.optim.SGD(model.parameters(), lr=0.1), Stack(GradPrune(0.75), SignCompression()), model=model)
    x, y = small_batch
    F.cross_entropy(model(x), y).backward()
    raw = [p.grad.clone() for p in model.parameters()]
    opt.step()
    stats = opt.last_stats
    assert stats.iteration == 1 and stats.fired
    prune_stage = stats.stages[0]
    names = [n for n, _ in model.named_parameters()]
    assert [layer.name for layer in prune_stage.layers] == names
    for (name, p), g, layer in zip(model.named_parameters(), raw, prune_stage.layers):
        zeros_made = int(((p.grad == 0) & (g != 0)).sum())  # the sign stage keeps zeros as zeros
        assert zeros_made == round(layer.fraction_zeroed * p.numel()) <= prune_count(0.75, p.numel())
        assert zeros_made > 0 or p.numel() == 1
    assert stats.to_dict()["stages"][1]["kind"] == "sign"


def test_iteration_counter_and_new_round(small_model, small_batch):
    opt = guardfl.wrap(torch.optim.SGD(small_model.parameters(), lr=0.1), Outpost(beta=1e9, seed=0))
    fired = []
    for _ in range(3):
        opt.zero_grad()
        F.cross_entropy(small_model(small_batch[0]), small_batch[1]).backward()
        opt.step()
        fired.append(opt.last_stats.fired)
    assert opt.iteration == 3 and fired == [True, False, False]
    opt.new_round()
    assert opt.iteration == 0
    opt.zero_grad()
    F.cross_entropy(small_model(small_batch[0]), small_batch[1]).backward()
    opt.step()
    assert opt.last_stats.iteration == 1 and opt.last_stats.fired  # fires again at i = 1


def test_closure_is_supported(small_model, small_batch):
    opt = guardfl.wrap(torch.optim.SGD(small_model.parameters(), lr=0.1), SignCompression())
    _train(small_model, opt, small_batch, 2, closure=True)
    assert opt.iteration == 2
    assert all(set(p.grad.unique().tolist()) <= {-1.0, 0.0, 1.0} for p in small_model.parameters())


def test_proxies_and_state_dict_round_trip(small_model, small_batch):
    inner = torch.optim.SGD(small_model.parameters(), lr=0.1, momentum=0.9)
    opt = guardfl.wrap(inner, GradPrune(0.5))
    assert isinstance(opt, torch.optim.Optimizer) and opt.original_optimizer is inner
    assert opt.param_groups is inner.param_groups and opt.state is inner.state and opt.defaults is inner.defaults
    _train(small_model, opt, small_batch, 2)
    sd = opt.state_dict()
    assert sd["guardfl"]["iteration"] == 2 and sd["guardfl"]["defense"]["kind"] == "gradprune"
    other = guardfl.wrap(torch.optim.SGD(small_model.parameters(), lr=0.1, momentum=0.9), GradPrune(0.5))
    other.load_state_dict(sd)
    assert other.iteration == 2
    assert torch.equal(
        other.state[next(small_model.parameters())]["momentum_buffer"],
        opt.state[next(small_model.parameters())]["momentum_buffer"],
    )
    plain = copy.deepcopy(inner.state_dict())
    other.load_state_dict(plain)  # a plain optimizer state dict loads too
    opt.zero_grad()
    assert all(p.grad is None for p in small_model.parameters())
    extra = torch.nn.Parameter(torch.zeros(2))
    opt.add_param_group({"params": [extra]})
    assert len(inner.param_groups) == 2
    assert "GuardedOptimizer(GradPrune(ratio=0.5)" in repr(opt)


def test_accepts_a_config_dict(small_model):
    opt = guardfl.wrap(torch.optim.SGD(small_model.parameters(), lr=0.1), {"kind": "gradprune", "ratio": 0.9})
    assert isinstance(opt.defense, GradPrune)


def test_rejects_what_it_cannot_guard(small_model):
    with pytest.raises(UnsupportedOptimizerError, match="LBFGS"):
        guardfl.wrap(torch.optim.LBFGS(small_model.parameters()), Identity())
    opt = guardfl.wrap(torch.optim.SGD(small_model.parameters(), lr=0.1), Identity())
    with pytest.raises(UnsupportedOptimizerError, match="already guarded"):
        guardfl.wrap(opt, Identity())
    with pytest.raises(UnsupportedOptimizerError, match="torch.optim.Optimizer"):
        guardfl.GuardedOptimizer(object(), Identity())


def test_nonfinite_gradient_raises_with_the_parameter_name(small_model, small_batch):
    opt = guardfl.wrap(torch.optim.SGD(small_model.parameters(), lr=0.1), GradPrune(0.5), model=small_model)
    F.cross_entropy(small_model(small_batch[0]), small_batch[1]).backward()
    small_model[3].bias.grad[0] = float("nan")
    before = [p.detach().clone() for p in small_model.parameters()]
    with pytest.raises(NonFiniteGradientError, match="3.bias"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, small_model.parameters()))  # no update happened


def test_global_rng_untouched_by_guarded_training(small_model, small_batch):
    opt = guardfl.wrap(torch.optim.SGD(small_model.parameters(), lr=0.1), Stack(Outpost(), GaussianNoise(0.1)))
    F.cross_entropy(small_model(small_batch[0]), small_batch[1]).backward()
    state = torch.get_rng_state()
    opt.step()
    assert torch.equal(state, torch.get_rng_state())
