"""Reusable work buffers, so that a defense's step allocates nothing on the hot path.

A defense that needs a temporary as large as a layer (the sign of a gradient, a draw of noise, a mask of
changed entries) would otherwise allocate and free tens of megabytes every step. On a CPU, glibc hands
blocks that large back to the kernel when they are freed, so every step pays a page fault per 4 KiB page
again: on ResNet-18 that was half the cost of sign compression (``bench/bench_defenses.py``). A ``Scratch``
keeps one flat buffer per (device, dtype), as large as the largest tensor it was asked for, and returns
views of it: the memory stays mapped and warm from one step to the next. The views alias one another, so a
caller uses one view per dtype at a time (a layer's temporaries are dead before the next layer's).

A ``Scratch`` is not shared between threads (each defense instance owns one), and it is never pickled or
deep-copied with its buffers: a copy starts empty.
"""

from __future__ import annotations

import torch
from torch import Tensor


class Scratch:
    """Views of reusable flat buffers, one per (device, dtype), grown to the largest request."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.device, torch.dtype], Tensor] = {}

    def like(self, x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """An uninitialised tensor with ``x``'s shape and device (and ``dtype``, default ``x``'s): a view
        of this scratch's buffer for that device and dtype, valid until the next call for the same pair."""
        dtype = x.dtype if dtype is None else dtype
        key = (x.device, dtype)
        buf = self._buffers.get(key)
        n = x.numel()
        if buf is None or buf.numel() < n:
            buf = torch.empty(n, dtype=dtype, device=x.device)
            self._buffers[key] = buf
        return buf[:n].view(x.shape)

    def __getstate__(self) -> dict:
        return {"_buffers": {}}

    def __deepcopy__(self, memo: dict) -> "Scratch":
        return Scratch()
