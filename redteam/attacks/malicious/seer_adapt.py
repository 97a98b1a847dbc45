"""SEER adapted to the client's defense. The decoder of the checkpoint the server sends is fitted further to
what the client's defense transmits for the attacker's own batches, simulated by ``TransmitSimulator``
(guardfl's own defense code, with the attacker's randomness, never the client's): the defense as
augmentation, as ``learned_inversion`` trains its inverter (Wu et al. 2023, Sec. 3.1).

SEER's paper trains on clean gradients and evaluates no defense; a server that knows the client's defense
configuration (``threat.defense: known``, the red team's default) would fit its decoder to it. The
decoder is adapted (``adapt``), and against noise whose scale does not follow the gradient's the model sent
is rescaled so that the layer read has a larger gradient and the same forward pass (``rescale``, as
``robbing_the_fed``'s ``boost``); the model's joint training stays SEER's (a defense as a differentiable
stage of the second-order training, e.g. a straight-through sign or a pruning mask, is not built: docs
section 20).
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from guardfl.ops.selection import prune_count
from guardfl.redteam.attacks.malicious.seer_training import Decoder, augment, property_scores
from guardfl.redteam.client.transmit import TransmitSimulator
from guardfl.redteam.modality.image.metrics import ssim
from guardfl.redteam.threat import defense_kinds


def first_layer_updates(sim: TransmitSimulator, x: Tensor, y: Tensor, weight: str) -> Tensor:
    """``(N, rows, cols)``: the block of parameter ``weight`` in the update each of the ``N`` batches of ``x``
    ``(N, B, ...)`` would transmit through the simulated client's defense (each its own draw)."""
    k = sim.names.index(weight)
    blocks = [parts[k] for parts in sim.chunks(x, y, parts=True)]
    return torch.cat(blocks).view(-1, *sim.params[weight].shape)


def _batches(images: Tensor, labels: Tensor, draws: int, batch: int, gen: torch.Generator,
             vary: tuple[float, float] | None) -> tuple[Tensor, Tensor]:
    """``draws`` batches of ``batch`` distinct images each ``(draws, batch, ...)``, augmented as SEER's
    training is when ``vary`` gives the input range, and their labels ``(draws, batch)``."""
    idx = torch.stack([torch.randperm(len(images), generator=gen)[:batch] for _ in range(draws)])
    x = images[idx.flatten()]
    if vary is not None:
        x = torch.cat([augment(x[i * batch:(i + 1) * batch], vary, gen) for i in range(draws)])
    return x.view(draws, batch, *images.shape[1:]), labels[idx]


