"""Flower (flwr >= 1.41, Message API) adapters: a guarded ``@app.train()`` helper, an update-defense mod
and a legacy ``NumPyClient`` wrapper. Needs ``pip install 'guardfl[flower]'``.

Optimizer-level defenses (everything guardfl has, DP-SGD and encodings included)::

    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        model, loader = Net(), load_partition(context.node_config["partition-id"])
        return guardfl_flower.train(msg, context, model, loader,
                                    lambda p: torch.optim.SGD(p, lr=0.01), defense=Outpost(), epochs=1)

``train`` loads the received ``ArrayRecord`` into ``model``, runs ``guardfl.integrations.torch.local_update``
and replies with the trained weights under the same key (key order kept), plus a ``MetricRecord`` with
``num-examples``, ``train_loss`` and, with DP-SGD, ``guardfl-epsilon``. Flower rebuilds a ``ClientApp``
every round, so the per-client defense state (round counter, DP accountant) is kept in
``context.state`` under ``"guardfl"``: epsilon is cumulative over rounds, Outpost's schedule restarts
every round, and an explicitly seeded defense never reuses a round's noise stream.

``train(..., inspect=True)`` checks the received model with ``guardfl.inspect_model`` first and replies
with an error naming the reasons when it is not ok; ``InspectModelMod(reference)`` does the same on the
weights alone as a mod (``ClientApp(mods=[InspectModelMod(Net())])``). ``train(..., max_rounds=n)`` and
``RoundBudgetMod(n)`` (first in ``mods``) are the client's round budget: ``n`` rounds answered, every later
train message an error reply (``guardfl.integrations.budget``).

Update-level defenses (prune / noise / clip on the delta, when the optimizer is out of reach)::

    app = ClientApp(mods=[LocalDpMod(...), GuardUpdateMod(GradPrune(0.9))])

``GuardUpdateMod`` follows the built-in mods' contract: it needs exactly one ``ArrayRecord`` in the message
and in the reply, the reply must keep the received keys (order included) and shapes, and every failure
comes back as an error ``Message`` (code ``MOD_FAILED_PRECONDITION``), never as an exception. It fails
closed: floating-point arrays are defended whatever their precision, an integer / boolean / complex array
is sent only when training left it bit for bit as received, and any other array (quantised weights that
changed) makes the reply an error naming it instead of an undefended update (``UpdateDefense``). Mods wrap
the app in list order, so replies pass them in reverse: with ``[LocalDpMod(...), GuardUpdateMod(...)]``
the update is pruned first and ``LocalDpMod`` clips and noises it last, which keeps its sensitivity
and (epsilon, delta) meaning intact (Flower: clipping mods should be the last to act on the parameters).
"""

from __future__ import annotations

import math
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor, nn

try:
    from flwr.app import DEFAULT_TTL, Array, ArrayRecord, ConfigRecord, Context, Error, Message, Metadata, MessageType, MetricRecord, RecordDict
    from flwr.common.constant import ErrorCode
    from flwr.compat.client.numpy_client import NumPyClient
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError("guardfl.integrations.flower needs Flower: pip install 'guardfl[flower]'") from err

from guardfl.defenses import Defense
from guardfl.errors import (ConfigError, GuardflError, MaliciousModelError, NonFiniteGradientError, RoundBudgetError,
                            UndefendedUpdateError)
from guardfl.inspect import inspect_model
from guardfl.inspect_history import LeakHistory
from guardfl.integrations import statefile
from guardfl.integrations.budget import MAX_ROUNDS_LIMIT, check_budget_left, check_max_rounds, spent_rounds, write_count
from guardfl.integrations.round import check_round_counter
from guardfl.integrations.torch import (ClientState, MakeOptimizer, inspect_enabled, inspect_received, leak_history_for,
                                        local_update)
from guardfl.integrations.update import BN_BUFFERS, UpdateDefense, key_mismatch
from guardfl.protect import load_plain_state_dict, soft_cross_entropy

#: ``context.state`` keys
STATE_KEY = "guardfl"
UPDATE_STATE_KEY = "guardfl-update"
BUDGET_STATE_KEY = "guardfl-budget"
NUMPY_BUDGET_STATE_KEY = "guardfl-budget-numpyclient"  # its own: a RoundBudgetMod beside it keeps its count apart


