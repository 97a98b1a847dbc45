"""The factored cosine (``redteam/attacks/optimisation/factored.py``): the same distance and input gradient as the
materialised weight gradients, on the layers and settings where ``Replica`` uses it, and nowhere else."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import vmap

from guardfl.defenses import GradPrune, SignCompression
from guardfl.redteam import FedAvg, ThreatModel, simulate_client
from guardfl.redteam.attacks.optimisation.engine import ObjectiveWeights, Replica
from guardfl.redteam.attacks.optimisation.optimiser import _batched_objective
from guardfl.redteam.attacks.optimisation.factored import choose_taps, conv_dot, conv_square, gram_pays
from guardfl.redteam.modality.image.models import resnet18_cifar


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 3), c_in=st.integers(1, 5), c_out=st.integers(1, 5), k=st.sampled_from([1, 2, 3]),
       stride=st.integers(1, 2), padding=st.integers(0, 2), dilation=st.integers(1, 2), size=st.integers(5, 8),
       seed=st.integers(0, 2**16))
def test_dot_and_square_of_a_weight_gradient_without_it(n, c_in, c_out, k, stride, padding, dilation, size, seed):
    """<dW, O> and |dW|^2 from the output gradient and the input equal those of the weight gradient."""
    gen = torch.Generator().manual_seed(seed)
    conv = nn.Conv2d(c_in, c_out, k, stride, padding, dilation, bias=False).double()
    a = torch.randn(n, c_in, size, size, generator=gen, dtype=torch.float64)
    out = conv(a)
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    weight_grad = torch.ops.aten.convolution_backward(g, a, conv.weight, None, conv.stride, conv.padding, conv.dilation,
                                                      False, [0, 0], 1, (False, True, False))[1]
    observed = torch.randn(conv.weight.shape, generator=gen, dtype=torch.float64)
    assert torch.allclose(conv_dot(g, a, conv, observed), (weight_grad * observed).sum())
    assert torch.allclose(conv_square(g, a, conv), weight_grad.square().sum())


def test_gram_form_pays_in_the_deep_layers_of_resnet18_only():
    assert gram_pays((512, 512, 3, 3), 16) and gram_pays((256, 256, 3, 3), 64)  # stages 4 and 3 at 32x32
    assert not gram_pays((64, 64, 3, 3), 1024) and not gram_pays((128, 128, 3, 3), 256)  # stages 1, 2
    assert not gram_pays((512, 512, 3, 3), 32 * 16 * 16)  # a large batch materialises again


class SmallCNN(nn.Module):
    """A small CNN whose last convolution (64 -> 64 on 4x4) takes the Gram form; BatchNorm in between."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.b1 = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 64, 3, stride=2, padding=1)
        self.c3 = nn.Conv2d(64, 64, 3, padding=1, bias=False)
        self.fc = nn.Linear(64 * 16, 10)

    def forward(self, x):
        x = F.relu(self.b1(self.c1(x)))
        x = F.max_pool2d(F.relu(self.c2(x)), 2)
        return self.fc(F.relu(self.c3(x)).flatten(1))


def _replica(model, n, defense=None, protocol=None, distance="cosine", train_mode=True):
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(n, 3, 16, 16, generator=gen)
    y = torch.arange(n) % 10
    obs = simulate_client(model, x, y, defense, protocol, train_mode=train_mode)
    replica = Replica(obs, ThreatModel(labels="known").knowledge(obs), ObjectiveWeights(distance, tv=1e-2),
                      torch.device("cpu"))
    return replica, y


