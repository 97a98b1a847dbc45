import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import guardfl
from guardfl.defenses import DPSGD, GradDefense, Stack, from_config
from guardfl.defenses.base import StepContext
from guardfl.errors import ConfigError, UnsupportedOptimizerError
from guardfl.ops.sensitivity import layer_sensitivity, slice_bounds, slice_segments
from tests.errors import assert_config_error


def _cnn(seed=0, bn=False):
    torch.manual_seed(seed)
    layers = [nn.Conv2d(1, 3, 3), nn.ReLU()]
    if bn:
        layers.insert(1, nn.BatchNorm2d(3))
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(3 * 4 * 4, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(seed, n=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 6, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def _grads(model, x, y):
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad()
    return grads, [p.detach() for p in model.parameters()], [n for n, _ in model.named_parameters()]


def _slice_masks(grads, defense):
    """Per gradient tensor, the entries of the slices the defense drew (from its sensitivity)."""
    bounds = slice_bounds([g.numel() for g in grads], defense.last_sensitivity, defense.config.slices)
    masks = [torch.zeros(g.numel(), dtype=torch.bool) for g in grads]
    for k in defense.last_slices:
        for layer, a, b in slice_segments(bounds, k):
            masks[layer][a:b] = True
    return [m.view(g.shape) for m, g in zip(masks, grads)], bounds


# -- configuration ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg, field, allowed", [
    ({"slices": 0}, "graddefense.slices", ">= 1"),
    ({"perturb_slices": 0}, "graddefense.perturb_slices", "[1, slices]"),
    ({"slices": 4, "perturb_slices": 5}, "graddefense.perturb_slices", "[1, slices]"),
    ({"noise": -0.1}, "graddefense.noise", "[0, 1e6]"),
    ({"noise": float("inf")}, "graddefense.noise", "[0, 1e6]"),
    ({"clip_norm": 0.0}, "graddefense.clip_norm", "> 0"),
    ({"clip": "maybe"}, "graddefense.clip", "true or false"),
    ({"root_size": 0}, "graddefense.root_size", ">= 1"),
    ({"refresh": "epoch"}, "graddefense.refresh", "'round' or 'step'"),
    ({"noise": 0.0, "clip": False}, "graddefense", "noise > 0 or clip=true"),
    ({"noise": 0.0}, "graddefense.clip_norm", "> 0"),
    ({"slice": 3}, "graddefense.slice", "slices"),
])
def test_bad_configs_name_the_field_and_range(cfg, field, allowed):
    assert_config_error("graddefense", cfg, field, allowed)


def test_defaults_are_the_settings_of_the_outpost_paper():
    d = from_config({"kind": "graddefense"})
    c = d.config
    assert isinstance(d, GradDefense)
    assert (c.slices, c.perturb_slices, c.noise, c.clip, c.root_size, c.refresh) == (10, 5, 0.01, True, 50, "round")
    assert d.clip_bound == 0.01 and d.randomized and d.needs_model
    assert from_config({"kind": "graddefense", "noise": 0.0, "clip_norm": 2.0}).clip_bound == 2.0
    assert from_config({"kind": "graddefense", "clip": False}).clip_bound is None


# -- the maths --------------------------------------------------------------------------------------------
@given(sizes=st.lists(st.integers(0, 300), min_size=1, max_size=6),
       sens=st.lists(st.one_of(st.just(0.0), st.floats(1e-6, 1e3)), min_size=6, max_size=6),
       slices=st.integers(1, 12))
def test_slices_partition_the_gradient_with_equal_sensitivity(sizes, sens, slices):
    sens = sens[: len(sizes)]
    bounds = slice_bounds(sizes, sens, slices)
    total = math.fsum(sens)
    if not total > 0:
        sens, total = [float(n) for n in sizes], float(sum(sizes))
    seen = [0] * len(sizes)
    largest_entry = max([s / n for s, n in zip(sens, sizes) if n] or [0.0])
    for k in range(slices):
        mass = 0.0
        for layer, a, b in slice_segments(bounds, k):
            assert 0 <= a < b <= sizes[layer]
            seen[layer] += b - a
            mass += (b - a) * sens[layer] / sizes[layer]
        if total > 0:  # each slice holds S / K, up to one entry at each end
            assert abs(mass - total / slices) <= 2 * largest_entry + 1e-9 * total
    assert seen == list(sizes)  # every entry in exactly one slice
    for row, n in zip(bounds, sizes):
        assert row[0] == 0 and row[-1] == n and row == sorted(row)


