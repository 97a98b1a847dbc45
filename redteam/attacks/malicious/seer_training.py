"""The maths of SEER (Garov et al., ICLR 2024) at the scale of a dense first layer: the secret property,
the disaggregation / reconstruction objective, the decoder, and the held-out measure of what was learned.

Pure functions over tensors and one ``nn.Module`` (the shared model being trained); ``seer.py`` holds
the attack. Written from the paper's description and the authors' training script (``seer/train.py`` at
``09567fc``: the batch sorted by the property, the loss gradient taken for the chosen sample alone and for
two combinations of the others, the decoder asked to map the others to its output at zero and the chosen
sample to its image, the gradient of that loss flowing into the shared model's weights), not copied.

The decoder (a deviation, for CPU budgets): SEER's is a linear map of a fixed random selection of
gradient coordinates across the whole network (8,400 per layer or 0.1%) to an image; on FC-2 that is an
11,738 x 512 disaggregator, 0.1 s per step on 2 cores, and at 4,000 steps it reconstructs nothing held out.
Here the disaggregator reads the gradient of the first dense layer, whose rows are input-sized: ``z = A G``
(``A``: ``width`` combinations of the layer's rows, so ``z`` is ``width`` input-sized maps), then
``z`` is normalised and its sign fixed (``sign(sum z)``: the chosen image's pixels are positive in a [0, 1]
range, so a sign flip of the sample's coefficient, which depends on its label, is undone), and the
reconstructor is one weight per map and pixel plus a bias. It is linear in the gradient up to that scale
and sign, which the server reads off the gradient itself; nothing of the client's batch enters it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from guardfl.redteam.modality.image.metrics import ssim

#: the properties of SEER's code this reading supports (``Filters`` / ``property_scores``): the mean pixel
#: (``bright``), its negative (``dark``), and one channel against the other two (``red``, ``green``,
#: ``blue``: ``2 c - the others``, 3-channel images only)
PROPERTIES = ("bright", "dark", "red", "green", "blue")
#: the scale the normalised maps are given before the reconstructor (any constant: the reconstructor's
#: weights absorb it; this one keeps them near 1 at Adam's step sizes)
MAP_SCALE = 50.0


def property_scores(images: Tensor, prop: str) -> Tensor:
    """SEER's secret property of each image ``(N, C, H, W)``: larger is more of it."""
    if prop == "bright":
        return images.mean(dim=(1, 2, 3))
    if prop == "dark":
        return -images.mean(dim=(1, 2, 3))
    channel = {"red": 0, "green": 1, "blue": 2}[prop]
    means = images.mean(dim=(2, 3))
    return 3 * means[:, channel] - means.sum(1)


@dataclass
class Decoder:
    """The server's secret decoder: ``A`` ``(width, rows)``, ``weight`` ``(width, D)``, ``bias`` ``(D,)``."""

    A: Tensor
    weight: Tensor
    bias: Tensor

    @classmethod
    def init(cls, rows: int, width: int, mean_image: Tensor, gen: torch.Generator) -> "Decoder":
        """Random combinations, a zero reconstructor and the mean auxiliary image as its bias."""
        a = (torch.randn(width, rows, generator=gen) / rows ** 0.5).to(mean_image.device)
        weight = torch.zeros(width, mean_image.numel(), device=mean_image.device)
        return cls(a.requires_grad_(), weight.requires_grad_(), mean_image.flatten().clone().requires_grad_())

    def parameters(self) -> list[Tensor]:
        return [self.A, self.weight, self.bias]

    def maps(self, gradient: Tensor) -> Tensor:
        """The disaggregator: ``width`` combinations of the first layer's gradient rows."""
        return self.A @ gradient

    def reconstruct(self, maps: Tensor) -> Tensor:
        """The reconstructor on the disaggregator's output: scale and sign fixed, then per-pixel linear."""
        sign = torch.sign(maps.sum(1, keepdim=True)).detach()
        sign = torch.where(sign == 0, torch.ones_like(sign), sign)
        z = maps * sign / (maps.norm() + 1e-12) * MAP_SCALE
        return (self.weight * z).sum(0) + self.bias

    def __call__(self, gradient: Tensor) -> Tensor:
        return self.reconstruct(self.maps(gradient))

    def state(self) -> dict[str, Tensor]:
        return {"A": self.A.detach().clone(), "weight": self.weight.detach().clone(), "bias": self.bias.detach().clone()}

    @classmethod
    def from_state(cls, state: dict[str, Tensor]) -> "Decoder":
        return cls(state["A"].float(), state["weight"].float(), state["bias"].float())

    def to(self, device: torch.device | str) -> "Decoder":
        return Decoder(self.A.to(device), self.weight.to(device), self.bias.to(device))


def weighted_gradient(losses: Tensor, weights: Tensor, layer: Tensor, create_graph: bool) -> Tensor:
    """The gradient of ``sum_i weights_i loss_i`` in ``layer`` (the batch's forward pass kept: BatchNorm's
    statistics are the whole batch's, as the client trains)."""
    return torch.autograd.grad((losses * weights).sum(), layer, create_graph=create_graph, retain_graph=True)[0]


