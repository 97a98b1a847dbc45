"""One FL round on a client: the one training loop every guardfl client path runs.

``client_round`` is called by ``guardfl.integrations.torch.local_update`` (a user's plain PyTorch client,
and through it the Flower ``train`` helper and the NVIDIA FLARE trainer) and by
``guardfl.redteam.simulate_client`` (the client a certificate judges), so the red team attacks the loop
users run, not a copy of it. A round is:

1. this round's defense, built fresh from the configuration (``round_defense``: OS entropy, or a per-round
   seed derived from an explicit ``seed``);
2. ``guardfl.protect``: gradient defenses wrap the optimizer, DP-SGD is Opacus (Poisson sampling when the
   DP config says so, per-sample clipping, noise from the defense's generator, gradient defenses after the
   noise), an input encoding encodes every batch the loader yields (soft labels);
3. the local steps: ``epochs`` passes over the (protected) loader, one optimizer step per batch. A batch
   that Poisson sampling left empty still takes its step (zero loss: under DP-SGD a noise-only step, which
   Opacus's accountant counts), as Opacus's own training loops do;
4. the update: the state-dict delta ``trained - received`` (what FedAvg sends) and, when the round took
   exactly one step, that step's defended gradient (what FedSGD sends). Fail closed: when a defense acts,
   a state entry that training changed and no gradient defense reached (a buffer other than BatchNorm's,
   a parameter outside the optimizer) raises ``UndefendedUpdateError``.

The protocols of the red team live here too (``FedSGD``, ``FedAvg``): each says how the client's loader and
optimizer are built from its private batch and which part of the round it sends.

Deliberate choices (where the red team's and the adapter's loops used to differ; the adapter's behaviour,
the deployed one, was kept unless said otherwise):

- FedSGD goes through the loader like every round (one batch of all n samples). Under DP-SGD with Poisson
  sampling its sample rate is 1/len(loader) = 1, so every sample is drawn: the batch is exactly the given
  one (the sampler still draws n uniforms from the global RNG, as it does for any DP round).
- FedSGD's local optimizer is SGD with lr 1: the gradient it sends is taken before the step, so no lr
  changes it (a user's ``local_update`` with any lr sends the same ``gradient``).
- ``train_mode=False`` (an eval-mode client, a threat-model option of the red team) is refused with
  DP-SGD: Opacus computes per-sample gradients in train mode only (``protect`` used to switch such a
  client to train mode silently).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, TensorDataset

from guardfl.defenses import Defense, Identity, from_config
from guardfl.errors import ConfigError, UndefendedUpdateError
from guardfl.protect import dp_compatible, protect, soft_cross_entropy, split_stages

MakeOptimizer = Callable[[Iterable[nn.Parameter]], Optimizer]

#: state-dict name endings sent as trained by default (BatchNorm buffers): no gradient defense reaches a
#: buffer, and noise would make a running variance negative
BN_BUFFERS: tuple[str, ...] = ("running_mean", "running_var", "num_batches_tracked")


# -- protocols --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FedSGD:
    """One local step on the whole batch; the client sends the (defended) gradient."""

    name: str = "fedsgd"

    @property
    def local_epochs(self) -> int:
        return 1

    def loader(self, inputs: Tensor, labels: Tensor) -> DataLoader:
        """The client's loader: all its samples in one batch, in order."""
        return DataLoader(TensorDataset(inputs, labels), batch_size=int(inputs.shape[0]), shuffle=False)

    def make_optimizer(self, params: Iterable[nn.Parameter]) -> Optimizer:
        """Plain SGD (lr 1): the gradient is sent before the step, so the local lr moves nothing sent."""
        return torch.optim.SGD(params, lr=1.0)

    def sent(self, result: "RoundResult") -> dict[str, Tensor]:
        """What leaves the client: the defended gradient of its one step (parameter name -> tensor)."""
        if result.gradient is None:
            raise ConfigError(f"protocol: FedSGD takes one step, this round took {result.steps}")
        return result.gradient


