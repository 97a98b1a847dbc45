"""Detection of non-finite gradients."""

from __future__ import annotations

import torch
from torch import Tensor


def nonfinite_counts(tensors: list[Tensor]) -> list[int]:
    """Number of NaN/inf entries of each tensor.

    Fast path: one sum per tensor (a NaN or inf entry makes the sum non-finite); only tensors whose sum
    is not finite (a bad entry, or a finite overflow) are counted entry by entry, so the answer is exact.
    """
    if not tensors:
        return []
    sums = torch.stack([t.sum() for t in tensors]).float()
    suspect = (~torch.isfinite(sums)).nonzero().squeeze(1).tolist()
    counts = [0] * len(tensors)
    for i in suspect:
        counts[i] = int(torch.count_nonzero(~torch.isfinite(tensors[i])))
    return counts


def nonfinite_where(tensors: list[Tensor], names: list[str]) -> str | None:
    """``"name (count of numel, dtype)"`` for each tensor holding NaN or inf entries, comma-separated;
    None when every entry is finite."""
    counts = nonfinite_counts(tensors)
    bad = [f"{names[i]} ({c} of {tensors[i].numel()}, {str(tensors[i].dtype).removeprefix('torch.')})"
           for i, c in enumerate(counts) if c]
    return ", ".join(bad) if bad else None
