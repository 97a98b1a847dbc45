"""SecondOrderConv2d: the plain convolution's values and gradients, without the weight-of-weight term."""

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils._python_dispatch import TorchDispatchMode

from guardfl.redteam.attacks.optimisation.second_order import SecondOrderConv2d, second_order_convs_


def gradient_matching(model, params, x, y, target):
    """<d loss / d params, target>: the shape of every gradient-matching objective."""
    loss = lambda p, xi: nn.functional.cross_entropy(functional_call(model, p, (xi,)), y)  # noqa: E731
    g = grad(loss)(params, x)
    return sum((g[n] * target[n]).sum() for n in g)


def net(stride=2, groups=1, bias=True):
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=bias), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, stride=stride, padding=1, groups=groups, bias=bias), nn.ReLU(),
                         nn.Conv2d(8, 4, 1, stride=stride), nn.Flatten(), nn.LazyLinear(5))


@pytest.mark.parametrize("stride,groups,bias", [(1, 1, True), (2, 1, False), (2, 2, True), (3, 4, True)])
def test_values_first_and_second_order_gradients_are_the_plain_convolutions(stride, groups, bias):
    plain = net(stride, groups, bias)
    x = torch.rand(4, 3, 11, 11)
    plain(x)  # materialise the lazy layer
    swapped = second_order_convs_(copy.deepcopy(plain))
    assert sum(isinstance(m, SecondOrderConv2d) for m in swapped.modules()) == 3
    params = {n: p.detach() for n, p in plain.named_parameters()}
    y = torch.tensor([0, 1, 2, 3])
    target = {n: torch.randn_like(p) for n, p in params.items()}
    out = []
    for model in (plain, swapped):
        xr = x.clone().requires_grad_(True)
        value = vmap(lambda xi: gradient_matching(model, params, xi, y, target))(xr[None].expand(2, -1, -1, -1, -1))
        (gx,) = torch.autograd.grad(value.sum(), xr)
        first = grad(lambda p: nn.functional.cross_entropy(functional_call(model, p, (x,)), y))(params)
        out.append((value.detach(), gx, first))
    (v0, g0, f0), (v1, g1, f1) = out
    torch.testing.assert_close(v1, v0)
    torch.testing.assert_close(g1, g0)
    for n in f0:
        torch.testing.assert_close(f1[n], f0[n])


class Convolutions(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.weights_like_activations = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.convolution.default and args[1].shape[-1] > 3:
            self.weights_like_activations += 1  # a "kernel" as wide as a map (layers' are <= 3): weight-of-weight
        return func(*args, **(kwargs or {}))


def test_the_weight_of_weight_term_is_not_computed():
    counts = []
    for swap in (False, True):
        model = net(stride=1)
        x = torch.rand(2, 3, 8, 8)
        model(x)
        if swap:
            second_order_convs_(model)
        params = {n: p.detach() for n, p in model.named_parameters()}
        target = {n: torch.randn_like(p) for n, p in params.items()}
        xr = x.clone().requires_grad_(True)
        value = gradient_matching(model, params, xr, torch.tensor([0, 1]), target)
        with Convolutions() as seen:
            torch.autograd.grad(value, xr)
        counts.append(seen.weights_like_activations)
    assert counts[0] > 0 and counts[1] == 0


def test_only_plain_zero_padded_convolutions_are_swapped():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding="same"), nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect"),
                          nn.Conv2d(4, 4, 3, padding=1), nn.Conv1d(4, 4, 3))
    second_order_convs_(model)
    assert [type(m) is SecondOrderConv2d for m in model] == [False, False, True, False]


def test_the_replica_uses_them_on_a_gpu_and_for_large_models_only():
    from guardfl.redteam.attacks.optimisation.engine import second_order_pays
    from guardfl.redteam.modality.image.models import LeNetZhu, resnet18_cifar

    lenet, resnet = LeNetZhu((3, 32, 32), 10), resnet18_cifar((3, 32, 32), 10)
    assert not second_order_pays(lenet, torch.device("cpu"))
    assert second_order_pays(resnet, torch.device("cpu"))
    assert second_order_pays(lenet, torch.device("meta"))  # any accelerator (the meta tests run that path)
