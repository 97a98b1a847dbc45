"""Client simulation: what a guardfl-protected client actually transmits.

``simulate_client`` runs the real guardfl client round (``guardfl.integrations.round.client_round``, the
loop ``local_update`` runs: ``guardfl.protect`` around the client's SGD, the model in train mode) on a
private batch and returns an ``Observation``: the transmitted update (FedSGD: the defended gradient;
FedAvg: the model delta after E local epochs) plus the public context the server has (the global model).
Knowledge that does not leave the client (the true labels, the exact BatchNorm statistics of the private
batch) is recorded separately in ``Observation.side`` and reaches an attack only when its ``ThreatModel``
grants it.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import Tensor, nn

from guardfl.defenses import Defense, DefenseConfig, Identity, from_config, parse_config
from guardfl.errors import ConfigError, GuardflError, RoundBudgetError
from guardfl.inspect import inspect_model
from guardfl.inspect_history import LeakHistory
from guardfl.integrations.budget import check_budget_left, check_max_rounds
from guardfl.integrations.round import FedAvg, FedSGD, Protocol, RoundResult, bn_layers, client_round
from guardfl.protect import split_stages
from guardfl.redteam import modality as modalities
from guardfl.redteam.auxdata import content_hashes


def sgd_step(params: dict[str, Tensor], grads: dict[str, Tensor], momentum: dict[str, Tensor] | None,
             protocol: FedAvg) -> tuple[dict[str, Tensor], dict[str, Tensor] | None]:
    """One functional step of ``torch.optim.SGD`` as the FedAvg client runs it (weight decay added to the
    gradient, then momentum with dampening 0, the buffer starting at the first gradient), on dicts of
    tensors (differentiable, and batched under vmap or with a leading batch axis)."""
    g = grads
    if protocol.weight_decay:
        g = {k: g[k] + protocol.weight_decay * params[k] for k in g}
    if protocol.momentum:
        momentum = g if momentum is None else {k: protocol.momentum * momentum[k] + g[k] for k in g}
        g = momentum
    return {k: params[k] - protocol.lr * g[k] for k in params}, momentum


@dataclass
class SideKnowledge:
    """What did NOT leave the client; an attack sees it only if its threat model grants it."""

    labels: Tensor
    #: per BatchNorm layer (in module order): (mean, biased var) of its input over the first local batch
    bn_batch_stats: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    #: the defense's ``last_stats`` per local step (client logs, for reports)
    defense_stats: list[dict] = field(default_factory=list)
    #: content hashes of the private inputs (to refuse auxiliary data that overlaps them; never granted)
    input_hashes: tuple[str, ...] = ()
    #: with an input encoding: the (encoded inputs, soft labels) of every local step, in order (the
    #: encoding's randomness: never granted; the report compares reconstructed encodings with them)
    trained: list[tuple[Tensor, Tensor]] = field(default_factory=list)

    def training_labels(self) -> Tensor:
        """The labels the client trained on: its soft labels when it encoded one batch per sample (FedSGD, or
        one epoch of FedAvg without resampling), else the private hard labels."""
        if self.trained:
            soft = torch.cat([y for _, y in self.trained])
            if soft.shape[0] == self.labels.shape[0]:
                return soft
        return self.labels


@dataclass
class Observation:
    """What leaves the client, with the public context of the round."""

    protocol: Protocol
    model: nn.Module  # the global model as the server sent it (architecture + weights + buffers)
    update: dict[str, Tensor]  # param name -> transmitted gradient (FedSGD) or delta (FedAvg)
    num_samples: int
    input_shape: tuple[int, ...]
    num_classes: int
    input_range: tuple[float, float]
    #: the client's defense configuration, parsed (None: no defense); a dict given here is parsed once
    defense_config: DefenseConfig | None
    #: BatchNorm running statistics the client releases with its model after local training
    released_bn_stats: list[tuple[Tensor, Tensor]]
    side: SideKnowledge
    #: whether the client trained in train mode (BatchNorm on batch statistics, dropout on)
    train_mode: bool = True
    #: the coordinates of ``update`` an attack should match (param name -> bool mask), None: all. A
    #: malicious server that isolated part of an update (Fishing: the classifier's other rows mix every
    #: sample) attacks a view of the observation with the rest masked out (and zeroed).
    matched: dict[str, Tensor] | None = None
    #: ``image`` (float inputs in ``input_range``) or ``text`` (token ids: ``input_shape`` is ``(L,)``,
    #: ``input_range`` the id range ``(0, vocab - 1)``, the model follows ``textmodels``' protocol; its
    #: labels are the next tokens ``(N, L)`` for a causal LM, classes ``(N,)`` for a classifier)
    modality: str = "image"

    def __post_init__(self) -> None:
        if self.defense_config is not None:
            self.defense_config = parse_config(self.defense_config)

    @property
    def batch_size(self) -> int:
        return self.num_samples if isinstance(self.protocol, FedSGD) else min(self.protocol.batch_size, self.num_samples)

    @property
    def param_names(self) -> list[str]:
        return list(self.update)

    def to(self, device: torch.device | str, model: nn.Module | None = None) -> "Observation":
        """A copy with every tensor on ``device``. ``model``: the copy's model, taken as it is (already on
        ``device``, shared: several observations of one setting need one copy of the global model)
        instead of a deep copy of this observation's."""
        mv = lambda pairs: [(a.to(device), b.to(device)) for a, b in pairs]  # noqa: E731
        return Observation(
            protocol=self.protocol,
            model=copy.deepcopy(self.model).to(device) if model is None else model,
            update={k: v.to(device) for k, v in self.update.items()},
            num_samples=self.num_samples,
            input_shape=self.input_shape,
            num_classes=self.num_classes,
            input_range=self.input_range,
            defense_config=self.defense_config,
            released_bn_stats=mv(self.released_bn_stats),
            side=SideKnowledge(self.side.labels.to(device), mv(self.side.bn_batch_stats), self.side.defense_stats,
                               self.side.input_hashes, mv(self.side.trained)),
            train_mode=self.train_mode,
            matched=None if self.matched is None else {k: v.to(device) for k, v in self.matched.items()},
            modality=self.modality,
        )


