"""GradDefense (Wang et al. 2022, "Protect Privacy from Gradient Leakage Attack in Federated Learning",
INFOCOM 2022; public code github.com/wangjunxiao/GradDefense, also in TL-System/plato
``examples/gradient_leakage_attacks/defense/GradDefense``). A baseline of the Outpost paper (Wang et al.
2024, Sec. V: "we turn on the local clipping operation and use the same settings in their source code with
0.01 as the Gaussian noise variance"); the defaults are those settings: plato's ``slices_num: 10``,
``perturb_slices_num: 5``, ``scale: 0.01``, ``clip: true``, and a 50-sample root set.

Each step:

1. sensitivity: for every layer (parameter tensor) ``l``, the mean over the root set's samples of
   ``||d/dx sum_j dL/dtheta_{l,j}||_F`` (``guardfl.ops.sensitivity.layer_sensitivity``);
2. slicing: the gradient, flattened in parameter order, is cut into ``slices`` contiguous slices of equal
   total sensitivity (each layer's sensitivity spread evenly over its entries), so a sensitive layer is
   cut into more, smaller slices;
3. ``perturb_slices`` of the ``slices`` slices are drawn uniformly at random (the reference's reservoir
   sampling); with ``clip``, each drawn slice is clipped to L2 norm ``clip_norm`` (default: ``noise``, the
   reference's bound); then N(0, ``noise``^2) is added to every entry of the drawn slices.

Interpretation and deviations (cited against the public code at its latest version):

- Noise scale: the reference passes ``scale`` as the standard deviation of ``random.gauss``; the Outpost
  paper calls 0.01 a "variance". We follow the code: ``noise`` is the standard deviation.
- Root set: the reference takes 5 samples per class (50) from the client's training set. The defense sees
  the inputs the model is called with, not the labels, so the root set is the first ``root_size`` inputs
  the client trains on (the first step's batch, grown from later batches up to ``root_size``; kept, on
  the client, for later rounds while the model object stays the same: another model object, such as
  another simulated client's copy, starts a new root set), not class-balanced; and the loss is the
  cross-entropy against the model's own predictions (argmax) instead of the true labels. Inputs whose
  shape differs from the root set's are not added to it.
- When: the reference computes the sensitivity once per training run (plato's ``get_train_loader``, i.e.
  once per FL round, on the model at the start of the round). ``refresh="round"`` (default) does the same
  at the round's first local step (``GuardedOptimizer.new_round()`` restarts the count);
  ``refresh="step"`` recomputes it at every step, as the Outpost paper describes GradDefense.
- Slicing: exact per-entry boundaries (entry ``i`` is in slice ``floor(K m_i / S)``, ``m_i`` the
  sensitivity before it), instead of the reference's greedy packing of atoms of ``gcd(layer sizes)``
  entries. The reference's boundaries are inclusive at both ends, so the entry at each boundary belongs
  to two slices (noised twice when both are drawn); and a layer whose atom outweighs a slice produces a
  negative or missing boundary. Neither happens here; a slice can be empty where one entry carries more
  than ``S / slices``. A zero or non-finite total sensitivity falls back to slices of equal size.
- Clipping: the reference clips each sample's gradient slice (per-sample gradients from a loop of
  backward passes) and averages. The defense sees the batch gradient, so it clips the batch gradient's
  slice: identical for batch size 1 (the Outpost paper's Table III scenarios 1-3), and for larger
  batches the same bound on the slice that leaves the client (a mean of clipped vectors has norm at most
  the bound), though not the same vector.
- Randomness: the reference seeds Python's global ``random`` with 0 at import, so every client draws the
  same slices and the same noise in every run (an attacker can replay them). Here slices and noise come
  from the defense's own generators, from OS entropy unless ``seed`` is given.
- The server-side compensation (denoising the aggregate with ``Q``) is not part of the client defense.
- Settings that never change the gradient are refused (``noise=0`` with ``clip=false``); ``noise=0`` with
  clipping is a clip-only defense. ``last_stats`` counts what changed: ``fraction_noised`` the entries the
  noise moved, ``fraction_changed`` those that differ in all (a drawn slice already within the clipping
  bound is not changed by clipping), and ``fired`` is False when nothing changed.
- Cost: one forward pass and one backward pass per layer through a double-backward graph on the root
  set per refresh, plus, per step, a clip and noise of the drawn slices.
"""

from __future__ import annotations

import weakref
from typing import Literal, Sequence

import torch
from pydantic import Field, model_validator
from torch import Tensor, nn

from guardfl.defenses.base import Defense, DefenseConfig, StepContext, register
from guardfl.defenses.noise import NOISE_MAX
from guardfl.defenses.strength import never_changes
from guardfl.errors import ConfigError
from guardfl.ops.change import changed_count, to_ints
from guardfl.ops.model import match_params, model_device, require_float_inputs, side_pass
from guardfl.ops.sensitivity import clip_segments_, layer_sensitivity, noise_segments_, slice_bounds, slice_segments
from guardfl.stats import LayerStats, StageStats


