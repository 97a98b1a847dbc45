"""Input encodings: MixUp and InstaHide (Huang et al. 2020), as evaluated by Huang et al. 2021 (Sec. 4).

They act on the data, not on the gradient: ``guardfl.protect`` wraps the client's data loader so that the
model trains on encoded images with soft labels (``guardfl.soft_cross_entropy``, or plain
``F.cross_entropy``, which accepts class probabilities).

- MixUp(k, max_coeff): each private image is mixed with k-1 DISTINCT other images of its batch (drawn
  uniformly without replacement) with random non-negative coefficients summing to 1, each at most
  ``max_coeff`` (default 0.65); labels mixed with the same ones.
- InstaHide(k, max_coeff, mode): MixUp plus a fresh random sign-flip mask per encoded image. ``intra``
  mixes with private images as MixUp does; ``inter`` mixes each private image with k-1 DISTINCT images of
  a public dataset (``public``: an ``.npz`` with ``x``, or a tensor given to the constructor), and only
  the private label enters the label (weighted by its coefficient, not renormalised, as in InstaHide's
  reference code).

The k images of one mix are k distinct images, so ``max_coeff`` bounds the TOTAL weight of each distinct
image in an encoded image, the private image itself included. Hence the refusals (``ConfigError``):
intra mixing (MixUp, InstaHide ``intra``) needs batches of at least k images, and ``guardfl.protect``
refuses before training a loader whose ``batch_size`` is below k or whose short last batch would be
(pass ``drop_last=True`` to the DataLoader); any such batch met during training is refused too (e.g. a
Poisson-sampled DP-SGD batch; empty batches pass through empty). Inter mode needs a public set of at
least k-1 images (checked when the defense is built).

Limitation: partners are distinct *indices* of the batch, not distinct contents. A batch that holds the
same sample twice (a sampler with replacement, a dataset with duplicates) can mix that image twice, and
its total weight can then exceed ``max_coeff``; no content hashing is done.

No setting is zero-strength: k >= 2 and ``max_coeff > 1/k`` give every one of the k distinct images a
positive weight (almost surely), so an encoded image differs from its private image unless the batch holds
identical images.

Mixing partners, coefficients and masks are drawn per batch from the defense's own generator, so they are
re-drawn every epoch and follow whatever order a shuffled loader produces. Encoded images of InstaHide
lie in [-1, 1] (signs flipped), MixUp's in the input range.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import Tensor

from guardfl.data import from_array
from guardfl.defenses.base import Defense, DefenseConfig, StepContext, register
from guardfl.errors import ConfigError
from guardfl.ops.mixing import batch_partners, mix, mixing_coefficients, public_partners, sign_masks
from guardfl.stats import StageStats


class _MixConfig(DefenseConfig):
    k: int = Field(default=4, ge=2, json_schema_extra={"allowed": "an integer >= 2"})
    max_coeff: float = Field(default=0.65, le=1.0, json_schema_extra={"allowed": "(1/k, 1]"})

    @model_validator(mode="after")
    def _bound(self):
        if not self.max_coeff > 1.0 / self.k:
            raise ValueError(f"max_coeff must be in (1/k, 1] = ({1.0 / self.k:.4f}, 1] for k={self.k} (got {self.max_coeff})")
        return self


class MixUpConfig(_MixConfig):
    kind: Literal["mixup"] = "mixup"


class InstaHideConfig(_MixConfig):
    kind: Literal["instahide"] = "instahide"
    mode: Literal["intra", "inter"] = Field(default="intra", json_schema_extra={"allowed": "'intra' or 'inter'"})
    public: str | None = Field(default=None, json_schema_extra={"allowed": "null or the path of an .npz with 'x'"})


_DROP_LAST = "pass drop_last=True to the DataLoader to drop a short last batch"


class _InputEncoding(Defense):
    randomized = True
    stage = "input"
    sign_flip = False

    @property
    def mixes_within_batch(self) -> bool:
        """Whether the k-1 partners come from the batch itself (so a batch needs at least k images)."""
        return True

    def _too_small(self, what: str) -> ConfigError:
        k = self.config.k
        return ConfigError(f"{self.kind}.k: k={k} images per mix needs a batch of at least {k} distinct images "
                           f"({what}); allowed: 2 <= k <= batch size")

    def check_batch(self, n: int) -> None:
        """Refuse (ConfigError) a non-empty batch of fewer than k images when mixing within the batch."""
        if self.mixes_within_batch and 0 < n < self.config.k:
            raise self._too_small(f"got a batch of {n}; if it is a loader's last batch, {_DROP_LAST}")

    def check_loader(self, loader) -> None:
        """Early form of ``check_batch`` for a ``torch.utils.data.DataLoader`` (``guardfl.protect`` calls it):
        refuse a ``batch_size`` below k, or a short last batch below k (``drop_last=False``). Loaders whose
        batch sizes are not known in advance (a ``batch_sampler``, Poisson sampling) are left to
        ``check_batch``."""
        batch_size = getattr(loader, "batch_size", None)
        if not self.mixes_within_batch or not isinstance(batch_size, int) or batch_size <= 0:
            return
        try:
            samples = len(loader.sampler)
        except (AttributeError, TypeError, NotImplementedError):  # an IterableDataset, a sampler without len
            samples = None
        if batch_size < self.config.k and (samples is None or samples >= batch_size):
            raise self._too_small(f"the loader's batch_size is {batch_size}")
        last = samples % batch_size if samples is not None else 0
        if 0 < last < self.config.k and not getattr(loader, "drop_last", False):
            raise self._too_small(f"the loader's last batch has {last}: {samples} samples, batch_size {batch_size}; "
                                  f"{_DROP_LAST}")

    def encode(self, x: Tensor, y: Tensor, num_classes: int) -> tuple[Tensor, Tensor]:
        """Encoded images and soft labels for one batch ``x`` with integer (or soft) labels ``y``. Each
        encoded image mixes k distinct images, each at weight <= ``max_coeff``; a non-empty batch too small
        for that is refused (ConfigError), an empty one is returned as it is."""
        n = x.shape[0]
        soft = y.float() if y.dim() == 2 else F.one_hot(y.long(), num_classes).float()
        if n == 0:
            return x, soft
        self.check_batch(n)
        gen = self.generator("cpu")
        coeffs = mixing_coefficients(n, self.config.k, self.config.max_coeff, gen, device=x.device)
        encoded, labels = self._mix(x, soft, coeffs, gen)
        if self.sign_flip:
            encoded = encoded * sign_masks(tuple(encoded.shape), gen, device=x.device)
        return encoded, labels

    def _mix(self, x, soft, coeffs, gen):
        partners = batch_partners(x.shape[0], self.config.k, gen).to(x.device)
        return mix(x, partners, coeffs), mix(soft, partners, coeffs)

    def _apply_(self, grads: list[Tensor], ctx: StepContext) -> StageStats:
        raise ConfigError(f"{self.kind} encodes the client's inputs, not its gradients: use guardfl.protect(model, optimizer, loader, defense)")


@register
class MixUp(_InputEncoding):
    """MixUp with k distinct images per encoding, each image's weight bounded by ``max_coeff``; needs
    batches of at least k images.

    Args:
        k: images mixed into each encoding.
        max_coeff: the largest weight one image gets, in (1/k, 1].
        seed: an integer in [0, 2**32 - 1] for a reproducible stream; ``None`` (the default, as deployed): OS
            entropy.
        nonfinite: ``"raise"`` (default): a NaN or inf in the gradient raises; ``"zero"``: such entries are
            zeroed.
    """

    Config = MixUpConfig

    def __init__(self, k: int = 4, max_coeff: float = 0.65, *, seed: int | None = None, nonfinite: str = "raise") -> None:
        super().__init__(k=k, max_coeff=max_coeff, seed=seed, nonfinite=nonfinite)


@register
class InstaHide(_InputEncoding):
    """InstaHide: MixUp plus a random sign-flip mask per encoded image (intra: k distinct images of the
    batch; inter: the private image and k-1 distinct public images, so a public set of at least k-1).

    Args:
        k: images mixed into each encoding.
        max_coeff: the largest weight one image gets, in (1/k, 1].
        mode: ``"intra"``: k images of the batch; ``"inter"``: the private image and k-1 public ones.
        public: ``"inter"``'s public images: an ``.npz`` path (with ``x``) or a tensor.
        seed: an integer in [0, 2**32 - 1] for a reproducible stream; ``None`` (the default, as deployed): OS
            entropy.
        nonfinite: ``"raise"`` (default): a NaN or inf in the gradient raises; ``"zero"``: such entries are
            zeroed.
    """

    Config = InstaHideConfig
    sign_flip = True

    @property
    def mixes_within_batch(self) -> bool:
        return self.config.mode == "intra"

    def __init__(
        self, k: int = 4, max_coeff: float = 0.65, mode: str = "intra", public: str | Tensor | None = None, *,
        seed: int | None = None, nonfinite: str = "raise",
    ) -> None:
        self._public_tensor = public if isinstance(public, Tensor) else None
        super().__init__(k=k, max_coeff=max_coeff, mode=mode, public=None if isinstance(public, Tensor) else public,
                         seed=seed, nonfinite=nonfinite)

    def fresh(self) -> "InstaHide":
        new = type(self).__new__(type(self))
        new._public_tensor = self._public_tensor  # read only: shared, not copied
        new._init_from_config(self.config.model_copy(deep=True))
        return new

    def _check_config(self) -> None:
        if not hasattr(self, "_public_tensor"):
            self._public_tensor = None
        if self.config.mode == "inter":
            if self._public_tensor is None and self.config.public is None:
                raise ConfigError("instahide.public: mode 'inter' needs a public dataset (an .npz path or a tensor)")
            if self._public_tensor is None:
                self._public_tensor = load_public(self.config.public)
            self._check_public()

    def _check_public(self) -> None:
        size, k = self._public_tensor.shape[0], self.config.k
        if size < k - 1:
            raise ConfigError(f"instahide.public: the public set has {size} images; mode 'inter' with k={k} needs at "
                              f"least k-1 = {k - 1} (distinct partners per mix)")

    def _mix(self, x, soft, coeffs, gen):
        if self.config.mode == "intra":
            return super()._mix(x, soft, coeffs, gen)
        public = self._public_tensor.to(x.device, x.dtype)
        if public.shape[1:] != x.shape[1:]:
            raise ConfigError(f"instahide.public: public images have shape {tuple(public.shape[1:])}, private {tuple(x.shape[1:])}")
        self._check_public()
        n, k = x.shape[0], self.config.k
        idx = public_partners(n, k, public.shape[0], gen).to(x.device)
        pool = torch.cat([x, public])
        partners = torch.cat([torch.arange(n, device=x.device)[:, None], idx + n], 1)
        encoded = mix(pool, partners, coeffs)
        labels = soft * coeffs[:, :1]  # only the private label is mixed in
        return encoded, labels


def load_public(path: str) -> Tensor:
    """The public images of Inter-InstaHide from an .npz with a numeric array 'x' (no pickle): one line naming
    ``instahide.public`` for a missing file, a file that is not an npz, object arrays or no 'x'."""
    from pathlib import Path

    if not Path(path).is_file():
        raise ConfigError(f"instahide.public: file not found: {path!r} (an .npz with the public images as 'x')")
    try:
        with np.load(path, allow_pickle=False) as d:
            if "x" not in d:
                raise ConfigError(f"instahide.public: {path} has no array 'x' (has {list(d.keys())})")
            x = d["x"]
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(f"instahide.public: {path} is not an npz of numeric arrays ({str(err).splitlines()[0][:120]})") from None
    if x.dtype.kind not in "biuf" or x.ndim not in (3, 4):
        raise ConfigError(f"instahide.public: {path}: 'x' must be numeric images (N, H, W[, C]); got {x.dtype} {x.shape}")
    return from_array(x, np.zeros(len(x)))[0]
