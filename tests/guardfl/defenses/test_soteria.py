import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import guardfl
from guardfl.defenses import DPSGD, GradPrune, Soteria, Stack, from_config
from guardfl.errors import ConfigError, UnsupportedOptimizerError
from guardfl.ops.representation import feature_input_grad_norms, soteria_scores
from guardfl.ops.selection import prune_count
from tests.errors import assert_config_error


def _mlp(seed=0, act=nn.ReLU, bn=False):
    torch.manual_seed(seed)
    layers = [nn.Linear(6, 12), act()]
    if bn:
        layers.insert(1, nn.BatchNorm1d(12))
    return nn.Sequential(*layers, nn.Linear(12, 10), act(), nn.Linear(10, 3))


def _cnn(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, 8), nn.ReLU(), nn.Linear(8, 3))


def _grads(model, x, y):
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    params = [p.detach() for p in model.parameters()]
    names = [n for n, _ in model.named_parameters()]
    model.zero_grad()
    return grads, params, names


def _batch(seed, n=5, shape=(6,)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *shape, generator=g), torch.randint(0, 3, (n,), generator=g)


def _layer_input(model, layer, x):
    """(x as a leaf that requires grad, the input r of ``layer`` in a forward pass of it, with its graph)."""
    box = []
    h = layer.register_forward_pre_hook(lambda m, a: box.append(a[0]))
    xg = x.clone().requires_grad_(True)
    model(xg)
    h.remove()
    return xg, box[0]


def _slow_scores(model, layer, x):
    """The public code's loop, sample by sample: one backward pass per feature of sum_b r[b, f], the
    per-sample norm of the input gradient, divided by |r[b, f]|; samples with r = 0 left out and the
    sum rescaled to the batch size (guardfl's documented rule), +inf for a feature that is 0 everywhere."""
    xg, r = _layer_input(model, layer, x)
    batch, features = r.shape
    scores = []
    for f in range(features):
        (gx,) = torch.autograd.grad(r[:, f].sum(), xg, retain_graph=True, allow_unused=True)
        gx = torch.zeros_like(xg) if gx is None else gx
        terms = []
        for b in range(batch):
            value = float(r[b, f].detach())
            if value != 0.0:
                terms.append(float(gx[b].norm()) / abs(value))
        scores.append(math.inf if not terms else sum(terms) * batch / len(terms))
    return scores


def _chosen(scores, k):
    order = sorted(range(len(scores)), key=lambda f: (scores[f], f))  # ties by position
    return sorted(order[:k])


# -- configuration ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg, field, allowed", [
    ({"prune": 0.0}, "soteria.prune", "(0, 1)"),
    ({"prune": 1.0}, "soteria.prune", "(0, 1)"),
    ({"prune": -0.5}, "soteria.prune", "(0, 1)"),
    ({"prune": float("nan")}, "soteria.prune", "(0, 1)"),
    ({"layer": 3}, "soteria.layer", "nn.Linear"),
    ({"laer": "fc"}, "soteria.laer", "layer"),
])
def test_bad_configs_name_the_field_and_range(cfg, field, allowed):
    assert_config_error("soteria", cfg, field, allowed)


def test_defaults_are_the_outpost_papers_setting():
    d = from_config({"kind": "soteria"})
    assert isinstance(d, Soteria) and d.config.prune == 0.5 and d.config.layer is None
    assert d.needs_model and d.needs_params and not d.randomized


def test_layer_errors_are_one_line_and_name_the_field():
    conv_only = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten())
    opt = torch.optim.SGD(conv_only.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"soteria\.layer: the model has no nn\.Linear") as info:
        guardfl.wrap(opt, Soteria(), model=conv_only)
    assert "\n" not in str(info.value)
    model = _cnn()
    with pytest.raises(ConfigError, match=r"soteria\.layer: '0' is a Conv2d, not an nn\.Linear; allowed: .*'3', '5'"):
        guardfl.wrap(torch.optim.SGD(model.parameters(), lr=0.1), Soteria(layer="0"), model=model)
    with pytest.raises(ConfigError, match=r"soteria\.layer: 'fc' names no module"):
        guardfl.wrap(torch.optim.SGD(model.parameters(), lr=0.1), Soteria(layer="fc"), model=model)
    x, y = _batch(0, shape=(1, 6, 6))
    grads, params, names = _grads(model, x, y)
    with pytest.raises(ConfigError, match=r"soteria\.layer"):  # the functional form checks too
        Soteria(layer="1")(grads, params, model=model, inputs=x)


