"""The leak limit across rounds: what a server reads by differencing the updates a client sent on one batch
(``inspect_model(..., leak_limit=k, history=LeakHistory())``, issue 34).

``inspect_model``'s leak limit counts the samples a server reads from one update. A server may query the
same batch several times (FedSGD on a batch that is the client's data, the threat Wen et al.'s fishing
already assumes) and subtract two updates: the red team's ``threshold_bins`` sends models whose every
hidden unit fires for every sample (no support of one update isolates anyone, the limit reads 0) and whose
classifier switches a few samples between consecutive queries, so that the difference of two updates
holds those samples alone. Measured before this module (FC-2, 64 LFW faces in [0, 1], ``leak_limit=0``):
every one of its 65 models passed and 14 faces came back exactly.

A linear layer's update is ``sum_n delta_n a_n^T``; two rounds' updates on one batch differ by
``sum_n (delta_n' a_n'^T - delta_n a_n^T)``. Where the layer's input is the same in both rounds (the first
layer: the batch itself; a hidden layer the server left alone) that is ``sum_n (delta_n' - delta_n) a_n^T``,
one update's form with the coefficients' difference, and the isolation check's count applies to it
unchanged (``isolated_samples``). Elsewhere the two rounds' terms are counted as separate samples, a read
of either (the sample's input to the layer in one of the two rounds) a read of the sample. To that
``difference_reads`` adds one test: a row of the difference from which one sample reads within
``ISOLATION_READ_ERROR`` whatever its support's size (a single update's rows are tested so only up to
``1 + ISOLATION_PEEL`` samples). A difference is computed in float32 by the client: the samples a server
switched off keep rounding-level coefficients in it, which put every sample in every row's support: on the
bins of 64 CIFAR-10 images the support tests alone found 3 samples in the differences, the row test 22
more (a server could also leave such small changes on purpose).

``LeakHistory`` remembers, per batch (keyed by its bytes and labels), every accepted round's coefficients
and inputs of the examined linear layers, and the samples read so far. The leak limit is then on the
union: what one update reads, what its difference with any remembered round reads, and what earlier rounds
gave away. Every pair with the new round is compared (the server chooses which two rounds to subtract: any
window would let it space its queries), and a batch answered ``max_rounds`` times is refused (fail closed:
raise it to keep training on that batch). At most ``max_batches`` batches are kept, the least recently
answered dropped first (a client whose loader shuffles has a new first batch every round, almost never seen
again); a dropped batch's key is kept, and a round on it is refused, never compared with nothing.

Where the layer's input is the batch itself every round, the views of the updates (each update, each
difference of two) are also met with each other (``guardfl.inspect_meets``): two bins of different
directions that share one sample meet in it, four updates combined (the red team's ``threshold_bins
directions: 4`` read 25 of 64 LFW faces exactly through a history of pairs, none since); the views are kept
with the history. What it does not bound (said in ``checks["leak_limit"]``): reads from a batch that changes
between rounds (FedAvg over a shuffled loader: nothing to difference exactly, and nothing is compared),
the classification layer and convolutions (as the one-update count), and a client that drops its history
(``inspect_leak_history=False`` in the integrations; a state restored without it is refused there).
Honest FedSGD rounds on one batch read samples too, through units that switch on or off for one sample
between rounds (FC-2, 64 centred CIFAR-10 images, lr 0.01, seeds 0-2: a limit of 0 first refuses in rounds
8, 7 and 1 with the history, and never, 7, never per update): the limit counts those as it counts the
honest model's own reads.

Cost (``bench/bench_leak_history.py``): one isolation count per remembered round and layer, 10 ms per
remembered round for FC-2 on 64 samples (0.48 s against 0.16 s with 31 remembered), and 181 kB of memory
per round (float64 coefficients and hidden inputs; the batch's own inputs once).
"""

from __future__ import annotations

import hashlib
import io
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from guardfl.errors import ConfigError
from guardfl.inspect_isolation import ISOLATION_READ_ERROR, isolated_samples, row_reads
from guardfl.inspect_meets import MEET_MAX_FLOATS, Views, frame, meet_reads, views_of

#: the rounds on one batch a history remembers by default; the next round on that batch is refused
HISTORY_MAX_ROUNDS = 256
#: the batches a history keeps by default (the least recently answered dropped first; a round on a dropped
#: batch is refused): FC-2 on 64 samples, 181 kB per remembered round
HISTORY_MAX_BATCHES = 64

#: a round's signals: layer name -> (coefficients ``delta``, batch x units; the layer's input ``a``, batch x features)
Signals = dict[str, tuple[Tensor, Tensor]]


