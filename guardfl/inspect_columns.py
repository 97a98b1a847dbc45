"""Shared columns: hidden units that the layer reading them gives one coefficient per sample (``inspect_model``,
with the client's batch).

Every trap of Robbing the Fed's kind reads a sample from the difference of two rows' updates. Row ``j``'s
update is ``sum_n D_nj x_n`` over the samples that fire it, where ``D_nj`` is the loss's derivative with
respect to unit ``j``'s output for sample ``n``: the next layer's column ``j`` times that layer's error,
``D = delta @ W``. The difference of rows ``i`` and ``j`` cancels the samples both hold only when
``D_ni = c D_nj`` for every sample: the two units' columns of ``D`` are parallel over the batch. So the red
team's traps give every row of a chain one classifier column (``trap_chain.columns``). This check computes
``D`` on the client's batch for every ``nn.Linear`` that reads hidden units (not the model's input) and
refuses a model in which two units' columns of ``D`` have ``|cos| >= COLUMN_COS``.

Why on the batch and not on the weights: a server can make the weight columns differ where the batch's
error does not look. Softmax cross-entropy's error ``p - y`` sums to zero over the classes, so columns
``v + c_i 1`` give every unit the same coefficients while their weight cosines are anything; the entries of
a class that the batch's probabilities give ~0, or of the next layer's units that never fire, are as
invisible. ``D`` is what the trap needs equal, so it is what is compared.

Benign values (``bench/bench_inspect.py``): ``D``'s columns for the classifier live in the span of the
batch's errors (at most ``classes - 1`` dimensions), where random columns are near-parallel by chance:
about ``1 - 8e-3`` for 4096 columns in 9 dimensions; measured up to 0.998 over 171 benign models (default
inits, trained, FedAvg rounds, dead units; IID and non-IID CIFAR-10 batches of 32) and 0.9988 for a trained
LeNet's 768 features on a batch of 64. Class fishing has them too: with its other classifier rows scaled
down, every feature's gradient runs through the target class and every unit's coefficients are parallel. Layers whose error spans fewer than ``COLUMN_MIN_DIMENSIONS`` effective
dimensions over the batch (few classes, tiny batches, a batch of mostly one label) are not judged: in one or
two dimensions every column is near-parallel to another (a non-IID batch of 32, 28 of one label: 1.2
dimensions, benign cosines up to 0.999999). A client whose batches are that skewed gets no judgement from
this check, and ``checks`` says so.

What it cannot do (and the red team's ``trap_weights column_noise: auto`` shows): the check forces a
chain's coefficients apart by about ``sqrt(2 (1 - COLUMN_COS))`` ~ 1.4% per sample, no more: a benign
layer's chance parallelism sets how strict it can be. A trap whose rows share few samples (a few rows at
the top of its measurement) pays little for that; one whose rows share half the batch (the whole layer,
the median trap) pays more (docs/research/malicious-server.md, section 9). Traps of single rows share no column and
pass it untouched; disguised fishing passes with its other rows scaled by 0.05 instead of 3e-3.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from guardfl.inspect_rows import PARALLEL_MAX_ROWS, parallel_rows

#: two units whose coefficients over the batch have ``|cos|`` at or above this share a column (a trap's
#: chain: 1 without noise); benign classifier inputs measured <= 0.9988 (bench_inspect.py)
COLUMN_COS = 0.9999
#: layers whose error over the batch spans fewer effective dimensions (``dimensions``) are not judged: in
#: few dimensions random columns are near-parallel by chance (measured: a batch of 32 with 28 of one label
#: gives 1.2-1.7 dimensions and benign cosines up to 0.999999; IID batches of 32 CIFAR-10 images 3.4-6.9,
#: benign cosines <= 0.9973; 64 LFW faces of 10 people 8.9)
COLUMN_MIN_DIMENSIONS = 5.0


def coefficients(delta: Tensor, weight: Tensor) -> Tensor:
    """Each sample's derivative of the loss with respect to each input unit of a linear layer, ``delta @
    weight`` (batch x inputs, float64): ``delta`` the derivatives with respect to its outputs."""
    return delta.double() @ weight.detach().double().cpu()


def dimensions(delta: Tensor) -> float:
    """The effective number of dimensions a layer's error spans over the batch (batch x outputs): the
    participation ratio ``(sum s^2)^2 / sum s^4`` of its singular values ``s`` (the rank for equal ones; a
    direction the batch barely varies along counts for little). Computed on the error, which the server's
    weights do not shape, not on the coefficients, which they do."""
    s2 = torch.linalg.svdvals(delta.double()).pow(2)
    return float(s2.sum() ** 2 / s2.pow(2).sum()) if float(s2.sum()) > 0 else 0.0


def shared_columns(coeffs: Tensor, threshold: float = COLUMN_COS) -> tuple[float, Tensor, dict[str, int]]:
    """The largest ``|cos|`` between two non-zero columns of ``coeffs`` (batch x units), a mask of the units
    that have a partner at ``threshold`` or more, and ``info``: ``pairs``, ``screened`` and ``capped`` as
    ``parallel_rows`` reports them."""
    return parallel_rows(coeffs.T, threshold)


def check(layers: list[tuple[str, Tensor, Tensor]]) -> tuple[list[str], dict[str, Any]]:
    """The check on ``(name, delta, weight)`` of each linear layer that reads hidden units: reasons and
    ``checks["shared_columns"]`` (per layer ``max_cos``, ``units`` flagged, ``dimensions``, ``judged: False``
    below ``COLUMN_MIN_DIMENSIONS``; ``not_examined`` with why; ``max_cos`` over the judged layers)."""
    reasons: list[str] = []
    found: dict[str, Any] = {"max_cos": 0.0, "layers": {}, "rule": (f"|cos| >= {COLUMN_COS:g} over the batch, judged where the "
                                                                    f"error spans >= {COLUMN_MIN_DIMENSIONS:g} dimensions")}
    skipped: dict[str, str] = {}
    for name, delta, weight in layers:
        if weight.shape[1] > PARALLEL_MAX_ROWS:
            skipped[name] = f"more than {PARALLEL_MAX_ROWS} input units"
            continue
        top, flagged, info = shared_columns(coefficients(delta, weight))
        top = min(top, 1.0)  # float32 unit columns: a parallel pair can read 1 + 1e-7
        dims = dimensions(delta)
        found["layers"][name] = {"max_cos": top, "units": int(flagged.sum()), "dimensions": round(dims, 2), **info}
        if dims < COLUMN_MIN_DIMENSIONS:
            found["layers"][name]["judged"] = False
            continue
        found["max_cos"] = max(found["max_cos"], top)
        if flagged.any():
            some = "at least " if info["capped"] else ""
            reasons.append(f"shared columns: layer '{name}' gives {some}{int(flagged.sum())} of its {weight.shape[1]} input units "
                           f"the same coefficient per sample over the batch (|cos| up to {top:.6f} >= {COLUMN_COS:g}): "
                           "the rows feeding two such units differ by the samples only one of them holds, which is how a "
                           "trap's bins read single samples")
    if skipped:
        found["not_examined"] = skipped
    if not layers:
        found["skipped"] = "no nn.Linear layer that reads hidden units ran on the batch (nothing to compare)"
    return reasons, found
