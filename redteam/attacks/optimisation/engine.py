"""The gradient-matching engine shared by the attacks.

``Replica`` is a functional copy of the client's computation built only from what the attacker knows
(``Observation`` + ``Knowledge``): it maps a guess (inputs, labels) to the update the client would have
sent (FedSGD: the batch gradient; FedAvg: the delta of the unrolled local steps, ``torch.func``), with a
differentiable surrogate of the known defense inside each step. ``Replica.objective`` adds the distance
to the observed update and the priors. ``optimise_batched`` runs all restarts at once: ``torch.func.vmap``
over the restart axis and an elementwise optimiser (Adam, signed gradients), which is exactly equivalent to
running the restarts one after another.

Several private samples of one setting (the same model, protocol and defense; different client updates)
run in one loop too: what differs between them is their ``target`` (``observation_target``: the observed
update, its norm, a pruned update's mask, the BatchNorm statistics; the attack adds the labels), a pytree
that ``stack_targets`` stacks along a leading sample axis S. ``Replica.objective(x, y, anchor, target)`` reads
the sample's target instead of its own, and ``optimise_batched(..., targets=...)`` vmaps the objective
over samples (outer) and restarts (inner): S independent attacks, the same maths per sample, the
optimiser state and the group-consistency anchor of each sample its own. Only the reduction order of the
larger batched kernels differs from running the samples one after another (float32 rounding).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from torch.utils import _pytree as pytree

from guardfl.redteam import modality
from guardfl.redteam.attacks.optimisation import objectives as obj
from guardfl.redteam.client.simulate import FedAvg, FedSGD, Observation, bn_layers, sgd_step
from guardfl.redteam.attacks.optimisation.factored import ConvTaps, choose_taps, conv_dot, conv_square
from guardfl.redteam.attacks.known_defense import known_defense
from guardfl.redteam.attacks.optimisation.second_order import second_order_convs_
from guardfl.redteam.runtime.limits import LARGE_MODEL
from guardfl.redteam.threat import Knowledge


@dataclass(frozen=True)
class ObjectiveWeights:
    distance: str = "cosine"  # "cosine", "l2" or "tag" (L2 + tag_alpha * w_l * L1, Deng et al. 2021)
    tag_alpha: float = 0.1
    tv: float = 0.0
    bn: float = 0.0
    group: float = 0.0


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
    objective: Callable[..., Tensor],
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
    targets: Any = None,
    autotune: bool | None = None,
) -> Tensor:
    """Adam over all restarts at once: ``x0`` is ``(R, n, ...)``; ``objective(x, anchor)`` is one
    restart's objective. With ``group_every`` the anchor is the restarts' mean image (group consistency,
    Yin et al. 2021), refreshed every ``group_every`` iterations. Returns the final ``(R, n, ...)``.

    Several samples at once: with ``targets`` (a pytree of tensors with a leading sample axis S, see
    ``stack_targets``), ``x0`` is ``(S, R, n, ...)``, ``objective(x, anchor, target)`` is one restart's
    objective against one sample's target, and each sample's anchor is the mean of ITS restarts (never
    across samples). Returns ``(S, R, n, ...)``. Each sample's trajectory is the one the loop gives for
    that sample alone (``x0[s]``, ``target_of(targets, s)``): the objectives are independent, Adam is
    elementwise and the schedule is shared; only the kernels' reduction order differs (float32 rounding).

    The loop never reads a value back to the host (tests run it on the ``meta`` device). On CUDA
    (``cuda_graph`` None: whenever ``x0`` is on a GPU) one iteration (objective, double backward, Adam
    step) is recorded once as a CUDA graph and replayed: the same kernels on the same buffers, without
    Python and dispatcher overhead per operator, which dominates for small batches (ResNet-18: ~75 ms of
    host work per iteration for ~5 ms of GPU work). If recording fails, the loop runs eagerly instead.

    ``vmap_restarts``: the R (or S x R) objectives as one vmapped forward (one set of larger kernels:
    fast for small models, where per-operator overhead dominates) or as ordinary forwards summed (the
    same gradients: restarts are independent; faster for large models on a CPU, where vmap's per-restart
    weight gradients are grouped convolutions, unless the replica factors them: ``factored``).
    ``Replica.vmap_restarts`` chooses.

    ``autotune`` (None: on CUDA): cuDNN benchmarks its convolution algorithms for each shape once, in the
    warm-up before the graph is recorded, instead of taking its heuristic's first choice; every iteration
    has the same shapes, so the one-off search pays for itself within a few iterations (ResNet-18,
    16 samples x 4 restarts x 16 images on an H100: 172.8 -> 148.6 ms per iteration, TF32). The chosen
    algorithms compute the same convolution (float32, see ``exact_float32``), in another summation order."""
    use_graph = x0.device.type == "cuda" if cuda_graph is None else cuda_graph
    tuned = x0.device.type == "cuda" if autotune is None else autotune
    before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = tuned
    try:
        return _optimise(objective, x0, iterations, lr, bounds, signed, group_every, progress, use_graph,
                         vmap_restarts, targets)
    finally:
        torch.backends.cudnn.benchmark = before


def _optimise(objective, x0, iterations, lr, bounds, signed, group_every, progress, use_graph, vmap_restarts,
              targets) -> Tensor:
    x = x0.clone()
    m = torch.zeros_like(x)
    v = torch.zeros_like(x)
    restart_axis = 0 if targets is None else 1
    anchor = x.mean(restart_axis).detach() if group_every else None
    # Restarts (and samples) are independent, so d(sum_r f_r)/dx_r = df_r/dx_r: one vmapped forward of
    # the objectives and one ordinary backward give every restart's gradient.
    per_restart = _batched_objective(objective, targets, vmap_restarts)
    step_size = torch.zeros((), device=x.device, dtype=x.dtype)
    bias2 = torch.ones((), device=x.device, dtype=x.dtype)

    def iteration() -> None:
        xr = x.detach().requires_grad_(True)
        (g,) = torch.autograd.grad(per_restart(xr, anchor).sum(), xr)
        adam_step_(x, g, m, v, step_size, bias2, bounds, signed)

    step = record_cuda_graph(iteration, (x, m, v)) if use_graph and iterations > 1 else None
    for i in range(iterations):
        if group_every and i % group_every == 0:
            anchor.copy_(x.mean(restart_axis))
        a, b = _schedule(i, iterations, lr)
        step_size.fill_(a)
        bias2.fill_(b)
        (step or iteration)()
        if progress is not None:
            progress(1)
    return x


def _batched_objective(objective: Callable[..., Tensor], targets: Any, vmap_restarts: bool) -> Callable[[Tensor, Tensor | None], Tensor]:
    """``(x, anchor) -> objectives`` of every restart: ``(R,)`` for ``x`` ``(R, n, ...)`` (``targets``
    None), else ``(S, R)`` for ``x`` ``(S, R, n, ...)`` and a per-sample ``anchor`` ``(S, n, ...)``."""
    if targets is None:
        if vmap_restarts:
            return vmap(objective, in_dims=(0, None))
        # one ordinary forward per restart (large models on a CPU: see ``vmap_restarts``)
        return lambda xs, a: torch.stack([objective(xs[r], a) for r in range(xs.shape[0])])  # noqa: E731
    if vmap_restarts:
        # samples outer (their own target and anchor), restarts inner (sharing them)
        restarts = vmap(objective, in_dims=(0, None, None))
        return lambda xs, a: vmap(restarts, in_dims=(0, None if a is None else 0, 0))(xs, a, targets)  # noqa: E731
    per_sample = [target_of(targets, s) for s in range(pytree.tree_leaves(targets)[0].shape[0])]

    def loop(xs: Tensor, a: Tensor | None) -> Tensor:
        return torch.stack([
            torch.stack([objective(xs[s, r], None if a is None else a[s], t) for r in range(xs.shape[1])])
            for s, t in enumerate(per_sample)
        ])

    return loop


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
