"""Adam over all restarts (and samples) of a gradient-matching attack at once, on the CPU or as a CUDA graph.

``optimise_batched`` runs all restarts at once: ``torch.func.vmap`` over the restart axis and an
elementwise optimiser (Adam, signed gradients), which is exactly equivalent to running the restarts one
after another. With ``targets`` (``targets.stack_targets``) it vmaps the objective over samples (outer)
and restarts (inner): S independent attacks, the same maths per sample, the optimiser state and the
group-consistency anchor of each sample its own. Only the reduction order of the larger batched kernels
differs from running the samples one after another (float32 rounding).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import Tensor
from torch.func import vmap
from torch.utils import _pytree as pytree

from guardfl.redteam.attacks.optimisation.targets import target_of


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
