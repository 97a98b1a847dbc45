"""Update-level defenses: defend the model delta a client sends, after local training.

Some deployments cannot touch the client's optimizer (a third-party training loop, a legacy Flower
``NumPyClient``); they can still defend what leaves the client: the delta ``new - received``. This module
is the framework-free core that the Flower mod (``GuardUpdateMod``) and the ``NumPyClient`` wrapper share.

Order of operations: optional L2 clipping of the whole delta to ``clip_norm`` (as Flower's
``fixedclipping_mod`` / ``LocalDpMod`` do), then the defense (GradPrune, GaussianNoise, LaplaceNoise or a
stack of them) on the delta tensors, then ``received + defended delta`` is sent.

What is defended, array by array (``classify``; the update fails closed):

- a returned array whose name ends with one of ``skip`` is sent as trained (by default BatchNorm's
  ``running_mean``, ``running_var`` and ``num_batches_tracked``: the optimizer-level defenses do not
  touch buffers either, and noise would make a running variance negative). Naming an array in ``skip``
  is the one way to send it undefended on purpose;
- every other floating-point array (float16, float32, float64) is defended: its delta is taken in
  float64, defended, added back to the received array and cast to the dtype the app returned (rounding a
  defended value is post-processing: it never undoes the defense). A defended array that overflows its
  dtype (float16 + noise) is refused;
- any other array (integer, boolean, complex, object: quantised weights, say) is sent only when it is
  bit for bit the array the client received (nothing of the client's data is in it). One that training
  changed, or that came back with another dtype, cannot be defended (a noise scale or a pruning rule
  means nothing on quantisation codes whose scale lives elsewhere), so the whole update is refused with
  ``UndefendedUpdateError`` naming the arrays: defend before quantising, or name them in ``skip``.

Arrays without names (a ``NumPyClient``) are named ``array0``, ``array1``, ... unless ``names`` is given, so
a changed integer buffer there (BatchNorm's ``num_batches_tracked``) is refused until ``names`` lets
``skip`` recognise it.

Refused: ``sign`` (the sign of a multi-step delta loses its scale, so the server would add a +-1 step to
every weight) and ``outpost`` (its Fisher weighting and iteration schedule are defined on gradients);
use them on the optimizer (``guardfl.wrap``). DP-SGD and input encodings act inside training
(``guardfl.protect``). Noise on an update is not DP without clipping and accounting: for local DP use
Flower's ``LocalDpMod`` (see the Flower integration for the order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from guardfl.defenses import Defense, from_config
from guardfl.defenses.base import StepContext
from guardfl.errors import ConfigError, NonFiniteGradientError, UndefendedUpdateError
from guardfl.integrations.torch import BN_BUFFERS, round_defense
from guardfl.protect import split_stages

#: defense kinds meaningful on a multi-step model delta
UPDATE_KINDS: tuple[str, ...] = ("gradprune", "gaussian", "laplace", "identity")


@dataclass
class UpdateStats:
    """What an update defense did (for logs and metrics)."""

    defended: int  # number of arrays defended
    entries: int  # entries in the defended arrays
    zeros: int  # entries that are exactly zero in the defended delta
    clip_factor: float  # factor the delta was scaled by (1.0 when not clipped)
    norm_before: float  # L2 norm of the defended part of the delta before clipping and defense
    sent_as_trained: tuple[str, ...] = ()  # arrays named in ``skip`` that training changed, sent undefended

    @property
    def zero_fraction(self) -> float:
        return self.zeros / self.entries if self.entries else 0.0


def key_mismatch(sent: Sequence[str], returned: Sequence[str]) -> str | None:
    """None when ``returned`` lists the same keys as ``sent`` in the same order; else what differs."""
    sent, returned = list(sent), list(returned)
    if sent == returned:
        return None
    missing = [k for k in sent if k not in returned]
    extra = [k for k in returned if k not in sent]
    if not missing and not extra:
        return "the same keys in another order"
    return f"missing {missing[:5]}, extra {extra[:5]}"


class UpdateDefense:
    """Clip (optional) and defend a model delta; ``__call__(received, new)`` returns what to send."""

    def __init__(
        self,
        defense: Defense | Mapping[str, Any] | str,
        *,
        clip_norm: float | None = None,
        skip: Sequence[str] = BN_BUFFERS,
    ) -> None:
        self.defense = defense if isinstance(defense, Defense) else from_config(defense)
        dp, enc, leaves = split_stages(self.defense)
        bad = [d.kind for d in (*dp, *enc, *leaves) if d.kind not in UPDATE_KINDS]
        if bad:
            raise ConfigError(
                f"defense: {', '.join(sorted(set(bad)))} cannot act on a model update; allowed here: "
                f"{', '.join(UPDATE_KINDS)} (and stacks of them). Use sign / outpost on the optimizer "
                "(guardfl.wrap) and dpsgd / mixup / instahide through guardfl.protect"
            )
        if clip_norm is not None and not (isinstance(clip_norm, (int, float)) and clip_norm > 0 and math.isfinite(clip_norm)):
            raise ConfigError(f"clip_norm: must be null or a finite number > 0 (got {clip_norm!r})")
        self.clip_norm = None if clip_norm is None else float(clip_norm)
        self.skip = tuple(skip)

    def classify(self, name: str, received: np.ndarray, new: np.ndarray) -> str:
        """What happens to one returned array: ``"skip"`` (named in ``skip``: sent as trained),
        ``"defend"`` (floating point), ``"same"`` (not floating point and bit for bit the received array:
        sent as it is) or ``"refuse"`` (not floating point and changed: the update cannot be defended)."""
        if name.endswith(self.skip):
            return "skip"
        if np.issubdtype(new.dtype, np.floating):
            return "defend"
        if new.dtype == received.dtype and np.array_equal(new, received):
            return "same"
        return "refuse"

    def __call__(
        self,
        received: Sequence[np.ndarray] | Mapping[str, np.ndarray],
        new: Sequence[np.ndarray] | Mapping[str, np.ndarray],
        names: Sequence[str] | None = None,
        *,
        round_index: int | None = None,
    ) -> tuple[list[np.ndarray], UpdateStats]:
        """``received`` (the global model) and ``new`` (after local training), same order and shapes.
        Returns the arrays to send (``received + defended delta`` in the dtype the app returned) and the
        stats; raises ``UndefendedUpdateError`` when an array cannot be defended (see the module docstring).

        ``round_index``: the client's FL round (0-based); when given, the round gets a fresh defense whose
        explicit seed, if any, is derived from (seed, round), as in ``guardfl.integrations.torch``. Without
        it this instance's streams continue from call to call; an instance built again every round with
        the same seed would repeat its first noise (the adapters pass their round counter, and
        ``GuardedNumPyClient`` refuses a seeded defense without one)."""
        if isinstance(received, Mapping):
            names = list(received) if names is None else names
            received = list(received.values())
        if isinstance(new, Mapping):
            new = list(new.values())
        received, new = [np.asarray(a) for a in received], [np.asarray(b) for b in new]
        names = list(names) if names is not None else [f"array{i}" for i in range(len(received))]
        if not (len(received) == len(new) == len(names)):
            raise ValueError(f"update: {len(new)} arrays returned for {len(received)} received ({len(names)} names)")
        for name, a, b in zip(names, received, new):
            if a.shape != b.shape:
                raise ValueError(f"update: {name} came back with shape {b.shape}, it was sent as {a.shape}")

        kinds = [self.classify(n, a, b) for n, a, b in zip(names, received, new)]
        refused = [f"{n} ({a.dtype}->{b.dtype})" if a.dtype != b.dtype else f"{n} ({b.dtype})"
                   for n, a, b, k in zip(names, received, new, kinds) if k == "refuse"]
        if refused:
            raise UndefendedUpdateError(
                f"update: {len(refused)} array(s) changed in training but are not floating point, so no defense "
                f"can act on them: {', '.join(refused[:5])}{' ...' if len(refused) > 5 else ''}; the update was not "
                "sent. Defend before quantising, or name them in skip= to send them undefended deliberately")
        picked = [i for i, k in enumerate(kinds) if k == "defend"]
        out = [np.array(b, copy=True) for b in new]  # the defended ones are rebuilt below
        deltas = [torch.from_numpy(new[i].astype(np.float64) - received[i].astype(np.float64)) for i in picked]
        bad = [names[i] for i, d in zip(picked, deltas) if not torch.isfinite(d).all()]
        if bad:
            raise NonFiniteGradientError(f"update: non-finite entries in {', '.join(bad[:5])}; the client's training diverged")
        norm = math.sqrt(sum(float(d.pow(2).sum()) for d in deltas))
        factor = 1.0
        if self.clip_norm is not None and norm > self.clip_norm:
            factor = self.clip_norm / norm
            for d in deltas:
                d.mul_(factor)
        if deltas:
            defense = self.defense if round_index is None else round_defense(self.defense, round_index)
            defense.apply_(deltas, StepContext(iteration=1, names=[names[i] for i in picked]))
        zeros = entries = 0
        overflow = []
        for i, d in zip(picked, deltas):
            zeros += int((d == 0).sum())
            entries += d.numel()
            with np.errstate(over="ignore"):
                out[i] = (received[i].astype(np.float64) + d.numpy()).astype(new[i].dtype)
            if not np.isfinite(out[i]).all():
                overflow.append(f"{names[i]} ({new[i].dtype})")
        if overflow:
            raise NonFiniteGradientError(f"update: the defended {', '.join(overflow[:5])} overflows its dtype; "
                                         "the update was not sent (send float32)")
        as_trained = tuple(n for n, a, b, k in zip(names, received, new, kinds)
                           if k == "skip" and not (a.dtype == b.dtype and np.array_equal(a, b)))
        return out, UpdateStats(len(picked), entries, zeros, factor, norm, as_trained)


__all__ = ["BN_BUFFERS", "UPDATE_KINDS", "UpdateDefense", "UpdateStats", "key_mismatch"]
