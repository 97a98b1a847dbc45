"""NVIDIA FLARE (nvflare 2.9) adapters: a task-result filter that defends the update a site sends, and a
Client API helper that trains with any guardfl defense. Needs ``pip install 'guardfl[nvflare]'``.

Update-level defenses, configured in the job as NVFlare's own privacy filters are (``PercentilePrivacy``,
``SVTPrivacy``, ``ExcludeVars``)::

    add_update_filter(recipe, GuardUpdateFilter({"kind": "gradprune", "ratio": 0.9}), tasks=["train"])

(``add_update_filter`` rather than ``recipe.add_client_output_filter``: see its docstring), or in
``config_fed_client.json``::

    "task_result_filters": [{"tasks": ["train"], "filters": [
        {"path": "guardfl.integrations.nvflare.GuardUpdateFilter",
         "args": {"defense": {"kind": "gradprune", "ratio": 0.9}, "clip_norm": 5.0}}]}]

``GuardUpdateFilter`` has ``GuardUpdateMod``'s semantics (``guardfl.integrations.update.UpdateDefense``):
optional L2 clipping of the whole delta, then GradPrune / GaussianNoise / LaplaceNoise / a stack of them on
it; BatchNorm buffers (``skip``) sent as trained; every other floating-point array defended; a changed
integer / boolean / complex array refuses the result. A ``WEIGHT_DIFF`` DXO is the delta itself; for a
``WEIGHTS`` DXO the filter keeps a copy of the global model the site received for that task (it listens to
``BEFORE_TASK_EXECUTION``, after the task-data filters) and defends ``trained - received``, sending
``received + defended delta``. What it did goes into the DXO's meta under ``"guardfl"`` (arrays defended,
zero fraction, clip factor, norm before, arrays sent as trained, the filter's round counter).

Fail closed: a config naming an unknown defense, or ``sign`` / ``outpost`` (meaningless on a multi-step
delta, see ``guardfl.integrations.update``), or a data kind other than ``WEIGHTS`` / ``WEIGHT_DIFF``,
raises ``ConfigError`` when NVFlare builds the filter (the site does not start the job). At run time a
result that is not a DXO, whose DXO has no weights or another kind (``METRICS``, ``COLLECTION``), a
``WEIGHTS`` result with no received model on record, keys or shapes that differ from what was received,
or any error of the defense, is answered with one error line in the site's log and a reply whose return
code is ``TASK_RESULT_FILTER_ERROR`` and which carries no data: the undefended result never leaves the
site. So is a result past the site's round budget (``max_rounds``; ``budget_path`` keeps its count across
restarts), which bounds how many rounds a server can average to shrink fresh noise. Attach the filter to
training tasks only (``tasks=["train"]``): a ``submit_model`` or ``validate`` result is refused by it, not
passed through.

Randomness: OS entropy unless the defense config sets ``seed``; then round ``r`` of this filter instance
(its own counter of defended results, never the server's round number, which a server could repeat)
uses a seed derived from (seed, r), as ``guardfl.integrations.torch`` does.

``InspectModelFilter(reference="task:Net")``, a task-data filter, refuses a ``train`` task whose global
model carries a malicious-server signature before the executor sees it (``guardfl.inspect_model`` on the
weights, as Flower's ``InspectModelMod``).

Optimizer-level defenses, DP-SGD and input encodings with the Client API (``nvflare.client``)::

    flare.init()
    trainer = GuardedTrainer(Net(), lambda p: torch.optim.SGD(p, lr=0.01), {"kind": "dpsgd", ...}, inspect=True)
    while flare.is_running():
        input_model = flare.receive()
        if flare.is_train():
            flare.send(trainer.train(input_model, loader))

``GuardedTrainer`` loads the received ``FLModel``'s params into the model, checks it with
``guardfl.inspect_model`` first when ``inspect=True`` (raising ``MaliciousModelError``: nothing trained,
nothing sent), runs ``guardfl.integrations.torch.local_update`` and returns an ``FLModel`` with the trained
weights (``FULL``, the received keys in their order and the received container type: numpy arrays or torch
tensors), ``NUM_STEPS_CURRENT_ROUND`` in its meta and ``train_loss`` / ``guardfl_epsilon`` /
``guardfl_delta`` in its metrics. The per-site state (round counter, DP accountant) lives in the trainer,
which a ``launch_once`` script keeps for the whole job, so epsilon is cumulative over rounds; pass
``state_path`` to keep it in a JSON file as well (a script launched per task, a restarted site).

The red team certifies such a site as deployed (``guardfl.redteam.client.target.run_nvflare``): it calls the
script's train round with the global model and runs the site's result filters on what comes back with
``apply_result_filters`` (filters from ``job_result_filters`` / ``build_filters``), as the client runner
would.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor, nn

try:
    from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
    from nvflare.apis.dxo_filter import DXOFilter
    from nvflare.apis.event_type import EventType
    from nvflare.apis.filter import Filter
    from nvflare.apis.fl_constant import FLContextKey, ReturnCode
    from nvflare.apis.fl_context import FLContext
    from nvflare.apis.shareable import Shareable, make_reply
    from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError("guardfl.integrations.nvflare needs NVIDIA FLARE: pip install 'guardfl[nvflare]'") from err

from guardfl.defenses import Defense, from_config
from guardfl.errors import ConfigError, GuardflError, StateFileError, UndefendedUpdateError
from guardfl.integrations import statefile
from guardfl.inspect_history import LeakHistory
from guardfl.integrations.budget import check_budget_left, check_max_rounds, spent_rounds, write_count
from guardfl.integrations.torch import (BN_BUFFERS, ClientState, MakeOptimizer, inspect_enabled, inspect_received, leak_history_for,
                                        local_update)
from guardfl.integrations.update import UpdateDefense, key_mismatch
from guardfl.protect import load_plain_state_dict, soft_cross_entropy

#: the DXO kinds an update defense acts on
UPDATE_DATA_KINDS: tuple[str, ...] = (DataKind.WEIGHTS, DataKind.WEIGHT_DIFF)
#: DXO meta key of the filter's statistics
META_KEY = "guardfl"
#: ``GuardedTrainer(state_path=)``'s file format (``guardfl.integrations.statefile``); version 1 was the plain
#: ``ClientState`` JSON, still read
STATE_FORMAT = ("guardfl-client-state", 2)
_LOG = logging.getLogger(__name__)


def defense_config(defense: Defense | Mapping[str, Any] | str | None) -> dict | str | None:
    """A defense as ``guardfl.defenses.from_config`` takes it, JSON-friendly for a job config: a bare kind
    (``"gradprune"``) becomes ``{"kind": "gradprune"}``; a ``Defense`` becomes its config dict."""
    if defense is None or isinstance(defense, dict):
        return defense
    if isinstance(defense, Defense):
        return defense.config.model_dump(mode="json")
    if isinstance(defense, Mapping):
        return dict(defense)
    if isinstance(defense, str):
        text = defense.strip()
        if text and ":" not in text and not text.endswith((".yaml", ".yml")):
            return {"kind": text}
        return text
    raise ConfigError(f"defense: expected a guardfl defense config (dict, kind, YAML text or .yaml path), got {type(defense).__name__}")


def _to_numpy(name: str, value: Any) -> np.ndarray:
    if isinstance(value, Tensor):
        if value.dtype == torch.bfloat16:  # numpy has no bfloat16: do not guess a cast
            raise UndefendedUpdateError(f"update: {name} is a bfloat16 tensor; send float32 or float16")
        return value.detach().cpu().numpy()
    if isinstance(value, (np.ndarray, np.generic, int, float, bool)):
        return np.asarray(value)
    raise UndefendedUpdateError(f"update: {name} is a {type(value).__name__}, not an array or tensor: it cannot be defended")


def _kind(kind: Any) -> str:
    return str(getattr(kind, "value", kind))


def _like(template: Any, array: np.ndarray) -> Any:
    """``array`` in the container type of ``template`` (a torch tensor stays a tensor, on its device)."""
    if isinstance(template, Tensor):
        return torch.from_numpy(np.ascontiguousarray(array)).to(device=template.device)
    return array


class GuardUpdateFilter(DXOFilter):
    """NVFlare task-result filter: clip (optional) and defend the update in a ``train`` result's DXO (see
    the module docstring). Arguments are JSON values, so the job config can set them:

    - ``defense``: a guardfl defense config acting on an update (``gradprune``, ``gaussian``, ``laplace``,
      ``identity`` or a ``stack`` of them): a dict, a bare kind, YAML text or a ``.yaml`` path;
    - ``clip_norm``: L2 bound on the whole delta, applied first (null: no clipping);
    - ``skip``: array-name endings sent as trained (default: BatchNorm's buffers);
    - ``data_kinds``: the DXO kinds to defend, a subset of ``["WEIGHTS", "WEIGHT_DIFF"]`` (default both);
    - ``max_rounds``: the site's round budget (``guardfl.integrations.budget``): after that many results sent,
      every later one is refused (error reply), null: none; ``budget_path``: a file keeping the count across
      site restarts (``{"rounds": n}``, written atomically; an unreadable file refuses, never counts from 0;
      without it the count lasts as long as the filter object).

    Deviation from NVFlare's ``DXOFilter`` contract: a DXO of another kind, or a result that is no DXO,
    is refused (error reply) instead of passed through unfiltered, since an unfiltered train result is an
    undefended update.
    """

    def __init__(self, defense: Any, clip_norm: float | None = None,
                 skip: Sequence[str] | None = None, data_kinds: Sequence[str] | None = None,
                 max_rounds: int | None = None, budget_path: str | None = None) -> None:
        kinds = list(data_kinds) if data_kinds else list(UPDATE_DATA_KINDS)
        bad = [k for k in kinds if k not in UPDATE_DATA_KINDS]
        if bad:
            raise ConfigError(f"data_kinds: {bad} cannot carry a model update; allowed: {list(UPDATE_DATA_KINDS)}")
        super().__init__(supported_data_kinds=list(UPDATE_DATA_KINDS), data_kinds_to_filter=kinds)
        # the attributes keep the constructor's names and JSON values, so that NVFlare's Job API can
        # write this filter into a job config (it reads them back by name)
        self.defense = defense_config(defense)
        self.clip_norm = clip_norm
        self.skip = list(BN_BUFFERS if skip is None else skip)
        self.update_defense = UpdateDefense(self.defense, clip_norm=clip_norm, skip=tuple(self.skip))
        self.max_rounds = check_max_rounds(max_rounds)
        if budget_path is not None and self.max_rounds is None:
            raise ConfigError("budget_path: keeps a round budget's count, but max_rounds is null: set max_rounds")
        self.budget_path = budget_path
        self._received: dict[str, tuple[list[str], list[np.ndarray]]] = {}
        self._rounds = 0
        self._sent = 0
        self._lock = threading.Lock()

    # -- the received global model, for WEIGHTS results ------------------------------------------------
    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        if event_type == EventType.BEFORE_TASK_EXECUTION:
            task_id = fl_ctx.get_prop(FLContextKey.TASK_ID)
            data = fl_ctx.get_prop(FLContextKey.TASK_DATA)
            if task_id is None or not isinstance(data, Shareable):
                return
            try:
                dxo = from_shareable(data)
            except Exception:  # noqa: BLE001 - not a DXO task (the result will be refused if it is filtered)
                return
            if dxo.data_kind != DataKind.WEIGHTS or not dxo.data:
                return
            try:
                names = list(dxo.data)
                arrays = [np.array(_to_numpy(n, dxo.data[n]), copy=True) for n in names]
            except GuardflError:
                return  # refused when the result comes back (no received model on record)
            with self._lock:
                self._received[str(task_id)] = (names, arrays)
        elif event_type in (EventType.END_RUN, EventType.ABORT_TASK):
            with self._lock:
                self._received.clear()

    # -- the result ---------------------------------------------------------------------------------------
    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        if shareable.get_return_code() != ReturnCode.OK:
            return shareable  # an error reply carries no update
        task_id = str(fl_ctx.get_prop(FLContextKey.TASK_ID))
        task = fl_ctx.get_prop(FLContextKey.TASK_NAME, "?")
        with self._lock:
            received = self._received.pop(task_id, None)
        try:
            try:
                dxo = from_shareable(shareable)
            except Exception as err:  # noqa: BLE001
                raise UndefendedUpdateError(f"the {task!r} result is not a DXO ({type(err).__name__}), so no defense can act on it") from None
            if dxo.data_kind not in self.data_kinds:
                raise UndefendedUpdateError(f"the {task!r} result is a {_kind(dxo.data_kind)} DXO; this filter defends "
                                            f"{'/'.join(_kind(k) for k in self.data_kinds)} (attach it to training tasks "
                                            "only, and list the kind the sites send in data_kinds)")
            if not dxo.data:
                raise UndefendedUpdateError(f"the {task!r} result holds no weights")
            with self._lock, (statefile.locked(self.budget_path, "budget_path") if self.budget_path
                              else contextlib.nullcontext()):  # the round budget: checked before, spent after
                sent = spent_rounds(self._sent, self.budget_path)
                check_budget_left(self.max_rounds, sent)
                self._defend(dxo, received)
                if self.max_rounds is not None:
                    self._sent = sent + 1
                    if self.budget_path:
                        write_count(self.budget_path, self._sent)
        except Exception as err:  # noqa: BLE001 - fail closed: whatever went wrong, nothing undefended leaves the site
            reason = str(err) if isinstance(err, (ValueError, GuardflError)) else f"{type(err).__name__}: {err}"
            self.log_error(fl_ctx, f"{type(self).__name__}: {reason}; the result was not sent (return code "
                                   f"{ReturnCode.TASK_RESULT_FILTER_ERROR})", fire_event=False)
            return make_reply(ReturnCode.TASK_RESULT_FILTER_ERROR)
        dxo.add_filter_history(type(self).__name__)
        return dxo.update_shareable(shareable)

    def job_config(self) -> dict[str, Any]:
        """This filter as a job-config entry (``{"path": ..., "args": ...}``)."""
        args: dict[str, Any] = {"defense": self.defense}
        if self.clip_norm is not None:
            args["clip_norm"] = self.clip_norm
        if tuple(self.skip) != BN_BUFFERS:
            args["skip"] = list(self.skip)
        if tuple(self.data_kinds) != UPDATE_DATA_KINDS:
            args["data_kinds"] = [_kind(k) for k in self.data_kinds]
        if self.max_rounds is not None:
            args["max_rounds"] = self.max_rounds
        if self.budget_path is not None:
            args["budget_path"] = self.budget_path
        return {"path": f"{GuardUpdateFilter.__module__}.{GuardUpdateFilter.__qualname__}", "args": args}

    def process_dxo(self, dxo: DXO, shareable: Shareable, fl_ctx: FLContext) -> DXO | None:  # pragma: no cover
        raise NotImplementedError("GuardUpdateFilter defends in process()")  # DXOFilter's hook, unused

    def _defend(self, dxo: DXO, received: tuple[list[str], list[np.ndarray]] | None) -> None:
        names = list(dxo.data)
        new = [_to_numpy(n, dxo.data[n]) for n in names]
        if dxo.data_kind == DataKind.WEIGHTS:
            if received is None:
                raise UndefendedUpdateError("a WEIGHTS result came back for a task whose global model this filter did not "
                                            "see (no WEIGHTS task data), so the update (trained - received) is unknown")
            sent_names, base = received
            mismatch = key_mismatch(sent_names, names)
            if mismatch is not None:
                raise ValueError(f"update: the result's weights are not those received ({mismatch})")
        else:  # WEIGHT_DIFF: the delta itself
            base = [np.zeros_like(a) for a in new]
        round_index = self._rounds  # process() holds the lock
        self._rounds += 1
        arrays, stats = self.update_defense(base, new, names, round_index=round_index)
        dxo.data = {n: _like(dxo.data[n], a) for n, a in zip(names, arrays)}
        dxo.set_meta_prop(META_KEY, {
            "defense": json.dumps(self.defense) if not isinstance(self.defense, str) else self.defense,
            "round": round_index,
            "defended": stats.defended,
            "entries": stats.entries,
            "zero_fraction": float(stats.zero_fraction),
            "clip_factor": float(stats.clip_factor),
            "norm_before": float(stats.norm_before),
            "sent_as_trained": list(stats.sent_as_trained),
        })


def _add_filter_section(recipe: Any, section: str, entry: dict[str, Any], tasks: Sequence[str],
                        clients: Sequence[str] | None) -> None:
    if isinstance(tasks, str) or not tasks or not all(isinstance(t, str) and t for t in tasks):
        raise ConfigError(f"tasks: expected a non-empty list of task names (got {tasks!r})")
    if not hasattr(recipe, "add_client_config"):
        raise ConfigError(f"recipe: expected an nvflare.recipe Recipe, got {type(recipe).__name__}")
    recipe.add_client_config({section: [{"tasks": list(tasks), "filters": [entry]}]},
                             clients=list(clients) if clients is not None else None)


def add_update_filter(recipe: Any, update_filter: GuardUpdateFilter, tasks: Sequence[str] = ("train",),
                      clients: Sequence[str] | None = None) -> None:
    """Put ``update_filter`` in the sites' ``task_result_filters`` of an NVFlare ``Recipe``.

    Use this instead of ``recipe.add_client_output_filter(update_filter)``: NVFlare's Job API finds a
    filter's class by its source file and copies non-NVFlare modules into the job's custom code, which
    fails for guardfl installed in editable mode (its ``guardfl.integrations`` package lives in
    ``integrations/``) and would ship guardfl's source with the job. This writes the filter by its import
    path instead (guardfl must be installed at every site). Deviation: it sets the whole
    ``task_result_filters`` section of the sites' config; add other result filters to it by hand.
    ``tasks``: the task names the filter applies to; ``clients``: the sites (default: every site)."""
    if not isinstance(update_filter, GuardUpdateFilter):
        raise ConfigError(f"update_filter: expected a GuardUpdateFilter, got {type(update_filter).__name__}")
    _add_filter_section(recipe, "task_result_filters", update_filter.job_config(), tasks, clients)


def add_inspect_filter(recipe: Any, inspect_filter: "InspectModelFilter", tasks: Sequence[str] = ("train",),
                       clients: Sequence[str] | None = None) -> None:
    """Put ``inspect_filter`` in the sites' ``task_data_filters`` (as ``add_update_filter`` does for the
    result filters; it sets the whole section).

    Args:
        recipe: the NVFlare ``Recipe`` (``FedAvgRecipe``, ...) whose sites get the filter.
        inspect_filter: the ``InspectModelFilter`` that checks every model the server sends.
        tasks: the task names the filter applies to.
        clients: the sites; ``None``: every site.
    """
    if not isinstance(inspect_filter, InspectModelFilter):
        raise ConfigError(f"inspect_filter: expected an InspectModelFilter, got {type(inspect_filter).__name__}")
    entry = {"path": f"{InspectModelFilter.__module__}.{InspectModelFilter.__qualname__}",
             "args": {"reference": inspect_filter.reference} if inspect_filter.reference is not None else {}}
    _add_filter_section(recipe, "task_data_filters", entry, tasks, clients)


class InspectModelFilter(Filter):
    """NVFlare task-data filter: refuse a task whose global model carries a malicious-server signature
    (``guardfl.inspect_model`` on the weights, as ``InspectModelMod`` does for Flower).

    ``reference``: ``"module:callable"`` building the site's own model (``"task:Net"``), to refuse other
    architectures (an inserted imprint block); null checks the weights alone. A ``WEIGHTS`` DXO is inspected;
    other task data passes. A model that is not ok is logged in one error line naming the reasons and the
    filter raises ``MaliciousModelError``: NVFlare then answers the task with ``TASK_DATA_FILTER_ERROR``
    and the executor never sees the model (nothing trained, nothing sent). For the checks that need the
    site's data (logits and gradients on its first batch) use ``GuardedTrainer(inspect=True)``.
    """

    def __init__(self, reference: str | None = None) -> None:
        super().__init__()
        if reference is not None and (not isinstance(reference, str) or reference.count(":") != 1):
            raise ConfigError(f"reference: expected null or 'module:callable' building the site's model (got {reference!r})")
        self.reference = reference
        self._model: nn.Module | None = None

    def _reference_model(self) -> nn.Module | None:
        if self.reference is None:
            return None
        if self._model is None:
            import importlib

            module, attr = self.reference.split(":")
            try:
                factory = getattr(importlib.import_module(module), attr)
                model = factory()
            except Exception as err:  # noqa: BLE001 - the user's code
                raise ConfigError(f"reference: cannot build {self.reference} ({type(err).__name__}: {err})") from None
            if not isinstance(model, nn.Module):
                raise ConfigError(f"reference: {self.reference} returned {type(model).__name__}, not a torch.nn.Module")
            self._model = model
        return self._model

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        from guardfl.errors import MaliciousModelError
        from guardfl.inspect import inspect_model

        if shareable.get_return_code() != ReturnCode.OK:
            return shareable
        try:
            dxo = from_shareable(shareable)
        except Exception:  # noqa: BLE001 - not a model: nothing to inspect
            return shareable
        if dxo.data_kind != DataKind.WEIGHTS or not dxo.data:
            return shareable
        try:
            inspection = inspect_model(params_to_state(dxo.data), self._reference_model())
            reasons = inspection.reasons if not inspection.ok else []
        except (ValueError, TypeError, GuardflError) as err:
            reasons = [str(err)]
        if reasons:
            message = "the received model was refused: " + "; ".join(reasons)
            self.log_error(fl_ctx, f"{type(self).__name__}: {message}; the task was not run", fire_event=False)
            raise MaliciousModelError(reasons)
        self.log_info(fl_ctx, f"{type(self).__name__}: the received model passed guardfl.inspect_model", fire_event=False)
        return shareable


# -- running a site's result filters outside NVFlare (the red team) ----------------------------------------
def job_result_filters(job: str | Path, task: str = "train") -> list[dict[str, Any]]:
    """The ``{"path", "args"}`` entries of the result filters a site applies to ``task``, read from an
    exported NVFlare job (a folder holding one ``config_fed_client.json``) or that file itself."""
    path = Path(job)
    files = [path] if path.is_file() else sorted(path.rglob("config_fed_client.json"))
    if len(files) != 1:
        raise ConfigError(f"target.job: expected an exported NVFlare job with exactly one config_fed_client.json, "
                          f"found {len(files)} under {str(path)!r}")
    try:
        config = json.loads(files[0].read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"target.job: cannot read {files[0]} ({err})") from None
    entries = []
    for chain in config.get("task_result_filters", []):
        if task in chain.get("tasks", []) or "*" in chain.get("tasks", []):
            entries.extend(chain.get("filters", []))
    return entries


def build_filters(entries: Sequence[Mapping[str, Any]]) -> list[Any]:
    """NVFlare filters from job-config entries ``{"path": "module.Class", "args": {...}}``."""
    from nvflare.apis.filter import Filter
    from nvflare.fuel.utils.class_utils import instantiate_class

    filters = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping) or not isinstance(entry.get("path"), str):
            raise ConfigError(f"result_filters[{i}]: expected {{path: module.Class, args: {{...}}}}, got {entry!r}")
        try:
            f = instantiate_class(entry["path"], dict(entry.get("args") or {}))
        except GuardflError:
            raise
        except Exception as err:  # noqa: BLE001 - NVFlare's builder raises what the class raises
            raise ConfigError(f"result_filters[{i}]: cannot build {entry['path']} ({type(err).__name__}: {err})") from None
        if not isinstance(f, Filter):
            raise ConfigError(f"result_filters[{i}]: {entry['path']} is not an NVFlare Filter")
        filters.append(f)
    return filters


def apply_result_filters(filters: Sequence[Any], received: Mapping[str, Any], result: FLModel, *,
                         task: str = "train") -> FLModel:
    """Run task-result ``filters`` on a train ``result`` as a site's client runner does: the filters see
    ``BEFORE_TASK_EXECUTION`` with ``received`` (the global model) as the task data, then ``process`` the
    result's shareable in order. Raises ``UndefendedUpdateError`` when a filter refuses the result (a
    return code other than OK): the site would not have sent it."""
    from nvflare.app_common.utils.fl_model_utils import FLModelUtils

    task_id = f"guardfl-{id(result)}"
    ctx = FLContext()
    ctx.set_prop(FLContextKey.TASK_ID, task_id, private=True, sticky=False)
    ctx.set_prop(FLContextKey.TASK_NAME, task, private=True, sticky=False)
    ctx.set_prop(FLContextKey.TASK_DATA, DXO(DataKind.WEIGHTS, dict(received)).to_shareable(), private=True, sticky=False)
    for f in filters:
        f.handle_event(EventType.BEFORE_TASK_EXECUTION, ctx)
    ctx.set_prop(FLContextKey.TASK_DATA, None, private=True, sticky=False)
    shareable = FLModelUtils.to_shareable(copy.copy(result))
    for f in filters:
        shareable = f.process(shareable, ctx)
        if not isinstance(shareable, Shareable) or shareable.get_return_code() != ReturnCode.OK:
            code = shareable.get_return_code() if isinstance(shareable, Shareable) else type(shareable).__name__
            raise UndefendedUpdateError(f"{type(f).__name__} refused the {task!r} result (return code {code}): the site "
                                        "would not send it")
    return FLModelUtils.from_shareable(shareable)


# -- Client API --------------------------------------------------------------------------------------------
def params_to_state(params: Mapping[str, Any]) -> dict[str, Tensor]:
    """An ``FLModel``'s params (numpy arrays or torch tensors) as a CPU state dict (copies)."""
    if not isinstance(params, Mapping) or not params:
        raise ValueError("input_model.params: expected a non-empty dict of arrays (the global model)")
    out = {}
    for k, v in params.items():
        out[k] = v.detach().cpu().clone() if isinstance(v, Tensor) else torch.from_numpy(np.array(v, copy=True))
    return out


