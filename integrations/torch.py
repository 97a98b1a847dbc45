"""Plain PyTorch FL loops: ``local_update`` runs one defended FL round and returns the model update.

The pattern it packages (write it yourself if you prefer)::

    optimizer = guardfl.wrap(torch.optim.SGD(model.parameters(), lr=0.01), defense, model=model)
    for rnd in rounds:
        model.load_state_dict(global_state)
        optimizer.new_round()           # Outpost's local-iteration counter restarts every round
        for x, y in loader: ...         # train as usual
        send({k: model.state_dict()[k] - global_state[k] for k in global_state})

With the helper::

    state = ClientState()                                  # or ClientState.from_json(saved)
    for rnd in rounds:
        model.load_state_dict(global_state)
        result = local_update(model, loader, lambda p: torch.optim.SGD(p, lr=0.01), defense, epochs=1, state=state)
        send(result.delta); state = result.state           # save state.to_json() between rounds

Per-client defense state lives in ``ClientState``: the round counter, the DP accountant's history (so
epsilon is cumulative over rounds) and nothing else. Each round builds a fresh defense from the config:
unseeded defenses draw new OS entropy; a defense with an explicit ``seed`` gets a per-round seed derived
from (seed, round), so no two rounds reuse one noise stream (which would let a server cancel the noise
by differencing updates).

The round itself (protect, the local steps, the update and its fail-closed checks) is
``guardfl.integrations.round.client_round``, the loop the red team's ``simulate_client`` runs too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from torch import Tensor, nn

from guardfl.defenses import Defense
from guardfl.errors import ConfigError
from guardfl.inspect import Inspection, check_leak_limit, inspect_model
from guardfl.inspect_history import LeakHistory
from guardfl.integrations.budget import check_budget_left, check_max_rounds
from guardfl.integrations.round import (BN_BUFFERS, MakeOptimizer, check_round_args, check_round_counter, client_round,
                                        round_defense)
from guardfl.protect import soft_cross_entropy

_STATE_VERSION = 1

@dataclass
class ClientState:
    """What a client keeps between FL rounds. JSON-serialisable (``to_json`` / ``from_json``)."""

    #: FL rounds this client has completed
    rounds: int = 0
    #: local optimizer steps over all rounds
    steps: int = 0
    #: the DP accountant's state (Opacus ``accountant.state_dict()``); None without DP-SGD
    privacy: dict | None = None
    #: what the client sent, for ``inspect_leak_limit`` across rounds (``guardfl.inspect_history``): kept in
    #: memory, not in ``to_json`` (``LeakHistory.to_bytes`` saves it; the Flower integration keeps it in
    #: ``context.state``, NVIDIA FLARE's beside its state file)
    leak_history: LeakHistory | None = field(default=None, compare=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        privacy = None
        if self.privacy is not None:
            privacy = {"mechanism": self.privacy["mechanism"], "history": [list(h) for h in self.privacy["history"]]}
        return {"version": _STATE_VERSION, "rounds": self.rounds, "steps": self.steps, "privacy": privacy}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ClientState":
        """The state ``to_dict`` wrote. Strict: a missing ``version``, ``rounds`` or ``steps`` (a truncated or
        hand-edited record) or a count that is not an integer >= 0 is a ``ConfigError``, never a count of 0."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"client state: expected a mapping, got {type(data).__name__}")
        missing = [k for k in ("version", "rounds", "steps", "privacy") if k not in data]
        if missing:
            raise ConfigError(f"client state: missing {', '.join(missing)} (a truncated or foreign record); refusing "
                              "rather than counting from 0")
        if data["version"] != _STATE_VERSION:
            raise ConfigError(f"client state: version {data['version']!r} is not supported (this guardfl writes "
                              f"{_STATE_VERSION})")
        for k in ("rounds", "steps"):
            if isinstance(data[k], bool) or not isinstance(data[k], int) or data[k] < 0:
                raise ConfigError(f"client state: {k} must be an integer >= 0, got {data[k]!r}")
        privacy = data["privacy"]
        if privacy is not None:
            privacy = {"mechanism": privacy["mechanism"], "history": [tuple(h) for h in privacy["history"]]}
        return cls(rounds=data["rounds"], steps=data["steps"], privacy=privacy)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> "ClientState":
        try:
            return cls.from_dict(json.loads(text))
        except (ValueError, KeyError, TypeError) as err:
            raise ConfigError(f"client state: not a saved guardfl ClientState ({err})") from None