# -- client state in context.state ------------------------------------------------------------------
def client_state(context: Context, key: str = STATE_KEY) -> ClientState:
    """The client's guardfl state kept in ``context.state`` (a fresh one on the first round), with its leak
    history when it keeps one (``LeakHistory.to_bytes`` beside the JSON).

    Args:
        context: the ClientApp's ``Context``.
        key: the record key the state is kept under."""
    record = context.state.config_records.get(key)
    if record is None or "json" not in record:
        return ClientState()
    state = ClientState.from_json(str(record["json"]))
    if "leak-history" in record:
        state.leak_history = LeakHistory.from_bytes(bytes(record["leak-history"]))
    return state


def save_client_state(context: Context, state: ClientState, key: str = STATE_KEY) -> None:
    """Keep ``state`` in ``context.state`` under ``key`` for the next round (``client_state`` reads it back):
    Flower rebuilds a ClientApp every round, and the context is what survives."""
    record = {"json": state.to_json()}
    if state.leak_history is not None:
        record["leak-history"] = state.leak_history.to_bytes()
    context.state[key] = ConfigRecord(record)


def received_arrays(msg: Message) -> tuple[str, ArrayRecord]:
    """The one ``ArrayRecord`` of a message, with its key; ValueError naming what was found otherwise.

    Args:
        msg: the received ``Message``."""
    records = msg.content.array_records
    if len(records) != 1:
        raise ValueError(f"message: expected exactly one ArrayRecord (the global model), found {len(records)}: {list(records)}")
    key, record = next(iter(records.items()))
    return key, record


def _array_record(state: Mapping[str, Tensor], keys: Sequence[str]) -> ArrayRecord:
    unsent = [f"{k} ({state[k].dtype})" for k in keys if state[k].dtype == torch.bfloat16]
    if unsent:  # numpy, and so a Flower Array, has no bfloat16
        raise UndefendedUpdateError(f"update: a Flower ArrayRecord cannot carry bfloat16 tensors: {', '.join(unsent[:5])}; "
                                    "train in bfloat16 if you like, but keep the model's parameters in float32 or float16")
    return ArrayRecord({k: Array(state[k].detach().cpu().numpy()) for k in keys})


def train_message(
    arrays: ArrayRecord | Mapping[str, Tensor],
    config: Mapping[str, Any] | None = None,
    *,
    node_id: int = 1,
    server_round: int = 1,
    arrays_key: str = "arrays",
    config_key: str = "config",
) -> Message:
    """A ``train`` Message as a ServerApp's FedAvg sends it (``arrays`` + ``config`` records), for
    driving a ``ClientApp`` directly: in tests, and by the red team (``guardfl redteam`` with a
    ``target.clientapp``).

    Args:
        arrays: the global model (an ``ArrayRecord`` or a state dict).
        config: the round's config record (``None``: empty).
        node_id: the receiving node's id.
        server_round: the round the message belongs to.
        arrays_key: the record key of ``arrays``.
        config_key: the record key of ``config``."""
    record = arrays if isinstance(arrays, ArrayRecord) else _array_record(arrays, list(arrays))
    content = RecordDict({arrays_key: record, config_key: ConfigRecord({"server-round": server_round, **dict(config or {})})})
    metadata = Metadata(run_id=0, message_id=uuid.uuid4().hex, src_node_id=0, dst_node_id=node_id,
                        reply_to_message_id="", group_id=str(server_round), created_at=time.time(), ttl=DEFAULT_TTL,
                        message_type=MessageType.TRAIN)
    return Message(content, metadata=metadata)