def test_sensitivity_matches_the_reference_computation():
    """The public code's compute_sens: dL/dtheta with create_graph, one vector-Jacobian product with ones
    per layer, the per-sample Frobenius norm averaged over the root set (labels: the model's argmax)."""
    model = _cnn(2)
    x, _ = _batch(5, n=6)
    params = list(model.parameters())
    ours = layer_sensitivity(model, params, x)
    xg = x.clone().requires_grad_(True)
    pred = model(xg)
    loss = nn.CrossEntropyLoss()(pred, pred.detach().argmax(1))
    dy_dx = torch.autograd.grad(loss, params, create_graph=True)
    for s, layer in zip(ours, dy_dx):
        (vjp,) = torch.autograd.grad(layer, xg, torch.ones_like(layer), retain_graph=True)
        ref = sum(torch.norm(sample) for sample in vjp) / len(vjp)
        assert s == pytest.approx(float(ref), rel=1e-5, abs=1e-9)
    assert ours[0] > 0 and ours[2] > 0
    # the classification layer's gradient sums to zero (softmax minus one-hot), so the reference's
    # measure gives it no sensitivity: its entries fall in the last slice, as in the reference
    assert ours[-1] < 1e-6 * max(ours) and ours[-2] < 1e-6 * max(ours)


# -- what leaves the client -------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_noise_only_on_the_drawn_slices(seed):
    model = _cnn(seed)
    x, y = _batch(seed)
    grads, params, names = _grads(model, x, y)
    d = GradDefense(noise=0.05, clip=False, seed=seed)
    out, stats = d(grads, params, names=names, model=model, inputs=x)
    assert len(d.last_slices) == 5 and len(set(d.last_slices)) == 5
    masks, _ = _slice_masks(grads, d)
    for g, o, m, layer in zip(grads, out, masks, stats.stages[0].layers):
        diff = o - g
        assert torch.all(diff[~m] == 0)
        assert torch.all(diff[m] != 0)
        assert layer.fraction_noised == int(m.sum()) / g.numel()
        assert layer.noise_std == (0.05 if m.any() else 0.0)
    assert 0 < sum(int(m.sum()) for m in masks) < sum(g.numel() for g in grads)


def test_noise_std_is_as_configured():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(36, 400), nn.ReLU(), nn.Linear(400, 300), nn.ReLU(), nn.Linear(300, 3))
    x, y = _batch(0, n=8)
    grads, params, names = _grads(model, x, y)
    d = GradDefense(noise=0.3, clip=False, seed=1)
    out, _ = d(grads, params, model=model, inputs=x)
    masks, _ = _slice_masks(grads, d)
    noise = torch.cat([(o - g)[m] for o, g, m in zip(out, grads, masks)]).double()
    assert noise.numel() > 50_000
    assert abs(float(noise.std()) - 0.3) < 0.01 * 0.3 and abs(float(noise.mean())) < 0.01 * 0.3


