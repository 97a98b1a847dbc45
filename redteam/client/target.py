"""Certify the user's real client: run their Flower ``ClientApp`` or ``train_fn`` on the global model and
turn what it returns into an ``Observation`` the attacks work on.

- ``clientapp: module:attr``: the red team sends the app a ``train`` Message (the global model as an
  ``ArrayRecord`` plus a ``ConfigRecord``), exactly as a FedAvg ServerApp does, with the node config and
  run config of a deployed client, and attacks the reply. The app loads its own private data; the inputs
  and labels it trained on are recorded by ``TrainingCapture`` (the ground truth for the metrics).
- ``nvflare: module:callable``: an NVFlare Client API site's training round, called as
  ``fn(input_model, site="site-<b+1>", **run_config) -> FLModel`` with the global model as a FedAvg server
  sends it (FULL weights); the site's ``train`` result filters (``job``: an exported job, or
  ``result_filters``) then run on the result as NVFlare's client runner runs them, and what they let
  through is attacked. A filter that refuses the result means nothing would be sent: not certified.
- ``train_fn: module:callable``: called as ``train_fn(model, loader) -> model`` with a copy of the global
  model and a loader over the red team's private samples (``data`` section, batches of
  ``client.batch_size`` in order); the returned (or in-place trained) model's delta is attacked.

What leaves the client is the returned weights, so the protocol is FedAvg: the update is
``returned - global`` over the model's trainable parameters; ``client`` (lr, epochs, batch size,
momentum, weight decay) states the local hyperparameters the attacker is assumed to know, and is checked
against the observed number of local steps and batch size. ``defense`` states the defense the client
runs (the attacker knows its configuration); it is NOT applied by the red team: the client applies it.
The attacker's replica replays the batch order of the client's first epoch (later shuffles are unknown
to it).

The red team refuses to certify a client it could not observe: an error reply, a reply whose keys or
shapes differ from what was sent, a non-finite update, a client that did not train (no training forward
pass, or an all-zero update), a loss whose labels it cannot see, or more samples than the attacks handle.
"""

from __future__ import annotations

import contextlib
import copy
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch
from torch import Tensor, nn

from guardfl.defenses import DefenseConfig, parse_config
from guardfl.integrations.round import record_first_bn_inputs
from guardfl.integrations.update import key_mismatch
from guardfl.redteam.client.capture import Step, TrainingCapture
from guardfl.redteam.auxdata import content_hashes
from guardfl.redteam.client.simulate import FedAvg, Observation, SideKnowledge
from guardfl.redteam.threat import defense_kinds
from guardfl.redteam.runtime.userref import UserCodeError, calling, resolve, train_function

#: the attacks reconstruct every distinct sample the client trained on; beyond this the run is refused
MAX_SAMPLES = 64


class TargetError(UserCodeError):
    """The user's client could not be run or observed; the red team does not certify it."""


@contextlib.contextmanager
def on_path(app_dir: str | Path | None):
    """``app_dir`` first on ``sys.path`` while loading and running the user's code."""
    if app_dir is None:
        yield
        return
    path = str(Path(app_dir).resolve())
    sys.path.insert(0, path)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(path)


def load_object(ref: str, field: str) -> Any:
    """``module:attr`` (attr may be dotted) -> the object, narrowed to what ``field`` means (a training
    function for ``target.train_fn``; a ClientApp is checked when it runs); TargetError otherwise."""
    try:
        return train_function(ref, field) if field.endswith("train_fn") else resolve(ref, field)
    except UserCodeError as err:
        raise TargetError(str(err)) from None


