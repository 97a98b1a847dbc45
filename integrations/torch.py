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
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from guardfl.defenses import Defense, Identity, from_config
from guardfl.errors import ConfigError, UndefendedUpdateError
from guardfl.inspect import Inspection, inspect_model
from guardfl.protect import dp_compatible, protect, soft_cross_entropy, split_stages

MakeOptimizer = Callable[[Iterable[nn.Parameter]], Optimizer]

_STATE_VERSION = 1

#: state-dict name endings sent as trained by default (BatchNorm buffers): no gradient defense reaches a
#: buffer, and noise would make a running variance negative
BN_BUFFERS: tuple[str, ...] = ("running_mean", "running_var", "num_batches_tracked")


@dataclass
class ClientState:
    """What a client keeps between FL rounds. JSON-serialisable (``to_json`` / ``from_json``)."""

    #: FL rounds this client has completed
    rounds: int = 0
    #: local optimizer steps over all rounds
    steps: int = 0
    #: the DP accountant's state (Opacus ``accountant.state_dict()``); None without DP-SGD
    privacy: dict | None = None

    def to_dict(self) -> dict[str, Any]:
        privacy = None
        if self.privacy is not None:
            privacy = {"mechanism": self.privacy["mechanism"], "history": [list(h) for h in self.privacy["history"]]}
        return {"version": _STATE_VERSION, "rounds": self.rounds, "steps": self.steps, "privacy": privacy}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ClientState":
        if data.get("version", _STATE_VERSION) != _STATE_VERSION:
            raise ConfigError(f"client state: version {data.get('version')} is not supported (this guardfl writes {_STATE_VERSION})")
        privacy = data.get("privacy")
        if privacy is not None:
            privacy = {"mechanism": privacy["mechanism"], "history": [tuple(h) for h in privacy["history"]]}
        return cls(rounds=int(data.get("rounds", 0)), steps=int(data.get("steps", 0)), privacy=privacy)

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


def _mix(seed: int, round_index: int) -> int:
    """A per-round seed: the seed itself in round 0, an unrelated 63-bit value in later rounds."""
    if round_index == 0:
        return seed
    x = (seed * 0x9E3779B97F4A7C15 + round_index * 0xBF58476D1CE4E5B9) % (1 << 64)
    x ^= x >> 31
    x = (x * 0x94D049BB133111EB) % (1 << 64)
    return (x ^ (x >> 29)) >> 1


def _reseed_for_round(defense: Defense, round_index: int) -> None:
    if defense.config.seed is not None:
        defense.reseed(_mix(defense.config.seed, round_index))
    for member in getattr(defense, "members", []):
        _reseed_for_round(member, round_index)


def round_defense(defense: Defense | Mapping[str, Any] | str | None, round_index: int) -> Defense:
    """A fresh defense for FL round ``round_index`` (0-based): OS entropy, or a per-round seed derived from
    an explicit ``seed`` (so rounds never share a noise stream)."""
    if defense is None:
        return Identity()
    fresh = from_config(defense.config if isinstance(defense, Defense) else defense)
    _reseed_for_round(fresh, round_index)
    return fresh


def _batch_size(x: Any) -> int:
    return int(x.shape[0]) if isinstance(x, Tensor) else len(x)


def _inspect_mode(inspect: bool | str) -> bool:
    if inspect is True or inspect is False:
        return inspect
    if inspect == "strict":
        return True
    raise ConfigError(f"inspect: expected False, True or 'strict' (got {inspect!r})")


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


def inspect_received(model: nn.Module, loader: Iterable, reference: Any = None, received: Any = None) -> Inspection:
    """``inspect_model`` on the model a client received (``received``: its state dict when it is not yet
    loaded into ``model``, which is then the reference architecture), with the loader's first batch;
    raises ``MaliciousModelError`` naming the reasons when it is not ok, ``ConfigError`` (naming
    ``batch``) when the model cannot run on the loader's first batch. Without a usable first batch the
    weights alone are checked and ``checks["batch"]`` says why the batch checks were skipped."""
    batch = first_batch(loader)
    if received is None:
        result = inspect_model(model, reference, batch=batch, strict=True)
    else:
        result = inspect_model(received, model if reference is None else reference, batch=batch, strict=True)
    if batch is None:
        result.checks["batch"] = {"skipped": "no usable first batch: the loader is a one-shot iterator, is empty, "
                                             "or its first batch is not (x, y) with one class label per sample"}
    return result


def _is_identity(defense: Defense) -> bool:
    members = getattr(defense, "members", None)
    return all(_is_identity(m) for m in members) if members is not None else defense.kind == "identity"