def _num_classes(model: nn.Module, x: Tensor) -> int:
    """The model's output width (one forward in eval mode, so no BatchNorm buffer moves)."""
    was = model.training
    model.eval()
    with torch.no_grad():
        k = int(model(x[:1]).shape[-1])
    model.train(was)
    return k


def simulate_client(
    model: nn.Module,
    inputs: Tensor,
    labels: Tensor,
    defense: Defense | Mapping[str, Any] | str | None = None,
    protocol: Protocol | None = None,
    *,
    input_range: tuple[float, float] = (0.0, 1.0),
    train_mode: bool = True,
    round_index: int = 0,
) -> Observation:
    """Run the client exactly as deployed on its private ``inputs`` (``labels``, ``input_range`` their value
    range) and return what it transmits. The round is ``guardfl.integrations.round.client_round``, the loop ``local_update`` (and so the Flower
    and NVFlare adapters) runs: the same model, data, defense and seed give a bit-identical update (FedSGD:
    ``local_update(...).gradient`` with one batch of all samples; FedAvg: its ``delta`` with the protocol's
    in-order loader and SGD). The defense is round ``round_index``'s (``round_defense``: rebuilt; seeded, that
    round's seed, as ``local_update`` with its ``ClientState`` derives it). ``model`` is the global model the
    server sent (left untouched). ``defense``: any guardfl defense or stack (a config works too); None
    means no defense (``Identity``, bit-identical to plain SGD). The client
    goes through ``guardfl.protect`` as a deployed client does: gradient defenses wrap its SGD; DP-SGD is
    Opacus (per-sample clipping, Gaussian noise from the defense's generator, gradient defenses of the stack
    applied after the noise); an input encoding (MixUp / InstaHide) encodes every batch it trains on, with
    soft labels. FedSGD sends the gradient of exactly the given batch (encoded, then clipped and noised as
    configured; under Poisson sampling its sample rate is 1); FedAvg trains E epochs over the n samples in
    batches of B, in order, or Poisson-sampled when DP-SGD says so (an empty batch takes a noise-only step).
    The client trains in train mode (BatchNorm on batch statistics) unless ``train_mode=False`` (refused
    with DP-SGD).
    """
    protocol = protocol or FedSGD()
    modality, input_range = _modality(model, inputs, input_range)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("model: it has no trainable parameters, so the client transmits nothing")
    if inputs.shape[0] != labels.shape[0] or inputs.shape[0] < 1:
        raise ValueError(f"inputs/labels: need the same non-zero batch size (got {inputs.shape[0]} and {labels.shape[0]})")
    defense_obj = Identity() if defense is None else (defense if isinstance(defense, Defense) else from_config(defense))
    _, encodings, _ = split_stages(defense_obj)
    if encodings and not modalities.get(modality).encodings:  # before guardfl.protect, whose checks speak of images
        raise ConfigError(f"defense: {encodings[0].config.kind} mixes images (convex combinations of inputs); it cannot "
                          "encode token ids: use a gradient defense or DP-SGD for a text model")

    global_model = copy.deepcopy(model)
    result, update, released, num_classes = _run_client(model, inputs, labels, protocol, defense_obj, train_mode, round_index)
    return Observation(
        protocol=protocol,
        model=global_model,
        update=update,
        num_samples=int(inputs.shape[0]),
        input_shape=tuple(inputs.shape[1:]),
        num_classes=num_classes,
        input_range=input_range,
        defense_config=None if defense is None else defense_obj.config,
        released_bn_stats=released,
        side=SideKnowledge(labels=labels.detach().clone(), bn_batch_stats=list(result.bn_inputs),
                           defense_stats=result.defense_stats, input_hashes=tuple(content_hashes(inputs, input_range)),
                           trained=result.batches if encodings else []),
        train_mode=train_mode,
        modality=modality,
    )


