"""Near-parallel rows: a hidden layer whose rows repeat one measurement direction (``inspect_model``).

Robbing the Fed's imprint is a layer of rows that all measure the input along one direction; the
inspection's rank-one and duplicate-row checks see that only when most of a layer does it. The trap
constructions of the red team (``trap_weights``: the bins written into a few rows, or into every row of
the honest layer in two chains, each row scaled or with a tiny random part) keep the layer full rank and
no row equal to another, and pass those checks. What they cannot avoid while they measure one direction is
that a chain's rows are (near) multiples of each other: ``|cos(w_i, w_j)|`` near 1.

``parallel_rows`` measures the largest absolute cosine between two non-zero rows of a weight and marks
every row that has a partner at ``PARALLEL_COS`` or more. Benign layers (``bench/bench_inspect.py``, 171
models): hidden layers (every 2-D weight but the classifier) at most 0.475 (FC-2 with BatchNorm / LayerNorm
/ GroupNorm trained 5 epochs; default initialisations <= 0.09); classification layers reach 0.93 (a LeNet
trained at lr 0.1 whose rarely predicted classes' rows are pushed the same way), so the classifier is not
judged (class fishing has its own checks). Random rows in few dimensions are near-parallel by chance
(64 rows in 8 dimensions), so layers of fewer than ``PARALLEL_MIN_COLS`` inputs are not judged either.

What it cannot do (and the red team's ``trap_weights disguise`` shows): a row's direction is compared in
weight space. A server that adds to each trapped row a component the inputs do not see (high spatial
frequencies, outside the span of natural images) keeps the measurement and lowers the cosine at will:
rows ``m + rho h_i`` with independent unit ``h_i`` have cosine ``1 / (1 + rho^2)``. The same comparison made
on the client's batch (the correlation of the rows' pre-activations over the batch) is no robust
replacement: natural images' few dominant principal components make benign rows' pre-activations strongly
correlated (measured up to 0.90 at FC-2's default init and 0.96 trained, CIFAR-10 batch of 32), against
0.995 for the disguised trap's rows, a margin the attacker moves by its ``rho`` (docs/research/malicious-server.md,
section 7).
"""

from __future__ import annotations

import torch
from torch import Tensor

#: two non-zero rows of a hidden layer with ``|cos|`` at or above this are near multiples of each other: one
#: measurement direction repeated (trap chains: 1 - 1e-10 with a 1e-5 random part); benign hidden layers
#: measured <= 0.475 (bench_inspect.py, 171 models)
PARALLEL_COS = 0.99
#: layers with fewer inputs are not judged: random rows in few dimensions are near-parallel by chance
#: (for ``d`` inputs the largest chance ``|cos|`` over ``R`` rows is about ``sqrt(4 ln R / d)``: 0.5 for 4096 rows
#: of 64 inputs)
PARALLEL_MIN_COLS = 64
#: layers with more rows are named as not examined (the comparison is rows x rows)
PARALLEL_MAX_ROWS = 8192
#: layers up to this many elements are compared exactly (float32 unit rows); larger ones are first screened
#: in a fixed-seed random projection of ``PROJECTION_DIM`` dimensions and the screened pairs compared exactly
EXACT_ELEMENTS = 2**24
PROJECTION_DIM = 256
#: the screen's margin below ``PARALLEL_COS``: a projection to 256 dimensions moves a cosine near 0.99 by
#: about (1 - c^2) / 16 ~ 1e-3, so a margin of 0.05 misses no pair
SCREEN_MARGIN = 0.05
#: the most screened pairs compared exactly (more: the first ones, the count is reported, and ``inspect_model``
#: refuses a layer with more that is not already flagged: rows just under the threshold could fill the
#: screen ahead of a trap's)
MAX_CANDIDATES = 20_000
_CHUNK = 2**22


def _scaled(rows: Tensor) -> Tensor:
    """Rows (float64) over their largest |entry|: no overflow or underflow in their norms."""
    rows = rows.double()
    return rows / rows.abs().amax(dim=1, keepdim=True).clamp_min(1e-300)


def _projection(cols: int, device: torch.device) -> Tensor:
    """``cols`` x ``PROJECTION_DIM`` fixed-seed Gaussian directions (float32, drawn in chunks; the caller's RNG
    untouched)."""
    g = torch.Generator().manual_seed(0)
    step = _CHUNK // PROJECTION_DIM
    return torch.cat([torch.randn(min(step, cols - j), PROJECTION_DIM, generator=g) for j in range(0, cols, step)]).to(device)


