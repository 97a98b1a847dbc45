"""Trap weights whose bins hold several rows with their own classifier columns (``trap_weights columns: k``):
the construction that adapts to the pairwise isolation tests and to the shared-columns check at once.

A chain of ``trap_weights`` gives every row one classifier column, so each row's coefficient per sample is
the same and the difference of two adjacent rows holds one bin's samples. That shared column is what the
shared-columns check refuses, and the pairwise isolation tests count every such difference. Here each cut
of a chain's measurement is held by ``k`` rows (same direction, same cut, each its own scale), and each of
those rows gets its own classifier column: a random rotation of the chain's ``k`` orthogonal random basis
columns ``u_1 .. u_k`` of the honest columns' mean norm (the columns of one cut orthogonal). No two rows'
coefficients are proportional (every pairwise test and the shared-columns check see nothing), but the
server knows the combinations: the ``k`` rows of cut ``j`` give ``C_j M_j``, where row ``l`` of ``M_j`` is
``sum_n (u_l . e_n) [x_n, 1]`` over the samples above the cut (``e_n`` their logits' gradient), so ``M_j =
C_j^-1 G_j``; the difference of adjacent cuts' ``M`` holds the bin's samples, and a sample alone in its bin
is read exactly from the component with the largest bias difference.

The top cuts hold one row each (the top one, and those the attacker's measurements expect fewer than
``SINGLE_BELOW`` samples above; their other rows stay as they were): a group that holds one sample alone,
or two of one label, gives ``k`` units with parallel coefficients, which the shared-columns check refuses
whatever their columns; a single row reads a sample alone from its own update, and the bin under the first
of them comes from that row's combination of the cut below.

Measured (FC-2, 64 LFW faces in [0, 1], whole layer, 2 chains, 2026-11-27): ``k = 2`` read 20 faces
exactly and passed every check of the inspection before its group test (``guardfl.inspect_groups``),
which now counts what combinations of two groups of rows read; since then ``k = 4`` still passes on these
uncentred faces (within chance of the honest FC-2's own count) and reads 11, and on centred inputs every
whole-layer grouped trap is refused (docs/research/malicious-server.md section 12). Ours.

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
    """Write each of ``rows`` (cuts x k; -1: no row) its own classifier column, a random rotation of
    ``basis`` (k x classes, orthogonal rows of one norm), into ``second_weight`` (in place): the columns of
    one cut are orthogonal, so that no two units of the same support have parallel coefficients (the
    shared-columns check) and the cut's system is well conditioned. Returns each cut's combinations as
    sent (cuts x k x k, the written float columns solved against the basis; a missing row's the rotation's)."""
    mixes = []
    for cut in rows:
        rotation = torch.linalg.qr(torch.randn(len(cut), len(cut), generator=gen, dtype=torch.float64))[0]
        used, sent = cut >= 0, rotation @ basis
        second_weight[:, cut[used]] = sent[used].T.to(second_weight.dtype)
        sent[used] = second_weight[:, cut[used]].T.double()  # as rounded in the sent weights
        mixes.append(torch.linalg.lstsq(basis.T, sent.T).solution.T)
    return torch.stack(mixes)


#: a cut of a whole-layer trap that the attacker's measurements expect fewer than this many samples above is
#: held by one row (``single_cuts``): a group holding one sample, or two of one label (whose logit gradients are nearly
#: parallel), gives units with parallel coefficients over the batch. Measured (FC-2, 64 LFW faces, 3 rows
#: per cut): at 2, groups of two faces of one label were refused by the shared-columns check (8 units)
SINGLE_BELOW = 4


def single_cuts(cut: Tensor, measure: Tensor | None, samples: int) -> Tensor:
    """The cuts held by one row: the top one, and every cut the attacker's measurements expect fewer than
    ``SINGLE_BELOW`` of ``samples`` above (a group of rows holding one sample alone, or two of one label,
    gives units with parallel coefficients, which the shared-columns check refuses whatever their columns).
    A suffix of the cuts, in cut-off order."""
    single = torch.zeros(len(cut), dtype=torch.bool)
    single[-1] = True
    if measure is not None and measure.numel() >= 2:
        single |= (measure.double()[:, None] > cut[None, :]).double().mean(0) * samples < SINGLE_BELOW
    return single


def craft_groups(model, layers, aux: Tensor | None, chains: int, columns: int, input_range: tuple[float, float],
                 gen: torch.Generator, rows: int | None, samples: int, boost: float, cuts: str) -> Trap:
    """The trapped model (a deep copy): ``chains`` chains of cuts (``rows`` per chain at the top or the
    middle; None: the whole layer, ``U // (chains columns)`` cuts), each cut held by ``columns`` rows with
    their own columns (see the module docstring), the top cuts by one (``single_cuts``). ``Trap.chains``:
    per chain the rows, cuts x columns in cut-off order, -1 where a cut holds fewer; ``Trap.mixes``: per
    chain each cut's combinations."""
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
            measure = None if aux is None else aux.flatten(1).double() @ m
            cut = cuts_for(measure, k, rows, cuts, samples, input_range, m)
            chain = order[c * k * columns:(c + 1) * k * columns].reshape(k, columns).clone()
            # those rows stay as they were; a small trap's cuts are all near the top (a sample or so per bin,
            # its groups hold few samples by design): only its top cut is single
            chain[single_cuts(cut, measure if rows is None else None, samples), 1:] = -1
            used = chain >= 0
            first.weight[chain[used]] = (scale[used][:, None] * m[None, :]).to(first.weight.dtype)
            first.bias[chain[used]] = (-scale * cut[:, None])[used].to(first.bias.dtype)
            basis = torch.linalg.qr(torch.randn(second.out_features, columns, generator=gen, dtype=torch.float64))[0].T
            basis = basis * boost * honest
            mixes.append(group_columns(second.weight, chain, basis, gen))
            chain_rows.append(chain)
    return Trap(sent, chain_rows, f"{layers.first_name}.weight", f"{layers.first_name}.bias", mixes=mixes)


def group_bins(weight: Tensor, bias: Tensor, rows: Tensor, mixes: Tensor) -> tuple[Tensor, Tensor]:
    """One chain's bins (in cut-off order, d and 1 each) from the update of its rows (cuts x k, -1 where a
    cut holds one row: a suffix): each cut of k rows gives ``M = C^-1 G``; adjacent differences, of each
    the component with the largest bias difference; under the first single-row cut, that row's own
    combination of the cut below minus its update; every single row as it is (a bin when it holds one
    sample)."""
    full = int((rows[:, 1:] >= 0).all(1).sum()) if rows.shape[1] > 1 else 0
    first = rows[:, 0]
    g1 = torch.cat([weight[first].flatten(1), bias[first][:, None]], 1).double()  # each cut's first row
    parts = []
    if full:
        block = rows[:full].flatten()
        g = torch.cat([weight[block].flatten(1), bias[block][:, None]], 1).double().reshape(full, rows.shape[1], -1)
        m = torch.linalg.solve(mixes[:full], g)  # full x k x (d + 1)
        diff = m[:-1] - m[1:]
        parts.append(diff[torch.arange(diff.shape[0]), diff[:, :, -1].abs().argmax(1)])
        if full < len(rows):
            parts.append((mixes[full, 0] @ m[-1] - g1[full])[None])
        else:
            parts.append(m[-1][m[-1][:, -1].abs().argmax()][None])
    parts.append(g1[full:])
    bins = torch.cat(parts)
    return bins[:, :-1], bins[:, -1]


__all__ = ["SINGLE_BELOW", "craft_groups", "group_bins", "group_columns", "single_cuts"]
