"""The defense as data augmentation (Wu et al. 2023, Sec. 3.1): what the client would transmit for many
auxiliary batches at once, for attacks that learn from (observation, batch) pairs.

``TransmitSimulator`` is the client of ``simulate_client`` made functional so that thousands of batches
cost one vmapped gradient per local step, never a copy of the model per batch: the same loss
(cross-entropy, mean over the batch), BatchNorm as the client runs it (train mode: the batch's own
statistics; eval mode: the running statistics), the FedSGD gradient or the FedAvg delta (plain SGD with
weight decay then momentum, torch's order). The defense is the REAL guardfl defense code, built from the
configuration the attacker knows with its seed removed (the attacker knows the configuration, never the
randomness): ``Defense.apply_`` runs on each batch's gradient of each local step, exactly where
``GuardedOptimizer`` runs it, with the step's iteration number and that batch's current weights
(``Defense.apply_batch_``: vectorised over the batches where the defense allows). Its private generator
runs on from ``seed`` (the attacker's own, e.g. drawn from the attack's seed, so that a red-team run is
reproducible and does not depend on its worker count) or from OS entropy, never from the client's
seed; every draw continues the stream, so each gets fresh randomness.

The batch gradient is defended, as a real client does. (The public LTI code defends each per-sample
gradient and then averages them: a weaker, different threat that we do not copy.)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import copy

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from guardfl.defenses import REGISTRY, Defense, from_config, parse_config
from guardfl.protect import soft_cross_entropy
from guardfl.redteam.client import FedAvg, FedSGD, bn_layers, sgd_step

if TYPE_CHECKING:
    from guardfl.redteam.attacks.hashing import CountSketch


def unseeded(config: dict | None) -> dict | None:
    """The defense configuration without its seeds (a stack's members included)."""
    if config is None:
        return None
    out = {k: v for k, v in config.items() if k != "seed"}
    if "defenses" in out:
        out["defenses"] = [unseeded(m) for m in out["defenses"]]
    return out


def defense_leaves(config: dict | None) -> list[type[Defense]]:
    """The classes of the leaf defenses of a configuration (a stack expanded at every depth); nothing is
    built, so no randomness is drawn and no public data loaded."""
    return [REGISTRY[leaf.kind] for leaf in parse_config(config).leaves()] if config else []


def config_stages(config: dict | None) -> set[str]:
    """The stages ("gradient", "dp", "input") a defense configuration acts at (empty for none)."""
    return {leaf.stage for leaf in defense_leaves(config)}


class TransmitSimulator:
    """What a client running ``defense_config`` under ``protocol`` transmits, for many batches at once.

    ``updates(x, y)``: ``x`` is ``(N, B, *input_shape)`` (N batches of the client's batch geometry),
    ``y`` is ``(N, B)``; returns ``(N, D)``, each row the flattened update (parameters in
    ``names`` order) the client would send for that batch, each with its own defense draw.
    """

    def __init__(self, model: nn.Module, defense_config: dict | None, protocol: FedSGD | FedAvg, *,
                 train_mode: bool = True, device: torch.device | str = "cpu", chunk: int = 256,
                 seed: int | None = None) -> None:
        if config_stages(defense_config) - {"gradient"}:
            raise ValueError("defense: DP-SGD and input encodings are not simulated as augmentation yet; "
                             "gradient defenses (and their stacks) are")
        self.device = torch.device(device)
        self.protocol = protocol
        self.chunk = chunk
        self.defense: Defense | None = from_config(unseeded(defense_config)) if defense_config else None
        if self.defense is not None and seed is not None:
            self.defense.reseed(seed)  # the attacker's own stream: a reproducible red team
        replica = copy.deepcopy(model).to(self.device)
        replica.train(train_mode)
        if train_mode:
            for bn in bn_layers(replica):  # batch statistics, no running-buffer updates (inert for the update)
                bn.track_running_stats = False
                bn.running_mean = bn.running_var = bn.num_batches_tracked = None
        self.model = replica
        self.names = [n for n, p in replica.named_parameters() if p.requires_grad]
        named = dict(replica.named_parameters())
        self.params = {n: named[n].detach() for n in self.names}
        self.frozen = {n: p.detach() for n, p in replica.named_parameters() if n not in self.params}
        self.buffers = {n: b for n, b in replica.named_buffers()}
        self.dim = sum(self.params[n].numel() for n in self.names)

    def _loss(self, params: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        logits = functional_call(self.model, ({**self.frozen, **params}, self.buffers), (x,), tie_weights=False)
        return soft_cross_entropy(logits, y)

    def _defend(self, grads: dict[str, Tensor], iteration: int, params: dict[str, Tensor], batched_params: bool) -> None:
        """The real defense on each batch's gradient (in place, one draw each): ``Defense.apply_batch_``,
        vectorised over the batches for the defenses that support it (Outpost, pruning), row by row otherwise."""
        if self.defense is None:
            return
        self.defense.apply_batch_([grads[name] for name in self.names], iteration=iteration,
                                  params=[params[name] for name in self.names], names=self.names,
                                  batched_params=batched_params)

    def _chunk_parts(self, x: Tensor, y: Tensor) -> list[Tensor]:
        """Each parameter's rows ``(n, numel)`` in ``names`` order, each with its own storage (the
        consumer may overwrite them): the columns of a chunk's rows without the copy into them."""
        n = x.shape[0]
        if isinstance(self.protocol, FedSGD):
            g = vmap(grad(self._loss), in_dims=(None, 0, 0), randomness="different")(self.params, x, y)
            self._defend(g, 1, self.params, batched_params=False)
            return [g.pop(name).reshape(n, -1) for name in self.names]
        p = self.protocol
        params = {k: v.unsqueeze(0).expand(n, *v.shape).clone() for k, v in self.params.items()}
        momentum: dict[str, Tensor] | None = None
        step_grad = vmap(grad(self._loss), in_dims=(0, 0, 0), randomness="different")
        b, samples, it = p.batch_size, x.shape[1], 0
        for _ in range(p.epochs):
            for lo in range(0, samples, b):
                it += 1
                g = step_grad(params, x[:, lo : lo + b], y[:, lo : lo + b])
                self._defend(g, it, params, batched_params=True)
                params, momentum = sgd_step(params, g, momentum, p)
        return [(params.pop(name) - self.params[name]).reshape(n, -1) for name in self.names]

    def chunks(self, x: Tensor, y: Tensor, parts: bool = False) -> Iterator[Any]:
        """The rows of ``updates(x, y)``, ``chunk`` batches at a time (for a consumer that reduces each
        chunk, e.g. hashes it, instead of holding every full row). ``y`` is ``(N, B)`` or, for a causal
        LM's next tokens (or soft labels), ``(N, B, ...)``. With ``parts``, each chunk comes as the list
        of its per-parameter column blocks (``_chunk_parts``: ``CountSketch.of_parts`` hashes them
        without building the rows, which for a language model are hundreds of MB per chunk)."""
        if x.dim() < 3 or y.dim() < 2 or x.shape[:2] != y.shape[:2]:
            raise ValueError(f"updates: expected x (N, B, ...) and y (N, B, ...); got {tuple(x.shape)} and {tuple(y.shape)}")
        for i in range(0, x.shape[0], self.chunk):
            xi, yi = x[i : i + self.chunk].to(self.device), y[i : i + self.chunk].to(self.device)
            blocks = [t.detach() for t in self._chunk_parts(xi, yi)]
            yield blocks if parts else torch.cat(blocks, 1)

    def updates(self, x: Tensor, y: Tensor, sketch: CountSketch | None = None) -> Tensor:
        """Every batch's row, or with ``sketch`` its hash, computed chunk by chunk and parameter block by
        parameter block (``CountSketch.of_parts``): the full rows are never held."""
        if sketch is None:
            return torch.cat(list(self.chunks(x, y)))
        return torch.cat([sketch.of_parts(blocks) for blocks in self.chunks(x, y, parts=True)])


def flatten_update(update: dict[str, Tensor], names: list[str]) -> Tensor:
    """An observation's update as one vector in ``names`` order."""
    missing = [n for n in names if n not in update]
    if missing:
        raise ValueError(f"update: missing parameters {missing[:3]} of the model")
    return torch.cat([update[n].reshape(-1) for n in names])