# -- the guarded train helper -----------------------------------------------------------------------
def train(
    msg: Message,
    context: Context,
    model: nn.Module,
    loader: Iterable,
    make_optimizer: MakeOptimizer,
    defense: Defense | Mapping[str, Any] | str | None = None,
    *,
    epochs: int = 1,
    loss_fn: Callable[[Tensor, Tensor], Tensor] = soft_cross_entropy,
    num_classes: int | None = None,
    max_steps: int | None = None,
    state_key: str = STATE_KEY,
    inspect: bool | str = False,
    inspect_disaggregation: bool = False,
    inspect_leak_limit: int | None = None,
    inspect_leak_history: bool | Mapping[str, int] = True,
    max_rounds: int | None = None,
) -> Message:
    """One guarded round for ``@app.train()``: load the global model, train with ``defense``, reply.

    ``inspect=True`` (or ``"strict"``) checks the received arrays with ``guardfl.inspect_model`` first,
    against ``model`` as the expected architecture and on the loader's first batch; a model that is not
    ok gets an error reply (``MOD_FAILED_PRECONDITION``) naming the reasons: nothing is trained, nothing
    sent, ``model`` and the client state are untouched. With inspection on, arrays that do not convert
    to tensors, a first batch the model cannot run on (``ConfigError`` naming ``batch``) and any other
    error while inspecting also come back as that error reply (fail closed), never as an exception.
    ``inspect_disaggregation=True`` (with ``inspect``) adds SEER's D-SNR check, ``inspect_leak_limit=k``
    refuses any model (the honest one too) with which the server would read more than ``k`` samples of the
    first batch from the update (``local_update``), across rounds with ``inspect_leak_history`` (the default:
    the ``LeakHistory`` kept in ``context.state`` with the client state; a mapping ``{"max_rounds": n,
    "max_batches": m}`` sets its limits, also on the history kept from earlier rounds).
    ``max_rounds=n``: the client's round budget (``guardfl.integrations.budget``, counted in the client
    state in ``context.state``): after ``n`` rounds sent every train message gets an error reply, before
    anything is inspected or trained. ``RoundBudgetMod`` is the same budget for any ``ClientApp``.

    ``msg`` and ``context``: the train Message and the Context the app was called with; ``model``: the
    client's model (the received arrays are loaded into it); ``loader``: its local data; ``make_optimizer(params)``:
    its optimizer, rebuilt every round; ``epochs``, ``loss_fn``, ``num_classes``, ``max_steps``: as in
    ``local_update``; ``state_key``: where in ``context.state`` the client's state is kept. Errors the
    client must not send past (an undefended array, a non-finite gradient, a refused model, a spent budget)
    become an error reply, never an exception."""
    check_max_rounds(max_rounds)
    key, record = received_arrays(msg)
    state = client_state(context, state_key)
    try:
        check_budget_left(max_rounds, state.rounds)
    except RoundBudgetError as err:
        return _error_reply(msg, f"guardfl train: {err}")
    if not inspect_enabled(inspect, inspect_disaggregation, inspect_leak_limit):
        received = record.to_torch_state_dict()
    else:
        try:
            received = record.to_torch_state_dict()
            history = leak_history_for(state, inspect_leak_limit, inspect_leak_history)
            inspect_received(getattr(model, "_module", model), loader, received=received,
                             disaggregation=inspect_disaggregation, leak_limit=inspect_leak_limit, history=history)
            state.leak_history = history or state.leak_history
        except MaliciousModelError as err:
            return _error_reply(msg, f"guardfl inspect_model: {err}")
        except Exception as err:  # noqa: BLE001 - fail closed: a model that cannot be inspected is not trained
            return _error_reply(msg, InspectModelMod.failure_line("guardfl inspect_model", err))
    load_plain_state_dict(model, received)
    try:
        result = local_update(model, loader, make_optimizer, defense, epochs, state=state, loss_fn=loss_fn,
                              num_classes=num_classes, max_steps=max_steps)
        arrays = _array_record(model.state_dict(), list(record.keys()))  # the received key order
    except (UndefendedUpdateError, NonFiniteGradientError) as err:
        return _error_reply(msg, f"guardfl train: {err}")
    save_client_state(context, result.state, state_key)
    metrics: dict[str, int | float] = {
        # FedAvg's weight: the local dataset's size, as Flower's examples report it (not the number of
        # samples drawn, which with DP-SGD's Poisson sampling is random and would leak the draw)
        "num-examples": int(_dataset_size(loader, result.num_examples)),
        "train_loss": float(result.mean_loss),
        "guardfl-round": int(result.state.rounds),
    }
    if math.isfinite(result.epsilon):
        metrics["guardfl-epsilon"] = float(result.epsilon)
        metrics["guardfl-delta"] = float(result.dp_delta)
    return Message(RecordDict({key: arrays, "metrics": MetricRecord(metrics)}), reply_to=msg)


def _dataset_size(loader: Iterable, fallback: int) -> int:
    try:
        return len(loader.dataset)  # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        return fallback


