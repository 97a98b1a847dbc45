"""The attacker's auxiliary data (Wu et al. 2023, Sec. 3 and 4.1.3): public images it can compute
gradients on, disjoint from the client's private data.

``AuxData`` holds images in the client's input range and integer labels, plus a content digest that
identifies it (prepared attacks are cached under it). ``ood_pseudo_images`` is LTI-OOD's augmentation:
a Gaussian fitted per DCT coefficient on out-of-distribution images, sampled and transformed back.
Private and auxiliary images are compared by content hashes (8-bit quantised), never by index.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
from torch import Tensor

from guardfl.errors import ConfigError


def content_hashes(images: Tensor, input_range: tuple[float, float] = (0.0, 1.0)) -> list[str]:
    """One hash per image of its content quantised to 256 levels of ``input_range`` (so the same picture
    loaded twice, or through another float path, hashes the same)."""
    if not images.is_floating_point():  # token ids (text): hashed exactly
        ids = images.detach().cpu().long()
        return [hashlib.sha256(ids[i].numpy().tobytes() + b"ids").hexdigest()[:32] for i in range(len(ids))]
    lo, hi = input_range
    q = ((images.detach().float().cpu() - lo) / (hi - lo) * 255).round().clamp(0, 255).to(torch.uint8)
    return [hashlib.sha256(q[i].numpy().tobytes() + str(tuple(q[i].shape)).encode()).hexdigest()[:32] for i in range(len(q))]


@dataclass
class AuxData:
    """Auxiliary images ``(N, C, H, W)`` in the input range and labels ``(N,)``; ``ood``: images known to be
    out of distribution (for LTI-OOD's DCT pseudo-images), with ``ood_samples`` pseudo-images to draw.
    Text: ``images`` are token ids ``(N, L)`` (kept as integers) and ``labels`` the client's targets for
    them (next tokens ``(N, L)`` for a causal LM, classes ``(N,)`` for a classifier)."""

    images: Tensor
    labels: Tensor
    ood: Tensor | None = None
    ood_samples: int = 0
    name: str = "aux"
    _digest: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.images.dim() < 2 or len(self.images) != len(self.labels):
            raise ConfigError(f"aux: images {tuple(self.images.shape)} and labels {tuple(self.labels.shape)} must have "
                              "the same first dimension")
        if self.ood is not None and len(self.ood) and tuple(self.ood.shape[1:]) != tuple(self.images.shape[1:]) and len(self.images):
            raise ConfigError(f"aux.ood: OOD images have shape {tuple(self.ood.shape[1:])}, aux images {tuple(self.images.shape[1:])}")
        if not len(self.images) and (self.ood is None or not len(self.ood)):
            raise ConfigError("aux: no auxiliary images (give in-distribution images, OOD images, or both)")
        # token ids (int64, text) stay integers; images become float
        self.images = self.images.detach().cpu() if self.images.dtype == torch.long else self.images.detach().float().cpu()
        self.labels = self.labels.detach().long().cpu()
        self.ood = None if self.ood is None else self.ood.detach().float().cpu()

    @classmethod
    def from_any(cls, value) -> "AuxData":
        """An ``AuxData``, an ``(images, labels)`` pair of tensors, or a torch ``Dataset`` of ``(image, label)``."""
        if isinstance(value, AuxData):
            return value
        if isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(v, Tensor) for v in value):
            return cls(value[0], value[1])
        if hasattr(value, "__getitem__") and hasattr(value, "__len__"):
            items = [value[i] for i in range(len(value))]
            if not items:
                raise ConfigError("aux: the dataset is empty")
            try:
                x = torch.stack([torch.as_tensor(a) for a, _ in items])
                y = torch.as_tensor([int(b) for _, b in items])
            except (TypeError, ValueError) as err:
                raise ConfigError(f"aux: expected a Dataset of (image tensor, integer label) pairs ({err})") from None
            return cls(x, y)
        raise ConfigError(f"aux: expected a torch Dataset or an (images, labels) pair of tensors, got {type(value).__name__}")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple((self.images if len(self.images) else self.ood).shape[1:])

    def digest(self) -> str:
        """Identifies the data (content, labels, OOD part and pseudo-image count) for cache keys."""
        if self._digest is None:
            h = hashlib.sha256()
            for t in (self.images, self.labels, self.ood if self.ood is not None else torch.zeros(0)):
                h.update(str(tuple(t.shape)).encode())
                h.update(t.numpy().tobytes())
            h.update(str(self.ood_samples).encode())
            self._digest = h.hexdigest()[:20]
        return self._digest

    def check_disjoint(self, private: Tensor, input_range: tuple[float, float] = (0.0, 1.0)) -> None:
        """Refuse auxiliary data that shares any image with ``private`` (content hashes)."""
        mine = content_hashes(private, input_range)
        where = {h: i for i, h in enumerate(mine)}
        for part, images in (("aux", self.images), ("aux.ood", self.ood)):
            if images is None or not len(images):
                continue
            if tuple(images.shape[1:]) != tuple(private.shape[1:]):
                raise ConfigError(f"{part}: images have shape {tuple(images.shape[1:])}, the client's {tuple(private.shape[1:])}")
            hits = [(j, where[h]) for j, h in enumerate(content_hashes(images, input_range)) if h in where]
            if hits:
                j, i = hits[0]
                what = "image" if images.is_floating_point() else "sequence"
                raise ConfigError(
                    f"{part}: {len(hits)} auxiliary {what}(s) are private {what}s of the client (e.g. {part} #{j} = private "
                    f"#{i}); the attacker's auxiliary data must be disjoint from the client's (move aux.offset, or "
                    "choose other data)"
                )


def dct_matrix(n: int, dtype=torch.float64) -> Tensor:
    """The orthonormal DCT-II matrix ``D`` (n x n): ``D @ x`` transforms, ``D.T @ y`` inverts."""
    k = torch.arange(n, dtype=dtype)[:, None]
    i = torch.arange(n, dtype=dtype)[None, :]
    d = torch.cos(torch.pi * (2 * i + 1) * k / (2 * n)) * (2.0 / n) ** 0.5
    d[0] /= 2**0.5
    return d


def ood_pseudo_images(ood: Tensor, count: int, generator: torch.Generator,
                      input_range: tuple[float, float] = (0.0, 1.0)) -> Tensor:
    """LTI-OOD (Wu et al. 2023, Sec. 4.1.3): transform ``ood`` images ``(N, C, H, W)`` by a 2-D DCT per
    channel, fit an independent Gaussian per DCT coefficient (mean and variance over the N images), draw
    ``count`` samples and transform them back; clipped to the input range."""
    if ood.dim() != 4 or len(ood) < 2:
        raise ConfigError(f"aux.ood: need at least 2 OOD images of shape (C, H, W) (got {tuple(ood.shape)})")
    _, c, h, w = ood.shape
    dh, dw = dct_matrix(h), dct_matrix(w)
    coeffs = dh @ ood.double() @ dw.T  # (N, C, H, W)
    mean, std = coeffs.mean(0), coeffs.std(0, unbiased=True)
    z = torch.randn(count, c, h, w, generator=generator, dtype=torch.float64)
    images = dh.T @ (mean + std * z) @ dw
    return images.float().clamp(*input_range)


def pseudo_labels(count: int, num_classes: int, generator: torch.Generator) -> Tensor:
    """Random labels for pseudo-images (the paper's LTI-OOD trains on random labels)."""
    return torch.randint(0, num_classes, (count,), generator=generator)


def training_pool(aux: AuxData, num_classes: int, generator: torch.Generator,
                  input_range: tuple[float, float] = (0.0, 1.0)) -> tuple[Tensor, Tensor]:
    """Every image the attacker trains on: in-distribution aux images with their labels, OOD images and
    ``aux.ood_samples`` DCT pseudo-images with random labels."""
    xs, ys = [], []
    if len(aux.images):
        if int(aux.labels.max()) >= num_classes or int(aux.labels.min()) < 0:
            raise ConfigError(f"aux: labels must lie in [0, {num_classes}) for this model (got {int(aux.labels.min())}.."
                              f"{int(aux.labels.max())})")
        xs.append(aux.images)
        ys.append(aux.labels)
    if aux.ood is not None and len(aux.ood):
        xs.append(aux.ood.clamp(*input_range))
        ys.append(pseudo_labels(len(aux.ood), num_classes, generator))
        if aux.ood_samples:
            xs.append(ood_pseudo_images(aux.ood, aux.ood_samples, generator, input_range))
            ys.append(pseudo_labels(aux.ood_samples, num_classes, generator))
    return torch.cat(xs), torch.cat(ys)


def random_flips(images: Tensor, generator: torch.Generator) -> Tensor:
    """Each image ``(N, C, H, W)`` mirrored left-right with probability 1/2 (a fresh copy; the inputs are
    untouched): augmentation of the attacker's own auxiliary images, for data whose distribution is
    mirror-symmetric (natural images, faces; not digits or text)."""
    flip = torch.rand(len(images), generator=generator) < 0.5
    return torch.where(flip.view(-1, *([1] * (images.dim() - 1))), images.flip(-1), images)

