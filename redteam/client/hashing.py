"""Feature hashing of an observation (Wu et al. 2023, Sec. 3.2; Weinberger et al. 2009).

Each of the ``dim_in`` coordinates is sent to one of ``dim_out`` bins by a fixed random map r(i) and
the values in a bin are summed: ``out[j] = sum_{i: r(i)=j} s(i) x[i]``. We use the signed form of
Weinberger et al. (a count-sketch, s(i) = +-1 at random), which keeps inner products unbiased; the LTI
paper writes P in {0, 1} (unsigned). Either way the map is linear and fixed, so noise a defense added
before hashing is still noise after it (its variance summed per bin), and what the inverter sees is a
function of what the client transmitted only.
"""

from __future__ import annotations

import torch
from torch import Tensor


class CountSketch:
    """A fixed random linear map R^dim_in -> R^dim_out (defined by ``seed``; cheap to store and rebuild)."""

    def __init__(self, dim_in: int, dim_out: int, seed: int, signed: bool = True) -> None:
        if not 1 <= dim_out <= dim_in:
            raise ValueError(f"hash dimension must be in [1, {dim_in}] (got {dim_out})")
        g = torch.Generator().manual_seed(seed)
        self.dim_in, self.dim_out, self.seed, self.signed = dim_in, dim_out, seed, signed
        self.bins = torch.randint(0, dim_out, (dim_in,), generator=g)
        self.signs = (torch.randint(0, 2, (dim_in,), generator=g) * 2 - 1).float() if signed else torch.ones(dim_in)

    def __call__(self, x: Tensor) -> Tensor:
        """``x``: ``(N, dim_in)`` -> ``(N, dim_out)``."""
        bins, signs = self.bins.to(x.device), self.signs.to(x.device, x.dtype)
        out = x.new_zeros(x.shape[0], self.dim_out)
        return out.index_add_(1, bins, x * signs)

    def of_parts(self, parts: list[Tensor]) -> Tensor:
        """The sketch of rows given as consecutive column blocks, ``self(torch.cat(parts, 1))`` without
        building the rows (the same sums in the same order). CONSUMES ``parts``: each block is multiplied
        by its signs in place and dropped from the list once added, so it is freed as the hashing goes (a
        language model's rows are ~43 MB each, and the copy into them cost more than the gradients on a
        CPU)."""
        total = sum(block.shape[1] for block in parts)
        if total != self.dim_in:
            raise ValueError(f"of_parts: the blocks have {total} columns, the sketch takes {self.dim_in}")
        device, dtype, rows = parts[0].device, parts[0].dtype, parts[0].shape[0]
        bins, signs = self.bins.to(device), self.signs.to(device, dtype)
        out = torch.zeros(rows, self.dim_out, device=device, dtype=dtype)
        offset = 0
        while parts:
            block = parts.pop(0)
            k = block.shape[1]
            out.index_add_(1, bins[offset : offset + k], block.mul_(signs[offset : offset + k]))
            offset += k
        return out

    def spec(self) -> dict:
        return {"dim_in": self.dim_in, "dim_out": self.dim_out, "seed": self.seed, "signed": self.signed}