# -- the update-defense mod ---------------------------------------------------------------------------
def _one_array_record(msg: Message, mod: str) -> ArrayRecord | Message:
    """The one ArrayRecord of a train message, or the error reply a mod sends instead of calling the app."""
    if len(msg.content.array_records) != 1:
        return _error_reply(msg, f"{mod} expects exactly one ArrayRecord, but found {len(msg.content.array_records)} ArrayRecord(s).")
    return next(iter(msg.content.array_records.values()))


def _error_reply(msg: Message, reason: str) -> Message:
    return Message(Error(code=ErrorCode.MOD_FAILED_PRECONDITION, reason=reason), reply_to=msg)


class GuardUpdateMod:
    """Flower mod: clip (optional) and defend the update a ``ClientApp`` returns (see the module docstring).

    ``defense``: GradPrune, GaussianNoise, LaplaceNoise, Identity or a stack of them (others raise
    ``ConfigError`` here, at construction). ``clip_norm``: L2 bound on the whole delta, applied first.
    ``skip``: array-name endings left as trained (default: BatchNorm buffers); every other array is
    defended, or the reply is an error (a changed non-floating array). Acts on ``train`` messages only. The round counter of the per-round defense seed lives in ``context.state["guardfl-update"]``.
    Adds ``guardfl-update-zero-fraction`` and ``guardfl-update-clip-factor`` to the reply's
    ``MetricRecord`` when it has exactly one.
    """

    def __init__(self, defense: Defense | Mapping[str, Any] | str, *, clip_norm: float | None = None,
                 skip: Sequence[str] = BN_BUFFERS) -> None:
        self.update_defense = UpdateDefense(defense, clip_norm=clip_norm, skip=skip)

    def __call__(self, msg: Message, ctxt: Context, call_next: Callable[[Message, Context], Message]) -> Message:
        if msg.metadata.message_type.split(".")[0] != "train":
            return call_next(msg, ctxt)
        name = type(self).__name__
        received = _one_array_record(msg, name)
        if isinstance(received, Message):
            return received
        out = call_next(msg, ctxt)
        if out.has_error():
            return out
        if len(out.content.array_records) != 1:
            return _error_reply(msg, f"{name} expects exactly one ArrayRecord in the reply, but found {len(out.content.array_records)} ArrayRecord(s).")
        out_key, returned = next(iter(out.content.array_records.items()))
        mismatch = key_mismatch(list(received.keys()), list(returned.keys()))
        if mismatch is not None:
            return _error_reply(msg, f"{name} expects the keys in the ArrayRecord of the reply message to match those "
                                     f"the ClientApp received ({mismatch}).")
        names = list(received.keys())
        round_index = _next_round(ctxt)
        try:
            arrays, stats = self.update_defense(received.to_numpy_ndarrays(), returned.to_numpy_ndarrays(), names,
                                                round_index=round_index)
        except Exception as err:  # noqa: BLE001 - fail closed: whatever went wrong, the reply is an error, never the undefended update
            return _error_reply(msg, f"{name}: {err}" if isinstance(err, (ValueError, GuardflError))
                                else f"{name}: the update could not be defended ({type(err).__name__}: {err}); nothing was sent")
        out.content.array_records[out_key] = ArrayRecord({k: Array(np.asarray(v)) for k, v in zip(names, arrays, strict=True)})
        if len(out.content.metric_records) == 1:
            metrics = next(iter(out.content.metric_records.values()))
            metrics["guardfl-update-zero-fraction"] = float(stats.zero_fraction)
            metrics["guardfl-update-clip-factor"] = float(stats.clip_factor)
        return out