def _check_received(received: Mapping[str, Tensor], model: nn.Module) -> None:
    """The received global model against the site's: the same keys, shapes and kind of dtype (floating point
    or not) for every entry, else a ``ValueError`` naming the first that differs (a malformed model, which
    ``load_state_dict`` would partly cast into the model)."""
    own = model.state_dict()
    missing, extra = [k for k in own if k not in received], [k for k in received if k not in own]
    if missing or extra:
        raise ValueError(f"input_model.params: not the site's model (missing {missing[:3]}, unexpected {extra[:3]})")
    for k, mine in own.items():
        got = received[k]
        if tuple(got.shape) != tuple(mine.shape):
            raise ValueError(f"input_model.params: {k} has shape {list(got.shape)}, the site's model {list(mine.shape)}")
        if got.is_floating_point() != mine.is_floating_point() or got.is_complex():
            raise ValueError(f"input_model.params: {k} is {got.dtype}, the site's model holds {mine.dtype} there "
                             "(a floating-point tensor sent as integers, or the reverse)")


class GuardedTrainer:
    """One site's guarded local training for an NVFlare Client API script (see the module docstring).

    ``model``: the site's model (trained in place every round); ``make_optimizer(params)``: its optimizer
    (rebuilt every round); ``defense``: any guardfl defense or stack (optimizer-level, DP-SGD, input
    encodings; a dict, kind, YAML text, path or ``Defense``); ``epochs`` / ``loss_fn`` / ``num_classes`` /
    ``max_steps`` as in ``local_update``; ``inspect``: check the received model first
    (``inspect_disaggregation``: with SEER's D-SNR check too; ``inspect_leak_limit``: refuse any model with
    which the server reads more than that many samples of the first batch; as in ``local_update``, across
    rounds unless ``inspect_leak_history`` is False, with its limits when it is a mapping of ``max_rounds`` /
    ``max_batches``); ``max_rounds``: the site's round budget (``local_update``: after that many rounds sent,
    ``train`` raises ``RoundBudgetError`` before anything is inspected or trained; the count is the state's,
    so keep ``state_path`` for a budget that outlives the process); ``state_path``: a JSON file keeping the ``ClientState``
    between rounds and launches (read when it exists), its leak history beside it (``<state_path>.leak-history``,
    ``LeakHistory.to_bytes``).
    """

    def __init__(self, model: nn.Module, make_optimizer: MakeOptimizer, defense: Defense | Mapping[str, Any] | str | None = None,
                 *, epochs: int = 1, loss_fn: Callable[[Tensor, Tensor], Tensor] = soft_cross_entropy,
                 num_classes: int | None = None, max_steps: int | None = None, inspect: bool | str = False,
                 inspect_disaggregation: bool = False, inspect_leak_limit: int | None = None,
                 inspect_leak_history: bool | Mapping[str, int] = True, max_rounds: int | None = None,
                 state_path: str | Path | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        self.model, self.make_optimizer = model, make_optimizer
        self.defense = defense if isinstance(defense, Defense) else defense_config(defense)
        if self.defense is not None and not isinstance(self.defense, Defense):
            from_config(self.defense)  # a bad config fails here, before the first round
        self.epochs, self.loss_fn, self.num_classes, self.max_steps = epochs, loss_fn, num_classes, max_steps
        self.inspect = inspect_enabled(inspect, inspect_disaggregation, inspect_leak_limit)
        self.inspect_disaggregation, self.inspect_leak_limit = inspect_disaggregation, inspect_leak_limit
        self.inspect_leak_history = inspect_leak_history
        leak_history_for(None, inspect_leak_limit, inspect_leak_history)  # a bad flag fails here, before the first round
        self.max_rounds = check_max_rounds(max_rounds)
        self.state_path = Path(state_path) if state_path is not None else None
        self.state = ClientState()
        self._on_disk = False  # whether self.state came from (or was written to) state_path
        if self.state_path is not None:
            with statefile.locked(self.state_path, "state_path"):  # a corrupt or lost file fails here, before round 1
                self._read_state()
        self.last = None  # the last round's LocalUpdate

    def _history_path(self) -> Path:
        """``<state_path>.leak-history``: the leak history beside the state's JSON."""
        return self.state_path.with_name(self.state_path.name + ".leak-history")

    def _config_record(self) -> dict[str, Any]:
        """What the state file records of this trainer's configuration (checked when it is read back)."""
        defense = self.defense.config.model_dump(mode="json") if isinstance(self.defense, Defense) else self.defense
        return {"defense": json.loads(json.dumps(defense, default=str))}

    def _parse_state(self, data: Any) -> ClientState:
        """The ``ClientState`` of a state file: this format (``STATE_FORMAT``), or the plain ``ClientState`` JSON
        guardfl wrote before it (read as it is: it holds the same counts). Another format version, or a file
        written by a trainer of another defense configuration, is a ``StateFileError`` naming the file."""
        if isinstance(data, dict) and "format" in data:
            if data.get("format") != STATE_FORMAT[0] or data.get("format_version") != STATE_FORMAT[1]:
                raise StateFileError(f"state_path {self.state_path}: format {data.get('format')!r} version "
                                     f"{data.get('format_version')!r}; this guardfl reads {STATE_FORMAT[0]!r} version "
                                     f"{STATE_FORMAT[1]} (a newer guardfl wrote it? run that version)")
            recorded, now = data.get("config"), self._config_record()
            if recorded != now:
                raise StateFileError(f"state_path {self.state_path}: written by a trainer with defense "
                                     f"{json.dumps((recorded or {}).get('defense'))[:120]}, this one runs "
                                     f"{json.dumps(now['defense'])[:120]}: another site's or job's state? pass the same "
                                     "defense, or move the file and its .created marker aside to start a new budget on purpose")
            data = data["state"]
        try:
            return ClientState.from_dict(data)
        except ConfigError as err:
            raise ValueError(str(err)) from None

    def _read_state(self) -> None:
        """Read ``state_path`` (under its lock): a first launch keeps a fresh state; a lost, unreadable, foreign
        or rolled-back file raises ``StateFileError`` naming it (see ``guardfl.integrations.statefile``)."""
        loaded = statefile.load(self.state_path, "state_path", self._parse_state)
        if loaded is None:
            if self._on_disk:  # this trainer wrote it, and it is gone (the marker too)
                raise StateFileError(f"state_path {self.state_path}: deleted while the job ran (this process wrote round "
                                     f"{self.state.rounds} to it): refusing rather than counting from 0; restore it")
            return
        if loaded.rounds < self.state.rounds:
            raise StateFileError(f"state_path {self.state_path}: holds {loaded.rounds} rounds where this process has "
                                 f"counted {self.state.rounds} (an older copy put back?): refusing rather than counting down")
        history = self._history_path()
        loaded.leak_history = (LeakHistory.from_bytes(history.read_bytes()) if history.is_file()
                               else self.state.leak_history if loaded.rounds == self.state.rounds else None)
        self.state, self._on_disk = loaded, True

    def _write_state(self) -> None:
        if self.state.leak_history is not None:  # first: a crash between the two over-remembers, never forgets
            statefile.atomic_write(self._history_path(), self.state.leak_history.to_bytes())
        record = {"format": STATE_FORMAT[0], "format_version": STATE_FORMAT[1], "state": self.state.to_dict(),
                  "config": self._config_record()}
        statefile.save(self.state_path, json.dumps(record))
        self._on_disk = True

    def train(self, input_model: FLModel, loader: Iterable) -> FLModel:
        """Load ``input_model``, train one guarded round over ``loader`` and return the ``FLModel`` to send.

        Fail closed: any failure (a malformed model, the inspection's refusal, the round budget, an error of
        the defense, a state file that is lost, corrupt or in use) raises, after one error line in the log
        (``logging.getLogger("guardfl.integrations.nvflare")``) saying why; nothing is returned, so the
        script sends nothing. With ``state_path`` the state is read and written under its lock."""
        try:
            if self.state_path is None:
                return self._train(input_model, loader)
            with statefile.locked(self.state_path, "state_path"):
                self._read_state()  # another writer's rounds, or a lost file, before anything is trained
                out = self._train(input_model, loader)
                self._write_state()
                return out
        except Exception as err:
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            _LOG.error("GuardedTrainer: %s: %s; nothing was sent", type(err).__name__, reason[:400])
            raise

    def _train(self, input_model: FLModel, loader: Iterable) -> FLModel:
        if not isinstance(input_model, FLModel):
            raise ValueError(f"input_model: expected the FLModel of flare.receive(), got {type(input_model).__name__}")
        if input_model.params_type not in (None, ParamsType.FULL):
            raise ValueError(f"input_model.params_type: {input_model.params_type}; the global model must be FULL weights")
        received = params_to_state(input_model.params)
        _check_received(received, getattr(self.model, "_module", self.model))
        check_budget_left(self.max_rounds, self.state.rounds)  # RoundBudgetError before anything is inspected
        if self.inspect:  # MaliciousModelError before anything is trained
            history = leak_history_for(self.state, self.inspect_leak_limit, self.inspect_leak_history)
            inspect_received(getattr(self.model, "_module", self.model), loader, received=received,
                             disaggregation=self.inspect_disaggregation, leak_limit=self.inspect_leak_limit, history=history)
            self.state.leak_history = history or self.state.leak_history
        load_plain_state_dict(self.model, received)
        result = local_update(self.model, loader, self.make_optimizer, self.defense, self.epochs, state=self.state,
                              loss_fn=self.loss_fn, num_classes=self.num_classes, max_steps=self.max_steps)
        trained = self.model.state_dict() if not hasattr(self.model, "_module") else self.model._module.state_dict()
        params = {}
        for k, template in input_model.params.items():
            value = trained[k].detach().cpu()
            params[k] = value.clone() if isinstance(template, Tensor) else _to_numpy(k, value).copy()
        self.state, self.last = result.state, result
        metrics: dict[str, float] = {"train_loss": float(result.mean_loss)}
        if math.isfinite(result.epsilon):
            metrics["guardfl_epsilon"] = float(result.epsilon)
            metrics["guardfl_delta"] = float(result.dp_delta)
        meta = {MetaKey.NUM_STEPS_CURRENT_ROUND: int(result.steps), "guardfl_round": int(result.state.rounds)}
        return FLModel(params_type=ParamsType.FULL, params=params, metrics=metrics, meta=meta,
                       current_round=input_model.current_round, total_rounds=input_model.total_rounds)


def train(input_model: FLModel, model: nn.Module, loader: Iterable, make_optimizer: MakeOptimizer,
          defense: Defense | Mapping[str, Any] | str | None = None, *, state: ClientState | None = None,
          **kwargs: Any) -> tuple[FLModel, ClientState]:
    """Functional form of ``GuardedTrainer.train``: returns the ``FLModel`` to send and the state to keep.

    Args:
        input_model: the ``FLModel`` the site received (``flare.receive()``).
        model: the local ``nn.Module``, loaded with the received weights and trained.
        loader: the site's training batches.
        make_optimizer: ``params -> torch.optim.Optimizer``, called once per round.
        defense: a defense, its config (a mapping or a YAML path), or ``None`` for none.
        state: the ``ClientState`` the previous round returned (``None``: the first round).
        **kwargs: the other arguments of ``GuardedTrainer`` (epochs, inspection, clipping...).
    """
    trainer = GuardedTrainer(model, make_optimizer, defense, **kwargs)
    trainer.state = copy.deepcopy(state) if state is not None else ClientState()
    out = trainer.train(input_model, loader)
    return out, trainer.state


__all__ = ["GuardUpdateFilter", "InspectModelFilter", "add_inspect_filter", "add_update_filter", "apply_result_filters", "build_filters", "job_result_filters", "GuardedTrainer", "META_KEY", "UPDATE_DATA_KINDS", "defense_config", "params_to_state", "train"]