def test_model_not_given_is_a_one_line_error():
    model = _mlp()
    with pytest.raises(UnsupportedOptimizerError, match="soteria needs the model .*pass model=") as info:
        guardfl.wrap(torch.optim.SGD(model.parameters(), lr=0.1), Soteria())
    assert "\n" not in str(info.value)
    with pytest.raises(UnsupportedOptimizerError, match="pass model="):  # inside a stack too
        guardfl.wrap(torch.optim.SGD(model.parameters(), lr=0.1), Stack(GradPrune(0.5), Stack(Soteria())))
    x, y = _batch(0)
    grads, params, _ = _grads(model, x, y)
    with pytest.raises(ConfigError, match="soteria needs the model"):
        Soteria()(grads, params)
    with pytest.raises(ConfigError, match="soteria needs the batch inputs"):
        Soteria()(grads, params, model=model)


# -- what leaves the client -------------------------------------------------------------------------------
@given(seed=st.integers(0, 2**16), prune=st.sampled_from([0.1, 0.25, 0.5, 0.8, 0.95]),
       layer=st.sampled_from([None, "2", "4"]), n=st.integers(1, 6), act=st.sampled_from([nn.ReLU, nn.Sigmoid]))
def test_zeroes_exactly_the_chosen_columns_and_nothing_else(seed, prune, layer, n, act):
    model = _mlp(seed % 7, act=act)
    x, y = _batch(seed, n=n)
    grads, params, names = _grads(model, x, y)
    d = Soteria(prune=prune, layer=layer)
    out, stats = d(grads, params, names=names, model=model, inputs=x)
    name = layer or "0"
    idx = names.index(f"{name}.weight")
    lin = dict(model.named_modules())[name]
    features = lin.in_features
    k = prune_count(prune, features)
    chosen = d.last_pruned
    assert len(chosen) == k
    mask = torch.zeros(features, dtype=torch.bool)
    mask[chosen] = True
    assert torch.all(out[idx][:, mask] == 0)
    assert torch.equal(out[idx][:, ~mask], grads[idx][:, ~mask])
    for i, (g, o) in enumerate(zip(grads, out)):
        if i != idx:
            assert torch.equal(g, o)  # the bias and every other layer: untouched
    (stage,) = stats.stages
    zeroed = int(((out[idx] == 0) & (grads[idx] != 0)).sum())  # entries of the chosen columns not already zero
    assert [s.fraction_zeroed for s in stage.layers] == [zeroed / grads[idx].numel() if i == idx else 0.0 for i in range(len(grads))]
    assert stage.fired == (zeroed > 0)
    # the chosen features are those with the smallest ratio, by the slow reference computation
    assert chosen == _chosen(_slow_scores(model, lin, x), k)


def test_matches_the_public_codes_percentile_rule_when_no_feature_is_zero():
    """Sigmoid features are never 0: the public code's rule (sum of norm / r over the batch, zero the
    features below np.percentile(scores, 50)) picks the same features."""
    model = _cnn(3)
    model[4] = nn.Sigmoid()
    torch.manual_seed(3)
    model.insert(2, nn.Sigmoid())  # conv -> sigmoid -> relu: r is positive
    x, y = _batch(1, n=4, shape=(1, 6, 6))
    grads, params, names = _grads(model, x, y)
    d = Soteria(prune=0.5, layer="6")
    d(grads, params, model=model, inputs=x)
    xg, r = _layer_input(model, model[6], x)
    target = torch.zeros_like(r)
    norms = torch.zeros_like(r)
    for f in range(r.shape[1]):  # the public code's loop
        target[:, f] = 1
        (gx,) = torch.autograd.grad(r, xg, target, retain_graph=True)
        norms[:, f] = gx.view(gx.size(0), -1).norm(dim=1) / r.detach()[:, f]
        target[:, f] = 0
    summed = norms.sum(0).numpy()
    thresh = np.percentile(summed, 50)
    public = sorted(np.where(np.abs(summed) < thresh)[0].tolist())
    assert (r > 0).all() and len(public) == r.shape[1] // 2
    assert d.last_pruned == public


def test_zero_features_are_left_out_of_the_sum_and_dead_features_go_last():
    r = torch.tensor([[1.0, 0.0, 0.0, 2.0], [2.0, 4.0, 0.0, 2.0]])
    norms = torch.tensor([[1.0, 2.0], [5.0, 2.0], [3.0, 3.0], [2.0, 2.0]])  # (features, batch)
    s = soteria_scores(norms, r)
    assert s[0] == pytest.approx(1 / 1 + 2 / 2)
    assert s[1] == pytest.approx(2 * (2 / 4))  # sample 0 has r = 0: the other sample's ratio stands in
    assert s[2] == math.inf  # off for every sample: its weight-gradient column is already zero
    assert s[3] == pytest.approx(2.0)
    assert soteria_scores(torch.tensor([[float("nan")]]), torch.tensor([[1.0]]))[0] == math.inf


def test_batched_and_looped_input_gradients_agree():
    model = _cnn(1)
    model.insert(1, nn.BatchNorm2d(3))  # couples the samples of the batch
    x, _ = _batch(2, n=4, shape=(1, 6, 6))
    xg = x.clone().requires_grad_(True)
    r = model[:5](xg)
    a = feature_input_grad_norms(r, xg, batched=False)
    b = feature_input_grad_norms(r, xg, batched=True, chunk=5)
    assert a.shape == (r.shape[1], 4)
    assert torch.allclose(a, b, atol=1e-6)