@dataclass
class LocalUpdate:
    """The result of one defended FL round on a client."""

    #: state-dict key -> (trained - received); what the client sends (FedAvg servers add it back)
    delta: dict[str, Tensor]
    #: the client state to keep for the next round
    state: ClientState
    num_examples: int
    steps: int
    mean_loss: float
    #: cumulative (epsilon, delta) of DP-SGD over all rounds; epsilon is inf without DP-SGD
    epsilon: float
    dp_delta: float | None
    #: ``last_stats.to_dict()`` of every local step (what each gradient defense did)
    defense_stats: list[dict] = field(default_factory=list)
    #: the verdict on the received model with ``inspect=True`` (always ok here: a model that is not
    #: ok raises ``MaliciousModelError`` before training); None without inspection
    inspection: Inspection | None = None
    #: the defended gradient of the round's one step when it took exactly one (a FedSGD client: one
    #: batch holding all its samples, ``epochs=1``): parameter name -> tensor, what a FedSGD client sends
    #: (``delta`` is ``-lr`` times it, rounded); None after several steps
    gradient: dict[str, Tensor] | None = None


def inspect_enabled(inspect: bool | str, disaggregation: bool = False, leak_limit: int | None = None) -> bool:
    """Whether to inspect (``inspect``: False, True or "strict", the same as True); ``disaggregation``
    (``inspect_disaggregation``: SEER's D-SNR check) must be a bool and ``leak_limit``
    (``inspect_leak_limit``) None or an integer >= 0; each needs inspection on."""
    if inspect is True or inspect is False:
        on = inspect
    elif inspect == "strict":
        on = True
    else:
        raise ConfigError(f"inspect: expected False, True or 'strict' (got {inspect!r})")
    if disaggregation is not True and disaggregation is not False:
        raise ConfigError(f"inspect_disaggregation: expected False or True (got {disaggregation!r})")
    if disaggregation and not on:
        raise ConfigError("inspect_disaggregation: True adds a check to the inspection, but inspect is False: "
                          "set inspect=True, or inspect_disaggregation=False")
    if leak_limit is not None:
        check_leak_limit(leak_limit, "inspect_leak_limit", "samples of the first batch")
        if not on:
            raise ConfigError("inspect_leak_limit: a limit adds a check to the inspection, but inspect is False: "
                              "set inspect=True, or inspect_leak_limit=None")
    return on


def first_batch(loader: Iterable) -> tuple[Tensor, Tensor] | None:
    """The loader's first ``(x, y)`` batch of class labels, for ``inspect_model(batch=)``; None when the
    loader is a one-shot iterator (drawing from it would lose data), empty, yields something else, or
    its first batch holds no samples (``inspect_received`` then notes in ``checks["batch"]`` that the
    batch checks were skipped)."""
    if iter(loader) is loader:
        return None
    for batch in loader:
        if (isinstance(batch, (tuple, list)) and len(batch) == 2 and all(isinstance(t, Tensor) for t in batch)
                and batch[0].dim() >= 1 and batch[1].dim() == 1 and not batch[1].is_floating_point()
                and batch[0].shape[0] == batch[1].shape[0] > 0):
            return batch[0], batch[1]
        return None
    return None


def _history_limits(keep: Any) -> dict[str, int] | None:
    """``inspect_leak_history`` parsed: None (limit each update alone), or the ``LeakHistory`` limits to keep
    (``{}``: its defaults); one ``ConfigError`` line naming the field otherwise."""
    if isinstance(keep, bool):
        return {} if keep else None
    if isinstance(keep, Mapping):
        unknown = sorted(set(map(str, keep)) - {"max_rounds", "max_batches"})
        if unknown:
            raise ConfigError(f"inspect_leak_history: unknown key(s) {unknown}; allowed: max_rounds, max_batches "
                              f"(integers in [1, 100000])")
        try:
            LeakHistory(**keep)
        except ConfigError as err:
            raise ConfigError(f"inspect_leak_history.{err}") from None
        return dict(keep)
    raise ConfigError(f"inspect_leak_history: must be true or false, or a mapping of max_rounds / max_batches (integers in "
                      f"[1, 100000]), got {keep!r}")


def leak_history_for(state: ClientState | None, leak_limit: int | None, keep: bool | Mapping[str, int] = True) -> LeakHistory | None:
    """The ``LeakHistory`` this round's inspection adds to (None: no limit, or ``keep`` False: the limit per
    update only; a mapping ``{"max_rounds": n, "max_batches": m}``: kept, with those limits, also on a history
    restored from an earlier round, so that a client may raise them mid-training). The state's own; a new one
    in a client's first round (``state`` None or 0 rounds done). Fails closed: a later round whose state has
    lost its history (``ClientState.from_json`` does not carry it) is a ``ConfigError``, never a limit that
    silently forgot what earlier rounds gave away."""
    limits = _history_limits(keep)
    if leak_limit is None or limits is None:
        return None
    if state is not None and state.leak_history is not None:
        for name, value in limits.items():
            setattr(state.leak_history, name, value)
        return state.leak_history
    if state is None or state.rounds == 0:
        return LeakHistory(**limits)
    raise ConfigError(f"inspect_leak_history: this client's state has done {state.rounds} rounds but holds no leak history (ClientState "
                      "JSON does not carry it: keep the ClientState object between rounds, or LeakHistory.to_bytes beside the JSON), "
                      "so the limit cannot count what differences with earlier updates read: refused (inspect_leak_history=False "
                      "limits each update alone)")


