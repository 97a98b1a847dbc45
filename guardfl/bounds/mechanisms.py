"""Which part of a defense is a randomised mechanism with bounded sensitivity, and with what parameters.

``analyse(defense, client)`` walks a defense configuration (a stack's ``leaves()`` in order) and returns
the ``Mechanism`` objects that bound what the client sends, or an ``Unbounded`` saying why nothing does.

The threat model of every bound here is the informed adversary of Hayes, Mahloujifar, Balle 2023 (and of
Balle et al. 2022): it knows the model, the mechanism and its parameters, every other sample of the client,
and sees every update the client sends. A bound compares the client's output with a REFERENCE output that
does not depend on the target (the ReRo argument needs nothing more; Kaissis et al. 2023, Thm. 1):

- DP-SGD (``dpsgd``): per-sample clipping to ``max_grad_norm``, Gaussian noise of std ``noise_multiplier *
  max_grad_norm`` on the sum, Poisson sampling at rate ``q``. Reference: the same client with the target's
  clipped gradient removed (add/remove-one: the target absent, as Opacus's accountants assume). One step
  is a Poisson-subsampled Gaussian of sensitivity 1 and noise ``noise_multiplier`` (Hayes et al. Sec. 3).
  Without Poisson sampling (``poisson_sampling: false``) no amplification is claimed (``q = 1``): the
  reference zeroes the target's contribution in its batch, and every step counts.
- Clipped update noise (``gaussian`` / ``laplace`` with ``clip``): the whole update is scaled to L2 norm at
  most ``clip``, then noise is added to every entry. There is no per-sample clipping, so two datasets'
  updates can be ``2 * clip`` apart (the replace-one sensitivity); the reference here is the noise around
  a zero update, which every clipped update lies within ``clip`` of, so the target moves the mean by at
  most ``clip``: Gaussian noise ``sigma`` is a Gaussian mechanism of noise multiplier ``sigma / clip``
  (tight: two candidates whose clipped updates are opposite reach it, ``tests/guardfl/bounds``).
  Laplace noise of scale ``b`` on ``d`` entries: the L1 distance is at most ``sqrt(d) * clip``, so each
  step is ``sqrt(d) * clip / b``-DP (pure), the conservative route (no tighter dominating pair of the
  d-dimensional Laplace over an L2 ball is known to us); ``d`` must be given.

Steps: every local optimizer step of every round the client answers (``client.max_rounds``): FedSGD one
step a round; FedAvg ``epochs * ceil(n / batch_size)`` a round, ``n`` the local dataset (``dataset_size``
when given, else ``samples``). DP-SGD's sample rate is ``batch_size / n`` (at least Opacus's ``1 /
ceil(n / batch_size)``: conservative). Clipped noise claims no subsampling (``q = 1``) and counts every step
at full sensitivity, whether or not the target was in its batch.

Stacks (the leaves in order): a gradient defense after a mechanism is post-processing (pruning, sign,
Outpost: functions of the noisy update, the weights and fresh randomness) and keeps its bound, unless it
reads the private inputs again (``needs_model``: Soteria, GradDefense), which voids it. Anything before a
clipped-noise mechanism is pre-processing (the clip bounds whatever arrives). An input encoding (MixUp,
InstaHide) before DP-SGD voids DP-SGD's bound: one private sample enters several encoded training samples,
so its influence is no longer one clipped gradient; a clipped-update mechanism keeps its bound under an
encoding (its clip bounds the whole update whatever the data). Several mechanisms that hold: each alone
bounds the client (the others are pre- or post-processing of it), so the least bound is the stack's.

>>> from guardfl.defenses import parse_config
>>> m = analyse(parse_config({"kind": "gaussian", "sigma": 0.5, "clip": 1.0}), Client())
>>> m[0].noise_multiplier
0.5
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from guardfl.defenses import DefenseConfig, parse_config
from guardfl.errors import ConfigError

#: statuses of a bound
PROVEN, NOT_PROVEN, NO_MECHANISM = "PROVEN", "NOT PROVEN", "NO MECHANISM"

#: why a defense kind is no mechanism (alone)
WHY_NOT = {
    "identity": "no defense: the update is sent as computed",
    "gradprune": "pruning is deterministic: it hides coordinates, adds no randomness, bounds nothing",
    "sign": "sign compression is deterministic: no randomness, no bounded sensitivity",
    "soteria": "Soteria prunes by a score of the private inputs: deterministic, no bounded sensitivity",
    "outpost": "Outpost's noise scales with the weights' variance and is added with a probability, without a clip: "
               "the update's sensitivity is unbounded",
    "graddefense": "GradDefense noises some slices only and leaves the others as computed: no bound on what the "
                   "unnoised slices reveal",
    "mixup": "MixUp mixes private samples (a convex combination): deterministic given its coefficients, which hide "
             "nothing a theorem bounds",
    "instahide": "InstaHide mixes private samples and flips signs: no bounded sensitivity (attacks decode it)",
    "gaussian": "Gaussian noise of a fixed scale without a clip: the update's sensitivity is unbounded (a server that "
                "scales the model scales the gradient, and the noise vanishes beside it); set clip",
    "laplace": "Laplace noise of a fixed scale without a clip: the update's sensitivity is unbounded; set clip",
    "dpsgd": "dpsgd with noise_multiplier 0 clips only: no noise, no bound",
}


@dataclass(frozen=True)
class Client:
    """What a bound needs of the client: its protocol, batch size, local dataset and rounds.

    ``samples``: the local dataset a FedAvg round trains on (the red team's ``client.samples``);
    ``dataset_size``: the deployment's local dataset for DP-SGD accounting (``client.dataset_size``; None:
    ``samples``, or the batch for FedSGD); ``max_rounds``: the round budget (None: none, unbounded).
    ``dimension``: the number of entries the update's noise is added to (trainable parameters), needed for
    Laplace noise; ``released``: state the client sends without noise (BatchNorm running statistics), which
    voids every bound."""

    protocol: str = "fedsgd"
    batch_size: int = 1
    samples: int | None = None
    epochs: int = 1
    dataset_size: int | None = None
    max_rounds: int | None = None
    dimension: int | None = None
    released: tuple[str, ...] = ()

    @property
    def local_size(self) -> int:
        """The local dataset: ``dataset_size``, else ``samples``, else the batch."""
        return int(self.dataset_size or self.samples or self.batch_size)

    @property
    def steps_per_round(self) -> int:
        """Local optimizer steps a round: FedSGD 1; FedAvg ``epochs * ceil(n / batch_size)``."""
        if self.protocol == "fedsgd":
            return 1
        return int(self.epochs) * math.ceil(self.local_size / self.batch_size)


@dataclass(frozen=True)
class Mechanism:
    """One mechanism of the client's defense, normalised to sensitivity 1: ``noise_multiplier`` (Gaussian:
    noise std over sensitivity) or ``epsilon`` (pure DP a step), ``sample_rate``, ``steps_per_round``."""

    leaf: str
    noise: str  # "gaussian" or "laplace"
    sample_rate: float
    steps_per_round: int
    reference: str
    description: str
    noise_multiplier: float | None = None
    epsilon: float | None = None
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def accountant(self) -> str:
        if self.noise == "gaussian":
            return ("dp-accounting PLD (Poisson-subsampled Gaussian, pessimistic, self-composed)" if self.sample_rate < 1
                    else "dp-accounting PLD (Gaussian; full-batch steps compose exactly into one Gaussian)")
        return "dp-accounting PLD (pure epsilon-DP, randomised-response dominating pair, self-composed)"


@dataclass(frozen=True)
class Unbounded:
    """No bound: ``status`` NO MECHANISM (no part of the defense is a mechanism) or NOT PROVEN (one is, but
    its bound does not hold or cannot be computed here), with the reason."""

    status: str
    reason: str


def analyse(defense: DefenseConfig | dict | None, client: Client) -> list[Mechanism] | Unbounded:
    """The mechanisms bounding what ``client`` sends under ``defense`` (at least one), or why none does."""
    if defense is None:
        return Unbounded(NO_MECHANISM, WHY_NOT["identity"])
    leaves = parse_config(defense).leaves()
    found: list[Mechanism] = []
    voided: list[str] = []
    encodings = [leaf.kind for leaf in leaves if _stage(leaf) == "input"]
    for i, leaf in enumerate(leaves):
        mech = _mechanism(leaf, client)
        if isinstance(mech, str):
            voided.append(mech)
            continue
        if mech is None:
            continue
        later = leaves if leaf.kind == "dpsgd" else leaves[i + 1:]  # DP-SGD's gradient stages follow its noise
        readers = [x.kind for x in later if _stage(x) == "gradient" and _reads_inputs(x)]
        if readers:
            voided.append(f"{leaf.kind}: {', '.join(readers)} reads the private inputs again after the noise (not "
                          "post-processing), so the noise's bound does not cover what is sent")
            continue
        if leaf.kind == "dpsgd" and encodings:
            voided.append(f"dpsgd: the input encoding ({', '.join(encodings)}) mixes each private sample into several "
                          "training samples, so one sample's influence is no longer one clipped gradient")
            continue
        found.append(mech)
    if found and client.released:
        return Unbounded(NOT_PROVEN, f"the client sends {', '.join(client.released[:3])}"
                         f"{' ...' if len(client.released) > 3 else ''} (BatchNorm running statistics of its private "
                         "data) without noise: no mechanism covers them (use GroupNorm, guardfl.dp_compatible)")
    if found:
        return found
    if voided:
        return Unbounded(NOT_PROVEN, "; ".join(voided))
    kinds = sorted({leaf.kind for leaf in leaves})
    return Unbounded(NO_MECHANISM, "; ".join(f"{k}: {_why_not(k, leaves)}" for k in kinds))


def _why_not(kind: str, leaves: list[DefenseConfig]) -> str:
    return WHY_NOT.get(kind, f"{kind} is not a mechanism with bounded sensitivity that guardfl.bounds knows")


def _stage(leaf: DefenseConfig) -> str:
    from guardfl.defenses import REGISTRY

    return REGISTRY[leaf.kind].stage


def _reads_inputs(leaf: DefenseConfig) -> bool:
    from guardfl.defenses import REGISTRY

    return bool(REGISTRY[leaf.kind].needs_model)


def _mechanism(leaf: DefenseConfig, client: Client) -> Mechanism | str | None:
    """The leaf's mechanism; a reason (str) when it is one whose bound cannot be computed; None when it is
    none."""
    if leaf.kind == "dpsgd":
        return _dpsgd(leaf, client)
    if leaf.kind in ("gaussian", "laplace") and leaf.clip is not None:
        return _clipped(leaf, client)
    return None


def dpsgd_sample_rate(leaf: DefenseConfig, client: Client) -> float:
    """DP-SGD's sample rate: ``batch_size / n`` under Poisson sampling (capped at 1), else 1."""
    return min(1.0, client.batch_size / client.local_size) if leaf.poisson_sampling else 1.0