def test_leaves_no_trace_batchnorm_rng_grads_and_input_shape_errors():
    model = _mlp(bn=True)
    model.insert(3, nn.Dropout(0.2))
    x, y = _batch(0, n=8)
    grads, params, names = _grads(model, x, y)
    bn = model[1]
    stats = (bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone())
    rng = torch.get_rng_state()
    Soteria(layer="4")(grads, params, model=model, inputs=x)
    assert torch.equal(rng, torch.get_rng_state())
    assert all(torch.equal(a, b) for a, b in zip(stats, (bn.running_mean, bn.running_var, bn.num_batches_tracked)))
    assert all(p.grad is None for p in model.parameters())
    seq = nn.Sequential(nn.Linear(5, 4))
    xs = torch.randn(2, 3, 5)
    g = [torch.randn(4, 5), torch.randn(4)]
    with pytest.raises(ConfigError, match=r"soteria\.layer: the input of '0' has shape \(2, 3, 5\)"):
        Soteria()(g, [p.detach() for p in seq.parameters()], model=seq, inputs=xs)
    with pytest.raises(ConfigError, match="not floating point"):
        Soteria()(g, [p.detach() for p in seq.parameters()], model=seq, inputs=torch.ones(2, 5, dtype=torch.long))


# -- through guardfl.wrap and guardfl.protect --------------------------------------------------------------
def test_through_wrap_the_update_is_the_pruned_gradient():
    model = _cnn()
    x, y = _batch(4, n=6, shape=(1, 6, 6))
    grads, params, names = _grads(model, x, y)
    expected, _ = Soteria()(grads, params, names=names, model=model, inputs=x)
    before = [p.detach().clone() for p in model.parameters()]
    opt = guardfl.wrap(torch.optim.SGD(model.parameters(), lr=0.5), Soteria(), model=model)
    with torch.no_grad():
        model(torch.randn(2, 1, 6, 6))  # an evaluation pass under no_grad is not the training batch
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    for p, b, e in zip(model.parameters(), before, expected):
        assert torch.equal(p.grad, e)
        assert torch.allclose(p.detach() - b, -0.5 * e, atol=1e-6)
    (stage,) = opt.last_stats.stages
    assert stage.kind == "soteria" and stage.fired
    w = names.index("3.weight")
    assert stage.layers[w].fraction_zeroed == int(((expected[w] == 0) & (grads[w] != 0)).sum()) / grads[w].numel() > 0
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    model.zero_grad()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # the inputs of the last forward pass are used once
    with pytest.raises(ConfigError, match="none recorded"):
        opt.step()


def test_through_protect_and_with_dp():
    torch.manual_seed(0)
    model = _cnn()
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 1, 6, 6, generator=g), torch.randint(0, 3, (32,), generator=g))
    loader = DataLoader(data, batch_size=8)
    net, opt, loader = guardfl.protect(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, {"kind": "soteria"})
    assert isinstance(opt, guardfl.GuardedOptimizer) and opt.model is model
    for xb, yb in loader:
        opt.zero_grad()
        F.cross_entropy(net(xb), yb).backward()
        opt.step()
        w = model[3].weight.grad
        assert int((w.abs().sum(0) == 0).sum()) >= w.shape[1] // 2  # half the columns (or more, already dead)
    assert opt.iteration == 4

    model = _cnn()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        net, opt, loader = guardfl.protect(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=8),
                                           Stack(DPSGD(noise_multiplier=0.5, max_grad_norm=1.0, seed=0), Soteria()))
        for xb, yb in loader:
            if len(xb) == 0:
                continue
            opt.zero_grad()
            F.cross_entropy(net(xb), yb).backward()
            opt.step()
    assert opt.last_stats.stages[0].kind == "soteria" and opt.last_stats.stages[0].fired
    assert opt.epsilon(1e-5) < math.inf


def test_column_masks_of_many_batches_equal_each_batchs_own():
    """One pass for N batches sharing the weights (the red team's simulation): each row is the mask
    ``apply_`` prunes for that batch alone; BatchNorm in train mode couples samples and is refused."""
    model = _cnn(3)
    x = torch.randn(5, 2, 1, 6, 6, generator=torch.Generator().manual_seed(1))
    defense = Soteria(prune=0.5)
    name, masks = defense.column_masks(model, x)
    assert name == "3" and masks.shape == (5, 48)
    for i in range(5):
        defense(*_grads(model, x[i], torch.zeros(2, dtype=torch.long))[:2], model=model, inputs=x[i])
        want = torch.zeros(48, dtype=torch.bool)
        want[defense.last_pruned] = True
        assert torch.equal(masks[i], want)
    with pytest.raises(ValueError, match="BatchNorm"):
        defense.column_masks(_mlp(bn=True).train(), torch.randn(2, 3, 6))