class InspectModelMod:
    """Flower mod: refuse a ``train`` message whose global model carries a malicious-server signature.

    On a ``train`` message it builds a state dict from the message's one ``ArrayRecord`` and runs
    ``guardfl.inspect_model(state, reference)`` (weights only: a mod has no data to run the model on;
    use ``train(..., inspect=True)`` for the batch checks). When the model is not ok it replies with an
    error ``Message`` (``MOD_FAILED_PRECONDITION``) naming the reasons instead of calling the app, so
    nothing is trained and nothing sent. ``reference``: the client's model (``nn.Module``) or a state dict
    of expected tensors or shapes, to refuse other architectures (an inserted imprint block); None
    checks the weights alone. Other messages pass through. Every failure is an error reply, never an
    exception: arrays that do not convert to tensors, or any error while inspecting, refuse the model
    with one line naming the error (fail closed: the app is not called).
    """

    def __init__(self, reference: nn.Module | Mapping[str, Any] | None = None) -> None:
        if reference is not None and not isinstance(reference, (nn.Module, Mapping)):
            raise ConfigError(f"reference: expected None, an nn.Module or a state dict, got {type(reference).__name__}")
        self.reference = reference

    def __call__(self, msg: Message, ctxt: Context, call_next: Callable[[Message, Context], Message]) -> Message:
        if msg.metadata.message_type.split(".")[0] != "train":
            return call_next(msg, ctxt)
        name = type(self).__name__
        received = _one_array_record(msg, name)
        if isinstance(received, Message):
            return received
        try:
            state = received.to_torch_state_dict()
            inspection = inspect_model(state, self.reference)
        except Exception as err:  # noqa: BLE001 - a mod answers with a Message, never an exception; fail closed
            return _error_reply(msg, self.failure_line(name, err))
        if not inspection.ok:
            return _error_reply(msg, f"{name}: the received model was refused: " + "; ".join(inspection.reasons))
        return call_next(msg, ctxt)

    @staticmethod
    def failure_line(name: str, err: BaseException) -> str:
        """One line for an error raised while inspecting a received model (ours: their message; anything
        else: its type and first line, and that the model was refused)."""
        text = (str(err).strip().splitlines() or [""])[0][:300]
        if isinstance(err, GuardflError):
            return f"{name}: {text}"
        return f"{name}: the received model could not be inspected and was refused ({type(err).__name__}: {text})"


class RoundBudgetMod:
    """Flower mod: the client's round budget for any ``ClientApp`` (``guardfl.integrations.budget``).

    On a ``train`` message it reads how many rounds this client has answered (``context.state[key]``): once
    ``max_rounds`` were, it replies with an error ``Message`` (``MOD_FAILED_PRECONDITION``) instead of calling
    the app, so nothing is trained and nothing sent, whatever model arrived. Otherwise it calls the app and
    counts the round when the reply carries no error (a refused model, or a failed round, sent nothing and
    spends nothing). Other messages pass through. Place it first in ``mods`` (outermost): a refusal then
    costs no inspection or training. The count lives in ``context.state``, which lasts as long as the node's
    run: a SuperNode restarted mid-run, or a new run on the same data, would start from 0. ``path``: a file
    that keeps the count across restarts and runs too (``{"rounds": n}``, written atomically; the larger of
    the two counts is the one spent; a file that cannot be read refuses the round, never counts from 0). One
    file per client data set: the budget is for the data, whichever run asks.
    """

    def __init__(self, max_rounds: int, *, key: str = BUDGET_STATE_KEY, path: str | Path | None = None) -> None:
        if check_max_rounds(max_rounds) is None:
            raise ConfigError(f"max_rounds: expected an integer in [1, {MAX_ROUNDS_LIMIT}] (got None)")
        self.max_rounds, self.key = max_rounds, key
        self.path = Path(path) if path is not None else None

    def __call__(self, msg: Message, ctxt: Context, call_next: Callable[[Message, Context], Message]) -> Message:
        if msg.metadata.message_type.split(".")[0] != "train":
            return call_next(msg, ctxt)
        if self.path is None:
            return self._counted(msg, ctxt, call_next)
        try:  # a second process on the same file is refused, not left to race (guardfl.integrations.statefile)
            with statefile.locked(self.path, "budget file"):
                return self._counted(msg, ctxt, call_next)
        except ConfigError as err:
            return _error_reply(msg, f"{type(self).__name__}: {err}")

    def _counted(self, msg: Message, ctxt: Context, call_next: Callable[[Message, Context], Message]) -> Message:
        try:
            answered = spent_rounds(_rounds_answered(ctxt, self.key), self.path)
            check_budget_left(self.max_rounds, answered)
        except (RoundBudgetError, ConfigError) as err:
            return _error_reply(msg, f"{type(self).__name__}: {err}")
        out = call_next(msg, ctxt)
        if not out.has_error():
            ctxt.state[self.key] = ConfigRecord({"rounds": answered + 1})
            if self.path is not None:
                try:
                    write_count(self.path, answered + 1)
                except OSError as err:  # the count could not be kept: the update is not sent
                    return _error_reply(msg, f"{type(self).__name__}: budget file {self.path}: could not be written "
                                             f"({type(err).__name__}: {err}); the update was not sent")
        return out