def flower_run_config(app_dir: str | Path | None, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The run config a Flower app gets: ``[tool.flwr.app.config]`` of ``app_dir/pyproject.toml`` (when
    there is one), with ``overrides`` on top."""
    base: dict[str, Any] = {}
    if app_dir is not None and (Path(app_dir) / "pyproject.toml").is_file():
        from flwr.common.config import get_fused_config_from_dir

        base = dict(get_fused_config_from_dir(Path(app_dir), {}))
    unknown = sorted(set(overrides) - set(base)) if base else []
    if unknown:
        raise TargetError(f"target.run_config: {unknown} are not in {app_dir}/pyproject.toml's [tool.flwr.app.config]; "
                          f"allowed: {sorted(base)}")
    return {**base, **overrides}


# -- running the client ------------------------------------------------------------------------------
def run_clientapp(app: Any, global_model: nn.Module, *, config: Mapping[str, Any], node_config: Mapping[str, Any],
                  run_config: Mapping[str, Any], node_id: int = 1) -> tuple[dict[str, Tensor], list[Step]]:
    """Send ``app`` a train Message with the global model; return the returned state dict and the steps."""
    from flwr.app import Context, RecordDict
    from flwr.clientapp import ClientApp

    from guardfl.integrations.flower import train_message

    if not isinstance(app, ClientApp):
        raise TargetError(f"target.clientapp: expected a flwr ClientApp, got {type(app).__name__}")
    sent = {k: v.detach().cpu() for k, v in global_model.state_dict().items()}
    msg = train_message(sent, dict(config), node_id=node_id)
    context = Context(run_id=0, node_id=node_id, node_config=dict(node_config), state=RecordDict(), run_config=dict(run_config))
    with TrainingCapture() as capture:
        with calling("target.clientapp", "running it"):  # the user's code: report, do not certify
            reply = app(msg, context)
    if reply.has_error():
        raise TargetError(f"target.clientapp replied with an error (code {reply.error.code}): {reply.error.reason}")
    records = reply.content.array_records
    if len(records) != 1:
        raise TargetError(f"target.clientapp: the reply holds {len(records)} ArrayRecords ({list(records)}); expected exactly one")
    returned = next(iter(records.values())).to_torch_state_dict()
    _check_keys(sent, returned, "target.clientapp")
    return dict(returned), capture.captured.for_model()


def run_train_fn(fn: Callable, global_model: nn.Module, inputs: Tensor, labels: Tensor,
                 batch_size: int) -> tuple[dict[str, Tensor], list[Step]]:
    """Call ``fn(model, loader)``; return the trained model's state dict and the steps."""
    from torch.utils.data import DataLoader, TensorDataset

    if not callable(fn):
        raise TargetError(f"target.train_fn: expected a callable, got {type(fn).__name__}")
    model = copy.deepcopy(global_model)
    sent = {k: v.detach().clone() for k, v in global_model.state_dict().items()}
    loader = DataLoader(TensorDataset(inputs, labels), batch_size=batch_size, shuffle=False)
    with TrainingCapture() as capture:
        with calling("target.train_fn", "running it"):
            out = fn(model, loader)
    if out is None:
        out = model
    if not isinstance(out, nn.Module):
        raise TargetError(f"target.train_fn: returned {type(out).__name__}; expected the trained torch.nn.Module (or None)")
    returned = {k: v.detach().cpu() for k, v in out.state_dict().items()}
    _check_keys(sent, returned, "target.train_fn")
    return returned, capture.captured.for_model()


def nvflare_result_filters(job: str | None, entries: list[dict] | None) -> list:
    """The NVFlare result filters a site applies to its ``train`` results: from the exported ``job``, or
    the ``entries`` given in the config (none when neither is given)."""
    if job is None and not entries:
        return []
    try:
        from guardfl.integrations.nvflare import build_filters, job_result_filters
    except ImportError as err:
        raise TargetError(f"target.nvflare: {err}") from None
    return build_filters(job_result_filters(job) if job is not None else entries)


def run_nvflare(fn: Callable, global_model: nn.Module, *, site: str, kwargs: Mapping[str, Any],
                filters: list) -> tuple[dict[str, Tensor], list[Step]]:
    """Call an NVFlare Client API train round ``fn(input_model, site=site, **kwargs)`` with the global model
    as the ``FLModel`` a FedAvg server sends (FULL numpy weights), run the site's result ``filters`` on what
    it returns as the client runner does, and return the state dict that would reach the server."""
    try:
        from guardfl.errors import GuardflError
        from guardfl.integrations.nvflare import apply_result_filters
        from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
    except ImportError as err:
        raise TargetError(f"target.nvflare: {err}") from None
    if not callable(fn):
        raise TargetError(f"target.nvflare: expected a callable, got {type(fn).__name__}")
    if "site" in kwargs:
        raise TargetError("target.run_config: 'site' is set by the red team, one site per batch (site-1, site-2, ...); "
                          "remove it")
    sent = {k: v.detach().cpu().clone() for k, v in global_model.state_dict().items()}
    params = {k: v.numpy().copy() for k, v in sent.items()}
    input_model = FLModel(params_type=ParamsType.FULL, params=params, current_round=0, total_rounds=1)
    with TrainingCapture() as capture:
        with calling("target.nvflare", "running it"):
            out = fn(input_model, site=site, **dict(kwargs))
    if not isinstance(out, FLModel) or not isinstance(out.params, Mapping) or not out.params:
        raise TargetError(f"target.nvflare: returned {type(out).__name__}; expected the FLModel with the trained weights "
                          "that the script passes to flare.send")
    try:
        out = apply_result_filters(filters, {k: v.numpy() for k, v in sent.items()}, out)
    except (GuardflError, ValueError) as err:
        raise TargetError(f"target.nvflare: {err}") from None
    values = {k: torch.as_tensor(v.detach().cpu() if isinstance(v, Tensor) else np.asarray(v)) for k, v in out.params.items()}
    if out.params_type == ParamsType.DIFF:  # the Client API's DIFF transfer: the server adds it back
        values = {k: sent[k] + v.to(sent[k].dtype) if k in sent else v for k, v in values.items()}
    elif out.params_type not in (None, ParamsType.FULL):
        raise TargetError(f"target.nvflare: the result's params_type is {out.params_type}; expected FULL or DIFF")
    _check_keys(sent, values, "target.nvflare")
    return values, capture.captured.for_model()


def _check_keys(sent: Mapping[str, Tensor], returned: Mapping[str, Tensor], field: str) -> None:
    mismatch = key_mismatch(list(sent), list(returned))
    if mismatch is not None:
        raise TargetError(f"{field}: the returned model's keys differ from those sent ({mismatch})")
    for k, v in sent.items():
        if tuple(returned[k].shape) != tuple(v.shape):
            raise TargetError(f"{field}: {k} came back with shape {tuple(returned[k].shape)}, it was sent as {tuple(v.shape)}")


# -- from a run to an observation ----------------------------------------------------------------------
@dataclass
class TargetRun:
    observation: Observation
    inputs: Tensor  # the distinct private samples the client trained on (ground truth), first-epoch order
    labels: Tensor
    steps: int
    batch_sizes: list[int]


def _distinct(steps: list[Step]) -> tuple[Tensor, Tensor, int]:
    """Distinct samples in order of first use, their labels, and the number of steps of the first epoch."""
    seen: dict[bytes, int] = {}
    xs, ys = [], []
    first_epoch_steps = len(steps)
    for i, step in enumerate(steps):
        fresh = 0
        for x, y in zip(step.inputs, step.labels):
            key = x.cpu().numpy().tobytes()
            if key not in seen:
                seen[key] = len(xs)
                xs.append(x)
                ys.append(y)
                fresh += 1
        if fresh == 0 and len(step.inputs) and first_epoch_steps == len(steps):
            first_epoch_steps = i
    if not xs:
        raise TargetError("the client's training steps held no samples (empty batches only)")
    return torch.stack(xs), torch.stack(ys), first_epoch_steps


def observe(global_model: nn.Module, returned: Mapping[str, Tensor], steps: list[Step], protocol: FedAvg,
            defense_config: DefenseConfig | dict | None, field: str, declared_samples: int | None = None) -> TargetRun:
    """Check what the client did against what is declared (``protocol``; ``declared_samples`` when the
    config states it) and build the ``Observation``. With DP-SGD's Poisson sampling declared, batch sizes
    are random, so only the declared hyperparameters are used (the attacker's replica replays fixed
    batches: an approximation, as it would be for a real attacker)."""
    _check_steps(steps, field)
    defense_config = parse_config(defense_config) if defense_config is not None else None  # once per observation
    inputs, labels, first_epoch = _distinct(steps)
    n, batch_sizes = inputs.shape[0], [int(s.inputs.shape[0]) for s in steps]
    _check_geometry(n, steps, batch_sizes, first_epoch, protocol, defense_config, field, declared_samples)
    update = _update(global_model, returned, field)

    lo, hi = float(inputs.min()), float(inputs.max())
    input_range = (0.0, 1.0) if lo >= 0.0 and hi <= 1.0 else (lo, hi)
    num_classes, records = _probe(global_model, steps[0].inputs)
    observation = Observation(
        protocol=protocol,
        model=copy.deepcopy(global_model),
        update=update,
        num_samples=n,
        input_shape=tuple(inputs.shape[1:]),
        num_classes=num_classes,
        input_range=input_range,
        defense_config=defense_config,
        released_bn_stats=_released(global_model, returned),
        side=SideKnowledge(labels=labels.clone(), bn_batch_stats=list(records), defense_stats=[],
                           input_hashes=tuple(content_hashes(inputs, input_range))),
    )
    return TargetRun(observation, inputs, labels, len(steps), batch_sizes)


def _check_steps(steps: list[Step], field: str) -> None:
    """Refuse a run without training steps, or whose steps' labels the red team cannot read (TargetError)."""
    if not steps:
        raise TargetError(f"{field}: no training step was observed (no forward pass of a model in train mode with "
                          "gradients enabled): the client did not train, so there is no update to certify")
    if any(s.labels is None for s in steps):
        raise TargetError(f"{field}: the client's loss is not torch.nn.functional.cross_entropy / nll_loss (or "
                          "nn.CrossEntropyLoss / NLLLoss) with hard labels, so the red team cannot see the labels it trained on "
                          "(input encodings such as MixUp / InstaHide train on soft labels and are not certified this way)")
    for s in steps:
        if s.labels.dim() != 1 or s.labels.shape[0] != s.inputs.shape[0]:
            raise TargetError(f"{field}: a step's labels have shape {tuple(s.labels.shape)} for {s.inputs.shape[0]} inputs; "
                              "the red team certifies classification with hard labels")


def _check_geometry(n: int, steps: list[Step], batch_sizes: list[int], first_epoch: int, protocol: FedAvg,
                    defense_config: DefenseConfig | None, field: str, declared_samples: int | None) -> None:
    """Refuse a run of more than ``MAX_SAMPLES`` distinct samples, or (without Poisson sampling) one whose
    samples, steps or batch size differ from the declared ones (TargetError)."""
    if n > MAX_SAMPLES:
        raise TargetError(f"{field}: the client trained on {n} distinct samples; the attacks reconstruct at most "
                          f"{MAX_SAMPLES}. Give it a smaller private set for the red team (target.run_config / node_config)")
    poisson = any(c.kind == "dpsgd" and getattr(c, "poisson_sampling", True) for c in defense_kinds(defense_config))
    if not poisson and declared_samples is not None and declared_samples != n:
        raise TargetError(f"client.samples: declares {declared_samples}, but the client trained on {n} distinct samples")
    expected = protocol.epochs * math.ceil(n / protocol.batch_size)
    if not poisson and (len(steps) != expected or batch_sizes[0] != min(protocol.batch_size, n)):
        raise TargetError(
            f"client: declares {protocol.epochs} epoch(s) in batches of {protocol.batch_size} ({expected} steps), but the "
            f"client ran {len(steps)} steps over {n} samples in batches of {batch_sizes[0]} ({first_epoch} per epoch); "
            "set client.epochs and client.batch_size to what it does")


def _update(global_model: nn.Module, returned: Mapping[str, Tensor], field: str) -> dict[str, Tensor]:
    """The returned weights minus the global model's, by trainable parameter (TargetError when a delta is
    not finite, or when every delta is zero: the client did not train)."""
    names = [name for name, p in global_model.named_parameters() if p.requires_grad]
    start = global_model.state_dict()
    update = {}
    for name in names:
        delta = returned[name].to(start[name].dtype) - start[name].detach().cpu()
        if not torch.isfinite(delta).all():
            raise TargetError(f"{field}: the returned {name} holds NaN or infinite values")
        update[name] = delta
    if all(float(d.abs().max()) == 0.0 for d in update.values()):
        raise TargetError(f"{field}: the returned weights equal the global model: the client did not train")
    return update


def _probe(global_model: nn.Module, inputs: Tensor) -> tuple[int, list]:
    """The number of classes and the first BatchNorm inputs of a train-mode copy of the global model on
    the first step's ``inputs`` (no gradients)."""
    probe = copy.deepcopy(global_model).train()
    records, handles = record_first_bn_inputs(probe)
    try:
        with torch.no_grad():
            num_classes = int(probe(inputs).shape[-1])
    finally:
        for h in handles:
            h.remove()
    return num_classes, records


def _released(global_model: nn.Module, returned: Mapping[str, Tensor]) -> list[tuple[Tensor, Tensor]]:
    """The BatchNorm running statistics the client returned (mean, var), in the global model's order."""
    released = []
    for bn_name, bn in global_model.named_modules():
        if isinstance(bn, nn.modules.batchnorm._BatchNorm) and bn.running_mean is not None:
            released.append((returned[f"{bn_name}.running_mean"].clone(), returned[f"{bn_name}.running_var"].clone()))
    return released
