"""The first dense layers of a model, where the first-layer attacks work: a first ``nn.Linear`` on the whole
flattened input, (optionally) a normalisation of its units, a ReLU, and the ``nn.Linear`` that reads them.

``trap_weights`` writes its bins there (a malicious server); ``exclusive_neurons`` reads the units of the
honest model's own first layer there (an honest one), and so does ``trap_weights`` after its bins.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn


class TrapLayers(NamedTuple):
    """Where trap weights go: the first linear layer, the linear layer that reads its units, and the
    ``BatchNorm1d`` between them (None when the first layer's units go straight into the ReLU)."""

    first_name: str
    first: nn.Linear
    second_name: str
    second: nn.Linear
    norm_name: str | None = None
    norm: nn.BatchNorm1d | nn.GroupNorm | None = None


def run_order(model: nn.Module, input_shape: tuple[int, ...]) -> list[nn.Module] | str:
    """The leaf modules that run on one zero input (eval mode, no gradient), in the order they ran, or the
    reason the probe could not run the model."""
    order: list[nn.Module] = []
    hooks = [m.register_forward_hook(lambda m, i, o: order.append(m)) for m in model.modules()
             if not any(True for _ in m.children())]
    was = model.training
    try:
        model.eval()
        with torch.no_grad():
            model(torch.zeros(1, *input_shape, device=next((p.device for p in model.parameters()), torch.device("cpu"))))
    except Exception as err:  # noqa: BLE001 - a model the probe cannot run: say so
        return f"the model does not run on one input of shape {list(input_shape)} ({type(err).__name__})"
    finally:
        for h in hooks:
            h.remove()
        model.train(was)
    return order


def trap_layers(model: nn.Module, input_shape: tuple[int, ...],
                order: list[nn.Module] | str | None = None) -> TrapLayers | str:
    """The layers of a model that can host trap weights, or the reason it cannot: the modules that run on
    one probe input, in order, must start with an ``nn.Linear`` on the flattened input, then (optionally)
    an affine ``nn.BatchNorm1d`` of its units, then an ``nn.ReLU``, then an ``nn.Linear`` reading them.
    ``order``: ``run_order``'s result when the caller has probed the model already."""
    names = {id(m): n for n, m in model.named_modules()}
    order = run_order(model, input_shape) if order is None else order
    if isinstance(order, str):
        return order
    normalising = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm)  # with or without parameters
    layers = [m for m in order if any(True for _ in m.parameters(recurse=False)) or isinstance(m, (nn.ReLU, *normalising))]
    d = math.prod(input_shape)
    if len(layers) < 3 or not isinstance(layers[0], nn.Linear) or layers[0].in_features != d:
        first = type(layers[0]).__name__ if layers else "none"
        return (f"a dense-layer construction needs a first layer that is an nn.Linear on the whole flattened input ({d} features); "
                f"this model's first layer is {first}")
    norm = layers[1] if isinstance(layers[1], normalising) else None
    if norm is not None:
        reason = _norm_refusal(norm, layers[0].out_features)
        if reason:
            return reason
        layers = [layers[0], *layers[2:]]
    first, relu, second = layers[0], layers[1], layers[2] if len(layers) > 2 else None
    if not isinstance(relu, nn.ReLU) or not isinstance(second, nn.Linear) or second.in_features != first.out_features:
        return "a dense-layer construction needs nn.Linear -> (nn.BatchNorm1d ->) nn.ReLU -> nn.Linear reading all of the first layer's units"
    return TrapLayers(names[id(first)], first, names[id(second)], second,
                      None if norm is None else names[id(norm)], norm)


def _norm_refusal(norm: nn.Module, units: int) -> str | None:
    """Why trap weights cannot go through this normalisation of the first layer's ``units``, or None: an
    affine ``nn.BatchNorm1d`` of all of them, an affine ``nn.GroupNorm`` of groups of 3 or more, or a
    ``nn.LayerNorm`` over them (8 or more) with a weight and a bias."""
    if isinstance(norm, nn.BatchNorm1d) and norm.num_features == units and norm.affine:
        return None
    if isinstance(norm, nn.GroupNorm) and norm.num_channels == units and norm.affine and units // norm.num_groups >= 3:
        return None
    if (isinstance(norm, nn.LayerNorm) and tuple(norm.normalized_shape) == (units,) and units >= 8
            and norm.weight is not None and norm.bias is not None):
        return None
    return (f"the first layer's units go through {type(norm).__name__}: a dense-layer construction needs an affine nn.BatchNorm1d of all "
            "of them, an affine nn.GroupNorm of groups of 3 or more, a nn.LayerNorm over 8 or more of them with a weight "
            "and a bias (the cut-offs go in its bias), or none")
