"""The gradient-matching engine shared by the attacks.

``Replica`` is a functional copy of the client's computation built only from what the attacker knows
(``Observation`` + ``Knowledge``): it maps a guess (inputs, labels) to the update the client would have
sent (FedSGD: the batch gradient; FedAvg: the delta of the unrolled local steps, ``torch.func``), with a
differentiable surrogate of the known defense inside each step. ``Replica.objective`` adds the distance
to the observed update and the priors. ``optimise_batched`` runs all restarts at once: ``torch.func.vmap``
over the restart axis and an elementwise optimiser (Adam, signed gradients), which is exactly equivalent to
running the restarts one after another.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from guardfl.redteam.attacks import objectives as obj
from guardfl.redteam.client import FedAvg, Observation, bn_layers, sgd_step
from guardfl.redteam.attacks.known_defense import known_defense
from guardfl.redteam.threat import Knowledge


@dataclass(frozen=True)
class ObjectiveWeights:
    distance: str = "cosine"  # "cosine" or "l2"
    tv: float = 0.0
    bn: float = 0.0
    group: float = 0.0


class Replica:
    """The attacker's functional copy of the client (see module docstring)."""

    def __init__(self, observation: Observation, knowledge: Knowledge, weights: ObjectiveWeights, device: torch.device):
        self.obs = observation
        self.knowledge = knowledge
        self.weights = weights
        self.device = device
        model = copy.deepcopy(observation.model).to(device)
        self._bn_records: list[tuple[Tensor, Tensor]] = []
        self._configure_bn(model, knowledge)
        self.model = model
        self.names = observation.param_names
        named = dict(model.named_parameters())
        self.params = {n: named[n].detach() for n in self.names}
        self.frozen = {n: p.detach() for n, p in model.named_parameters() if n not in self.params}
        self.buffers = {n: b for n, b in model.named_buffers()}
        self.observed = [observation.update[n].to(device) for n in self.names]

        self.known = known_defense(knowledge.defense_config)
        self.signed = self.known.signed
        self.pruned = self.known.pruned
        # the update stays a list of layers: the distances sum layer by layer (no flat 11M-entry copies)
        self.observed_norm = obj.layers_norm(self.observed)
        self.masks = [o != 0 for o in self.observed] if self.pruned else None
        self.protocol = knowledge.protocol
        self.batch_size = observation.batch_size
        self.n = observation.num_samples
        # Eq. 4 of Wu et al. for one sample; a tanh surrogate of sign inside each simulated step otherwise
        self.hinge = self.signed and not isinstance(self.protocol, FedAvg) and self.protocol is not None and self.n == 1
        self.bn_target = knowledge.bn_target if knowledge.bn_mode in ("exact", "infer") else None
        if self.bn_target is not None:
            self.bn_target = [(m.to(device), v.to(device)) for m, v in self.bn_target]

    # -- BatchNorm --------------------------------------------------------------------------------------
    def _configure_bn(self, model: nn.Module, knowledge: Knowledge) -> None:
        layers = bn_layers(model)
        if knowledge.bn_mode == "proxy":
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
        logits = functional_call(self.model, ({**self.frozen, **params}, self.buffers), (x,), tie_weights=False)
        return F.cross_entropy(logits, y)

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

    def distance(self, sim: list[Tensor]) -> Tensor:
        if self.hinge:
            return obj.sign_hinge_distance_layers(sim, self.observed)
        if self.weights.distance == "l2":
            # divided by ||observed||^2: same minimiser as DLG's L2, but scale-free, so that a tiny update
            # (a FedAvg delta at lr 0.01) does not fall under the optimiser's tolerances
            return obj.l2_distance_layers(sim, self.observed, self.masks) / (self.observed_norm.pow(2).to(sim[0].dtype) + 1e-30)
        return obj.cosine_distance_layers(sim, self.observed, self.masks, self.observed_norm)

    def objective(self, x: Tensor, y: Tensor, anchor: Tensor | None = None) -> Tensor:
        """Distance to the observed update plus the weighted priors, for one guess."""
        self._bn_records.clear()
        value = self.distance(self.simulate(x, y))
        w = self.weights
        if w.tv:
            value = value + w.tv * obj.total_variation(x.abs() if self.known.abs_tv else x)
        if w.bn and self.bn_target is not None:
            first_pass = self._bn_records[: len(self.bn_target)]
            value = value + w.bn * obj.bn_prior(first_pass, self.bn_target)
        if w.group and anchor is not None:
            value = value + w.group * (x - anchor).pow(2).mean()
        self._bn_records.clear()
        return value


def lr_at(step: int, total: int, lr: float) -> float:
    """Geiping et al. 2020 schedule: x0.1 at 3/8, 5/8 and 7/8 of the iterations."""
    drops = sum(step >= math.floor(total * f) for f in (3 / 8, 5 / 8, 7 / 8))
    return lr * (0.1**drops)


ADAM = (0.9, 0.999, 1e-8)  # beta1, beta2, eps (torch's defaults)


def adam_step_(x: Tensor, g: Tensor, m: Tensor, v: Tensor, step_size: Tensor, bias2: Tensor,
               bounds: tuple[float, float], signed: bool) -> None:
    """One Adam step of every restart, in place, then the box projection. ``step_size`` (the scheduled
    learning rate over beta1's bias correction) and ``bias2`` (beta2's correction) are 0-dim tensors on
    ``x``'s device, so that one recorded step (a CUDA graph) replays with each iteration's values."""
    b1, b2, eps = ADAM
    if signed:
        g = g.sign()
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    x.sub_((m / (v / bias2).sqrt_().add_(eps)).mul_(step_size))
    x.clamp_(*bounds)