def _refuse_undefended_changes(model: nn.Module, optimizer: Optimizer, start: Mapping[str, Tensor],
                               after: Mapping[str, Tensor]) -> None:
    """``UndefendedUpdateError`` when training changed a state entry that no gradient defense reached: a
    buffer other than BatchNorm's (``BN_BUFFERS``) or a parameter outside the optimizer. Such an entry
    would be sent as trained, whatever the defense; the update fails closed instead."""
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    defended = {name for name, p in model.named_parameters(remove_duplicate=False) if id(p) in optimized}
    changed = [f"{k} ({after[k].dtype})" for k in start
               if k not in defended and not k.endswith(BN_BUFFERS) and not torch.equal(after[k], start[k])]
    if changed:
        raise UndefendedUpdateError(
            f"update: training changed {len(changed)} state entr{'y' if len(changed) == 1 else 'ies'} that no "
            f"gradient defense reaches: {', '.join(changed[:5])}{' ...' if len(changed) > 5 else ''}; the update "
            "was not returned. Only the optimizer's parameters are defended (and BatchNorm's buffers sent as trained)")


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
) -> LocalUpdate:
    """Train ``model`` (in place, train mode) for ``epochs`` over ``loader`` with ``defense`` and return the
    defended update.

    ``make_optimizer(params)`` builds the client's optimizer (e.g. ``lambda p: torch.optim.SGD(p, lr=0.01)``);
    it is rebuilt every round, as a Flower client would. ``defense`` is any guardfl defense or stack,
    DP-SGD and input encodings included (through ``guardfl.protect``). ``state`` is the previous round's
    ``result.state`` (None on a client's first round). Batches are moved to the model's device.

    ``inspect=True`` (or ``"strict"``, the same) first checks the received model with
    ``guardfl.inspect_model`` (weights, and the loader's first batch in eval mode unless the loader is a
    one-shot iterator) and refuses to train a model that is not ok: ``MaliciousModelError`` naming the
    reasons, the model untouched. There is no warn-and-train mode: the update of a malicious model is
    what leaks, and a client that trained on one has nothing safe to send. The architecture is the
    client's own (the received state was loaded into ``model``, which refuses other names and shapes).

    Fail closed: when a defense acts, every state entry that training changed must be one of the
    optimizer's parameters (defended, whatever their floating-point dtype) or a BatchNorm buffer
    (``BN_BUFFERS``, sent as trained as documented); any other changed entry (a custom buffer a forward
    pass writes, a parameter changed outside the optimizer) raises ``UndefendedUpdateError`` naming it.
    """
    if not isinstance(epochs, int) or epochs < 1:
        raise ConfigError(f"epochs: must be an integer >= 1 (got {epochs!r})")
    if max_steps is not None and max_steps < 1:
        raise ConfigError(f"max_steps: must be null or an integer >= 1 (got {max_steps!r})")
    if not callable(make_optimizer):
        raise ConfigError("make_optimizer: expected a callable params -> torch.optim.Optimizer "
                          "(e.g. lambda p: torch.optim.SGD(p, lr=0.01))")
    inspection = inspect_received(model, loader) if _inspect_mode(inspect) else None
    state = state or ClientState()
    current = round_defense(defense, state.rounds)
    dp, _, _ = split_stages(current)
    if dp and dp_compatible(model) is not model:
        raise ConfigError("defense: DP-SGD cannot train this model (it has layers Opacus replaces: BatchNorm -> GroupNorm, "
                          "nn.MultiheadAttention -> DPMultiheadAttention, with other parameter names); build the global "
                          "model with guardfl.dp_compatible(model) on the server and on every client")
    try:
        device = next(model.parameters()).device
    except StopIteration:
        raise ConfigError("model: it has no parameters, so there is no update to send") from None

    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.train()
    optimizer = make_optimizer(model.parameters())
    if not isinstance(optimizer, Optimizer):
        raise ConfigError(f"make_optimizer: returned {type(optimizer).__name__}, expected a torch.optim.Optimizer")
    trained, optimizer, loader = protect(model, optimizer, loader, current, num_classes=num_classes,
                                         privacy_state=state.privacy)
    optimizer.new_round()
    steps, examples, loss_sum, stats = 0, 0, 0.0, []
    try:
        for _ in range(epochs):
            for x, y in loader:
                if max_steps is not None and steps >= max_steps:
                    break
                x, y = x.to(device), y.to(device)
                optimizer.zero_grad(set_to_none=True)
                out = trained(x)
                loss = loss_fn(out, y) if _batch_size(x) else out.sum() * 0.0  # Opacus's Poisson batches can be empty
                loss.backward()
                optimizer.step()
                steps += 1
                examples += _batch_size(x)
                loss_sum += float(loss.detach()) * _batch_size(x)
                if optimizer.last_stats is not None:
                    stats.append(optimizer.last_stats.to_dict())
    finally:
        if dp and hasattr(trained, "to_standard_module"):
            trained.to_standard_module()  # remove Opacus's hooks from the caller's model
    if steps == 0:
        raise ConfigError("loader: it yielded no batches, so the client did not train")

    epsilon, dp_delta, privacy = math.inf, None, None
    if dp:
        dp_delta = dp[0].config.delta
        epsilon = optimizer.epsilon(dp_delta)
        privacy = optimizer.privacy_state()
    after = model.state_dict()
    if not _is_identity(current):
        _refuse_undefended_changes(model, optimizer, start, after)
    delta = {k: after[k].detach() - start[k] for k in start}
    new_state = ClientState(rounds=state.rounds + 1, steps=state.steps + steps, privacy=privacy)
    return LocalUpdate(delta=delta, state=new_state, num_examples=examples, steps=steps,
                       mean_loss=loss_sum / max(examples, 1), epsilon=epsilon, dp_delta=dp_delta, defense_stats=stats,
                       inspection=inspection)


__all__ = ["BN_BUFFERS", "ClientState", "LocalUpdate", "MakeOptimizer", "first_batch", "inspect_received", "local_update", "round_defense"]