@dataclass(frozen=True)
class FedAvg:
    """E local epochs over the client's n samples in mini-batches of B, plain SGD with momentum and weight
    decay; the client sends the model delta ``w_end - w_start``. Batches are taken in order (an attacker
    with known hyperparameters replays that order), or Poisson-sampled when DP-SGD says so."""

    epochs: int = 1
    batch_size: int = 1
    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 0.0
    name: str = "fedavg"

    def __post_init__(self) -> None:
        for key, low in (("epochs", 1), ("batch_size", 1)):
            if int(getattr(self, key)) < low:
                raise ValueError(f"FedAvg.{key} must be >= {low} (got {getattr(self, key)})")
        if not self.lr > 0:
            raise ValueError(f"FedAvg.lr must be > 0 (got {self.lr})")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"FedAvg.momentum must be in [0, 1) (got {self.momentum})")
        if self.weight_decay < 0:
            raise ValueError(f"FedAvg.weight_decay must be >= 0 (got {self.weight_decay})")

    @property
    def local_epochs(self) -> int:
        return int(self.epochs)

    def loader(self, inputs: Tensor, labels: Tensor) -> DataLoader:
        """The client's loader: mini-batches of B (the last one shorter), in order."""
        return DataLoader(TensorDataset(inputs, labels), batch_size=min(int(self.batch_size), int(inputs.shape[0])),
                          shuffle=False)

    def make_optimizer(self, params: Iterable[nn.Parameter]) -> Optimizer:
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)

    def sent(self, result: "RoundResult") -> dict[str, Tensor]:
        """What leaves the client: the model delta (state-dict key -> tensor)."""
        return result.delta


Protocol = FedSGD | FedAvg


# -- the round's defense ---------------------------------------------------------------------------------
def _mix(seed: int, round_index: int) -> int:
    """A per-round seed: the seed itself in round 0, an unrelated 63-bit value in later rounds."""
    if round_index == 0:
        return seed
    x = (seed * 0x9E3779B97F4A7C15 + round_index * 0xBF58476D1CE4E5B9) % (1 << 64)
    x ^= x >> 31
    x = (x * 0x94D049BB133111EB) % (1 << 64)
    return (x ^ (x >> 29)) >> 1


def _reseed_for_round(defense: Defense, round_index: int) -> None:
    # every node, not only the leaves (``Defense.leaves``): a seeded stack reseeds its unseeded members
    if defense.config.seed is not None:
        defense.reseed(_mix(defense.config.seed, round_index))
    for member in getattr(defense, "members", []):
        _reseed_for_round(member, round_index)


def check_round_counter(defense: Defense | Mapping[str, Any] | str | None, field: str, remedy: str) -> None:
    """One ``ConfigError`` line naming ``field`` when ``defense`` draws randomness from an explicit seed and
    the caller has no round counter: each round would rebuild it with the same seed and repeat round 0's
    noise (or masks, or mixing), and a server that differences two rounds' updates of one batch cancels it
    (the red team's ``threshold_bins`` read 16 of 64 faces exactly through DP-SGD that way). OS entropy
    and deterministic defenses need no counter."""
    if defense is None:
        return
    built = defense if isinstance(defense, Defense) else from_config(defense)
    seeded = built.seeded_randomness()
    if seeded:
        raise ConfigError(f"{field}: required with a defense seeded explicitly ({', '.join(sorted(set(seeded)))}): {remedy}; "
                          "without it every round would draw the seed's first noise again, which a server cancels "
                          "by differencing two rounds (or leave seed unset: OS entropy)")


def round_defense(defense: Defense | Mapping[str, Any] | str | None, round_index: int) -> Defense:
    """A fresh defense for FL round ``round_index`` (0-based): OS entropy, or a per-round seed derived from
    an explicit ``seed`` (so rounds never share a noise stream). A given instance is not used itself (its
    streams may have been drawn from): ``Defense.fresh`` rebuilds it, keeping what its configuration cannot
    hold (Inter-InstaHide's public tensor)."""
    if defense is None:
        return Identity()
    fresh = defense.fresh() if isinstance(defense, Defense) else from_config(defense)
    _reseed_for_round(fresh, round_index)
    fresh.round_index = round_index
    return fresh