def _unit_rows(w: Tensor, proj: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Each row over its norm (float32; read in chunks), and which rows are non-zero; with ``proj``, each row
    projected on its directions first."""
    out, keep = [], []
    step = max(1, _CHUNK // max(1, w.shape[1]))
    for i in range(0, w.shape[0], step):
        c = _scaled(w[i:i + step])
        keep.append(c.abs().amax(dim=1) > 0)
        p = c if proj is None else c.float() @ proj
        out.append((p / p.norm(dim=1, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny)).float())
    return torch.cat(out), torch.cat(keep)


def _pairs_above(u: Tensor, keep: Tensor, level: float) -> tuple[float, Tensor, Tensor, int]:
    """The largest ``|u_i . u_j|`` (i != j, both kept), the rows with a partner at or above ``level``, the first
    ``MAX_CANDIDATES`` such pairs (i < j) and how many there are (memory stays bounded when every row is
    parallel to every other: a hostile layer of repeated rows)."""
    top, pairs, count, kept = 0.0, [], 0, 0
    rows_hit = torch.zeros(u.shape[0], dtype=torch.bool, device=u.device)
    step = max(1, _CHUNK // max(1, u.shape[0]))
    idx = torch.arange(u.shape[0], device=u.device)
    for i in range(0, u.shape[0], step):
        g = (u[i:i + step] @ u.T).abs()
        rows = idx[i:i + step]
        g[~keep[rows]] = 0
        g[:, ~keep] = 0
        g[torch.arange(len(rows)), rows] = 0  # a row with itself
        top = max(top, float(g.max()) if g.numel() else 0.0)
        hit = g >= level
        rows_hit[rows] |= hit.any(1)
        hit = hit.nonzero()
        hit = hit[rows[hit[:, 0]] < hit[:, 1]]
        count += int(hit.shape[0])
        if kept < MAX_CANDIDATES:
            pairs.append(torch.stack([rows[hit[:MAX_CANDIDATES - kept, 0]], hit[:MAX_CANDIDATES - kept, 1]], dim=1))
            kept += int(pairs[-1].shape[0])
    found = torch.cat(pairs) if pairs else torch.zeros(0, 2, dtype=torch.long)
    return top, rows_hit, found, count


def parallel_rows(weight: Tensor, threshold: float = PARALLEL_COS) -> tuple[float, Tensor, dict[str, int]]:
    """The largest ``|cos|`` between two non-zero rows of a 2-D ``weight``, and a mask of the rows that have a
    partner at ``threshold`` or more (see the module docstring). Exact up to ``EXACT_ELEMENTS``; larger
    layers are screened in a random projection and the screened pairs compared exactly (the largest value
    is then exact where it is at or above the screen, an estimate below it). ``info``: ``pairs`` (row pairs
    at the threshold), ``screened`` (1 when projected) and ``capped`` (1 when more than ``MAX_CANDIDATES``
    pairs were screened: the first ones were compared, and the rows marked are those)."""
    w = weight.detach().reshape(weight.shape[0], -1)
    rows = w.shape[0]
    info = {"pairs": 0, "screened": 0, "capped": 0}
    if rows < 2 or w.shape[1] == 0:
        return 0.0, torch.zeros(rows, dtype=torch.bool), info
    if w.numel() <= EXACT_ELEMENTS:
        u, keep = _unit_rows(w)
        top, flagged, _, info["pairs"] = _pairs_above(u, keep, threshold)
        return top, flagged.cpu(), info
    info["screened"] = 1
    p, keep = _unit_rows(w, _projection(w.shape[1], w.device))
    top, _, pairs, count = _pairs_above(p, keep, threshold - SCREEN_MARGIN)
    info["capped"] = int(count > MAX_CANDIDATES)
    flagged = torch.zeros(rows, dtype=torch.bool)
    if pairs.shape[0]:
        exact = torch.cat([_exact_cos(w, block) for block in pairs.split(1024)])
        top = float(exact.max()) if float(exact.max()) >= threshold - SCREEN_MARGIN else top
        pairs = pairs[exact >= threshold]
        flagged[pairs.flatten().cpu()] = True
    info["pairs"] = int(pairs.shape[0])
    return top, flagged, info


def _exact_cos(w: Tensor, pairs: Tensor) -> Tensor:
    a, b = _scaled(w[pairs[:, 0]]), _scaled(w[pairs[:, 1]])
    return ((a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1)).clamp_min(1e-300)).abs().cpu()
