"""Which parameter tensors a defense setting can never change: the static side of "never silently nothing".

``last_stats`` reports, step by step, what a defense changed. This answers before training, from the
defense's config and the model's parameter shapes alone, which tensors it leaves as they are in every step,
so that ``guardfl check --model`` and the red team's certificate can warn about them:

    >>> from guardfl.defenses import GradPrune, untouched_layers
    >>> untouched_layers(GradPrune(0.5), [("fc.weight", (10, 84)), ("scale", (1,))])
    [Untouched(name='scale', reason='gradprune (ratio=0.5) never prunes a one-entry tensor (ceil(ratio * (n - 1)) = 0)')]

Only certainties are listed (what holds in every step, whatever the gradient):

- ``gradprune``: a one-entry tensor (``ceil(ratio * (n - 1)) = 0``); with ``scope="global"``, which layers
  are pruned depends on the magnitudes, so nothing is listed unless the whole model has one entry.
- ``outpost``: a one-entry tensor (never pruned, and its risk ``Var(w)`` is 0, so never noised).
- ``soteria``: every tensor but the weight of its ``nn.Linear`` (and that one too when ``prune`` rounds to
  0 features). Given only shapes and ``layer=None``, the layer is unknown: 2-D tensors are not listed.
- ``identity``: every tensor (the deliberate baseline: a caller may skip the warning for it).
- ``stack``: the tensors every member leaves untouched, with the members' reasons.
- Nothing for noise (every entry is noised), sign, GradDefense (its slices are drawn at random each step),
  DP-SGD (every per-sample gradient is clipped and noised) and input encodings (every gradient is computed
  on encoded inputs). Empty tensors are never listed.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, NamedTuple

from torch import Tensor, nn

from guardfl.defenses.base import Defense, DefenseConfig
from guardfl.ops.selection import prune_count

Shapes = nn.Module | Mapping[str, Any] | Iterable[tuple[str, Any]]


class Untouched(NamedTuple):
    """A parameter tensor a defense setting never changes, and why."""

    name: str
    reason: str

    def __str__(self) -> str:
        return f"{self.name}: {self.reason}"


def named_shapes(params: Shapes) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of a model's trainable parameters, of a mapping name -> shape (or tensor), or of
    ``(name, shape)`` pairs."""
    if isinstance(params, nn.Module):
        return [(n, tuple(p.shape)) for n, p in params.named_parameters() if p.requires_grad]
    items = params.items() if isinstance(params, Mapping) else params
    return [(str(n), tuple(s.shape) if isinstance(s, Tensor) else tuple(int(d) for d in s)) for n, s in items]


def untouched_layers(defense: Defense | DefenseConfig | Mapping | str | None, params: Shapes) -> list[Untouched]:
    """The parameter tensors ``defense`` leaves unchanged in every step, in ``params`` order, each with a
    short reason. ``defense``: a defense, its config, or anything ``from_config`` reads (None: no defense,
    every tensor). ``params``: the model (then Soteria's layer is found exactly), or names and shapes
    (see ``named_shapes``). Pure: nothing is built but the config (and, for Soteria, the layer lookup)."""
    from guardfl.defenses.registry import parse_config

    config = None if defense is None else (defense.config if isinstance(defense, Defense) else parse_config(defense))
    shapes = [(n, s) for n, s in named_shapes(params) if math.prod(s) > 0]
    if config is None:
        return [Untouched(n, "no defense") for n, _ in shapes]
    model = params if isinstance(params, nn.Module) else None
    found: dict[str, list[str]] | None = None  # name -> reasons, for the names every leaf leaves untouched
    for leaf in config.leaves():
        reasons = _leaf_untouched(leaf, shapes, model)
        found = reasons if found is None else {n: found[n] + reasons[n] for n in found if n in reasons}
    return [Untouched(n, "; ".join(found[n])) for n, _ in shapes if n in (found or {})]


def _leaf_untouched(leaf: DefenseConfig, shapes: list[tuple[str, tuple[int, ...]]], model: nn.Module | None) -> dict[str, list[str]]:
    kind = leaf.kind
    if kind == "identity":
        return {n: ["identity: no defense"] for n, _ in shapes}
    if kind == "gradprune":
        if leaf.scope == "global":
            total = sum(math.prod(s) for _, s in shapes)
            if prune_count(leaf.ratio, total) == 0:
                return {n: [f"gradprune (ratio={leaf.ratio}, global) prunes 0 of the model's {total} entries"] for n, _ in shapes}
            return {}
        return {n: [f"gradprune (ratio={leaf.ratio}) never prunes a one-entry tensor (ceil(ratio * (n - 1)) = 0)"]
                for n, s in shapes if prune_count(leaf.ratio, math.prod(s)) == 0}
    if kind == "outpost":
        return {n: ["outpost never changes a one-entry tensor (never pruned; its risk Var(w) is 0, so no noise)"]
                for n, s in shapes if math.prod(s) == 1}
    if kind == "soteria":
        return _soteria_untouched(leaf, shapes, model)
    return {}


def _soteria_untouched(leaf: DefenseConfig, shapes: list[tuple[str, tuple[int, ...]]], model: nn.Module | None) -> dict[str, list[str]]:
    from guardfl.defenses.soteria import Soteria

    if model is not None:
        layer, _ = Soteria.from_config(leaf).find_layer(model)
    else:
        layer = leaf.layer.removeprefix("_module.") if leaf.layer is not None else None
    out: dict[str, list[str]] = {}
    for n, s in shapes:
        plain = n.removeprefix("_module.")
        if layer is None and len(s) == 2:
            continue  # the first nn.Linear's weight is unknown without the model: not certain
        if layer is not None and plain == f"{layer}.weight":
            if len(s) == 2 and prune_count(leaf.prune, s[1]) == 0:
                out[n] = [f"soteria (prune={leaf.prune}) prunes 0 of the {s[1]} input features of {layer!r}"]
            continue
        where = f"the weight of nn.Linear {layer!r}" if layer is not None else "the weight of the first nn.Linear"
        out[n] = [f"soteria prunes only {where}"]
    return out