@pytest.mark.parametrize("bound", [1e-3, 0.05, 10.0])
def test_clipping_bound_is_respected_on_the_drawn_slices_only(bound):
    model = _cnn(1)
    x, y = _batch(1)
    grads, params, names = _grads(model, x, y)
    d = GradDefense(noise=0.0, clip=True, clip_norm=bound, seed=0)
    out, _ = d(grads, params, model=model, inputs=x)
    masks, bounds = _slice_masks(grads, d)
    for g, o, m in zip(grads, out, masks):
        assert torch.equal(o[~m], g[~m])
    for k in d.last_slices:
        segs = slice_segments(bounds, k)
        before = math.sqrt(sum(float(grads[i].reshape(-1)[a:b].double().pow(2).sum()) for i, a, b in segs))
        after = math.sqrt(sum(float(out[i].reshape(-1)[a:b].double().pow(2).sum()) for i, a, b in segs))
        assert after <= bound * (1 + 1e-5)
        assert after == pytest.approx(min(before, bound), rel=1e-4)
        g_slice = torch.cat([grads[i].reshape(-1)[a:b] for i, a, b in segs])
        o_slice = torch.cat([out[i].reshape(-1)[a:b] for i, a, b in segs])
        assert torch.allclose(o_slice, g_slice * min(1.0, bound / before), rtol=1e-5, atol=1e-12)  # scaled as a whole


def test_clip_then_noise_with_the_defaults():
    model = _cnn(3)
    x, y = _batch(3)
    grads, params, names = _grads(model, x, y)
    d = GradDefense(seed=5)
    out, _ = d(grads, params, model=model, inputs=x)
    masks, bounds = _slice_masks(grads, d)
    clip_only, _ = GradDefense(seed=5, noise=0.0, clip_norm=0.01)(grads, params, model=model, inputs=x)
    for o, c, g, m in zip(out, clip_only, grads, masks):
        assert torch.equal(o[~m], g[~m])
        if m.any():  # the same slices, clipped to norm 0.01, plus N(0, 0.01^2) on each entry
            assert 0 < float((o - c)[m].abs().max()) < 0.06


def test_seeded_runs_reproduce_unseeded_runs_differ_global_rng_untouched():
    model = _cnn(bn=True)
    x, y = _batch(0, n=6)
    grads, params, names = _grads(model, x, y)
    bn = model[1]
    buffers = [b.clone() for b in bn.buffers()]
    state = torch.get_rng_state()
    a, _ = GradDefense(seed=11)(grads, params, model=model, inputs=x)
    b, _ = GradDefense(seed=11)(grads, params, model=model, inputs=x)
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    c, _ = GradDefense()(grads, params, model=model, inputs=x)
    e, _ = GradDefense()(grads, params, model=model, inputs=x)
    assert not all(torch.equal(u, v) for u, v in zip(c, e))
    assert torch.equal(state, torch.get_rng_state())
    assert all(torch.equal(u, v) for u, v in zip(buffers, bn.buffers()))  # no BatchNorm update
    assert all(p.grad is None for p in model.parameters())


def test_root_set_is_the_first_inputs_and_sensitivity_refreshes_per_round(monkeypatch):
    model = _cnn()
    calls = []
    import guardfl.defenses.graddefense as gd

    real = gd.layer_sensitivity
    monkeypatch.setattr(gd, "layer_sensitivity", lambda m, p, x: calls.append(x.shape[0]) or real(m, p, x))
    opt = guardfl.wrap(torch.optim.SGD(model.parameters(), lr=0.1), GradDefense(root_size=10, seed=0), model=model)
    batches = [_batch(i, n=4) for i in range(4)]
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    d = opt.defense
    assert torch.equal(d.root_set, torch.cat([batches[0][0], batches[1][0], batches[2][0][:2]]))
    assert calls == [4]  # once, at the round's first step
    opt.new_round()
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    assert calls == [4, 10]
    step = guardfl.wrap(torch.optim.SGD(model.parameters(), lr=0.1), GradDefense(refresh="step", seed=0), model=model)
    for x, y in batches[:3]:
        step.zero_grad()
        F.cross_entropy(model(x), y).backward()
        step.step()
    assert calls == [4, 10, 4, 8, 12]
    other = _cnn(1)  # the same defense object on another model (another client): a new root set
    x, y = _batch(9, n=3)
    grads, params, _ = _grads(other, x, y)
    d(grads, params, model=other, inputs=x, iteration=3)
    assert torch.equal(d.root_set, x) and calls[-1] == 3


