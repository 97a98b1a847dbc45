"""Passes of a defense's own through the client's model (Soteria, GradDefense) that leave no trace.

A defense that differentiates through the model runs extra forward/backward passes at ``step()`` time.
``side_pass`` makes them invisible to training: BatchNorm running statistics are not updated (the pass
runs on clones of the buffers), the global RNG (dropout) is restored afterwards, Opacus's per-sample
gradient hooks are switched off, and no ``.grad`` is accumulated (``torch.autograd.grad`` only). The
model keeps its mode: a model in train mode runs BatchNorm on the batch's statistics, as the training
step that produced the gradient did.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call

from guardfl.errors import ConfigError


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a wrapper that keeps it as ``_module`` (Opacus ``GradSampleModule``), else ``model``."""
    inner = getattr(model, "_module", None)
    return inner if isinstance(inner, nn.Module) else model


@contextmanager
def side_pass(model: nn.Module, device: torch.device) -> Iterator[nn.Module]:
    """Context for a defense's own passes through ``model``; yields the module to call (``run``)."""
    hooks = getattr(model, "hooks_enabled", None)  # Opacus GradSampleModule: per-sample gradient capture
    if hooks:
        model.hooks_enabled = False
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            yield unwrap(model)
    finally:
        if hooks:
            model.hooks_enabled = True


def run(module: nn.Module, x: Tensor) -> Tensor:
    """``module(x)`` with its buffers replaced by clones, so BatchNorm's running statistics stay put."""
    buffers = {name: b.clone() for name, b in module.named_buffers()}
    return functional_call(module, buffers, (x,))


def model_device(model: nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    return torch.device("cpu")


def match_params(module: nn.Module, params: Sequence[Tensor], names: Sequence[str] | None) -> list[tuple[str, nn.Parameter] | None]:
    """For each tensor of ``params`` (the defended gradients' weights, possibly ``detach()``-ed), the
    parameter of ``module`` it is: same storage, offset, shape and dtype (a detached view of it), else
    the parameter named like it (``names``, with or without Opacus's ``_module.`` prefix); None if neither."""
    named = list(module.named_parameters())
    by_storage = {(p.data_ptr(), tuple(p.shape), p.dtype): (n, p) for n, p in named if p.numel()}
    by_name = dict(named)
    out: list[tuple[str, nn.Parameter] | None] = []
    for i, t in enumerate(params):
        hit = by_storage.get((t.data_ptr(), tuple(t.shape), t.dtype)) if t.numel() else None
        if hit is None and names is not None:
            name = names[i].removeprefix("_module.")
            if name in by_name and by_name[name].shape == t.shape:
                hit = (name, by_name[name])
        out.append(hit)
    return out


def require_float_inputs(kind: str, x: Tensor) -> None:
    """ConfigError unless ``x`` is floating point (a defense that differentiates with respect to it)."""
    if not x.is_floating_point():
        raise ConfigError(f"{kind}: the model's inputs are {x.dtype}, not floating point; {kind} differentiates "
                          "with respect to the inputs, so it needs float inputs (images, features)")
