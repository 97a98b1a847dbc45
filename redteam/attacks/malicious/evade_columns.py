"""The least disguise that passes the client's shared-columns check, calibrated on the attacker's own data
(``trap_weights column_noise: auto``, ``fishing disguise: true``).

``inspect_model`` refuses a model in which two hidden units get parallel coefficients per sample over the
client's batch (``guardfl.inspect_columns``, ``|cos| >= COLUMN_COS``). Two constructions of the red team
have them by design: a trap chain's rows share one classifier column (so that adjacent rows' updates cancel
the samples both hold), and class fishing's classifier sends the features' gradient through its target class
alone (so that every unit's coefficient is the target's error times one weight). The server has read that
check and runs it itself, on a batch as large as the client's: its auxiliary images (their labels where they
cover half the classes or more, else the classes in turn), or without them uniform noise in the input range
(the coefficients are the error times the weights: the labels shape them, the images little). It tries its
disguise's levels in turn and sends the first model whose largest cosine there leaves ``MARGIN`` times the
check's distance from 1 (the client's batch is not the one measured). What the disguise costs: for a trap,
exactness in proportion to the samples two rows share (docs/research/malicious-server.md, section 9); for fishing,
the other classes' share of the gradient it inverts.
"""

from __future__ import annotations

from typing import Callable, Sequence, TypeVar

import torch
from torch import Tensor, nn

from guardfl.inspect import inspect_model
from guardfl.inspect_columns import COLUMN_COS
from guardfl.redteam.attacks.setting import Setting
from guardfl.redteam.auxdata import AuxData

#: the calibration batch's largest cosine must sit this many times the check's distance below 1
MARGIN = 2.0

T = TypeVar("T")


def column_cos(model: nn.Module, x: Tensor, y: Tensor) -> float:
    """The shared-columns check's largest cosine for ``model`` on the batch ``(x, y)`` (guardfl's own check; 0
    where it does not judge)."""
    return float(inspect_model(model, batch=(x, y)).checks.get("shared_columns", {}).get("max_cos", 0.0))


def calibration_batch(aux: AuxData | None, setting: Setting) -> tuple[Tensor, Tensor, str]:
    """The batch, as large as the client's, that the server runs the check on (see the module docstring) and
    what it is, in words."""
    batch, classes = setting.num_samples, setting.num_classes
    if aux is not None and len(aux.images) >= 2:
        x, y = aux.images[:batch], aux.labels[:batch].long()
        if int(y.unique().numel()) >= max(2, classes // 2) and int(y.max()) < classes:
            return x, y, f"{len(x)} auxiliary samples"
        return x, torch.arange(len(x)) % classes, f"{len(x)} auxiliary samples, the classes in turn"
    g = torch.Generator().manual_seed(0)  # the server's own fixed draw, not the attack's randomness
    lo, hi = setting.input_range
    x = torch.rand(batch, *setting.input_shape, generator=g) * (hi - lo) + lo
    return x, torch.arange(batch) % classes, f"{batch} uniform noise inputs (no auxiliary data)"


def least_passing(build: Callable[[float], T], module_of: Callable[[T], nn.Module], levels: Sequence[float],
                  gen: torch.Generator | None, x: Tensor, y: Tensor, what: str) -> tuple[T, float, str]:
    """``build(level)`` for the first of ``levels`` whose model passes the check on ``(x, y)`` with ``MARGIN``
    (each try from the same state of ``gen``, so the model sent is the one measured), its level and the
    certificate's line; the last level, said so, when none passes."""
    goal = 1.0 - MARGIN * (1.0 - COLUMN_COS)
    state = None if gen is None else gen.get_state()
    for level in levels:
        if state is not None:
            gen.set_state(state)
        made = build(level)
        top = column_cos(module_of(made), x, y)
        if top <= goal:
            return made, level, f"{level:g} (auto: shared-columns cosine {top:.6f} on {what})"
    return made, level, f"{level:g} (auto: none passed; shared-columns cosine {top:.6f} on {what})"