def adapt(decoder: Decoder, sim: TransmitSimulator, weight: str, images: Tensor, labels: Tensor, batch: int,
          prop: str, input_range: tuple[float, float], steps: int, lr: float, gen: torch.Generator,
          draws: int = 4, bar=None) -> tuple[Decoder, list[float]]:
    """A copy of ``decoder`` fitted for ``steps`` of Adam to decode each simulated defended update of
    ``draws`` augmented auxiliary batches to its batch's chosen image (``prop``); the losses."""
    fitted = Decoder(*(t.detach().clone().requires_grad_() for t in (decoder.A, decoder.weight, decoder.bias)))
    opt = torch.optim.Adam(fitted.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        x, y = _batches(images, labels, draws, batch, gen, input_range)
        g = first_layer_updates(sim, x, y, weight).to(fitted.A.device)
        chosen = property_scores(x.flatten(0, 1), prop).view(draws, batch).argmax(1)
        loss = sum(F.mse_loss(fitted(g[i]), x[i, chosen[i]].flatten().to(g)) for i in range(draws)) / draws
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if bar:
            bar.update(1)
    return fitted, losses


def defended_held_out(decoder: Decoder, sim: TransmitSimulator, weight: str, images: Tensor, labels: Tensor,
                      batch: int, prop: str, input_range: tuple[float, float], draws: int,
                      gen: torch.Generator) -> dict[str, float]:
    """``seer_training.held_out`` through the simulated defense: the chosen image's SSIM decoded from each
    held-out batch's defended update, the batch's mean image as the guess, the share past 0.5."""
    lo, hi = input_range
    x, y = _batches(images, labels, draws, batch, gen, None)
    g = first_layer_updates(sim, x, y, weight)
    chosen = property_scores(x.flatten(0, 1), prop).view(draws, batch).argmax(1)
    got, base = [], []
    with torch.no_grad():
        for i in range(draws):
            target = x[i, chosen[i]]
            got.append(ssim(decoder(g[i].to(decoder.A.device)).view(target.shape).clamp(lo, hi).cpu(), target, hi - lo))
            base.append(ssim(x[i].mean(0), target, hi - lo))
    mean = lambda v: float(sum(v) / len(v))  # noqa: E731
    return {"ssim": mean(got), "ssim_batch_mean": mean(base), "share_past_0.5": mean([float(s > 0.5) for s in got]),
            "batches": draws}


#: kinds of defense whose noise does not follow the gradient's scale (Gaussian, Laplace; Outpost's follows
#: the layer's weight variance, which the rescaling shrinks too): against them the server boosts the read
#: layer's gradient by rescaling the model (``rescale``)
NOISE_KINDS = frozenset({"gaussian", "laplace", "outpost"})
#: the boosts ``boost: auto`` tries against those: the server keeps the one its inspection shadows pass that
#: decodes best on its held-out images through the simulated defense. BatchNorm's eps bounds what a boost
#: keeps of the forward pass (the rescaled layer's batch variance shrinks by its square, the eps does not:
#: on a fresh ``fc2bn`` and CIFAR-sized inputs the eps reaches 1% of the variance of a tenth of the units
#: at about 5); the attack needs the gradient, not the function, and says how far the logits moved
BOOSTS = (1.0, 10.0, 100.0, 1000.0)


def rescale(model: nn.Module, first: str, norm: str, k: float) -> nn.Module:
    """A copy of ``model`` with the dense layer ``first`` (followed by the scale-invariant normalisation
    ``norm``) divided by ``k``, and the normalisation's running statistics with it: the forward pass is the
    same while the normalisation's eps stays small beside the rescaled batch variance, and the layer's
    gradient is ``k`` times larger (BatchNorm's invariance to
    its input's scale). Against noise of a fixed scale the server sends this instead: the noise is ``k``
    times smaller beside the gradient it reads."""
    out = copy.deepcopy(model)
    modules = dict(out.named_modules())
    layer, bn = modules[first], modules[norm]
    with torch.no_grad():
        layer.weight.div_(k)
        if layer.bias is not None:
            layer.bias.div_(k)
        if getattr(bn, "running_mean", None) is not None:
            bn.running_mean.div_(k)
            bn.running_var.div_(k * k)
    return out


def surrogate(defense: Any) -> tuple[Callable[[Tensor], Tensor], str] | None:
    """A differentiable stand-in for what the client's defense does to the first layer's gradient, for
    training the model through it (``seer_training.seer_loss``'s ``defend``), and its name; None where no
    stage of it is one SEER's training can follow (noise: ``boost``; input encodings, Soteria, GradDefense:
    the decoder is fitted to them at interrogation only). Stages compose in order:

    - GradPrune (``layer`` scope; ``global`` taken per layer, the first layer holding most of the entries
      and of the norm) and Outpost's pruning (at its ``prune`` ratio, every step): the kept entries'
      values, a mask of the largest magnitudes computed without gradient;
    - sign compression: ``sign(g)`` forward, the identity backward (straight-through);
    - clipped Gaussian or Laplace noise (``clip`` set, where no boost helps): the gradient scaled to norm
      ``clip`` (the first layer's alone: the joint norm's other layers are the server's to make small),
      then fresh noise of the defense's standard deviation (Gaussian draws for Laplace too, same std). The
      server's own draws, never the client's."""
    stages, names = [], []
    draws = torch.Generator().manual_seed(0x5EE2)
    for leaf in defense_kinds(defense):
        if leaf.kind in ("gradprune", "outpost") and (ratio := leaf.ratio if leaf.kind == "gradprune" else leaf.prune) > 0:
            stages.append(lambda g, r=ratio: g * keep_largest(g.detach(), r))
            names.append(f"{leaf.kind} {ratio:g} (the mask of the largest entries)")
        elif leaf.kind == "sign":
            stages.append(lambda g: g + (torch.sign(g) - g).detach())
            names.append("sign (straight-through)")
        elif leaf.kind in ("gaussian", "laplace") and getattr(leaf, "clip", None) is not None:
            std = float(leaf.sigma) if leaf.kind == "gaussian" else float(leaf.scale) * math.sqrt(2.0)
            stages.append(lambda g, c=float(leaf.clip), s=std: clipped_noise(g, c, s, draws))
            names.append(f"{leaf.kind} clipped to {leaf.clip:g}, noise std {std:.3g}")
    if not stages:
        return None

    def defend(g: Tensor) -> Tensor:
        for stage in stages:
            g = stage(g)
        return g

    return defend, "; ".join(names)


def clipped_noise(g: Tensor, clip: float, std: float, gen: torch.Generator) -> Tensor:
    """``g`` scaled to L2 norm at most ``clip`` (differentiably), plus ``N(0, std^2)`` per entry."""
    scale = torch.clamp(clip / (g.norm() + 1e-12), max=1.0)
    return g * scale + std * torch.randn(g.shape, generator=gen).to(g)


def keep_largest(g: Tensor, ratio: float) -> Tensor:
    """The 0/1 mask of the entries of ``g`` that a pruning of ``ratio`` keeps (``prune_count`` smallest
    magnitudes zeroed, as GradPrune counts them)."""
    k = prune_count(ratio, g.numel())
    flat = g.abs().flatten()
    mask = torch.ones_like(flat)
    if k > 0:
        mask[flat.topk(k, largest=False).indices] = 0.0
    return mask.view_as(g)
