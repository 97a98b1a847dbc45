"""The attacker's replica of the client: a guess's simulated update, its distance to the observed one, priors.

``Replica`` is a functional copy of the client's computation built only from what the attacker knows
(``Observation`` + ``Knowledge``): it maps a guess (inputs, labels) to the update the client would have
sent (FedSGD: the batch gradient; FedAvg: the delta of the unrolled local steps, ``torch.func``), with a
differentiable surrogate of the known defense inside each step. ``Replica.objective`` adds the distance
to the observed update and the priors; ``optimiser.optimise_batched`` minimises it over all restarts at once.

Several private samples of one setting run in one loop too: ``Replica.objective(x, y, anchor, target)``
reads the sample's target (``targets.observation_target``) instead of its own, and
``optimise_batched(..., targets=...)`` vmaps the objective over samples and restarts.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from guardfl.redteam import modality
from guardfl.redteam.attacks.optimisation import objectives as obj
from guardfl.redteam.client.simulate import FedAvg, FedSGD, Observation, bn_layers, sgd_step
from guardfl.redteam.attacks.optimisation.factored import ConvTaps, choose_taps, conv_dot, conv_square
from guardfl.redteam.attacks.known_defense import known_defense
from guardfl.redteam.attacks.optimisation.second_order import second_order_convs_
from guardfl.redteam.attacks.optimisation.targets import observation_target
from guardfl.redteam.runtime.limits import LARGE_MODEL
from guardfl.redteam.threat import Knowledge


@dataclass(frozen=True)
class ObjectiveWeights:
    distance: str = "cosine"  # "cosine", "l2" or "tag" (L2 + tag_alpha * w_l * L1, Deng et al. 2021)
    tag_alpha: float = 0.1
    tv: float = 0.0
    bn: float = 0.0
    group: float = 0.0


class Replica:
    """The attacker's functional copy of the client (see module docstring). Its own observation's target
    is ``self.target``; ``distance`` and ``objective`` take another sample's target of the same setting
    (``observation_target``), so that one replica serves a batch of private samples."""

    def __init__(self, observation: Observation, knowledge: Knowledge, weights: ObjectiveWeights, device: torch.device):
        self.obs = observation
        self.knowledge = knowledge
        self.weights = weights
        self.device = device
        model = copy.deepcopy(observation.model).to(device)
        if second_order_pays(model, device):
            second_order_convs_(model)  # the attacker's copy: no weight-of-weight term in the double backward
        self._bn_records: list[tuple[Tensor, Tensor]] = []
        self._configure_bn(model, knowledge)
        self.model = model
        self.names = observation.param_names
        named = dict(model.named_parameters())
        self.params = {n: named[n].detach() for n in self.names}
        self.frozen = {n: p.detach() for n, p in model.named_parameters() if n not in self.params}
        self.buffers = {n: b for n, b in model.named_buffers()}

        self.known = known_defense(knowledge.defense_config)
        self.signed = self.known.signed
        self.pruned = self.known.pruned
        self.target = observation_target(observation, knowledge, self.pruned, device)
        self.observed = self.target["observed"]
        self.observed_norm = self.target["observed_norm"]
        self.masks = self.target.get("masks")
        self.protocol = knowledge.protocol
        self.batch_size = observation.batch_size
        self.n = observation.num_samples
        # Eq. 4 of Wu et al. for one sample; a tanh surrogate of sign inside each simulated step otherwise
        self.hinge = self.signed and not isinstance(self.protocol, FedAvg) and self.protocol is not None and self.n == 1
        self.bn_target = self.target.get("bn")
        self.taps = self._choose_taps()

    def _choose_taps(self) -> ConvTaps | None:
        """The convolutions whose weight gradients the cosine reads in factored form (``factored``): for the
        cosine of a FedSGD image update that the known defense neither signs, clips nor masks (then the
        distance needs only <dW, O> and |dW|^2 of each layer); None otherwise, or when no layer pays."""
        if (self.weights.distance != "cosine" or not isinstance(self.protocol, FedSGD) or self.signed
                or self.known.clip_norm is not None or self.masks is not None
                or modality.get(self.obs.modality).tokenized):
            return None
        example = torch.zeros(self.n, *self.obs.input_shape, device=self.device)
        taps = choose_taps(self.model, self.names, example)
        self._bn_records.clear()
        return taps

    @property
    def vmap_restarts(self) -> bool:
        """Whether ``optimise_batched`` should vmap this replica's restarts: ``restarts_vmapped``, and on a
        CPU also for a large model whose convolutions are factored (every kernel under vmap then shares
        its weight; ResNet-18, 4 restarts x 1 image, 2 threads: 96-134 ms per restart-iteration looped and
        materialised, 47 ms vmapped and factored)."""
        return self.taps is not None or restarts_vmapped(self.obs.model, self.device)

    # -- BatchNorm --------------------------------------------------------------------------------------
    def _configure_bn(self, model: nn.Module, knowledge: Knowledge) -> None:
        layers = bn_layers(model)
        if not self.obs.train_mode:
            # an eval-mode client (``client.train_mode: false``) normalises with the running statistics the
            # global model carries, and runs no dropout: so does its replica
            model.eval()
        elif knowledge.bn_mode == "proxy":
            # normalise with the released running statistics (Huang et al. 2021, BN_proxy)
            for bn, (mean, var) in zip(layers, knowledge.bn_target or []):
                bn.running_mean.copy_(mean)
                bn.running_var.copy_(var)
                bn.eval()
        else:
            # train-mode BatchNorm (batch statistics of the guess) without touching running buffers
            for bn in layers:
                bn.track_running_stats = False
                bn.running_mean = None
                bn.running_var = None
                bn.num_batches_tracked = None
        records = self._bn_records

        def record(_module, inputs):
            x = inputs[0]
            dims = [0, *range(2, x.dim())]
            records.append((x.mean(dims), x.var(dims, unbiased=False)))

        for bn in layers:
            bn.register_forward_pre_hook(record)

    # -- the client's computation ----------------------------------------------------------------------
    def _loss(self, params: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        kind = modality.get(self.obs.modality)  # text: x are token embeddings (TAG's variables), fed past the lookup
        args, kwargs = kind.model_inputs(x)
        logits = functional_call(self.model, ({**self.frozen, **params}, self.buffers), args, kwargs, tie_weights=False)
        return kind.loss(logits, y)

    def _clipped_gradient(self, params: dict[str, Tensor], x: Tensor, y: Tensor) -> dict[str, Tensor]:
        """DP-SGD's batch gradient without its noise: each sample's gradient clipped to the known norm C
        (Opacus's factor min(1, C / (||g_i|| + 1e-6))), summed, divided by the batch size."""
        one = lambda p, xi, yi: self._loss(p, xi[None], yi[None])  # noqa: E731
        per = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
        norms = torch.sqrt(sum(v.flatten(1).pow(2).sum(1) for v in per.values()))
        factor = (self.known.clip_norm / (norms + 1e-6)).clamp(max=1.0)
        return {k: torch.einsum("b,b...->...", factor, v) / x.shape[0] for k, v in per.items()}

    def _step_gradient(self, params: dict[str, Tensor], x: Tensor, y: Tensor) -> dict[str, Tensor]:
        if self.known.clip_norm is not None:
            g = self._clipped_gradient(params, x, y)
        else:
            g = grad(self._loss)(params, x, y)
        if self.signed and not self.hinge:
            g = {k: obj.soft_sign(v) for k, v in g.items()}
        return g

    def simulate(self, x: Tensor, y: Tensor) -> list[Tensor]:
        """The update the client would send for inputs ``x`` and labels ``y`` (indices or probabilities)."""
        p = self.protocol
        if not isinstance(p, FedAvg):
            g = self._step_gradient(self.params, x, y)
            out = [g[n] for n in self.names]
            return out if p is not None else [-t for t in out]  # unknown FedAvg: delta ~ -gradient
        params = dict(self.params)
        momentum: dict[str, Tensor] | None = None
        b = p.batch_size
        for _ in range(p.epochs):
            for i in range(0, self.n, b):
                g = self._step_gradient(params, x[i : i + b], y[i : i + b])
                params, momentum = sgd_step(params, g, momentum, p)
        return [params[n] - self.params[n] for n in self.names]

    def factored_cosine(self, x: Tensor, y: Tensor, target: dict[str, Any]) -> Tensor:
        """``distance(simulate(x, y), target)`` for the cosine of a FedSGD update, the tapped layers' weight
        gradients never materialised (``factored``): the same value in another summation order."""
        taps = self.taps
        fixed = {n: self.params[n] for n in taps.weights}
        free = {n: p for n, p in self.params.items() if n not in fixed}

        def loss(params: dict[str, Tensor], zeros: list[Tensor]):
            with taps.active(zeros) as inputs:
                value = self._loss({**fixed, **params}, x, y)
            return value, list(inputs)

        (grads, outputs), inputs = grad(loss, argnums=(0, 1), has_aux=True)(free, taps.zeros(x))
        observed = dict(zip(self.names, target["observed"]))
        names = [n for n in self.names if n in free]
        if names:
            dot, square = obj.dot_and_square([grads[n] for n in names], [observed[n] for n in names])
        else:
            dot = square = x.new_zeros((), dtype=torch.float64)
        for layer, weight, g, a in zip(taps.layers, taps.weights, outputs, inputs):
            dot = dot + conv_dot(g, a, layer, observed[weight])
            square = square + conv_square(g, a, layer)
        return obj.cosine_from(dot, square, target["observed_norm"], x.dtype)

    def distance(self, sim: list[Tensor], target: dict[str, Any] | None = None) -> Tensor:
        """Distance of a simulated update to the observed one (``target``'s; default: this replica's)."""
        t = self.target if target is None else target
        observed, norm, masks = t["observed"], t["observed_norm"], t.get("masks")
        if self.weights.distance == "tag":
            return obj.tag_distance_layers(sim, observed, masks, self.weights.tag_alpha, signed=self.hinge)
        if self.hinge:
            return obj.sign_hinge_distance_layers(sim, observed)
        if self.weights.distance == "l2":
            # divided by ||observed||^2: same minimiser as DLG's L2, but scale-free, so that a tiny update
            # (a FedAvg delta at lr 0.01) does not fall under the optimiser's tolerances
            return obj.l2_distance_layers(sim, observed, masks) / (norm.pow(2).to(sim[0].dtype) + 1e-30)
        return obj.cosine_distance_layers(sim, observed, masks, norm)

    def objective(self, x: Tensor, y: Tensor, anchor: Tensor | None = None, target: dict[str, Any] | None = None) -> Tensor:
        """Distance to the observed update plus the weighted priors, for one guess (against ``target``,
        another observation of the same setting, when given: ``observation_target``)."""
        t = self.target if target is None else target
        self._bn_records.clear()
        value = self.factored_cosine(x, y, t) if self.taps is not None else self.distance(self.simulate(x, y), t)
        w = self.weights
        if w.tv:
            value = value + w.tv * obj.total_variation(x.abs() if self.known.abs_tv else x)
        bn_target = t.get("bn")
        if w.bn and bn_target is not None:
            first_pass = self._bn_records[: len(bn_target)]
            value = value + w.bn * obj.bn_prior(first_pass, bn_target)
        if w.group and anchor is not None:
            value = value + w.group * (x - anchor).pow(2).mean()
        self._bn_records.clear()
        return value

def _large(model: nn.Module) -> bool:
    """A model of ``LARGE_MODEL`` parameters or more (ResNet-18, not LeNet): where a CPU's arithmetic, not
    per-operator overhead, sets an attack's speed."""
    return sum(p.numel() for p in model.parameters()) >= LARGE_MODEL


def restarts_vmapped(model: nn.Module, device: torch.device) -> bool:
    """Whether ``optimise_batched`` should vmap the restarts of an attack on ``model``: always on a GPU
    (measured there with vmap only), and on a CPU for models under ``LARGE_MODEL`` parameters."""
    return device.type != "cpu" or not _large(model)


def second_order_pays(model: nn.Module, device: torch.device) -> bool:
    """Whether the replica should use ``SecondOrderConv2d``: on a GPU (a third of the peak memory at the
    same speed, ResNet-18 on an H100) and for models of ``LARGE_MODEL`` parameters or more on a CPU
    (ResNet-18: 1.3x per objective and gradient); not for a small model on a CPU, where the custom
    function's Python overhead outweighs the saved arithmetic (LeNet, 16 samples x 4 restarts, one thread:
    53-56 -> 57-59 ms per iteration)."""
    return device.type != "cpu" or _large(model)
