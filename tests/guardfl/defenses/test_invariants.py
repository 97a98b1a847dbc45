"""Invariants every defense must keep: randomness, no mutation, non-finite handling, never identity."""

import pytest
import torch

from guardfl.defenses import (
    GaussianNoise,
    GradPrune,
    Identity,
    LaplaceNoise,
    Outpost,
    SignCompression,
    Stack,
)
from guardfl.errors import NonFiniteGradientError

FACTORIES = {
    "gradprune": lambda **kw: GradPrune(0.9, **kw),
    "gradprune_global": lambda **kw: GradPrune(0.9, scope="global", **kw),
    "sign": lambda **kw: SignCompression(**kw),
    "gaussian": lambda **kw: GaussianNoise(0.1, **kw),
    "laplace": lambda **kw: LaplaceNoise(0.1, **kw),
    "outpost": lambda **kw: Outpost(**kw),
    "stack": lambda **kw: Stack(GradPrune(0.5), GaussianNoise(0.1), **kw),
}
RANDOM = {"gaussian", "laplace", "outpost", "stack"}


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(64, 32, generator=g), torch.randn(32, generator=g), torch.randn(40_000, generator=g)]
    params = [torch.randn(p.shape, generator=g) for p in grads]
    return grads, params


@pytest.mark.parametrize("name", FACTORIES)
def test_changes_what_leaves_the_client(name):
    grads, params = _inputs()
    out, stats = FACTORIES[name]()(grads, params)
    assert stats.fired
    for g, o in zip(grads, out):
        assert not torch.equal(g, o)


@pytest.mark.parametrize("name", FACTORIES)
def test_caller_tensors_are_not_mutated(name):
    grads, params = _inputs()
    copies = [g.clone() for g in grads] + [p.clone() for p in params]
    FACTORIES[name]()(grads, params)
    assert all(torch.equal(a, b) for a, b in zip(grads + params, copies))


@pytest.mark.parametrize("name", sorted(RANDOM))
def test_seeded_runs_reproduce_unseeded_runs_differ(name):
    grads, params = _inputs()
    a, _ = FACTORIES[name](seed=7)(grads, params)
    b, _ = FACTORIES[name](seed=7)(grads, params)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    c, _ = FACTORIES[name]()(grads, params)
    d, _ = FACTORIES[name]()(grads, params)
    assert not all(torch.equal(x, y) for x, y in zip(c, d))


@pytest.mark.parametrize("name", FACTORIES)
def test_global_rng_is_never_touched(name):
    grads, params = _inputs()
    state = torch.get_rng_state()
    FACTORIES[name]()(grads, params)
    assert torch.equal(state, torch.get_rng_state())


@pytest.mark.parametrize("name", list(FACTORIES) + ["identity"])
def test_nonfinite_gradients_raise_by_default_and_can_be_zeroed(name):
    factory = FACTORIES.get(name, lambda **kw: Identity(**kw))
    grads, params = _inputs()
    grads[1][3] = float("nan")
    grads[0][2, 2] = float("inf")
    with pytest.raises(NonFiniteGradientError, match="param1 \\(1 of 32\\)"):
        factory()(grads, params, names=None)
    out, _ = factory(nonfinite="zero")(grads, params)
    assert all(torch.isfinite(o).all() for o in out)