def _dpsgd(leaf: DefenseConfig, client: Client) -> Mechanism | str | None:
    q = dpsgd_sample_rate(leaf, client)
    z = leaf.noise_multiplier
    if z is None:
        if client.dataset_size is None:
            return ("dpsgd: target_epsilon without client.dataset_size: the noise multiplier is not known (give "
                    "client.dataset_size, or noise_multiplier)")
        z = resolve_noise_multiplier(leaf, q)
    if z == 0:
        return None
    reference = ("the target's clipped gradient removed (add/remove-one; Poisson sampling at rate "
                 f"{q:.4g})" if leaf.poisson_sampling else
                 "the target's clipped gradient zeroed in its batch (no Poisson sampling: no amplification, q = 1)")
    return Mechanism(
        leaf="dpsgd", noise="gaussian", sample_rate=q, steps_per_round=client.steps_per_round, reference=reference,
        noise_multiplier=float(z),
        description=f"DP-SGD: per-sample clip {leaf.max_grad_norm:g}, noise multiplier {z:.4g}, sample rate {q:.4g}",
        params={"noise_multiplier": float(z), "max_grad_norm": leaf.max_grad_norm, "sample_rate": q})


def resolve_noise_multiplier(leaf: DefenseConfig, sample_rate: float) -> float:
    """The noise multiplier Opacus picks for a ``target_epsilon`` configuration (as the red team's
    ``client.privacy.resolve`` and ``guardfl.protect`` do)."""
    import warnings

    from opacus.accountants.utils import get_noise_multiplier

    if leaf.epochs is None:
        raise ConfigError("dpsgd.epochs: needed with target_epsilon (the passes the privacy budget covers)")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Optimal order is the largest alpha.*")
        return float(get_noise_multiplier(target_epsilon=leaf.target_epsilon, target_delta=leaf.delta,
                                          sample_rate=sample_rate, epochs=leaf.epochs, accountant=leaf.accountant))


