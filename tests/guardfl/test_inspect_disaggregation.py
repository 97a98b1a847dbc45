"""guardfl.inspect_model's disaggregation check: SEER's D-SNR (Garov et al. 2024), in train mode."""

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import guardfl
from guardfl import inspect as I
from tests import malicious as M

pytestmark = pytest.mark.skipif(not M.CIFAR.exists(), reason=f"needs the shared CIFAR-10 sample {M.CIFAR}")


@pytest.fixture(scope="module")
def batch():
    return M.cifar(32, offset=4000)


def test_dsnr_is_the_largest_norm_over_the_sum_of_the_others():
    assert I.disaggregation_snr(torch.tensor([1.0, 1.0, 1.0, 1.0])) == (pytest.approx(1 / 3), 0)
    assert I.disaggregation_snr(torch.tensor([1.0, 9.0, 2.0])) == (pytest.approx(3.0), 1)
    assert I.disaggregation_snr(torch.tensor([0.0, 5.0, 0.0])) == (math.inf, 1)
    assert I.disaggregation_snr(torch.zeros(4)) == (0.0, -1)
    assert I.disaggregation_snr(torch.zeros(0)) == (0.0, -1)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0, 1e6), min_size=2, max_size=64), st.floats(1e-3, 1e3))
def test_dsnr_is_scale_free_and_non_negative(norms, scale):
    n = torch.tensor(norms, dtype=torch.float64)
    value, i = I.disaggregation_snr(n)
    scaled, j = I.disaggregation_snr(n * scale)
    assert value >= 0 and (value == scaled or value == pytest.approx(scaled, rel=1e-9)) and i == j


def test_per_sample_norms_are_the_per_sample_gradients_without_batch_norm(batch):
    x, y = batch
    model = M.lenet(0)
    norms, skipped = I.per_sample_weight_norms(model, x[:6], y[:6])
    assert not skipped and set(norms) == {n for n, p in model.named_parameters() if p.dim() >= 2}
    for i in range(6):
        model.zero_grad()
        nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1], reduction="sum").backward()
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                assert float(norms[name][i]) == pytest.approx(float(p.grad.norm()), rel=1e-4), (name, i)


def test_with_batch_norm_each_loss_is_differentiated_alone_in_train_mode(batch):
    x, y = batch
    model = M.small_cnn(0)
    norms, _ = I.per_sample_weight_norms(model, x[:8], y[:8])
    own = copy.deepcopy(model).train()
    losses = nn.functional.cross_entropy(own(x[:8]), y[:8], reduction="none")
    for i in (0, 5):
        grads = torch.autograd.grad(losses[i], [p for p in own.parameters() if p.dim() >= 2], retain_graph=True)
        names = [n for n, p in own.named_parameters() if p.dim() >= 2]
        for name, g in zip(names, grads):
            assert float(norms[name][i]) == pytest.approx(float(g.norm()), rel=1e-4), (name, i)


def test_the_received_module_is_left_as_it_came(batch):
    model = M.small_cnn(0)  # batch norm: train mode would update its running statistics
    model.eval()
    before = copy.deepcopy(model.state_dict())
    state = torch.random.get_rng_state()
    result = guardfl.inspect_model(model, batch=batch, disaggregation=True)
    assert result.checks["disaggregation"]["mode"] == "train"
    assert not model.training and torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_benign_models_stay_far_below_the_threshold(batch):
    for model in (M.small_cnn(0), M.lenet(0), M.lenet(0, wide=True), M.linear_model(0),
                  M.train(M.small_cnn(1), *M.cifar(256), epochs=2)):
        found = guardfl.inspect_model(model, batch=batch, disaggregation=True).checks["disaggregation"]
        assert found["judged"] and found["max"] < I.DSNR_THRESHOLD / 4, found


def test_one_sample_that_alone_sends_a_gradient_is_flagged(batch):
    """Class fishing on a batch with one sample of the target label: that sample's gradient is the batch's."""
    x, y = batch
    counts = torch.bincount(y, minlength=10)
    target = int((counts == 1).nonzero()[0]) if bool((counts == 1).any()) else None
    if target is None:  # make one label unique
        target, y = int(y[0]), y.clone()
        y[(y == target) & (torch.arange(len(y)) > 0)] = (target + 1) % 10
    result = guardfl.inspect_model(M.class_fishing(M.small_cnn(0), target=target), batch=(x, y), disaggregation=True)
    found = result.checks["disaggregation"]
    assert found["max"] > I.DSNR_THRESHOLD and int(y[found["sample"]]) == target
    reason = next(r for r in result.reasons if r.startswith("disaggregation:"))
    assert f"sample {found['sample']} of 32" in reason and "D-SNR" in reason and "\n" not in reason


def test_it_is_off_by_default_and_small_batches_are_not_judged(batch):
    x, y = batch
    assert "disaggregation" not in guardfl.inspect_model(M.lenet(0), batch=batch).checks
    assert not guardfl.inspect_model(M.lenet(0), batch=(x[:4], y[:4]), disaggregation=True).checks["disaggregation"]["judged"]


def test_a_model_that_cannot_run_in_train_mode_is_named_not_passed():
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    result = guardfl.inspect_model(model, batch=(torch.randn(1, 12), torch.tensor([0])), disaggregation=True)
    assert "skipped" in result.checks["disaggregation"] and "train mode" in result.checks["disaggregation"]["skipped"]