def inspect_received(model: nn.Module, loader: Iterable, reference: Any = None, received: Any = None, *,
                     disaggregation: bool = False, leak_limit: int | None = None,
                     history: LeakHistory | None = None) -> Inspection:
    """``inspect_model`` on the model a client received (``received``: its state dict when it is not yet
    loaded into ``model``, which is then the reference architecture), with the loader's first batch;
    ``disaggregation``: SEER's D-SNR check too (``inspect_model(..., disaggregation=True)``, train mode);
    ``leak_limit``: at most that many samples of the first batch read from the update
    (``inspect_model(..., leak_limit=)``; the honest model too; ``history``: across rounds, see
    ``leak_history_for``); raises ``MaliciousModelError`` naming the
    reasons when it is not ok, ``ConfigError`` (naming ``batch``) when the model cannot run on the
    loader's first batch. Without a usable first batch the weights alone are checked and
    ``checks["batch"]`` says why the batch checks were skipped; with ``leak_limit`` that is a
    ``ConfigError`` (the limit is on that batch: it is never skipped silently)."""
    batch = first_batch(loader)
    if batch is None and leak_limit is not None:
        raise ConfigError("inspect_leak_limit: needs the loader's first batch, and the loader is a one-shot iterator, is "
                          "empty, or its first batch is not (x, y) with one class label per sample")
    if received is None:
        result = inspect_model(model, reference, batch=batch, strict=True, disaggregation=disaggregation,
                               leak_limit=leak_limit, history=history)
    else:
        result = inspect_model(received, model if reference is None else reference, batch=batch, strict=True,
                               disaggregation=disaggregation, leak_limit=leak_limit, history=history)
    if batch is None:
        result.checks["batch"] = {"skipped": "no usable first batch: the loader is a one-shot iterator, is empty, "
                                             "or its first batch is not (x, y) with one class label per sample"}
    return result