def singling_out(preactivations: Tensor, temperature: float = 0.1, width: float = 1.0) -> Tensor:
    """A differentiable stand-in for guardfl's isolation check at a normalisation's output
    (``inspect_isolation``: a unit, or the difference of two units, whose gradient holds one sample): with
    ``f`` each sample's soft firing of each unit (a sigmoid of the pre-activation at ``temperature``), the
    mean over units of a bump at 1 of the samples a unit fires for, plus the mean over pairs of units of a
    bump at 1 of the samples one fires for and the other not (``width`` wide). Zero when no unit and no
    pair separates about one sample; what a SEER adaptive to that check adds to its loss (``spread``)."""
    f = torch.sigmoid(preactivations / temperature)
    differences = torch.cdist(f.t(), f.t(), p=1)
    pairs = torch.exp(-(differences - 1).pow(2) / (2 * width ** 2))
    alone = torch.exp(-(f.sum(0) - 1).pow(2) / (2 * width ** 2))
    return pairs.mean() + alone.mean()


def seer_loss(model: nn.Module, layer: Tensor, decoder: Decoder, images: Tensor, labels: Tensor, prop: str,
              gen: torch.Generator, norm: nn.Module | None = None, spread: float = 0.0,
              defend: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """SEER's objective on one auxiliary batch, the model in train mode: the chosen sample (the most of
    ``prop``) alone decodes to its image, so does the whole batch's sum (through ``defend``, a differentiable
    stand-in for the client's defense, when given: the model learns to put the image where the defense
    leaves it); a random and the uniform combination of the others decode to nothing (the disaggregator's
    output at zero). ``spread`` > 0 adds ``spread`` times ``singling_out`` of ``norm``'s output (the units'
    pre-activations)."""
    n = len(images)
    chosen = int(property_scores(images, prop).argmax())
    one = F.one_hot(torch.tensor(chosen), n).to(images)
    seen: dict[str, Tensor] = {}
    hook = norm.register_forward_hook(lambda _m, _i, out: seen.setdefault("out", out)) if norm is not None and spread else None
    try:
        losses = F.cross_entropy(model(images), labels, reduction="none")
    finally:
        if hook is not None:
            hook.remove()
    g_alone = weighted_gradient(losses, one, layer, True)
    g_others = weighted_gradient(losses, 1 - one, layer, True)
    alone, others = decoder.maps(g_alone), decoder.maps(g_others)
    whole = decoder.maps(defend(g_alone + g_others)) if defend is not None else alone + others
    rand = torch.randn(n, generator=gen).to(images) * (1 - one)
    random_mix = decoder.maps(weighted_gradient(losses, rand / (rand.norm() + 1e-12), layer, True))
    target = images[chosen].flatten()
    positive = F.mse_loss(decoder.reconstruct(alone), target) + F.mse_loss(decoder.reconstruct(whole), target)
    negative = others.pow(2).mean() + random_mix.pow(2).mean()
    evasion = spread * singling_out(seen["out"]) if "out" in seen else 0.0
    return positive + negative + evasion


def augment(images: Tensor, input_range: tuple[float, float], gen: torch.Generator) -> Tensor:
    """The attacker's own images varied (flips, shifts of up to 4 pixels, brightness and contrast, a channel
    order): without it the shared model memorises the auxiliary images and decodes nothing held out."""
    lo, hi = input_range
    n = len(images)
    flip = (torch.rand(n, generator=gen) < 0.5).to(images.device)
    x = torch.where(flip[:, None, None, None], images.flip(-1), images)
    dy, dx = (torch.randint(-4, 5, (2,), generator=gen)).tolist()
    x = torch.roll(x, (dy, dx), (-2, -1))
    scale = (0.6 + 0.8 * torch.rand(n, 1, 1, 1, generator=gen)).to(images)
    shift = (0.2 * (torch.rand(n, 1, 1, 1, generator=gen) - 0.5) * (hi - lo)).to(images)
    x = ((x - lo) * scale + lo + shift).clamp(lo, hi)
    if x.shape[1] > 1 and float(torch.rand((), generator=gen)) < 0.5:
        x = x[:, torch.randperm(x.shape[1], generator=gen).to(images.device)]
    return x


def held_out(model: nn.Module, layer: Tensor, decoder: Decoder, images: Tensor, labels: Tensor, batch: int,
             prop: str, input_range: tuple[float, float], draws: int, gen: torch.Generator) -> dict[str, float]:
    """What the trained pair does on the attacker's held-out images, batches of the client's size as the
    client sends them (the mean loss's gradient): the chosen image's SSIM decoded from the batch, decoded
    from its own gradient alone, and the batch's mean image as the guess (the baseline); the share of
    batches decoded past SSIM 0.5. Never the client's data."""
    got, alone, base = [], [], []
    lo, hi = input_range
    for _ in range(draws):
        idx = torch.randperm(len(images), generator=gen)[:batch]
        x, y = images[idx].to(layer.device), labels[idx].to(layer.device)
        chosen = int(property_scores(x, prop).argmax())
        losses = F.cross_entropy(model(x), y, reduction="none")
        whole = weighted_gradient(losses, torch.full((len(x),), 1.0 / len(x), device=x.device), layer, False)
        own = weighted_gradient(losses, F.one_hot(torch.tensor(chosen), len(x)).to(x), layer, False)
        shape = x.shape[1:]
        with torch.no_grad():
            got.append(ssim(decoder(whole).view(shape).clamp(lo, hi), x[chosen], hi - lo))
            alone.append(ssim(decoder(own).view(shape).clamp(lo, hi), x[chosen], hi - lo))
            base.append(ssim(x.mean(0), x[chosen], hi - lo))
    mean = lambda v: float(sum(v) / len(v))  # noqa: E731
    return {"ssim": mean(got), "ssim_alone": mean(alone), "ssim_batch_mean": mean(base),
            "share_past_0.5": mean([float(s > 0.5) for s in got]), "batches": draws}