# -- the round ---------------------------------------------------------------------------------------------
@dataclass
class RoundResult:
    """One client round, as ``client_round`` ran it."""

    #: state-dict key -> (trained - received), every entry (BatchNorm buffers included)
    delta: dict[str, Tensor]
    #: the defended gradient of the round's one step (parameter name -> tensor, the optimizer's trainable
    #: parameters) when the round took exactly one step (FedSGD); None otherwise
    gradient: dict[str, Tensor] | None
    #: the defense this round ran (built by ``round_defense``)
    defense: Defense
    steps: int
    #: samples the steps trained on (Poisson-sampled batches count what was drawn)
    examples: int
    loss_sum: float
    #: ``last_stats.to_dict()`` of every local step (what each gradient defense did)
    defense_stats: list[dict] = field(default_factory=list)
    #: epsilon spent so far at ``dp_delta`` (inf without DP-SGD), and the accountant's state to keep
    epsilon: float = math.inf
    dp_delta: float | None = None
    privacy: dict | None = None
    #: with ``record=True``: the (inputs, targets) of every step as the model trained on them (encoded,
    #: with soft labels, under an input encoding), and per BatchNorm layer (module order) the (mean, biased
    #: var) of its input in the round's first forward pass
    batches: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    bn_inputs: list[tuple[Tensor, Tensor]] = field(default_factory=list)


def check_round_args(epochs: Any, max_steps: Any, make_optimizer: Any) -> None:
    """One ``ConfigError`` line naming a bad ``epochs``, ``max_steps`` or ``make_optimizer``."""
    if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 1:
        raise ConfigError(f"epochs: must be an integer >= 1 (got {epochs!r})")
    if max_steps is not None and max_steps < 1:
        raise ConfigError(f"max_steps: must be null or an integer >= 1 (got {max_steps!r})")
    if not callable(make_optimizer):
        raise ConfigError("make_optimizer: expected a callable params -> torch.optim.Optimizer "
                          "(e.g. lambda p: torch.optim.SGD(p, lr=0.01))")


def _batch_size(x: Any) -> int:
    return int(x.shape[0]) if isinstance(x, Tensor) else len(x)


def _is_identity(defense: Defense) -> bool:
    return all(leaf.kind == "identity" for leaf in defense.leaves())


