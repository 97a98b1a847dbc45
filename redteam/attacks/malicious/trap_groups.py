"""Trap weights whose bins hold several rows with their own classifier columns (``trap_weights columns: k``):
the construction that adapts to the pairwise isolation tests and to the shared-columns check at once.

A chain of ``trap_weights`` gives every row one classifier column, so each row's coefficient per sample is
the same and the difference of two adjacent rows holds one bin's samples. That shared column is what the
shared-columns check refuses, and the pairwise isolation tests count every such difference. Here each cut
of a chain's measurement is held by ``k`` rows (same direction, same cut, each its own scale), and each of
those rows gets its own classifier column: a random rotation of the chain's ``k`` orthogonal random basis
columns ``u_1 .. u_k`` of the honest columns' mean norm (the columns of one cut orthogonal). No two rows' coefficients are proportional
(every pairwise test and the shared-columns check see nothing), but the server knows the combinations:
the ``k`` rows of cut ``j`` give ``C_j M_j``, where row ``l`` of ``M_j`` is ``sum_n (u_l . e_n) [x_n, 1]``
over the samples above the cut (``e_n`` their logits' gradient), so ``M_j = C_j^-1 G_j``; the difference of
adjacent cuts' ``M`` holds the bin's samples, and a sample alone in its bin is read exactly from the
component with the largest bias difference. The top cut holds one row (its other rows stay as they
were): a top cut that holds one sample gives ``k`` rows with parallel coefficients, which the
shared-columns check refuses; one row reads it from its own update, and the bin under it from that row's
combination of the cut below. Measured (FC-2, 64 LFW faces in [0, 1], whole layer, 2
chains, 2026-11-28): ``k = 2`` read 20 faces exactly and passed every check of the inspection before the
group test (``guardfl.inspect_groups``), which now counts what combinations of a group's rows read. Ours.

Only without a normalisation between the layer and its ReLU (``trap_weights.refuses`` says so otherwise);
the left-over rows of a whole layer never fire, as in ``trap_weights``.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor

from guardfl.redteam.attacks.malicious.trap_chain import Trap, chain_draw
from guardfl.redteam.attacks.malicious.trap_cuts import cuts_for


def group_columns(second_weight: Tensor, rows: Tensor, basis: Tensor, gen: torch.Generator) -> Tensor:
    """Write each of ``rows`` (cuts x k) its own classifier column, a random rotation of ``basis`` (k x
    classes, orthogonal rows of one norm), into ``second_weight`` (in place): the columns of one cut are
    orthogonal, so that no two units of the same support have parallel coefficients (the shared-columns
    check) and the cut's system is well conditioned. Returns each cut's combinations as sent (cuts x k x
    k, the written float columns solved against the basis)."""
    cuts, k = rows.shape
    mixes = []
    for j in range(cuts):
        rotation = torch.linalg.qr(torch.randn(k, k, generator=gen, dtype=torch.float64))[0]
        cols = rotation @ basis  # orthonormal basis rows: the cut's columns orthogonal, none near another
        used = rows[j][:1] if j == cuts - 1 else rows[j]  # the top cut: one row (``craft_groups``)
        second_weight[:, used] = cols[:len(used)].T.to(second_weight.dtype)
        sent = second_weight[:, rows[j]].T.double()
        mixes.append(torch.linalg.lstsq(basis.T, sent.T).solution.T)
    return torch.stack(mixes)


def craft_groups(model, layers, aux: Tensor | None, chains: int, columns: int, input_range: tuple[float, float],
                 gen: torch.Generator, rows: int | None, samples: int, boost: float, cuts: str) -> Trap:
    """The trapped model (a deep copy): ``chains`` chains of cuts (``rows`` per chain at the top or the
    middle; None: the whole layer, ``U // (chains columns)`` cuts), each cut held by ``columns`` rows with
    their own columns (see the module docstring). ``Trap.chains``: per chain the rows, cuts x columns in
    cut-off order; ``Trap.mixes``: per chain each cut's combinations."""
    sent = copy.deepcopy(model)
    modules = dict(sent.named_modules())
    first, second = modules[layers.first_name], modules[layers.second_name]
    units, d = first.out_features, first.in_features
    per_chain = units // (chains * columns)
    k = per_chain if rows is None else min(rows, per_chain)
    order = torch.randperm(units, generator=gen)
    honest = second.weight.detach().double().norm(dim=0).mean().clamp_min(1e-3)
    chain_rows, mixes = [], []
    with torch.no_grad():
        if rows is None:
            first.weight.zero_()
            first.bias.fill_(-1.0)  # left-over rows never fire
        for c in range(chains):
            m, _ = chain_draw(d, k, rows, cuts, boost, gen)
            scale = torch.rand(k, columns, generator=gen, dtype=torch.float64) * 1.5 + 0.5
            if rows is not None and cuts == "middle":
                scale = scale / boost
            cut = cuts_for(None if aux is None else aux.flatten(1).double() @ m, k, rows, cuts, samples, input_range, m)
            chain = order[c * k * columns:(c + 1) * k * columns].reshape(k, columns)
            used = chain.flatten()[:-(columns - 1)]  # the top cut holds one row: the others stay as they were
            first.weight[used] = (scale.reshape(-1, 1) * m[None, :])[:len(used)].to(first.weight.dtype)
            first.bias[used] = (-scale * cut[:, None]).reshape(-1)[:len(used)].to(first.bias.dtype)
            basis = torch.linalg.qr(torch.randn(second.out_features, columns, generator=gen, dtype=torch.float64))[0].T
            basis = basis * boost * honest
            mixes.append(group_columns(second.weight, chain, basis, gen))
            chain_rows.append(chain)
    return Trap(sent, chain_rows, f"{layers.first_name}.weight", f"{layers.first_name}.bias", mixes=mixes)


def group_bins(weight: Tensor, bias: Tensor, rows: Tensor, mixes: Tensor) -> tuple[Tensor, Tensor]:
    """One chain's bins (cuts x d and cuts, in cut-off order) from the update of its rows (cuts x k; the top
    cut's first row only): each lower cut's ``M = C^-1 G``; adjacent differences, of each the component
    with the largest bias difference; below the top, the top row's own combination of the cut below minus
    its update; the top row as it is."""
    g = torch.cat([weight[rows.flatten()].flatten(1), bias[rows.flatten()][:, None]], 1).double()
    g = g.reshape(rows.shape[0], rows.shape[1], -1)
    top = g[-1, 0]
    if rows.shape[0] == 1:
        return top[None, :-1], top[-1:]
    m = torch.linalg.solve(mixes[:-1], g[:-1])  # cuts - 1 x k x (d + 1)
    diff = m[:-1] - m[1:]
    best = diff[torch.arange(diff.shape[0]), diff[:, :, -1].abs().argmax(1)]
    below = mixes[-1, 0] @ m[-1] - top  # the top row's column: the bin under the top cut
    bins = torch.cat([best, below[None], top[None]])
    return bins[:, :-1], bins[:, -1]


__all__ = ["craft_groups", "group_bins", "group_columns"]