def dominated_reads(delta: Tensor, inputs: Tensor, read_error: float = ISOLATION_READ_ERROR) -> list[int]:
    """The samples read from one row of a layer's update alone, whatever the row's support: the row's
    largest term ``|delta_n| |a_n|`` read with every other term as contamination, within ``read_error``
    of ``a_n`` (``relative_read_error``, from the inputs' Gram matrix)."""
    d = delta.detach().double()
    a = inputs.detach().reshape(inputs.shape[0], -1).double()
    if d.numel() == 0 or not bool(d.abs().max() > 0):
        return []
    gram = a @ a.T
    norms = gram.diagonal().clamp_min(0.0).sqrt()[:, None]
    top, ok = row_reads(d, gram, norms, read_error)  # a single update's rows are tested so up to 1 + ISOLATION_PEEL samples
    return sorted(set(top[ok & ((d.abs() * norms).amax(0) > 0)].tolist()))


def difference_reads(new: Signals, old: Signals) -> dict[str, list[int]]:
    """The samples a server reads from the difference of two rounds' updates of each linear layer both
    rounds examined (layer name -> samples read, sorted). Same input in both rounds: the coefficients'
    difference over that input; else the two rounds' terms side by side (a read of either is the sample's)."""
    found: dict[str, list[int]] = {}
    for name, (d1, a1) in new.items():
        if name not in old or old[name][0].shape != d1.shape:
            continue
        d0, a0 = old[name]
        n = d1.shape[0]
        if a1.shape == a0.shape and (a1 is a0 or torch.equal(a1, a0)):
            delta, inputs, owner = d1 - d0, a1, torch.arange(n)
        elif a1.shape[1:] == a0.shape[1:]:
            delta, inputs, owner = torch.cat([d1, -d0]), torch.cat([a1, a0]), torch.arange(n).repeat(2)
        else:
            continue
        read = set(isolated_samples(delta, inputs)[0]) | set(dominated_reads(delta, inputs))
        found[name] = sorted({int(owner[i]) for i in read})
    return found


def fingerprint(x: Tensor, y: Tensor) -> str:
    """The batch's key: a digest of its inputs' and labels' bytes, shapes and dtypes."""
    h = hashlib.sha256()
    for t in (x, y):
        t = t.detach().cpu().contiguous()
        h.update(f"{tuple(t.shape)}{t.dtype}".encode())
        h.update(t.numpy().tobytes() if t.dtype != torch.bfloat16 else t.float().numpy().tobytes())
    return h.hexdigest()


@dataclass
class _Batch:
    rounds: list[Signals] = field(default_factory=list)
    read: set[int] = field(default_factory=set)
    views: dict[str, Views] = field(default_factory=dict)  # per layer whose input is the same every round


def _new_views(entry: _Batch, signals: Signals) -> dict[str, tuple[Views, Tensor, Tensor]]:
    """Per layer whose input is the one its first remembered round had: this round's views (its update and
    its difference with every remembered round, ``guardfl.inspect_meets``), with the samples' norms and Gram."""
    out: dict[str, tuple[Views, Tensor, Tensor]] = {}
    for name, (d1, a1) in signals.items():
        a = a1.detach().double().cpu()
        first = next((r[name][1] for r in entry.rounds if name in r), None)
        if first is not None and not (first.shape == a.shape and torch.equal(first, a)):
            continue
        old = [r[name][0] for r in entry.rounds if name in r and r[name][0].shape == d1.shape
               and (r[name][1] is first or torch.equal(r[name][1], a))]  # only rounds over this very input
        norms, gram = frame(a1)
        d = d1.detach().double().cpu()
        out[name] = (views_of([d] + [d - d0 for d0 in old], norms), norms, gram)
    return out


def _replay_views(rounds: list[Signals]) -> dict[str, Views]:
    """The views (and the flats where they meet) a history keeps, built again from its rounds in order."""
    replay = _Batch()
    for signals in rounds:
        for name, (new, norms, gram) in _new_views(replay, signals).items():
            kept = replay.views.setdefault(name, Views())
            meet_reads(new, kept, norms, gram, max_floats=MEET_MAX_FLOATS)
            kept.extend(new)
        replay.rounds.append(signals)
    return replay.views