def bn_layers(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """The model's BatchNorm layers, in module order (their buffers travel with a FedAvg update)."""
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def record_first_bn_inputs(model: nn.Module) -> tuple[list[tuple[Tensor, Tensor]], list]:
    """Hooks recording (mean, biased var) of each BatchNorm input during the first forward pass."""
    layers = bn_layers(model)
    records: list[tuple[Tensor, Tensor]] = []

    def hook(_module, inputs, _output):
        if len(records) < len(layers):
            x = inputs[0].detach()
            dims = [0, *range(2, x.dim())]
            records.append((x.mean(dims), x.var(dims, unbiased=False)))

    return records, [bn.register_forward_hook(hook) for bn in layers]


def refuse_undefended_changes(model: nn.Module, optimizer: Optimizer, start: Mapping[str, Tensor],
                              after: Mapping[str, Tensor]) -> None:
    """``UndefendedUpdateError`` when training changed a state entry that no gradient defense reached: a
    buffer other than BatchNorm's (``BN_BUFFERS``) or a parameter outside the optimizer. Such an entry
    would be sent as trained, whatever the defense; the update fails closed instead."""
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    defended = {name for name, p in model.named_parameters(remove_duplicate=False) if id(p) in optimized}
    changed = [f"{k} ({after[k].dtype})" for k in start
               if k not in defended and not k.endswith(BN_BUFFERS) and not torch.equal(after[k], start[k])]
    if changed:
        raise UndefendedUpdateError(
            f"update: training changed {len(changed)} state entr{'y' if len(changed) == 1 else 'ies'} that no "
            f"gradient defense reaches: {', '.join(changed[:5])}{' ...' if len(changed) > 5 else ''}; the update "
            "was not returned. Only the optimizer's parameters are defended (and BatchNorm's buffers sent as trained)")


def client_round(
    model: nn.Module,
    loader: Iterable,
    make_optimizer: MakeOptimizer,
    defense: Defense | Mapping[str, Any] | str | None = None,
    *,
    epochs: int = 1,
    round_index: int = 0,
    privacy_state: dict | None = None,
    loss_fn: Callable[[Tensor, Tensor], Tensor] = soft_cross_entropy,
    num_classes: int | None = None,
    max_steps: int | None = None,
    train_mode: bool = True,
    record: bool = False,
) -> RoundResult:
    """Train ``model`` in place for one FL round (see the module docstring) and return the round.

    ``defense``: any guardfl defense, stack or config (None: no defense); the round runs
    ``round_defense(defense, round_index)``. ``privacy_state``: the DP accountant's state from the previous
    round (epsilon is cumulative). ``train_mode``: BatchNorm on batch statistics and dropout on, as a
    deployed client trains (False only to model an eval-mode client; refused with DP-SGD). ``record``: keep
    the batches trained on and the first BatchNorm inputs (``RoundResult.batches`` / ``bn_inputs``).
    Opacus's hooks are removed from ``model`` afterwards."""
    check_round_args(epochs, max_steps, make_optimizer)
    current = round_defense(defense, round_index)
    dp, _, _ = split_stages(current)
    if dp and dp_compatible(model) is not model:
        raise ConfigError("defense: DP-SGD cannot train this model (it has layers Opacus replaces: BatchNorm -> GroupNorm, "
                          "nn.MultiheadAttention -> DPMultiheadAttention, with other parameter names); build the global "
                          "model with guardfl.dp_compatible(model) on the server and on every client")
    if dp and not train_mode:
        raise ConfigError("train_mode: DP-SGD trains in train mode only (Opacus computes per-sample gradients in train "
                          "mode); allowed with dpsgd: true")
    try:
        device = next(model.parameters()).device
    except StopIteration:
        raise ConfigError("model: it has no parameters, so there is no update to send") from None

    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.train(train_mode)
    optimizer = make_optimizer(model.parameters())
    if not isinstance(optimizer, Optimizer):
        raise ConfigError(f"make_optimizer: returned {type(optimizer).__name__}, expected a torch.optim.Optimizer")
    trained, optimizer, loader = protect(model, optimizer, loader, current, num_classes=num_classes,
                                         privacy_state=privacy_state)
    optimizer.new_round()
    bn_inputs, handles = record_first_bn_inputs(model) if record else ([], [])
    steps, examples, loss_sum, stats, batches = 0, 0, 0.0, [], []
    try:
        for _ in range(epochs):
            for x, y in loader:
                if max_steps is not None and steps >= max_steps:
                    break
                x, y = x.to(device), y.to(device)
                optimizer.zero_grad(set_to_none=True)
                out = trained(x)
                loss = loss_fn(out, y) if _batch_size(x) else out.sum() * 0.0  # Opacus's Poisson batches can be empty
                with warnings.catch_warnings():  # Opacus's hook on a first layer whose input needs no grad: harmless
                    warnings.filterwarnings("ignore", message=".*Full backward hook is firing.*")
                    loss.backward()
                optimizer.step()
                steps += 1
                examples += _batch_size(x)
                loss_sum += float(loss.detach()) * _batch_size(x)
                if optimizer.last_stats is not None:
                    stats.append(optimizer.last_stats.to_dict())
                if record:
                    batches.append((x.detach().clone(), y.detach().clone()))
    finally:
        for h in handles:
            h.remove()
        if dp and hasattr(trained, "to_standard_module"):
            trained.to_standard_module()  # remove Opacus's hooks from the caller's model
    if steps == 0:
        raise ConfigError("loader: it yielded no batches, so the client did not train")

    epsilon, dp_delta, privacy = math.inf, None, None
    if dp:
        dp_delta = dp[0].config.delta
        epsilon = optimizer.epsilon(dp_delta)
        privacy = optimizer.privacy_state()
    after = model.state_dict()
    if not _is_identity(current):
        refuse_undefended_changes(model, optimizer, start, after)
    delta = {k: after[k].detach() - start[k] for k in start}
    gradient = None
    if steps == 1:
        optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
        gradient = {name: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                    for name, p in model.named_parameters() if p.requires_grad and id(p) in optimized}
    return RoundResult(delta=delta, gradient=gradient, defense=current, steps=steps, examples=examples,
                       loss_sum=loss_sum, defense_stats=stats, epsilon=epsilon, dp_delta=dp_delta, privacy=privacy,
                       batches=batches, bn_inputs=list(bn_inputs))


__all__ = ["BN_BUFFERS", "FedAvg", "FedSGD", "MakeOptimizer", "Protocol", "RoundResult", "bn_layers", "check_round_args",
           "client_round", "record_first_bn_inputs", "refuse_undefended_changes", "round_defense"]