def _schedule(step: int, iterations: int, lr: float) -> tuple[float, float]:
    """(step size, beta2 bias correction) of iteration ``step`` (0-based)."""
    b1, b2, _ = ADAM
    t = step + 1
    return lr_at(step, iterations, lr) / (1 - b1**t), 1 - b2**t


def optimise_batched(
    objective: Callable[[Tensor, Tensor | None], Tensor],
    x0: Tensor,
    *,
    iterations: int,
    lr: float,
    bounds: tuple[float, float],
    signed: bool = True,
    group_every: int = 0,
    progress: Callable[[int], None] | None = None,
    cuda_graph: bool | None = None,
    vmap_restarts: bool = True,
) -> Tensor:
    """Adam over all restarts at once: ``x0`` is ``(R, n, ...)``; ``objective(x, anchor)`` is one
    restart's objective. With ``group_every`` the anchor is the restarts' mean image (group consistency,
    Yin et al. 2021), refreshed every ``group_every`` iterations. Returns the final ``(R, n, ...)``.

    The loop never reads a value back to the host (tests run it on the ``meta`` device). On CUDA
    (``cuda_graph`` None: whenever ``x0`` is on a GPU) one iteration (objective, double backward, Adam
    step) is recorded once as a CUDA graph and replayed: the same kernels on the same buffers, without
    Python and dispatcher overhead per operator, which dominates for small batches (ResNet-18: ~75 ms of
    host work per iteration for ~5 ms of GPU work). If recording fails, the loop runs eagerly instead.

    ``vmap_restarts``: the R objectives as one vmapped forward (one set of larger kernels: fast for small
    models, where per-operator overhead dominates) or as R ordinary forwards summed (the same gradients:
    restarts are independent; faster for large models on a CPU, where vmap's batched convolution
    gradients cost more than R plain ones). ``restarts_vmapped`` chooses."""
    x = x0.clone()
    m = torch.zeros_like(x)
    v = torch.zeros_like(x)
    anchor = x.mean(0).detach() if group_every else None
    # Restarts are independent, so d(sum_r f_r)/dx_r = df_r/dx_r: one vmapped forward of the R
    # objectives and one ordinary backward give every restart's gradient.
    if vmap_restarts:
        per_restart = vmap(objective, in_dims=(0, None))
    else:  # one ordinary forward per restart (large models on a CPU: see ``vmap_restarts``)
        per_restart = lambda xs, a: torch.stack([objective(xs[r], a) for r in range(xs.shape[0])])  # noqa: E731
    step_size = torch.zeros((), device=x.device, dtype=x.dtype)
    bias2 = torch.ones((), device=x.device, dtype=x.dtype)

    def iteration() -> None:
        xr = x.detach().requires_grad_(True)
        (g,) = torch.autograd.grad(per_restart(xr, anchor).sum(), xr)
        adam_step_(x, g, m, v, step_size, bias2, bounds, signed)

    use_graph = x.device.type == "cuda" if cuda_graph is None else cuda_graph
    step = record_cuda_graph(iteration, (x, m, v)) if use_graph and iterations > 1 else None
    for i in range(iterations):
        if group_every and i % group_every == 0:
            anchor.copy_(x.mean(0))
        a, b = _schedule(i, iterations, lr)
        step_size.fill_(a)
        bias2.fill_(b)
        (step or iteration)()
        if progress is not None:
            progress(1)
    return x


def restarts_vmapped(model: nn.Module, device: torch.device) -> bool:
    """Whether ``optimise_batched`` should vmap the restarts of an attack on ``model``: always on a GPU
    (measured there with vmap only), and on a CPU for models under ``LARGE_MODEL`` parameters."""
    from guardfl.redteam.workers import LARGE_MODEL

    return device.type != "cpu" or sum(p.numel() for p in model.parameters()) < LARGE_MODEL


def record_cuda_graph(fn: Callable[[], None], state: tuple[Tensor, ...], warmup: int = 3) -> Callable[[], None] | None:
    """``fn`` (which updates ``state`` in place) recorded as a CUDA graph; returns its replay, or None
    when recording is not possible (then the caller runs ``fn`` eagerly). ``state`` is restored after the
    warm-up runs that recording needs (cuDNN/cuBLAS plans, autograd's lazy allocations)."""
    saved = [t.clone() for t in state]
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        for t, s in zip(state, saved):
            t.copy_(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception as err:  # noqa: BLE001  recording is an optimisation; the eager loop gives the same result
        import warnings

        warnings.warn(f"CUDA graph recording failed ({type(err).__name__}: {err}); running eagerly", RuntimeWarning)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        for t, s in zip(state, saved):
            t.copy_(s)
        return None
    return graph.replay  # recording runs no kernels: the state is the restored one


def evaluate_batched(objective: Callable[[Tensor, Tensor | None], Tensor], x: Tensor) -> Tensor:
    """The objective (without the group term) of each restart: ``(R,)``."""
    with torch.no_grad():
        return vmap(lambda xi: objective(xi, None))(x)
