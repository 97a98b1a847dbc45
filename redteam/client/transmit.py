"""The defense as data augmentation (Wu et al. 2023, Sec. 3.1): what the client would transmit for many
auxiliary batches at once, for attacks that learn from (observation, batch) pairs.

``TransmitSimulator`` is the client of ``simulate_client`` made functional so that thousands of batches
cost one vmapped gradient per local step, never a copy of the model per batch: the same loss
(cross-entropy, mean over the batch; soft labels for an input encoding), BatchNorm as the client runs it
(train mode: the batch's own statistics; eval mode: the running statistics), the FedSGD gradient or the
FedAvg delta (plain SGD with weight decay then momentum, torch's order). Every defense kind guardfl ships
is simulated, split into its stages in the order ``guardfl.protect`` applies them (``split_stages``):

- input encodings (MixUp, Intra/Inter-InstaHide): every batch of every local step is encoded by the REAL
  ``encode`` of the defense (fresh partners, coefficients and sign masks from the defense's generator,
  soft labels), batch by batch as the client's ``EncodedLoader`` does. The pair an attack learns from is
  (update of the encoded batch, the PRIVATE batch behind it). Inter-InstaHide mixes with a public set the
  client holds; the attacker does not, unless told so: ``public`` is the attacker's set of partners, its
  own auxiliary images as a stand-in by default (``LearnedInversion``), the client's set for an attacker
  who holds it. The client's ``public`` path is never read here.
- DP-SGD (Opacus semantics, as ``guardfl.protect`` runs it): per-sample gradients (vmapped, each sample's
  own loss: Opacus's ``loss_reduction="mean"`` scaling), clipped jointly over all parameters to
  ``max_grad_norm`` with Opacus's factor ``min(1, C / (norm + 1e-6))``, summed, Gaussian noise of std
  ``noise_multiplier * C`` from Opacus's own ``_generate_noise`` per parameter, divided by Opacus's expected
  batch size ``int(n / len(loader))``. The noise multiplier of a ``target_epsilon`` configuration is
  resolved as ``make_private_with_epsilon`` resolves it (``get_noise_multiplier`` at sample rate
  ``1 / len(loader)``). FedSGD sends the gradient of exactly the given batch (no resampling, as
  ``simulate_client``); FedAvg with ``poisson_sampling`` draws each step's batch by Poisson sampling at that
  rate (a per-sample mask: every sample's gradient is computed and the unselected ones weigh 0) and takes
  every step, an empty one too (a noise-only step, counted as an iteration, as the client's round in
  ``guardfl.integrations.round`` takes it), otherwise takes the batches in order. Opacus trains in train
  mode whatever ``train_mode`` says, and refuses BatchNorm (so does this).
  The noise comes from a generator built as ``guardfl.protect`` builds the client's (``make_generator``
  with the DP-SGD leaf's seed, the attacker's own here); Poisson sampling from the simulator's own stream
  (the client's is the global RNG).
- gradient defenses (and stacks of them), applied after the noise under DP-SGD: ``Defense.apply_batch_``
  on each batch's gradient of each local step, exactly where ``GuardedOptimizer`` runs it, with the
  step's iteration number and that batch's current weights (vectorised over the batches where the defense
  allows). Defenses that read the model and the batch (``needs_model``: Soteria, GradDefense) get a
  replica of the model holding the batch's current weights and the batch's (encoded) inputs, batch by
  batch (``Defense.apply_``), each batch its own client: a different model object per batch, so
  GradDefense's root set starts anew per client. Soteria on FedSGD clients of a model that couples no
  samples (no BatchNorm in train mode) uses ``Soteria.column_masks``: one representation and one
  vector-Jacobian product per feature for a whole chunk of batches, the same masks as batch by batch;
  GradDefense likewise measures every client's sensitivity in one double-backward pass
  (``GradDefense.root_sensitivities``) and then slices, draws, clips and noises each client's gradient
  with its own code (``apply_with_sensitivity_``). FedAvg with such a defense runs each client's local
  steps on its own (no vmap across clients).

The defense is built from the configuration the attacker knows with its seeds removed (the attacker knows
the configuration, never the randomness). Its private generators run on from ``seed`` (the attacker's own,
e.g. drawn from the attack's seed, so that a red-team run is reproducible and does not depend on its
worker count) or from OS entropy, never from the client's seed; every draw continues the stream, so each
gets fresh randomness.

The batch gradient is defended, as a real client does. (The public LTI code defends each per-sample
gradient and then averages them: a weaker, different threat that we do not copy.)

An encoding that mixes within the batch (MixUp, Intra-InstaHide) inside DP-SGD's Poisson-sampled FedAvg
batches: each step's sampled images (in index order, as Opacus's loader yields them) are encoded within
themselves by the real ``encode``. A client whose sampled batch holds 1 to k-1 images refuses it
(ConfigError) and transmits nothing that round, so what leaves it is its update *given* that no step drew
such a batch: the simulator redraws the rounds that did (rejection sampling, the exact conditional
distribution), and refuses with one line where the client would almost never complete a round.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from guardfl.defenses import Defense, DefenseConfig, Stack, parse_config
from guardfl.defenses.base import StepContext, make_generator
from guardfl.errors import ConfigError
from guardfl.protect import SAMPLING_STREAM, soft_cross_entropy, split_stages
from guardfl.redteam.client.attacker_defense import attacker_defense
from guardfl.redteam.client.simulate import FedAvg, FedSGD, bn_layers, sgd_step
from guardfl.redteam.threat import unseeded  # noqa: F401  (re-exported: the attacker's view of a defense config)

if TYPE_CHECKING:
    from guardfl.redteam.client.hashing import CountSketch


class TransmitSimulator:
    """What a client running ``defense_config`` under ``protocol`` transmits, for many batches at once.

    ``updates(x, y)``: ``x`` is ``(N, B, *input_shape)`` (N batches of the client's batch geometry),
    ``y`` is ``(N, B)``; returns ``(N, D)``, each row the flattened update (parameters in
    ``names`` order) the client would send for that batch, each with its own defense draw. ``public``:
    the partner images of an Inter-InstaHide encoding (see the module docstring).
    """

    def __init__(self, model: nn.Module, defense_config: DefenseConfig | dict | None, protocol: FedSGD | FedAvg, *,
                 train_mode: bool = True, device: torch.device | str = "cpu", chunk: int = 256,
                 seed: int | None = None, public: Tensor | None = None) -> None:
        self.device = torch.device(device)
        self.protocol = protocol
        self.chunk = chunk
        self.defense: Defense | None = (attacker_defense(unseeded(parse_config(defense_config)), public)
                                        if defense_config is not None else None)
        if self.defense is not None and seed is not None:
            self.defense.reseed(seed)  # the attacker's own stream: a reproducible red team
        dp, encodings, gradient = split_stages(self.defense) if self.defense is not None else ([], [], [])
        if len(dp) > 1 or len(encodings) > 1:
            raise ConfigError("defense: at most one dpsgd stage and one input encoding (mixup / instahide) in a stack")
        self.dp = dp[0] if dp else None
        self.encoding = encodings[0] if encodings else None
        self.gradient: Defense | None = (None if not gradient else gradient[0] if len(gradient) == 1
                                         else Stack.regroup(gradient))
        if self.dp is not None:
            if bn_layers(model):
                raise ConfigError("defense: DP-SGD cannot train this model (it has BatchNorm, which Opacus refuses); build "
                                  "the global model with guardfl.dp_compatible(model), or use a model without BatchNorm")
            train_mode = True  # Opacus's make_private puts the model in train mode
            self._noise_gen = make_generator(self.device, self.dp.stream_seed)
            self._sampling_gen = make_generator("cpu", self.dp.stream_seed, offset=SAMPLING_STREAM)
            self._multipliers: dict[int, float] = {}
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
        self.num_classes: int | None = None
        # needs_model defenses: two replicas used in turn, one per client (GradDefense's root set follows the model object)
        self._needs_model = self.gradient is not None and self.gradient.needs_model
        self._replicas = [copy.deepcopy(replica), copy.deepcopy(replica)] if self._needs_model else []
        self._turn = 0

    # -- the loss --------------------------------------------------------------------------------------
    def _loss(self, params: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        logits = functional_call(self.model, ({**self.frozen, **params}, self.buffers), (x,), tie_weights=False)
        return soft_cross_entropy(logits, y)

    def _sample_loss(self, params: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        """One sample's own loss (Opacus's per-sample gradients of a mean-reduced loss)."""
        return self._loss(params, x[None], y[None])

    # -- DP-SGD ----------------------------------------------------------------------------------------
    def _loader_len(self, samples: int) -> int:
        """``len(loader)`` of the client's DataLoader over ``samples`` samples (Opacus's 1 / sample rate)."""
        batch = samples if isinstance(self.protocol, FedSGD) else min(self.protocol.batch_size, samples)
        return math.ceil(samples / batch)

    def noise_multiplier(self, samples: int) -> float:
        """The noise multiplier the client uses: configured, or resolved from ``target_epsilon`` as Opacus's
        ``make_private_with_epsilon`` does (sample rate ``1 / len(loader)``)."""
        c = self.dp.config
        if c.noise_multiplier is not None:
            return float(c.noise_multiplier)
        if samples not in self._multipliers:
            from opacus.accountants.utils import get_noise_multiplier

            self._multipliers[samples] = float(get_noise_multiplier(
                target_epsilon=c.target_epsilon, target_delta=c.delta, sample_rate=1 / self._loader_len(samples),
                epochs=c.epochs, accountant=c.accountant))
        return self._multipliers[samples]

    def _private_grads(self, params: dict[str, Tensor], x: Tensor, y: Tensor, batched_params: bool,
                       mask: Tensor | None, samples: int) -> dict[str, Tensor]:
        """Opacus's privatised gradient of each batch: per-sample gradients clipped (jointly over the
        parameters), summed (the samples ``mask`` selects), noised, divided by the expected batch size."""
        from opacus.optimizers.optimizer import _generate_noise

        per_sample = vmap(grad(self._sample_loss), in_dims=(None, 0, 0), randomness="different")
        g = vmap(per_sample, in_dims=(0 if batched_params else None, 0, 0), randomness="different")(params, x, y)
        n, b = x.shape[:2]
        norms = torch.stack([g[name].reshape(n, b, -1).norm(2, dim=-1) for name in self.names], dim=-1).norm(2, dim=-1)
        factor = (self.dp.config.max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
        if mask is not None:
            factor = factor * mask.to(factor.dtype)
        std = self.noise_multiplier(samples) * self.dp.config.max_grad_norm
        expected = int(samples * (1 / self._loader_len(samples)))
        out = {}
        for name in self.names:
            summed = torch.einsum("nb,nb...->n...", factor.to(g[name].dtype), g.pop(name))
            out[name] = (summed + _generate_noise(std=std, reference=summed, generator=self._noise_gen)) / expected
        return out

    # -- encodings -------------------------------------------------------------------------------------
    def _encode(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """Each batch encoded by the real encoding (its own draws), with soft labels."""
        if self.encoding is None:
            return x, y
        pairs = [self.encoding.encode(xi, yi, self.num_classes) for xi, yi in zip(x, y)]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])

    # -- the gradient stage ----------------------------------------------------------------------------
    def _defend(self, grads: dict[str, Tensor], iteration: Tensor | int, params: dict[str, Tensor],
                batched_params: bool, inputs: Tensor, active: Tensor | None = None) -> None:
        """The real gradient defense on each batch's gradient (in place, one draw each), at each batch's
        iteration number (an int, or a tensor ``(N,)`` of per-batch numbers), on the ``active``
        batches only (None: all)."""
        if self.gradient is None:
            return
        n = inputs.shape[0]
        its = torch.full((n,), iteration, dtype=torch.long) if isinstance(iteration, int) else iteration.cpu()
        act = torch.ones(n, dtype=torch.bool) if active is None else active.cpu()
        if not self._needs_model:
            self._apply_batched(self.gradient, grads, its, act, params, batched_params)
            return
        for leaf in self.gradient.leaves():  # the leaves in order, as Stack.apply_ runs them
            if not leaf.needs_model:
                self._apply_batched(leaf, grads, its, act, params, batched_params)
            elif (hasattr(leaf, "column_masks") and not batched_params
                  and not any(bn.training for bn in bn_layers(self.model))):
                # Soteria on shared weights without coupled samples: every batch's mask in one pass
                idx = act.nonzero().flatten().to(self.device)
                name, masks = leaf.column_masks(self.model, inputs[idx])
                weight = grads[f"{name}.weight"]
                weight[idx] = weight[idx].masked_fill(masks[:, None, :].to(weight.device), 0)
            elif (hasattr(leaf, "root_sensitivities") and not batched_params and bool((its[act] == 1).all())
                  and not any(bn.training for bn in bn_layers(self.model))):
                # GradDefense on FedSGD clients sharing the weights: every client's sensitivity in one pass
                rows = act.nonzero().flatten().tolist()
                sens = leaf.root_sensitivities(self.model, [self.params[name] for name in self.names], self.names,
                                               inputs[torch.tensor(rows, device=inputs.device)])
                for i, s in zip(rows, sens):
                    leaf.apply_with_sensitivity_([grads[name][i] for name in self.names], s,
                                                 StepContext(iteration=1, names=self.names))
            else:
                for i in act.nonzero().flatten().tolist():
                    model = self._replica_for(params, i if batched_params else None)
                    named = dict(model.named_parameters())
                    leaf.apply_([grads[name][i] for name in self.names],
                                StepContext(iteration=int(its[i]), params=[named[name].detach() for name in self.names],
                                            names=self.names, model=model, inputs=inputs[i].detach()))

    def _apply_batched(self, defense: Defense, grads: dict[str, Tensor], its: Tensor, act: Tensor,
                       params: dict[str, Tensor], batched_params: bool) -> None:
        """``defense.apply_batch_`` on the active batches, one call per iteration number."""
        for it in its[act].unique().tolist():
            rows = act & (its == it)
            whole = bool(rows.all())
            idx = rows.nonzero().flatten().to(self.device)
            sub = [grads[name] if whole else grads[name][idx] for name in self.names]
            p = [params[name] if whole or not batched_params else params[name][idx] for name in self.names]
            defense.apply_batch_(sub, iteration=int(it), params=p, names=self.names, batched_params=batched_params)
            if not whole:
                for name, s in zip(self.names, sub):
                    grads[name][idx] = s

    def _replica_for(self, params: dict[str, Tensor], row: int | None) -> nn.Module:
        """The model object of the current client holding its weights (``row`` of batched ``params``)."""
        model = self._replicas[self._turn]
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in params:
                    p.copy_(params[name][row] if row is not None else params[name])
        return model

    def _next_client(self) -> None:
        """The next client gets the other replica (another model object: GradDefense starts a new root set)."""
        self._turn = 1 - self._turn

    # -- one chunk -------------------------------------------------------------------------------------
    def _chunk_parts(self, x: Tensor, y: Tensor) -> list[Tensor]:
        """Each parameter's rows ``(n, numel)`` in ``names`` order, each with its own storage (the
        consumer may overwrite them): the columns of a chunk's rows without the copy into them."""
        if self.encoding is not None and self.num_classes is None:
            from guardfl.redteam.client.simulate import _num_classes

            self.num_classes = _num_classes(self.model, x[0])
        if self._needs_model and isinstance(self.protocol, FedAvg):  # each client's steps on its own
            parts = [self._client_parts(x[i : i + 1], y[i : i + 1]) for i in range(x.shape[0])]
            return [torch.cat(blocks) for blocks in zip(*parts)]
        return self._client_parts(x, y)

    #: consecutive refused rounds of one batch after which the simulator gives up (the client would almost
    #: never transmit: a refusal per round of p leaves p ** 50, e.g. 0.5% at p = 0.9)
    MAX_REFUSED_ROUNDS = 50
    #: rounds redrawn so far because the client would have refused them (see ``_redraw_refused``)
    refused_rounds = 0

    def _client_parts(self, x: Tensor, y: Tensor, attempt: int = 0) -> list[Tensor]:
        n = x.shape[0]
        if isinstance(self.protocol, FedSGD):
            xe, ye = self._encode(x, y)
            if self.dp is not None:
                g = self._private_grads(self.params, xe, ye, False, None, x.shape[1])
            else:
                g = vmap(grad(self._loss), in_dims=(None, 0, 0), randomness="different")(self.params, xe, ye)
            if self._needs_model:
                self._defend_rows_fedsgd(g, xe)
            else:
                self._defend(g, 1, self.params, False, xe)
            return [g.pop(name).reshape(n, -1) for name in self.names]
        p = self.protocol
        params = {k: v.unsqueeze(0).expand(n, *v.shape).clone() for k, v in self.params.items()}
        momentum: dict[str, Tensor] | None = None
        samples = x.shape[1]
        b = min(p.batch_size, samples)
        poisson = self.dp is not None and self.dp.config.poisson_sampling
        within = poisson and self.encoding is not None and self.encoding.mixes_within_batch
        refused = torch.zeros(n, dtype=torch.bool)
        its = torch.zeros(n, dtype=torch.long)
        step_grad = vmap(grad(self._loss), in_dims=(0, 0, 0), randomness="different")
        for _ in range(p.epochs):
            for lo in range(0, samples, b):
                if poisson:  # Opacus's UniformWithReplacementSampler: len(loader) steps, each sample kept at rate q
                    q = 1 / self._loader_len(samples)
                    mask = (torch.rand(n, samples, generator=self._sampling_gen) < q).to(self.device)
                    xs, ys = x, y
                else:
                    mask, xs, ys = None, x[:, lo : lo + b], y[:, lo : lo + b]
                if within:
                    xe, ye, small = self._encode_sampled(xs, ys, mask)
                    refused |= small
                else:
                    xe, ye = self._encode(xs, ys)
                if self.dp is not None:
                    g = self._private_grads(params, xe, ye, True, mask, samples)
                else:
                    g = step_grad(params, xe, ye)
                # every batch steps, an empty Poisson batch too (its noise-only step), as the client's round does
                its += 1
                inputs = xe if mask is None or not self._needs_model else xe[:, mask[0]]  # one client when needs_model
                self._defend(g, its.clone(), params, True, inputs, None)
                params, momentum = sgd_step(params, g, momentum, p)
        if self._needs_model:
            self._next_client()
        out = [(params.pop(name) - self.params[name]).reshape(n, -1) for name in self.names]
        if refused.any():
            self._redraw_refused(x, y, refused, out, attempt)
        return out

    def _redraw_refused(self, x: Tensor, y: Tensor, refused: Tensor, out: list[Tensor], attempt: int) -> None:
        """Replace (in ``out``) the rounds a client would have refused (a sampled batch of 1 to k-1 images to
        mix within) by fresh rounds of the same batches: the client transmits only rounds it completes."""
        if attempt + 1 >= self.MAX_REFUSED_ROUNDS:
            k = self.encoding.config.k
            raise ConfigError(f"defense: {self.encoding.kind} mixes k={k} images within each Poisson-sampled DP-SGD "
                              f"batch, and {self.MAX_REFUSED_ROUNDS} rounds in a row drew a batch of 1 to {k - 1} images, "
                              "which the client refuses: it would almost never transmit; raise the batch_size "
                              "(the expected batch) well above k, set dpsgd.poisson_sampling: false, or use inter-InstaHide")
        rows = refused.nonzero().flatten()
        self.refused_rounds += len(rows)
        fresh = self._client_parts(x[rows.to(x.device)], y[rows.to(y.device)], attempt + 1)
        for block, new in zip(out, fresh):
            block[rows.to(block.device)] = new

    def _encode_sampled(self, x: Tensor, y: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Each row's Poisson-sampled images (``mask``; in index order, as Opacus's loader yields them)
        encoded within themselves by the real encoding and put back at their places (the other places are
        masked out of the gradient); and which rows drew a batch of 1 to k-1 images, which the client
        refuses."""
        soft = y.float() if y.dim() == 3 else torch.nn.functional.one_hot(y.long(), self.num_classes).float()
        xe, ye = x.clone(), soft.clone()
        small = torch.zeros(x.shape[0], dtype=torch.bool)
        for i in range(x.shape[0]):
            sel = mask[i].nonzero().flatten()
            if sel.numel() == 0:
                continue  # an empty batch: Opacus's noise-only step
            if sel.numel() < self.encoding.config.k:
                small[i] = True  # the client refuses this batch (ConfigError): this round is never sent
                continue
            xe[i, sel], ye[i, sel] = self.encoding.encode(x[i, sel], y[i, sel], self.num_classes)
        return xe, ye, small

    def _defend_rows_fedsgd(self, g: dict[str, Tensor], inputs: Tensor) -> None:
        """FedSGD with a ``needs_model`` defense: each batch is its own client (its own replica object)."""
        n = inputs.shape[0]
        if all(not leaf.needs_model or hasattr(leaf, "column_masks") or hasattr(leaf, "root_sensitivities")
               for leaf in self.gradient.leaves()) \
                and not any(bn.training for bn in bn_layers(self.model)):
            self._defend(g, 1, self.params, False, inputs)  # Soteria: one pass for the chunk
            return
        for i in range(n):
            sub = {name: g[name][i : i + 1] for name in self.names}
            self._defend(sub, 1, self.params, False, inputs[i : i + 1])
            self._next_client()

    @property
    def reads_model(self) -> bool:
        """Whether a gradient defense reads the model and each batch's inputs (Soteria, GradDefense): a draw
        then costs per batch, not one vmapped pass."""
        return self._needs_model

    # -- the public interface --------------------------------------------------------------------------
    def chunks(self, x: Tensor, y: Tensor, parts: bool = False) -> Iterator[Any]:
        """The rows of ``updates(x, y)``, ``chunk`` batches at a time (under DP-SGD ``chunk // B``: the
        per-sample gradients are B times larger) for a consumer that reduces each chunk, e.g. hashes it,
        instead of holding every full row. ``y`` is ``(N, B)`` or, for a causal LM's next tokens (or soft
        labels), ``(N, B, ...)``. With ``parts``, each chunk comes as the list of its per-parameter column
        blocks (``_chunk_parts``: ``CountSketch.of_parts`` hashes them without building the rows, which for
        a language model are hundreds of MB per chunk)."""
        if x.dim() < 3 or y.dim() < 2 or x.shape[:2] != y.shape[:2]:
            raise ValueError(f"updates: expected x (N, B, ...) and y (N, B, ...); got {tuple(x.shape)} and {tuple(y.shape)}")
        step = self.chunk if self.dp is None else max(1, self.chunk // x.shape[1])
        for i in range(0, x.shape[0], step):
            xi, yi = x[i : i + step].to(self.device), y[i : i + step].to(self.device)
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