def _objective_and_gradient(replica, x, y, factored):
    taps = replica.taps
    replica.taps = taps if factored else None
    try:
        x = x.clone().requires_grad_(True)
        value = replica.objective(x, y)
        return value.detach(), torch.autograd.grad(value, x)[0]
    finally:
        replica.taps = taps


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("train_mode", [True, False], ids=["train", "eval"])
def test_factored_objective_is_the_materialised_one(n, train_mode):
    torch.manual_seed(0)
    replica, y = _replica(SmallCNN(), n, train_mode=train_mode)
    assert replica.taps is not None and replica.taps.names == ["c3"]
    x = torch.rand(n, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    v1, g1 = _objective_and_gradient(replica, x, y, factored=True)
    v0, g0 = _objective_and_gradient(replica, x, y, factored=False)
    assert torch.allclose(v1, v0, atol=1e-6)
    assert (g1 - g0).norm() <= 1e-4 * g0.norm()


def test_factored_restarts_under_vmap_are_the_loop():
    """Restarts vmapped: each restart's objective and input gradient are its own call's (the gradient up to
    the ~1e-4 relative that vmap's batched kernels give the materialised objective too)."""
    torch.manual_seed(0)
    replica, y = _replica(SmallCNN(), 2)
    xs = torch.rand(3, 2, 3, 16, 16, generator=torch.Generator().manual_seed(2)).requires_grad_(True)
    batched = _batched_objective(lambda x, a: replica.objective(x, y, a), None, True)(xs, None)
    grads = torch.autograd.grad(batched.sum(), xs)[0]
    for r in range(3):
        value, grad = _objective_and_gradient(replica, xs[r].detach(), y, factored=False)
        assert torch.allclose(batched[r], value, atol=1e-6)
        assert (grads[r] - grad).norm() <= 5e-4 * grad.norm()


def test_resnet18_taps_its_deep_convolutions_and_vmaps_restarts_on_a_cpu():
    torch.manual_seed(0)
    model = resnet18_cifar((3, 32, 32), 10)
    obs = simulate_client(model, torch.rand(1, 3, 32, 32), torch.tensor([3]))
    replica = Replica(obs, ThreatModel(labels="known").knowledge(obs), ObjectiveWeights("cosine"), torch.device("cpu"))
    assert replica.taps.names[0] == "layer3.0.conv1" and replica.taps.names[-1] == "layer4.1.conv2"
    assert replica.vmap_restarts
    x = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    v1, g1 = _objective_and_gradient(replica, x, torch.tensor([3]), factored=True)
    v0, g0 = _objective_and_gradient(replica, x, torch.tensor([3]), factored=False)
    assert torch.allclose(v1, v0, atol=1e-6)
    assert (g1 - g0).norm() <= 1e-4 * g0.norm()


@pytest.mark.parametrize("setting", [
    dict(distance="l2"), dict(defense=SignCompression()), dict(defense=GradPrune(0.5, seed=0)),
    dict(protocol=FedAvg(epochs=1, batch_size=1, lr=0.01)),
], ids=["l2", "sign", "pruned", "fedavg"])
def test_no_taps_where_the_distance_needs_the_update_itself(setting):
    torch.manual_seed(0)
    replica, _ = _replica(SmallCNN(), 2, **setting)
    assert replica.taps is None


def test_taps_leave_the_model_unchanged_outside_the_objective():
    torch.manual_seed(0)
    model = SmallCNN().eval()
    x = torch.rand(2, 3, 16, 16)
    before = model(x)
    taps = choose_taps(model, [n for n, _ in model.named_parameters()], x)
    assert taps is not None and torch.equal(model(x), before)
    with taps.active([torch.ones(s) for s in taps.output_shapes]) as inputs:
        shifted = model(x)
    assert len(inputs) == 1 and not torch.equal(shifted, before)


def test_a_layer_called_twice_keeps_its_weight_gradient():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = nn.Conv2d(64, 64, 3, padding=1)

        def forward(self, x):
            return self.c(self.c(x)).mean((2, 3))

    model = Twice()
    assert choose_taps(model, ["c.weight", "c.bias"], torch.rand(1, 64, 4, 4)) is None


def test_factored_loop_never_syncs_with_the_host():
    """On PyTorch's meta device (see test_device.py): taps, Grams and the vmapped restarts read nothing back."""
    from guardfl.redteam.attacks.optimisation.optimiser import optimise_batched

    meta = torch.device("meta")
    torch.manual_seed(0)
    obs = simulate_client(SmallCNN(), torch.rand(2, 3, 16, 16), torch.tensor([1, 2])).to(meta)
    knowledge = ThreatModel(labels="known").knowledge(obs).to(meta)
    replica = Replica(obs, knowledge, ObjectiveWeights("cosine", tv=1e-2), meta)
    assert replica.taps is not None
    x = optimise_batched(lambda x, a: replica.objective(x, knowledge.labels, a), torch.zeros(3, 2, 3, 16, 16, device=meta),
                         iterations=5, lr=0.1, bounds=(0, 1), vmap_restarts=replica.vmap_restarts)
    assert x.device == meta