def local_update(
    model: nn.Module,
    loader: Iterable,
    make_optimizer: MakeOptimizer,
    defense: Defense | Mapping[str, Any] | str | None = None,
    epochs: int = 1,
    *,
    state: ClientState | None = None,
    loss_fn: Callable[[Tensor, Tensor], Tensor] = soft_cross_entropy,
    num_classes: int | None = None,
    max_steps: int | None = None,
    inspect: bool | str = False,
    inspect_disaggregation: bool = False,
    inspect_leak_limit: int | None = None,
    inspect_leak_history: bool | Mapping[str, int] = True,
    max_rounds: int | None = None,
) -> LocalUpdate:
    """Train ``model`` (in place, train mode) for ``epochs`` over ``loader`` with ``defense`` and return the
    defended update.

    ``make_optimizer(params)`` builds the client's optimizer (e.g. ``lambda p: torch.optim.SGD(p, lr=0.01)``);
    it is rebuilt every round, as a Flower client would. ``defense`` is any guardfl defense or stack,
    DP-SGD and input encodings included (through ``guardfl.protect``). ``state`` is the previous round's
    ``result.state`` (None on a client's first round; required, ``ClientState()`` in the first round, when
    the defense is seeded explicitly: each round's seed is derived from the seed and ``state.rounds``, and
    without the counter every round would repeat the first round's noise). Batches are moved to the model's device.

    ``inspect=True`` (or ``"strict"``, the same) first checks the received model with
    ``guardfl.inspect_model`` (weights, and the loader's first batch in eval mode unless the loader is a
    one-shot iterator) and refuses to train a model that is not ok: ``MaliciousModelError`` naming the
    reasons, the model untouched. There is no warn-and-train mode: the update of a malicious model is
    what leaks, and a client that trained on one has nothing safe to send. The architecture is the
    client's own (the received state was loaded into ``model``, which refuses other names and shapes); the
    isolation check judges its counts against that architecture at a fresh initialisation (until
    2026-11-27 it had no reference here and judged nothing).
    ``inspect_disaggregation=True`` (with ``inspect``) adds SEER's D-SNR check (``inspect_model(...,
    disaggregation=True)``: the model in train mode, per-sample weight gradients; one backward pass per
    sample on models with batch norm); a ``ConfigError`` without ``inspect``.
    ``inspect_leak_limit=k`` (with ``inspect``) refuses any model, the honest one included, with which a
    server would read more than ``k`` samples of the loader's first batch from the update's linear layers
    (``inspect_model(..., leak_limit=k)``: an absolute limit; the isolation check alone passes the honest
    architecture's own leak, e.g. 8-27 of 64 LFW faces in [0, 1] from FC-2's first layer); a
    ``ConfigError`` without ``inspect`` or without a usable first batch. Across rounds (``inspect_leak_history``,
    default True): the samples read from this update, from its difference with every update this client sent
    on the same first batch, and those earlier rounds gave away count together (a ``LeakHistory`` kept in
    ``state``; a server that queries one batch repeatedly and differences the updates reads what no single
    update shows: ``guardfl.inspect_history``); False limits each update alone; ``{"max_rounds": n,
    "max_batches": m}`` keeps the history with those limits (a batch answered ``max_rounds`` times is refused;
    defaults 256 and 64), also on a history restored from earlier rounds.

    ``max_rounds=n`` is the client's round budget (``guardfl.integrations.budget``): once ``state`` counts
    ``n`` rounds sent, every later call raises ``RoundBudgetError`` before anything is inspected or trained,
    whatever model arrives. It bounds how many rounds a server can average to shrink a fresh-noise defense's
    noise (``guardfl redteam`` certifies for ``client.max_rounds``). It needs ``state`` (``ClientState()`` in the
    first round): without the counter every round would be the first, a ``ConfigError``.

    Fail closed: when a defense acts, every state entry that training changed must be one of the
    optimizer's parameters (defended, whatever their floating-point dtype) or a BatchNorm buffer
    (``BN_BUFFERS``, sent as trained as documented); any other changed entry (a custom buffer a forward
    pass writes, a parameter changed outside the optimizer) raises ``UndefendedUpdateError`` naming it.

    ``loss_fn(logits, targets)``: the training loss (default ``guardfl.soft_cross_entropy``, which takes class
    indices or the soft labels an input encoding makes); ``num_classes``: the classes of those soft labels
    (default: the model's output width); ``max_steps``: stop the round after this many optimizer steps.
    The result (``LocalUpdate``): ``delta`` (trained minus received, the update to send), ``state`` (keep it
    for the next round), ``epsilon`` (DP-SGD, cumulative), ``gradient`` (a one-step round), ``steps``.

    >>> import torch
    >>> from torch.utils.data import DataLoader, TensorDataset
    >>> from guardfl.integrations.torch import ClientState, local_update
    >>> model = torch.nn.Linear(4, 2)
    >>> loader = DataLoader(TensorDataset(torch.rand(8, 4), torch.randint(0, 2, (8,))), batch_size=4)
    >>> result = local_update(model, loader, lambda p: torch.optim.SGD(p, lr=0.1), {"kind": "sign"},
    ...                       state=ClientState(), max_rounds=16)
    >>> sorted(result.delta), result.state.rounds
    (['bias', 'weight'], 1)
    """
    check_round_args(epochs, max_steps, make_optimizer)
    if state is None:
        check_round_counter(defense, "state", "pass ClientState() in the first round, then each result.state")
        if check_max_rounds(max_rounds) is not None:
            raise ConfigError("state: required with max_rounds (the round budget counts the rounds in ClientState): pass "
                              "ClientState() in the first round, then each result.state")
    check_budget_left(max_rounds, state.rounds if state is not None else 0)
    on = inspect_enabled(inspect, inspect_disaggregation, inspect_leak_limit)
    history = leak_history_for(state, inspect_leak_limit if on else None, inspect_leak_history)
    inspection = (inspect_received(model, loader, disaggregation=inspect_disaggregation, leak_limit=inspect_leak_limit,
                                   history=history) if on else None)
    state = state or ClientState()
    result = client_round(model, loader, make_optimizer, defense, epochs=epochs, round_index=state.rounds,
                          privacy_state=state.privacy, loss_fn=loss_fn, num_classes=num_classes, max_steps=max_steps)
    new_state = ClientState(rounds=state.rounds + 1, steps=state.steps + result.steps, privacy=result.privacy,
                            leak_history=history or state.leak_history)
    return LocalUpdate(delta=result.delta, state=new_state, num_examples=result.examples, steps=result.steps,
                       mean_loss=result.loss_sum / max(result.examples, 1), epsilon=result.epsilon,
                       dp_delta=result.dp_delta, defense_stats=result.defense_stats, inspection=inspection,
                       gradient=result.gradient)


__all__ = ["BN_BUFFERS", "ClientState", "LocalUpdate", "MakeOptimizer", "first_batch", "inspect_received", "leak_history_for",
           "local_update", "round_defense"]