def _run_client(model: nn.Module, inputs: Tensor, labels: Tensor, protocol: Protocol, defense: Defense,
                train_mode: bool, round_index: int = 0) -> tuple[RoundResult, dict[str, Tensor], list[tuple[Tensor, Tensor]], int]:
    """The deployed client's round on its own copy of ``model``: the round's result, the update it sends
    (by trainable parameter), the BatchNorm running statistics it releases, and the number of classes."""
    client = copy.deepcopy(model)
    num_classes = _num_classes(client, inputs)
    names = [n for n, p in client.named_parameters() if p.requires_grad]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Ss]ecure RNG.*")
        warnings.filterwarnings("ignore", message=".*Full backward hook.*")  # a first layer whose input needs no grad
        warnings.filterwarnings("ignore", message=".*Optimal order is the smallest alpha.*")  # epsilon, unused here
        result = client_round(client, protocol.loader(inputs, labels), protocol.make_optimizer, defense,
                              epochs=protocol.local_epochs, num_classes=num_classes, train_mode=train_mode, record=True,
                              round_index=round_index)
    sent = protocol.sent(result)
    update = {name: sent[name] for name in names}
    released = [(bn.running_mean.detach().clone(), bn.running_var.detach().clone())
                for bn in bn_layers(client) if bn.running_mean is not None]
    return result, update, released, num_classes


def _modality(model: nn.Module, inputs: Tensor, input_range: tuple[float, float]) -> tuple[str, tuple[float, float]]:
    """("text", the token-id range) for integer inputs (token ids of a model with ``get_input_embeddings``),
    else ("image", ``input_range``)."""
    if inputs.is_floating_point():
        return "image", tuple(input_range)
    embed = getattr(model, "get_input_embeddings", None)
    if not callable(embed):
        raise ValueError("inputs: integer inputs are token ids, but the model has no get_input_embeddings() (the "
                         "text-model protocol of guardfl.redteam.modality.text.models)")
    vocab = int(embed().num_embeddings)
    if inputs.numel() and (int(inputs.min()) < 0 or int(inputs.max()) >= vocab):
        raise ValueError(f"inputs: token ids must be in [0, {vocab - 1}] (the model's vocabulary; got "
                         f"{int(inputs.min())}..{int(inputs.max())})")
    return "text", (0.0, float(vocab - 1))