class LeakHistory:
    """What a client remembers of the updates it sent, per batch, for ``inspect_model(..., leak_limit=k,
    history=...)`` (see the module docstring). Keep one per client for its whole life: a new one forgets
    what earlier rounds gave away. Picklable. Only ``inspect_model`` adds to it, and only rounds it accepted
    (a refused model's update is never sent)."""

    def __init__(self, max_rounds: int = HISTORY_MAX_ROUNDS, max_batches: int = HISTORY_MAX_BATCHES) -> None:
        for field_name, value in (("max_rounds", max_rounds), ("max_batches", max_batches)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 100_000:
                raise ConfigError(f"{field_name}: must be an integer in [1, 100000], got {value!r}")
        self.max_rounds, self.max_batches = max_rounds, max_batches
        self._batches: OrderedDict[str, _Batch] = OrderedDict()  # least recently answered first
        self._dropped: set[str] = set()  # keys of batches dropped past max_batches
        self._pending: tuple[str, int, dict[str, Views]] | None = None  # the views reads() computed, for record()

    def rounds(self, x: Tensor, y: Tensor) -> int:
        """The accepted rounds remembered on this batch."""
        entry = self._batches.get(fingerprint(x, y))
        return 0 if entry is None else len(entry.rounds)

    def reads(self, x: Tensor, y: Tensor, signals: Signals) -> tuple[set[int], dict[str, Any]]:
        """The samples of this batch a server has read (earlier rounds) or would read by differencing this
        round's update with a remembered one, or where two views of the updates meet (``inspect_meets``), and a
        report (``full`` when the batch was answered ``max_rounds`` times already or its views fill
        ``MEET_MAX_FLOATS``, ``dropped`` when its rounds were dropped past ``max_batches``: the caller refuses
        either)."""
        key = fingerprint(x, y)
        entry = self._batches.get(key)
        views = _new_views(entry or _Batch(), signals)
        self._pending = (key, id(signals), {name: v for name, (v, _, _) in views.items()})
        if entry is None:
            return set(), {"rounds": 0, "read_before": 0, "read_by_differences": 0, "read_by_meets": 0,
                           "dropped": key in self._dropped}
        by_diff: set[int] = set()
        layers: dict[str, int] = {}
        for old in entry.rounds:
            for name, read in difference_reads(signals, old).items():
                by_diff.update(read)
                layers[name] = max(layers.get(name, 0), len(read))
        by_meets: set[int] = set()
        for name, (new, norms, gram) in views.items():
            by_meets |= meet_reads(new, entry.views.get(name, Views()), norms, gram, max_floats=MEET_MAX_FLOATS)
        floats = sum(v.floats() for v in entry.views.values()) + sum(v.floats() for v, _, _ in views.values())
        info = {"rounds": len(entry.rounds), "read_before": len(entry.read), "read_by_differences": len(by_diff),
                "read_by_meets": len(by_meets), "worst_pair_by_layer": layers,
                "full": len(entry.rounds) >= self.max_rounds,
                "views_full": floats > MEET_MAX_FLOATS or any(v.overflow for v, _, _ in views.values())}
        return entry.read | by_diff | by_meets, info

    def to_bytes(self) -> bytes:
        """The history as bytes (``torch.save`` of plain tensors, lists and dicts), for a client that keeps it
        outside the process between rounds (Flower's ``context.state``, a file); ``from_bytes`` reads it back."""
        plain = {"max_rounds": self.max_rounds, "max_batches": self.max_batches, "dropped": sorted(self._dropped), "batches": {
            key: {"read": sorted(entry.read), "rounds": [{name: [d, a] for name, (d, a) in r.items()} for r in entry.rounds],
                  "views": {name: [v.bases, v.members] for name, v in entry.views.items()}}
            for key, entry in self._batches.items()}}
        buffer = io.BytesIO()
        torch.save(plain, buffer)
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> "LeakHistory":
        """A history saved with ``to_bytes`` (``torch.load(weights_only=True)``: tensors and plain containers
        only); ``ConfigError`` when the bytes are not one."""
        try:
            plain = torch.load(io.BytesIO(data), weights_only=True)
            history = cls(int(plain["max_rounds"]), int(plain["max_batches"]))
            history._dropped = {str(k) for k in plain["dropped"]}
            for key, entry in plain["batches"].items():
                rounds = [{name: (d, a) for name, (d, a) in r.items()} for r in entry["rounds"]]
                if "views" in entry:
                    views = {str(name): Views(list(b), list(m)) for name, (b, m) in entry["views"].items()}
                else:  # saved before the history kept its views (2026-11-28): met again from its rounds
                    views = _replay_views(rounds)
                history._batches[str(key)] = _Batch(rounds, {int(i) for i in entry["read"]}, views)
        except ConfigError:
            raise
        except Exception as err:  # noqa: BLE001 - a damaged or foreign file: one line, never a traceback
            raise ConfigError(f"leak history: not a saved guardfl LeakHistory ({type(err).__name__}: {str(err)[:120]})") from None
        return history

    def record(self, x: Tensor, y: Tensor, signals: Signals, read: set[int]) -> None:
        """Remember an accepted round's signals and the samples read so far (its own and its differences')."""
        key = fingerprint(x, y)
        entry = self._batches.setdefault(key, _Batch())
        self._batches.move_to_end(key)
        while len(self._batches) > self.max_batches:
            self._dropped.add(self._batches.popitem(last=False)[0])
        pending = self._pending
        views = pending[2] if pending is not None and pending[:2] == (key, id(signals)) else \
            {name: v for name, (v, _, _) in _new_views(entry, signals).items()}
        self._pending = None
        for name, v in views.items():
            entry.views.setdefault(name, Views()).extend(v)
        kept: Signals = {}
        for name, (d, a) in signals.items():
            same = next((old[name][1] for old in entry.rounds[-1:] if name in old and torch.equal(old[name][1], a)), None)
            kept[name] = (d.detach().double().cpu().clone(), a.detach().double().cpu().clone() if same is None else same)
        entry.rounds.append(kept)
        entry.read |= set(read)


__all__ = ["HISTORY_MAX_BATCHES", "HISTORY_MAX_ROUNDS", "LeakHistory", "Signals", "difference_reads", "dominated_reads", "fingerprint"]