def _rounds_answered(ctxt: Context, key: str) -> int:
    """The rounds a round budget counted in ``ctxt.state[key]`` (0 before the first)."""
    record = ctxt.state.config_records.get(key)
    return int(record["rounds"]) if record is not None and "rounds" in record else 0


def _next_round(ctxt: Context) -> int:
    index = _rounds_answered(ctxt, UPDATE_STATE_KEY)
    ctxt.state[UPDATE_STATE_KEY] = ConfigRecord({"rounds": index + 1})
    return index


# -- legacy NumPyClient -------------------------------------------------------------------------------
class GuardedNumPyClient(NumPyClient):
    """Wraps a legacy ``NumPyClient``: ``fit`` returns the update defended by ``UpdateDefense``.

    ``names``: the arrays' names in ``get_parameters`` order (for example ``list(model.state_dict())``),
    so that BatchNorm buffers are left alone; without it every floating-point array is defended and a
    changed integer array (``num_batches_tracked``) makes ``fit`` raise ``UndefendedUpdateError`` (Flower
    then reports the client's failure: nothing undefended is sent). Pass the
    ``context`` of ``client_fn(context)`` to derive per-round seeds for an explicitly seeded defense
    (required with one: a ``ConfigError`` without it, since a client built again each round would repeat
    the seed's first noise).
    ``max_rounds=n``: the client's round budget (as ``RoundBudgetMod``'s, counted in ``context.state``, which
    it then requires): ``fit`` raises ``RoundBudgetError`` once ``n`` rounds were sent, before the wrapped
    client trains (Flower reports the failure; nothing is sent).
    Everything else is delegated to the wrapped client. For optimizer-level defenses inside your own
    ``fit``, use ``guardfl.wrap`` / ``local_update`` and keep ``client_state(context)``.
    """

    def __init__(self, client: NumPyClient, defense: Defense | Mapping[str, Any] | str, *,
                 clip_norm: float | None = None, names: Sequence[str] | None = None,
                 skip: Sequence[str] = BN_BUFFERS, context: Context | None = None, max_rounds: int | None = None) -> None:
        if context is None:  # a client_fn builds this client again every round: the seed's first noise every time
            check_round_counter(defense, "context", "pass client_fn's context (its state keeps the round counter)")
            if check_max_rounds(max_rounds) is not None:
                raise ConfigError("context: required with max_rounds (the round budget is counted in context.state): "
                                  "pass client_fn's context")
        self.max_rounds = check_max_rounds(max_rounds)
        self.client = client
        self.update_defense = UpdateDefense(defense, clip_norm=clip_norm, skip=skip)
        self.names = list(names) if names is not None else None
        self.context = context

    def get_properties(self, config):
        return self.client.get_properties(config)

    def get_parameters(self, config):
        return self.client.get_parameters(config)

    def evaluate(self, parameters, config):
        return self.client.evaluate(parameters, config)

    def fit(self, parameters, config):
        answered = _rounds_answered(self.context, NUMPY_BUDGET_STATE_KEY) if self.max_rounds is not None else 0
        check_budget_left(self.max_rounds, answered)
        received = [np.array(p, copy=True) for p in parameters]
        new, num_examples, metrics = self.client.fit(parameters, config)
        if self.names is not None and len(self.names) != len(received):
            raise ValueError(f"names: {len(self.names)} names for {len(received)} arrays")
        round_index = _next_round(self.context) if self.context is not None else None
        arrays, stats = self.update_defense(received, list(new), self.names, round_index=round_index)
        metrics = dict(metrics or {})
        metrics["guardfl-update-zero-fraction"] = float(stats.zero_fraction)
        if self.max_rounds is not None:
            self.context.state[NUMPY_BUDGET_STATE_KEY] = ConfigRecord({"rounds": answered + 1})
        return arrays, num_examples, metrics


__all__ = [
    "GuardUpdateMod",
    "GuardedNumPyClient",
    "InspectModelMod",
    "RoundBudgetMod",
    "STATE_KEY",
    "client_state",
    "received_arrays",
    "save_client_state",
    "train",
    "train_message",
]