def _clipped(leaf: DefenseConfig, client: Client) -> Mechanism | str:
    clip = float(leaf.clip)
    reference = (f"noise around a zero update (every update clipped to norm {clip:g} lies within {clip:g} of it; "
                 f"replace-one would be {2 * clip:g} apart)")
    common = dict(leaf=leaf.kind, sample_rate=1.0, steps_per_round=client.steps_per_round, reference=reference)
    if leaf.kind == "gaussian":
        z = float(leaf.sigma) / clip
        return Mechanism(noise="gaussian", noise_multiplier=z, **common,
                         description=f"Gaussian noise sigma {leaf.sigma:g} on an update clipped to {clip:g} "
                                     f"(noise multiplier {z:.4g}), every step",
                         params={"sigma": leaf.sigma, "clip": clip})
    if client.dimension is None:
        return ("laplace: its L1 sensitivity needs the number of entries the noise covers (the model's trainable "
                "parameters), which was not given")
    eps = math.sqrt(client.dimension) * clip / float(leaf.scale)
    return Mechanism(noise="laplace", epsilon=eps, **common,
                     description=f"Laplace noise scale {leaf.scale:g} on an update clipped to {clip:g} over "
                                 f"{client.dimension} entries: {eps:.4g}-DP a step (L1 sensitivity sqrt(d) x clip)",
                     params={"scale": leaf.scale, "clip": clip, "dimension": client.dimension})
