"""Small data helpers shared by the defenses and the red team."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from guardfl.errors import GuardflError


class DataError(GuardflError, ValueError):
    """Data that cannot be loaded or has the wrong layout (a ``ValueError`` too, as callers catch it)."""


def from_array(x: np.ndarray, y: np.ndarray) -> tuple[Tensor, Tensor]:
    x = np.asarray(x)
    if x.ndim == 3:
        x = x[..., None]
    if x.ndim != 4:
        raise DataError(f"data: expected images of shape (N, H, W[, C]), got {x.shape}")
    if x.shape[-1] not in (1, 3) and x.shape[1] in (1, 3):  # already NCHW
        t = torch.from_numpy(x)
    else:
        t = torch.from_numpy(x).permute(0, 3, 1, 2)
    t = t.float()
    if np.issubdtype(x.dtype, np.integer) or float(t.max()) > 1.0:
        t = t / 255.0
    return t.contiguous(), torch.from_numpy(np.asarray(y)).long()


