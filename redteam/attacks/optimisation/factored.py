"""The cosine of a FedSGD update without materialising the gradients of its large convolutions.

A convolution's weight gradient is a sum of outer products over its M = n x H_out x W_out output
positions: dW = G C^T, with G (C_out x M) the loss gradient at the layer's output and C (C_in k k x M)
the unfolded input patches. The cosine distance needs only two numbers of it, and both have a form that
never builds dW:

- <dW, O> = <G, O C> = <g, conv(a, O)>: the output gradient against the layer's input convolved with the
  observed gradient O as a kernel (a convolution whose weight is shared by every restart);
- |dW|^2 = <G^T G, C^T C>: two M x M Gram matrices (Frobenius product).

For the deep layers of a CNN on small images M is far smaller than the weight (ResNet-18 on 32 x 32 at
batch 1: M = 16 against 2.4M weights in stage 4), so the Gram form costs M^2 (C_out + C_in k k) instead of
the weight gradient's C_out C_in k k M, and the per-restart 11M-entry update of ResNet-18 (written, read
twice by the distance, its gradient written, read again by the double backward: memory-bound on a CPU)
mostly disappears. Under ``vmap`` over restarts every kernel is a batched one with a shared weight (the
materialised weight gradient of each restart is a grouped convolution there, slow on a CPU).

Exact (the same maths in another order; tested against the materialised objective: equal values and
input gradients within float32 rounding). Used by ``engine.Replica`` for the cosine distance of a FedSGD
update without sign, clipping or masks (``Replica`` decides); the layers where the Gram form costs
more than the weight gradient (``gram_pays``) keep their weight gradient.

How the output gradients are obtained: ``ConvTaps`` adds a zero tensor to each chosen layer's output in
the forward and records the layer's input; the gradient of the loss with respect to that zero IS the
output gradient g (``torch.func.grad`` with the zeros as an argument: it composes with ``vmap``).
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def gram_pays(weight_shape: Sequence[int], positions: int) -> bool:
    """Whether the Gram form (M^2 (C_out + C_in k k) multiply-adds) is cheaper than the weight gradient
    (C_out C_in k k M) for a convolution of ``weight_shape`` over M = ``positions`` output positions."""
    c_out, patch = weight_shape[0], math.prod(weight_shape[1:])
    return positions * (c_out + patch) < c_out * patch


def conv_dot(g: Tensor, a: Tensor, conv: nn.Conv2d, observed: Tensor) -> Tensor:
    """<dW, O> of ``conv``'s weight gradient dW (output gradient ``g``, input ``a``) with ``observed``: the
    float32 sum of g * conv(a, O), as float64."""
    return (g * F.conv2d(a, observed, None, conv.stride, conv.padding, conv.dilation, conv.groups)).sum().double()


def conv_square(g: Tensor, a: Tensor, conv: nn.Conv2d) -> Tensor:
    """|dW|^2 of ``conv``'s weight gradient as <G^T G, C^T C> (module docstring), as float64. ``groups`` 1."""
    grads = g.transpose(0, 1).reshape(g.shape[1], -1)  # C_out x M, columns (sample, position)
    cols = F.unfold(a, conv.kernel_size, conv.dilation, conv.padding, conv.stride)  # n x C_in k k x L
    cols = cols.transpose(0, 1).reshape(cols.shape[1], -1)  # C_in k k x M, the same column order
    return ((grads.T @ grads) * (cols.T @ cols)).sum().double()


def tappable(conv: nn.Module) -> bool:
    """A plain 2-d convolution (or guardfl's ``SecondOrderConv2d``) that ``conv_square`` handles."""
    return (isinstance(conv, nn.Conv2d) and conv.groups == 1 and conv.padding_mode == "zeros"
            and not isinstance(conv.padding, str))


class ConvTaps:
    """Forward hooks on the chosen convolutions of a model: while ``active(zeros)``, each adds its zero
    to its output and records its input (the module docstring's g and a). Outside ``active`` the hooks
    do nothing, so the model runs as before."""

    def __init__(self, model: nn.Module, names: Sequence[str], output_shapes: Sequence[torch.Size]) -> None:
        self.names = list(names)
        self.layers = [model.get_submodule(n) for n in self.names]
        self.weights = [f"{n}.weight" for n in self.names]
        self.output_shapes = [torch.Size(s) for s in output_shapes]
        self._zeros: list[Tensor] | None = None
        self._inputs: list[Tensor] = []
        for i, layer in enumerate(self.layers):
            layer.register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def hook(_module, inputs, output):
            if self._zeros is None:
                return None
            self._inputs.append(inputs[0])
            return output + self._zeros[i]

        return hook

    def zeros(self, like: Tensor) -> list[Tensor]:
        """The zero perturbations, one per layer (``like``'s dtype and device)."""
        return [like.new_zeros(s) for s in self.output_shapes]

    @contextlib.contextmanager
    def active(self, zeros: list[Tensor]) -> Iterator[list[Tensor]]:
        """Within: the taps add ``zeros`` and fill the yielded list with the layers' inputs, in order."""
        self._zeros, self._inputs = zeros, []
        try:
            yield self._inputs
        finally:
            self._zeros = None


def choose_taps(model: nn.Module, update_names: Sequence[str], example: Tensor) -> ConvTaps | None:
    """Taps on the convolutions of ``model`` whose weight is in the update and where ``gram_pays`` for
    the batch ``example`` (one forward without gradients reads the output sizes); None when none pays."""
    in_update = set(update_names)
    shapes: dict[str, list[torch.Size]] = {}
    handles = []
    for name, module in model.named_modules():
        if tappable(module) and f"{name}.weight" in in_update:
            handles.append(module.register_forward_hook(
                lambda _m, _i, out, name=name: shapes.setdefault(name, []).append(out.shape)))
    try:
        with torch.no_grad():
            model(example)
    finally:
        for h in handles:
            h.remove()
    # a layer called more than once per forward (shared weights) keeps its weight gradient
    once = {n: s[0] for n, s in shapes.items() if len(s) == 1}
    chosen = [n for n, s in once.items() if gram_pays(model.get_submodule(n).weight.shape, s[0] * math.prod(s[2:]))]
    return ConvTaps(model, chosen, [once[n] for n in chosen]) if chosen else None