# -- through guardfl.wrap and guardfl.protect --------------------------------------------------------------
def test_through_wrap_and_the_model_not_given():
    model = _cnn()
    with pytest.raises(UnsupportedOptimizerError, match="graddefense needs the model .*pass model=") as info:
        guardfl.wrap(torch.optim.SGD(model.parameters(), lr=0.1), GradDefense())
    assert "\n" not in str(info.value)
    x, y = _batch(7)
    grads, params, names = _grads(model, x, y)
    expected, _ = GradDefense(seed=2)(grads, params, model=model, inputs=x)
    opt = guardfl.wrap(torch.optim.SGD(model.parameters(), lr=1.0), GradDefense(seed=2), model=model)
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    for p, b, e in zip(model.parameters(), before, expected):
        assert torch.equal(p.grad, e)
        assert torch.allclose(b - p.detach(), e, atol=1e-6)
    assert opt.last_stats.stages[0].kind == "graddefense" and opt.last_stats.fired


def test_through_protect_and_with_dp():
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 1, 6, 6, generator=g), torch.randint(0, 3, (32,), generator=g))
    model = _cnn()
    net, opt, loader = guardfl.protect(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=8),
                                       {"kind": "graddefense", "seed": 0})
    for xb, yb in loader:
        opt.zero_grad()
        F.cross_entropy(net(xb), yb).backward()
        opt.step()
        assert opt.last_stats.fired
    assert opt.iteration == 4 and opt.defense.root_set.shape[0] == 32
    model = _cnn()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        net, opt, loader = guardfl.protect(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=8),
                                           Stack(DPSGD(noise_multiplier=0.5, max_grad_norm=1.0, seed=0), GradDefense(seed=0)))
        for xb, yb in loader:
            if len(xb) == 0:
                continue
            opt.zero_grad()
            F.cross_entropy(net(xb), yb).backward()
            opt.step()
    assert opt.last_stats.stages[0].kind == "graddefense"
    assert opt.epsilon(1e-5) < math.inf


def test_model_errors_are_one_line():
    model = nn.Sequential(nn.Linear(4, 3))
    grads = [torch.randn(3, 4), torch.randn(3)]
    params = [p.detach() for p in model.parameters()]
    with pytest.raises(ConfigError, match="not floating point"):
        GradDefense()(grads, params, model=model, inputs=torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ConfigError, match="graddefense: the gradients of param0 belong to no parameter"):
        GradDefense()(grads, [torch.randn(3, 4), params[1]], model=model, inputs=torch.randn(2, 4))
    seq = nn.Sequential(nn.Linear(4, 3), nn.Flatten(0))
    with pytest.raises(ConfigError, match=r"graddefense: expected \(batch, classes\) logits"):
        GradDefense()(grads, [p.detach() for p in seq.parameters()], model=seq, inputs=torch.randn(2, 4))


def test_root_sensitivities_of_many_clients_equal_each_clients_own():
    """One double-backward pass for N FedSGD clients sharing the weights: each row is the sensitivity
    ``apply_`` measures on that client's own root set; with it, ``apply_with_sensitivity_`` draws and noises
    as ``apply_`` does (the same stream gives the same gradient)."""
    model = _cnn(2)
    xs = torch.stack([_batch(s)[0] for s in range(3)])
    params, names = [p.detach() for p in model.parameters()], [n for n, _ in model.named_parameters()]
    sens = GradDefense(seed=0).root_sensitivities(model, params, names, xs)
    for i in range(3):
        x, y = _batch(i)
        grads, _, _ = _grads(model, x, y)
        a, b = GradDefense(seed=4), GradDefense(seed=4)
        out, _ = a(grads, params, names=names, model=model, inputs=x)
        assert sens[i] == pytest.approx(a.last_sensitivity, rel=1e-4, abs=1e-6 * max(a.last_sensitivity))
        mine = [g.clone() for g in grads]
        b.apply_with_sensitivity_(mine, a.last_sensitivity, StepContext(iteration=1, names=names))
        for g, h in zip(out, mine):
            torch.testing.assert_close(g, h)
    with pytest.raises(ValueError, match="BatchNorm"):
        GradDefense().root_sensitivities(_cnn(bn=True).train(), params, names, xs)
