"""Convolutions whose gradient is cheap to differentiate again.

A gradient-matching attack differentiates the client's gradient: the objective compares the simulated
weight gradient with the observed one, and its derivative with respect to the guessed images runs through
the convolutions' backward a second time. PyTorch's double backward of a convolution
(``_convolution_double_backward``) computes the second-order gradient with respect to the WEIGHT whenever
the incoming gradient of the input-gradient is defined, whether or not the weight needs one (it does not
look at the output mask for that term). In an attack the weights are constants, so that term, one
convolution per layer whose "kernel" is the whole activation map (64 x N x 32 x 32 on ResNet-18's first
stage), is computed and thrown away: about a quarter of the convolution time of an attack iteration.

``second_order_convs_`` swaps a model's ``nn.Conv2d`` layers for ``SecondOrderConv2d``: the same forward
(``F.conv2d``), and a backward written as two ordinary differentiable operators, each asked only for
what it must give: the input gradient as the transposed convolution, the weight gradient as
``convolution_backward`` with only its weight output requested. Differentiating those computes no
weight-of-weight term. Same values as the plain layers (tested: equal objectives and input gradients,
within float32 rounding). Measured: on a CPU (ResNet-18, 2 samples x 2 restarts x 4 images, 2 threads)
5.7 -> 4.3 s per objective and gradient; on an H100 (``bench/bench_gpu_objective.py --plain-convs``,
ResNet-18, 4 samples x 32 images, exact float32, autotuned) the same time per iteration (108 vs 110 ms)
and a third of the peak memory (11.5 -> 3.7 GiB; 10.3 -> 2.4 GiB at 16 images): cuDNN's workspace for
those map-sized kernels was most of it.
Only ``nn.Conv2d`` with zero padding given as numbers is swapped (others keep PyTorch's path). The
attacker's replica uses it where it pays (``engine.second_order_pays``: on a GPU, and for large models on
a CPU); a small model on a CPU keeps PyTorch's layers, the custom function's Python overhead being larger
there than the arithmetic it saves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class _Conv2d(torch.autograd.Function):
    generate_vmap_rule = True  # forward and backward are plain operators with batching rules

    @staticmethod
    def forward(x: Tensor, w: Tensor, b: Tensor | None, stride, padding, dilation, groups) -> Tensor:
        return F.conv2d(x, w, b, stride, padding, dilation, groups)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        x, w, _b, stride, padding, dilation, groups = inputs
        ctx.save_for_backward(x, w)
        ctx.conf = (stride, padding, dilation, groups)

    @staticmethod
    def backward(ctx, g: Tensor):
        x, w = ctx.saved_tensors
        stride, padding, dilation, groups = ctx.conf
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = F.conv_transpose2d(g, w, None, stride, padding, output_padding(x, w, g, stride, padding, dilation),
                                    groups, dilation)
        if ctx.needs_input_grad[1]:
            gw = torch.ops.aten.convolution_backward(g, x, w, None, stride, padding, dilation, False, [0, 0], groups,
                                                     (False, True, False))[1]
        if ctx.needs_input_grad[2]:
            gb = g.sum((0, 2, 3))
        return gx, gw, gb, None, None, None, None


def output_padding(x: Tensor, w: Tensor, g: Tensor, stride, padding, dilation) -> list[int]:
    """What the transposed convolution of ``g`` must add to give back ``x``'s spatial size (a strided
    convolution maps several input sizes to one output size)."""
    return [x.shape[-2 + i] - ((g.shape[-2 + i] - 1) * stride[i] - 2 * padding[i] + dilation[i] * (w.shape[-2 + i] - 1) + 1)
            for i in range(2)]


class SecondOrderConv2d(nn.Conv2d):
    """``nn.Conv2d`` with the backward above (see the module docstring); same parameters and forward."""

    def forward(self, x: Tensor) -> Tensor:
        return _Conv2d.apply(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


def second_order_convs_(model: nn.Module) -> nn.Module:
    """Swaps, in place, every plain ``nn.Conv2d`` of ``model`` with zero padding given as numbers for a
    ``SecondOrderConv2d`` (the same module state; only its class changes). Returns ``model``."""
    for module in model.modules():
        if type(module) is nn.Conv2d and module.padding_mode == "zeros" and not isinstance(module.padding, str):
            module.__class__ = SecondOrderConv2d
    return model
