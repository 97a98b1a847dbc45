"""What one observation's objective compares with (its ``target``), and the targets of several samples stacked.

Several private samples of one setting (the same model, protocol and defense; different client updates)
run in one loop: what differs between them is their ``target`` (``observation_target``: the observed
update, its norm, a pruned update's mask, the BatchNorm statistics; the attack adds the labels), a pytree
that ``stack_targets`` stacks along a leading sample axis S and ``target_of`` reads one sample of.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from guardfl.redteam.attacks.optimisation import objectives as obj
from guardfl.redteam.client.simulate import Observation
from guardfl.redteam.threat import Knowledge


def observation_target(observation: Observation, knowledge: Knowledge, pruned: bool, device: torch.device) -> dict[str, Any]:
    """What of one observation its objective compares with (a pytree of tensors on ``device``, no model):
    ``observed`` (the update, layer by layer, in ``observation.param_names`` order), ``observed_norm``,
    ``masks`` (a pruned update's non-zero coordinates when ``pruned``, and only the ``matched`` ones of an
    observation that names them; absent when neither), ``bn`` (the granted
    BatchNorm statistics of the prior: ``bn_mode`` exact or infer only). The labels are the attack's to
    add (granted or restored: ``labels_for``), as ``labels``."""
    observed = [observation.update[n].to(device) for n in observation.param_names]
    # the update stays a list of layers: the distances sum layer by layer (no flat 11M-entry copies)
    target: dict[str, Any] = {"observed": observed, "observed_norm": obj.layers_norm(observed)}
    masks = [o != 0 for o in observed] if pruned else None
    if observation.matched is not None:  # only part of the update is the attack's (a malicious server's view)
        chosen = [observation.matched[n].to(device) for n in observation.param_names]
        masks = chosen if masks is None else [m & c for m, c in zip(masks, chosen)]
    if masks is not None:
        target["masks"] = masks
    if knowledge.bn_mode in ("exact", "infer") and knowledge.bn_target is not None:
        target["bn"] = [(m.to(device), v.to(device)) for m, v in knowledge.bn_target]
    return target


def stack_targets(targets: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The samples' targets as one pytree whose every tensor has a leading sample axis; None when they
    do not stack (different keys, or tensors of different shapes or dtypes: e.g. hard and soft labels)."""
    flat = [pytree.tree_flatten(t) for t in targets]
    spec = flat[0][1]
    if any(other != spec for _, other in flat[1:]):
        return None
    leaves = list(zip(*(leaves for leaves, _ in flat)))
    if any(len({(t.shape, t.dtype) for t in group}) > 1 for group in leaves):
        return None
    return pytree.tree_unflatten([torch.stack(group) for group in leaves], spec)


def target_of(targets: dict[str, Any], s: int) -> dict[str, Any]:
    """Sample ``s``'s target out of stacked ``targets`` (views, no copies)."""
    return pytree.tree_map(lambda t: t[s], targets)