def first_batch(protocol: Protocol, inputs: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """The batch a client inspects a received model on: its first local step's (FedAvg: the first
    ``batch_size`` samples; FedSGD: all of them)."""
    first = protocol.batch_size if isinstance(protocol, FedAvg) else inputs.shape[0]
    return inputs[:first], labels[:first]


class ModelRefused(GuardflError):
    """The client refused the model a malicious server sent: its inspection (``guardfl.inspect_model``)
    found it not ok, or (``by="round budget"``) its round budget was spent. The client trained nothing and
    sent nothing. ``reasons``: one sentence each; ``info``: what the attack adds on the model it sent (its
    lines for the certificate), set where it catches this."""

    def __init__(self, reasons: list[str], by: str = "inspection") -> None:
        self.reasons, self.by = list(reasons), by
        self.info: dict = {}
        super().__init__(f"the client's {by} refused the model: " + "; ".join(self.reasons))


class ClientQuery:
    """The client as a malicious server reaches it: send a model, receive the update the client computes
    on its private batch with it (``simulate_client``: the real defense path, train mode as deployed).
    The attack holds only this callable, never the batch. Each query is the client's next FL round: the
    defense is built anew from its configuration for round ``k`` (``round_defense``), so its randomness is
    fresh per query, and a seeded configuration gets round ``k``'s seed derived from its seed, as a deployed
    client that keeps its ``ClientState`` does (before 2026-11-28 every query reused the first round's seed,
    repeating a seeded defense's noise, which a server differencing two queries cancels: ``threshold_bins``
    read 16 faces exactly through a seeded DP-SGD that way); ``queries`` counts the models sent. Picklable (a worker process runs
    it), so it holds the configuration, not a defense object.

    ``inspect=True``: the client checks every received model first, as ``local_update(inspect=True)`` does:
    ``guardfl.inspect_model`` with ``reference`` (the architecture it expects: the honest global model) and
    its first batch (``(x, y)`` of its first local step); a model that is not ok raises ``ModelRefused``
    (nothing trained, nothing sent) and is counted in ``refused``. ``disaggregation=True``: the inspection
    adds SEER's D-SNR check (``inspect_model(..., disaggregation=True)``, train mode); ``leak_limit``: at
    most that many samples of the first batch read from the update (``inspect_model(..., leak_limit=)``), from its
    difference with any earlier query's update and by earlier queries, together (a ``LeakHistory`` kept across
    queries, as ``local_update`` keeps one in its ``ClientState``; until 2026-11-28 each query was limited alone,
    and ``threshold_bins`` read 14 faces exactly through a limit of 0); ``leak_history=False``: per update only
    (a client built anew each round, as a Flower ``client_fn`` builds it); a mapping: kept, with those
    ``LeakHistory`` limits (``max_rounds``, ``max_batches``).

    ``max_rounds``: the client's round budget (``guardfl.integrations.budget``, as ``local_update(...,
    max_rounds=)`` keeps it): once it has answered that many queries, every later one raises
    ``ModelRefused(by="round budget")`` before it is inspected (counted in ``budget_refused``). A refused
    query spends no round, as a deployed client's refusal sends nothing. The budget is the client's
    configuration, which the server knows (``repeats: auto`` spends it all on a fresh-noise defense)."""

    def __init__(self, inputs: Tensor, labels: Tensor, defense_config: DefenseConfig | dict | None, protocol: Protocol,
                 *, input_range: tuple[float, float] = (0.0, 1.0), train_mode: bool = True,
                 inspect: bool = False, reference: nn.Module | None = None, disaggregation: bool = False,
                 leak_limit: int | None = None, leak_history: bool | Mapping[str, int] = True,
                 max_rounds: int | None = None) -> None:
        if inspect and reference is None:
            raise ConfigError("client.inspect: the client needs its reference model (the honest global model) to inspect")
        if disaggregation and not inspect:
            raise ConfigError("client.inspect_disaggregation: true adds a check to the client's inspection, but inspect is false")
        if leak_limit is not None and not inspect:
            raise ConfigError("client.inspect_leak_limit: a limit adds a check to the client's inspection, but inspect is false")
        self._inputs, self._labels = inputs, labels
        self.defense_config = parse_config(defense_config) if defense_config is not None else None  # parsed once
        self.protocol = protocol
        self.input_range, self.train_mode = tuple(input_range), train_mode
        self.inspect, self.reference, self.disaggregation, self.leak_limit = inspect, reference, disaggregation, leak_limit
        self.num_samples = int(inputs.shape[0])
        self.input_shape = tuple(inputs.shape[1:])
        # the client's memory of what it sent, for the leak limit across queries (a deployed client keeps it in its
        # ``ClientState``): a server differencing two queries of the batch reads what neither update shows alone
        limits = dict(leak_history) if isinstance(leak_history, Mapping) else {}
        self.history = LeakHistory(**limits) if leak_limit is not None and leak_history else None
        self.max_rounds = check_max_rounds(max_rounds, "client.max_rounds")
        self.queries = 0
        self.refused = 0
        self.answered = 0
        self.budget_refused = 0

    def __call__(self, model: nn.Module) -> Observation:
        self.queries += 1
        try:
            check_budget_left(self.max_rounds, self.answered, "client.max_rounds")
        except RoundBudgetError as spent:
            self.budget_refused += 1
            raise ModelRefused([str(spent)], by="round budget") from None
        if self.inspect:
            inspection = inspect_model(model, self.reference, batch=first_batch(self.protocol, self._inputs, self._labels),
                                       disaggregation=self.disaggregation, leak_limit=self.leak_limit, history=self.history)
            if not inspection.ok:
                self.refused += 1
                raise ModelRefused(inspection.reasons)
        defense = from_config(self.defense_config) if self.defense_config is not None else None
        # each model the server sends is the client's next round: a seeded defense gets that round's seed
        observation = simulate_client(model, self._inputs, self._labels, defense, self.protocol, input_range=self.input_range,
                                      train_mode=self.train_mode, round_index=self.queries - 1)
        self.answered += 1
        return observation