class GradDefenseConfig(DefenseConfig):
    kind: Literal["graddefense"] = "graddefense"
    slices: int = Field(default=10, ge=1, json_schema_extra={"allowed": "an integer >= 1"})
    perturb_slices: int = Field(default=5, ge=1, json_schema_extra={"allowed": "an integer in [1, slices]"})
    noise: float = Field(default=0.01, ge=0.0, le=NOISE_MAX, allow_inf_nan=False,
                         json_schema_extra={"allowed": "finite, in [0, 1e6]"})
    clip: bool = Field(default=True, json_schema_extra={"allowed": "true or false"})
    clip_norm: float | None = Field(
        default=None, gt=0.0, allow_inf_nan=False, json_schema_extra={"allowed": "null (= noise) or finite, > 0"}
    )
    root_size: int = Field(default=50, ge=1, json_schema_extra={"allowed": "an integer >= 1"})
    refresh: Literal["round", "step"] = Field(default="round", json_schema_extra={"allowed": "'round' or 'step'"})

    @model_validator(mode="after")
    def _changes_something(self):
        if self.noise == 0 and not self.clip:
            raise never_changes("noise=0 with clip=false", "noise > 0 or clip=true")
        return self


@register
class GradDefense(Defense):
    """GradDefense (Wang et al. 2022): noise (and clip) sensitivity-balanced gradient slices drawn at random.

    Args:
        slices: the slices of equal total sensitivity the gradient is cut into.
        perturb_slices: how many of them are drawn and noised each step (at most ``slices``).
        noise: the noise's standard deviation on the drawn slices.
        clip: clip each drawn slice to ``clip_norm`` before the noise.
        clip_norm: the slices' L2 bound; ``None``: ``noise`` (the reference code's bound).
        root_size: inputs in the root set the sensitivity is measured on.
        refresh: ``"round"``: the sensitivity once per FL round; ``"step"``: at every step.
        seed: an integer in [0, 2**32 - 1] for a reproducible stream; ``None`` (the default, as deployed): OS
            entropy.
        nonfinite: ``"raise"`` (default): a NaN or inf in the gradient raises; ``"zero"``: such entries are
            zeroed.
    """

    Config = GradDefenseConfig
    needs_params = True
    needs_model = True
    randomized = True

    #: after a step: the sensitivity per gradient tensor, and the slices drawn (for logs and tests)
    last_sensitivity: list[float] | None = None
    last_slices: list[int] | None = None

    def __init__(
        self,
        slices: int = 10,
        perturb_slices: int = 5,
        noise: float = 0.01,
        clip: bool = True,
        clip_norm: float | None = None,
        root_size: int = 50,
        refresh: str = "round",
        *,
        seed: int | None = None,
        nonfinite: str = "raise",
    ) -> None:
        super().__init__(slices=slices, perturb_slices=perturb_slices, noise=noise, clip=clip, clip_norm=clip_norm,
                         root_size=root_size, refresh=refresh, seed=seed, nonfinite=nonfinite)

    def _check_config(self) -> None:
        c = self.config
        if c.perturb_slices > c.slices:
            raise ConfigError(
                f"graddefense.perturb_slices: {c.perturb_slices} is more than slices={c.slices}; "
                "allowed: an integer in [1, slices]"
            )
        if c.clip and c.clip_norm is None and c.noise == 0:
            raise ConfigError(
                "graddefense.clip_norm: null means the noise std, which is 0 here (every drawn slice would be "
                "zeroed); allowed: finite, > 0 (or clip=false)"
            )
        self._root: Tensor | None = None
        self._sens_key: tuple | None = None
        self._owner: weakref.ref | None = None  # the model the root set was collected for

    @property
    def clip_bound(self) -> float | None:
        c = self.config
        return (c.clip_norm if c.clip_norm is not None else c.noise) if c.clip else None

    @property
    def root_set(self) -> Tensor | None:
        """The inputs the sensitivity is measured on (the first ``root_size`` the client trained on)."""
        return self._root

    def _grow_root(self, x: Tensor) -> None:
        size = self.config.root_size
        root = self._root
        if root is None:
            self._root = x[:size].detach().clone()
        elif root.shape[0] < size and root.shape[1:] == x.shape[1:] and root.dtype == x.dtype:
            self._root = torch.cat([root, x[: size - root.shape[0]].detach().to(root.device)])

    def _sensitivity(self, ctx: StepContext) -> list[float]:
        device = model_device(ctx.model)
        with side_pass(ctx.model, device) as module:
            matched = match_params(module, ctx.params, ctx.names)
            missing = [ctx.name(i) for i, m in enumerate(matched) if m is None]
            if missing:
                raise ConfigError(f"graddefense: the gradients of {', '.join(missing)} belong to no parameter of the model")
            try:
                return layer_sensitivity(module, [p for _, p in matched], self._root.to(device))
            except ValueError as err:
                raise ConfigError(f"graddefense: {err}; the sensitivity needs a classifier's logits") from None

    def _apply_(self, grads: list[Tensor], ctx: StepContext) -> StageStats:
        c = self.config
        require_float_inputs(self.kind, ctx.inputs)
        if self._owner is None or self._owner() is not ctx.model:  # another model: another client's data
            self._root, self.last_sensitivity, self._owner = None, None, weakref.ref(ctx.model)
        self._grow_root(ctx.inputs)
        key = tuple(tuple(g.shape) for g in grads)
        if c.refresh == "step" or ctx.iteration == 1 or self.last_sensitivity is None or key != self._sens_key:
            self.last_sensitivity = self._sensitivity(ctx)
            self._sens_key = key
        return self._perturb_(grads, self.last_sensitivity, ctx)

    def _perturb_(self, grads: list[Tensor], sensitivity: list[float], ctx: StepContext) -> StageStats:
        """Steps 2 and 3: slice by ``sensitivity``, draw the slices, clip and noise them (in place)."""
        c = self.config
        bounds = slice_bounds([g.numel() for g in grads], sensitivity, c.slices)
        drawn = torch.randperm(c.slices, generator=self.generator("cpu"))[: c.perturb_slices]
        self.last_slices = sorted(drawn.tolist())
        flats = [g.view(-1) if g.is_contiguous() else g.reshape(-1).clone() for g in grads]
        drawn_segments = [slice_segments(bounds, k) for k in self.last_slices]
        before = {layer: flats[layer].clone() for segments in drawn_segments for layer, _, _ in segments}
        noised = [0] * len(grads)
        for segments in drawn_segments:
            if self.clip_bound is not None:
                clip_segments_(flats, segments, self.clip_bound)
            if c.noise > 0:
                for (layer, _, _), count in zip(segments, noise_segments_(flats, segments, c.noise, self.generator)):
                    noised[layer] += count
        for g, flat in zip(grads, flats):
            if not g.is_contiguous():
                g.copy_(flat.view(g.shape))
        changed = to_ints([changed_count(before[i], flat) if i in before else 0 for i, flat in enumerate(flats)])
        return StageStats.from_layers(self.kind, tuple(
            LayerStats.counted(ctx.name(i), g.numel(), changed=changed[i], noised=noised[i], noise_std=c.noise)
            for i, g in enumerate(grads)
        ))

    # -- many clients that share the weights (the red team's simulation of the defense) ----------------
    def root_sensitivities(self, model: nn.Module, params: Sequence[Tensor], names: Sequence[str] | None,
                           inputs: Tensor) -> list[list[float]]:
        """Per client, the sensitivity ``_apply_`` measures at its first step, for N FedSGD clients
        ``inputs`` ``(N, B, ...)`` that share ``model``'s current weights (each client's root set: its first
        ``root_size`` inputs), from one double-backward pass over all the roots
        (``ops.sensitivity.sample_sensitivity``: each sample's norm, times N for the N-fold batch mean,
        averaged per client). Exact up to float rounding when the model couples no samples; a model with
        BatchNorm in train mode does (ValueError: apply per client)."""
        from guardfl.ops.model import unwrap
        from guardfl.ops.sensitivity import sample_sensitivity

        if any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training for m in unwrap(model).modules()):
            raise ValueError("graddefense.root_sensitivities: BatchNorm in train mode couples the samples; apply per client")
        n = inputs.shape[0]
        roots = inputs[:, : self.config.root_size]
        r = roots.shape[1]
        require_float_inputs(self.kind, roots)
        device = model_device(model)
        with side_pass(model, device) as module:
            matched = match_params(module, params, names)
            missing = [names[i] if names else f"param{i}" for i, m in enumerate(matched) if m is None]
            if missing:
                raise ConfigError(f"graddefense: the gradients of {', '.join(missing)} belong to no parameter of the model")
            try:
                norms = sample_sensitivity(module, [p for _, p in matched], roots.reshape(n * r, *roots.shape[2:]).to(device))
            except ValueError as err:
                raise ConfigError(f"graddefense: {err}; the sensitivity needs a classifier's logits") from None
        per = torch.stack([torch.zeros(n * r, device=device) if t is None else t.detach() * n for t in norms])  # (L, N*r)
        return per.view(len(norms), n, r).mean(2).T.tolist()

    def apply_with_sensitivity_(self, grads: Sequence[Tensor], sensitivity: list[float], ctx: StepContext) -> StageStats:
        """``apply_`` with the sensitivity given (``root_sensitivities``) instead of measured: the same slicing,
        draws, clipping and noise, in place, from this defense's generator."""
        if not ctx.known_finite(grads):
            self._handle_nonfinite(grads, ctx)
        with torch.no_grad():
            stats = self._perturb_(list(grads), list(sensitivity), ctx)
        self._check_output(grads, ctx)
        self.last_sensitivity = list(sensitivity)
        return stats
