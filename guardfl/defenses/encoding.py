"""Input encodings: MixUp and InstaHide (Huang et al. 2020), as evaluated by Huang et al. 2021 (Sec. 4).

They act on the data, not on the gradient: ``guardfl.protect`` wraps the client's data loader so that the
model trains on encoded images with soft labels (``guardfl.soft_cross_entropy``, or plain
``F.cross_entropy``, which accepts class probabilities).

- MixUp(k, max_coeff): each private image is mixed with k-1 others of its batch with random non-negative
  coefficients summing to 1, each at most ``max_coeff`` (default 0.65); labels mixed with the same ones.
- InstaHide(k, max_coeff, mode): MixUp plus a fresh random sign-flip mask per encoded image. ``intra``
  mixes with private images; ``inter`` mixes each private image with k-1 images of a public dataset
  (``public``: an ``.npz`` with ``x``, or a tensor given to the constructor), and only the private label
  enters the label (weighted by its coefficient, not renormalised, as in InstaHide's reference code).

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
from guardfl.ops.mixing import batch_partners, mix, mixing_coefficients, sign_masks
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


class _InputEncoding(Defense):
    stage = "input"
    sign_flip = False

    def encode(self, x: Tensor, y: Tensor, num_classes: int) -> tuple[Tensor, Tensor]:
        """Encoded images and soft labels for one batch ``x`` with integer (or soft) labels ``y``."""
        n = x.shape[0]
        gen = self.generator("cpu")
        soft = y.float() if y.dim() == 2 else F.one_hot(y.long(), num_classes).float()
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
    """MixUp with k images per encoding, coefficients bounded by ``max_coeff``."""

    Config = MixUpConfig

    def __init__(self, k: int = 4, max_coeff: float = 0.65, *, seed: int | None = None, nonfinite: str = "raise") -> None:
        super().__init__(k=k, max_coeff=max_coeff, seed=seed, nonfinite=nonfinite)


@register
class InstaHide(_InputEncoding):
    """InstaHide: MixUp plus a random sign-flip mask per encoded image (intra or inter)."""

    Config = InstaHideConfig
    sign_flip = True

    def __init__(
        self, k: int = 4, max_coeff: float = 0.65, mode: str = "intra", public: str | Tensor | None = None, *,
        seed: int | None = None, nonfinite: str = "raise",
    ) -> None:
        self._public_tensor = public if isinstance(public, Tensor) else None
        super().__init__(k=k, max_coeff=max_coeff, mode=mode, public=None if isinstance(public, Tensor) else public,
                         seed=seed, nonfinite=nonfinite)

    def _check_config(self) -> None:
        if not hasattr(self, "_public_tensor"):
            self._public_tensor = None
        if self.config.mode == "inter":
            if self._public_tensor is None and self.config.public is None:
                raise ConfigError("instahide.public: mode 'inter' needs a public dataset (an .npz path or a tensor)")
            if self._public_tensor is None:
                with np.load(self.config.public) as d:
                    self._public_tensor = from_array(d["x"], np.zeros(len(d["x"])))[0]

    def _mix(self, x, soft, coeffs, gen):
        if self.config.mode == "intra":
            return super()._mix(x, soft, coeffs, gen)
        public = self._public_tensor.to(x.device, x.dtype)
        if public.shape[1:] != x.shape[1:]:
            raise ConfigError(f"instahide.public: public images have shape {tuple(public.shape[1:])}, private {tuple(x.shape[1:])}")
        n, k = x.shape[0], self.config.k
        idx = torch.randint(0, public.shape[0], (n, k - 1), generator=gen).to(x.device)
        pool = torch.cat([x, public])
        partners = torch.cat([torch.arange(n, device=x.device)[:, None], idx + n], 1)
        encoded = mix(pool, partners, coeffs)
        labels = soft * coeffs[:, :1]  # only the private label is mixed in
        return encoded, labels
