"""What every trap construction shares (``trap_weights``, ``trap_per_sample``): the crafted model with what
its recovery needs (``Trap``), a chain's random measurement direction and row scales, and the chain's one
shared classifier column."""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
from torch import Tensor, nn

from guardfl.inspect_rows import PARALLEL_COS, parallel_rows


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
    #: ``columns: k`` (``trap_groups``): per chain each cut's k x k combinations of the basis columns, and
    #: ``chains`` then holds per chain the rows as cuts x k
    mixes: list[Tensor] | None = None

    def rows(self) -> nn.Parameter:
        """The sent model's first-layer weight: the trap's rows (what ``disguise`` changes)."""
        return dict(self.sent.named_parameters())[self.weight]


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


#: ``trap_weights disguise: auto``: each disguised row's unseen part is sized so that two rows of one chain
#: have ``|cos|`` about this, below the inspection's near-parallel threshold (``PARALLEL_COS``, 0.99)
DISGUISE_COS = PARALLEL_COS - 0.01
#: the rows disguised: those with a partner at this ``|cos|`` or more (honest rows measured <= 0.475)
DISGUISE_FROM = 0.9
#: the auxiliary images' principal directions projected out of the unseen parts: those up to this share of
#: the aux energy
AUX_ENERGY = 0.999


def auto_rho() -> float:
    """The relative size of a row's unseen part for which two disguised rows of one measurement have
    ``|cos| = 1 / (1 + rho^2) = DISGUISE_COS``."""
    return (1 / DISGUISE_COS - 1) ** 0.5


def unseen(count: int, input_shape: tuple[int, ...], aux: Tensor | None, gen: torch.Generator) -> Tensor:
    """``count`` random unit directions (flattened) that images barely see: white noise through a discrete
    Laplacian twice over the last two (spatial) dimensions (a gain growing as the fourth power of the spatial
    frequency, where natural images have the least energy), then the auxiliary images' principal directions
    (up to ``AUX_ENERGY`` of their energy, at most half the dimensions) projected out."""
    h = torch.randn(count, *input_shape, generator=gen, dtype=torch.float64)
    if len(input_shape) >= 2:
        for _ in range(2):
            h = 4 * h - (h.roll(1, -1) + h.roll(-1, -1) + h.roll(1, -2) + h.roll(-1, -2))
    h = h.flatten(1)
    if aux is not None and aux.shape[0] >= 2:
        basis = aux_basis(aux)
        h = h - (h @ basis.T) @ basis
    return h / h.norm(dim=1, keepdim=True).clamp_min(1e-300)


#: the last auxiliary images' basis: one tuple (a weak reference to them, their version, the basis), read
#: and replaced whole, so that an attack in another thread never takes another's basis
_BASIS: list[tuple] = [(lambda: None, -1, None)]


def aux_basis(aux: Tensor) -> Tensor:
    """The auxiliary images' principal directions up to ``AUX_ENERGY`` of their energy, at most half the
    dimensions; the last images' basis is kept (one SVD per attack, not one per row disguised: a fitted or
    calibrated trap is built many times on the same images; an in-place change of them, which bumps the
    tensor's version, computes it again)."""
    ref, version, basis = _BASIS[0]
    if ref() is aux and version == aux._version:
        return basis
    flat = aux.flatten(1).double()
    _, s, vh = torch.linalg.svd(flat, full_matrices=False)
    energy = torch.cumsum(s ** 2, 0) / (s ** 2).sum().clamp_min(1e-300)
    basis = vh[:min(int((energy < AUX_ENERGY).sum()) + 1, flat.shape[1] // 2)]
    _BASIS[0] = (weakref.ref(aux), aux._version, basis)
    return basis


def disguise(weight: Tensor, rho: float, input_shape: tuple[int, ...], aux: Tensor | None, gen: torch.Generator) -> int:
    """Add to every row of ``weight`` (in place) that has a near-multiple in the layer (``DISGUISE_FROM``) an
    unseen part (``unseen``) of ``rho`` times the row's norm: the rows still measure what they did on images,
    and two rows of one measurement have ``|cos| ~ 1 / (1 + rho^2)``. Returns how many rows were disguised."""
    if rho <= 0:
        return 0
    _, flagged, _ = parallel_rows(weight.detach(), DISGUISE_FROM)
    rows = flagged.nonzero().flatten()
    if rows.numel() == 0:
        return 0
    w = weight.detach()[rows].double().flatten(1)
    parts = unseen(rows.numel(), input_shape, aux, gen)
    with torch.no_grad():
        weight[rows] = (w + rho * w.norm(dim=1, keepdim=True) * parts).reshape(weight[rows].shape).to(weight.dtype)
    return int(rows.numel())
