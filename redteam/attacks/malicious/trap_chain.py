"""What every trap construction shares (``trap_weights``, ``trap_per_sample``): the crafted model with what
its recovery needs (``Trap``), a chain's random measurement direction and row scales, and the chain's one
shared classifier column."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn


#: a chain's rows with one scale (``trap_weights`` ``scales: equal``, the LayerNorm trap): each row's random
#: part, relative to the row, so that no two rows are equal (the inspection's duplicate-row check)
EQUAL_JITTER = 1e-5


class Trap(NamedTuple):
    """A crafted model and what its recovery needs: the rows of each chain in cut-off order, the state-dict
    names of the first layer's weight and bias, and through a BatchNorm its name and, per chain, the
    measurement direction, the rows' scales and the BatchNorm weights sent (``trap_norm``)."""

    sent: nn.Module
    chains: list[Tensor]
    weight: str
    bias: str
    norm: str | None = None
    norm_chains: list[tuple[Tensor, Tensor, Tensor]] | None = None
    #: through GroupNorm or LayerNorm: each row's slope, by which its update is divided (``trap_per_sample``)
    slopes: Tensor | None = None


def chain_draw(d: int, k: int, rows: int | None, cuts: str, boost: float,
               gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """A chain's random unit measurement direction and its ``k`` rows' scales in [0.5, 2] (over ``boost``
    for a median trap: half the batch fires those rows, so their activations and logits stay honest)."""
    m = torch.randn(d, generator=gen, dtype=torch.float64)
    m /= m.norm()
    scale = torch.rand(k, generator=gen, dtype=torch.float64) * 1.5 + 0.5
    if rows is not None and cuts == "middle":
        scale = scale / boost
    return m, scale


def columns(second: nn.Linear, chain: Tensor, boost: float, column_noise: float, gen: torch.Generator) -> None:
    """One random column, ``boost`` times the honest columns' mean norm, for every row of a chain (each
    with its relative ``column_noise``): every row of the chain then gets the same coefficient per sample."""
    column = torch.randn(second.out_features, generator=gen, dtype=torch.float64)
    column *= boost * second.weight.detach().double().norm(dim=0).mean().clamp_min(1e-3) / column.norm()
    noise = 1 + column_noise * torch.randn(second.out_features, len(chain), generator=gen, dtype=torch.float64)
    second.weight[:, chain] = (column[:, None] * noise).to(second.weight.dtype)


def equal_rows(m: Tensor, k: int, scale: float, gen: torch.Generator) -> Tensor:
    """``k`` rows ``scale (m + e_j)``, each ``e_j`` random of relative size ``EQUAL_JITTER``: one
    measurement, and no two rows equal."""
    d = len(m)
    return scale * (m[None, :] + EQUAL_JITTER / d ** 0.5 * torch.randn(k, d, generator=gen, dtype=torch.float64))
