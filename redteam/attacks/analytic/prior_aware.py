"""The prior-aware attack of Hayes, Mahloujifar, Balle 2023 ("Bounding Training Data Reconstruction in
DP-SGD", arXiv 2302.07225, Sec. 4): the attacker knows a set of candidates that contains the target and
every other sample of the batch, sees the defended update(s), and answers the candidate with the highest
likelihood under the mechanism. It is the attack the ReRo bound (``guardfl.bounds``) is tight for: with
``n`` candidates its baseline is ``kappa = 1 / n`` and its success can approach ``1 - f(1 / n)``.

The likelihood (``scores``): each candidate's contribution to the update is its gradient at the model the
server sent, as the defense shapes it before the noise (clipped to DP-SGD's ``max_grad_norm`` or the noise's
``clip``); the observed update, with what
the attacker knows of the rest of the batch removed, is that contribution plus the mechanism's noise. For
Gaussian noise of std ``s`` the log-likelihood is ``-||u - c||^2 / (2 s^2)`` summed over the updates
(rounds) observed: the candidate nearest the update (Hayes et al. score by the inner product ``<u, c>``,
the same ranking when every clipped contribution has the same norm); under Poisson sampling at rate
``q < 1`` the mixture ``log(1 - q + q exp((<u, c> - |c|^2 / 2) / s^2))`` per update; for Laplace noise
``-||u - c||_1 / b``. Without a mechanism (no defense, or noise without a clip) it is the nearest candidate in
L2, the likelihood of any isotropic Gaussian noise: the attack runs whatever the defense (the red team's
attacks never depend on the defense to apply). A stack is approximated (ours, not the paper's): its
deterministic stages (pruning, sign) are applied to each contribution after the clip, and the likelihood
is that of its last noise; the exact likelihood of noise followed by sign or pruning is not computed.

As a red-team attack (``prior_aware``, registered): the candidate set is the attacker's auxiliary data
(``candidates`` of it, drawn with the attack's seed), the observation one FedSGD update of ONE sample
(``max_samples: 1``): the informed adversary also knows the batch's other samples, which the red team does
not grant, and with a batch of one there are none, so the attack is exactly the paper's. Deviations: the
paper's target is always among the candidates; in a certificate the auxiliary data is disjoint from the
private data (checked), so the target is not, and the answer counts only when the chosen auxiliary image
already passes the certificate's criterion for it, which is the prior's baseline kappa sharpened by the
update. It runs in ``attacks: all`` certificates where it applies (FedSGD, one sample an update, auxiliary
data): it costs one gradient per candidate, and it is the one attack whose success a theorem bounds, so a
certificate shows both. The tightness measurement (the target among the candidates) is
``tests/redteam/attacks/analytic/test_prior_aware.py`` and ``bench/bench_rero.py``, with the pure functions
below.
"""

from __future__ import annotations

import copy
import math

import torch
from pydantic import Field
from torch import Tensor

from guardfl.defenses import REGISTRY, DefenseConfig
from guardfl.redteam import modality
from guardfl.redteam.attacks.base import Attack, AttackConfig, Capabilities, Reconstruction
from guardfl.redteam.attacks.registry import register
from guardfl.redteam.client.simulate import Observation
from guardfl.redteam.threat import Knowledge

#: deterministic gradient defenses that need nothing but the gradient: applied to each candidate's
#: contribution after its clip, as the client applies them to its own gradient
DETERMINISTIC = ("gradprune", "sign")


class PriorAwareConfig(AttackConfig):
    #: how many auxiliary samples make the candidate set (null: all of them)
    candidates: int | None = Field(default=64, ge=2, le=100_000,
                                   json_schema_extra={"allowed": "null (all auxiliary samples) or an integer in [2, 100000]"})


def noise_model(config: DefenseConfig | None) -> tuple[str, float | None, float | None]:
    """(noise kind "gaussian" / "laplace", its scale in the update's units, the clip before it) of a defense
    configuration's mechanism; ("gaussian", None, clip) without noise (the nearest candidate in L2). The last
    noise leaf decides the kind; DP-SGD's noise is ``noise_multiplier * max_grad_norm`` (a batch of one)."""
    kind, scale, clip = "gaussian", None, None
    for leaf in (config.leaves() if config is not None else []):
        if leaf.kind == "dpsgd":
            clip = leaf.max_grad_norm
            if leaf.noise_multiplier:
                scale = leaf.noise_multiplier * leaf.max_grad_norm
        elif leaf.kind in ("gaussian", "laplace"):
            kind, scale = leaf.kind, leaf.sigma if leaf.kind == "gaussian" else leaf.scale
            clip = leaf.clip if leaf.clip is not None else clip
    return kind, scale, clip


def contributions(model: torch.nn.Module, inputs: Tensor, labels: Tensor, names: list[str], *,
                  config: DefenseConfig | None = None, train_mode: bool = True, loss=None) -> Tensor:
    """``(n, d)``: each candidate's gradient (the parameters ``names``, flattened in order) at ``model``,
    clipped as the defense clips and shaped by its deterministic stages (``DETERMINISTIC``) as the client
    shapes its own gradient before the noise."""
    loss = loss or torch.nn.functional.cross_entropy
    net = copy.deepcopy(model).train(train_mode)
    params = dict(net.named_parameters())
    chosen = [params[n] for n in names]
    _, _, clip = noise_model(config)
    shaping = [REGISTRY[leaf.kind].from_config(leaf.model_copy(update={"seed": 0}))
               for leaf in (config.leaves() if config is not None else []) if leaf.kind in DETERMINISTIC]
    rows = []
    for x, y in zip(inputs, labels):
        grads = torch.autograd.grad(loss(net(x[None]), y[None]), chosen)
        flat = torch.cat([g.reshape(-1) for g in grads]).detach()
        if clip is not None:
            flat = flat * min(1.0, clip / max(float(flat.norm()), 1e-30))
        for defense in shaping:
            parts = list(torch.split(flat, [p.numel() for p in chosen]))
            parts, _ = defense([p.reshape(c.shape) for p, c in zip(parts, chosen)])
            flat = torch.cat([p.reshape(-1) for p in parts])
        rows.append(flat)
    return torch.stack(rows)


def scores(observed: Tensor, contrib: Tensor, kind: str = "gaussian", scale: float | None = None,
           sample_rate: float = 1.0) -> Tensor:
    """Each candidate's log-likelihood (up to a constant) of the ``observed`` update(s) ``(T, d)`` (or ``(d,)``)
    given its contributions ``(n, d)`` (the same every round) or ``(n, T, d)``: Gaussian of std ``scale``
    (at ``sample_rate`` < 1 the Poisson mixture of Hayes et al.), Laplace of scale ``scale``; ``scale`` None:
    the negative squared distance."""
    obs = observed.reshape(-1, observed.shape[-1]).double()
    c = contrib.double()
    c = c[:, None, :].expand(-1, obs.shape[0], -1) if c.dim() == 2 else c
    if kind == "laplace" and scale:
        return -(obs[None] - c).abs().sum(-1).sum(-1) / scale
    if sample_rate < 1.0:
        s2 = float(scale) ** 2
        inner = ((obs[None] * c).sum(-1) - 0.5 * (c * c).sum(-1)) / s2
        mixed = torch.logaddexp(torch.full_like(inner, math.log1p(-sample_rate)), inner + math.log(sample_rate))
        return mixed.sum(-1)
    dist = ((obs[None] - c) ** 2).sum(-1).sum(-1)
    return -dist / (2 * float(scale) ** 2) if scale else -dist


def score_candidates(observation: Observation, inputs: Tensor, labels: Tensor,
                     config: DefenseConfig | None = None) -> Tensor:
    """The candidates' scores for one observation (one FedSGD update of one sample) under the mechanism of
    ``config`` (the defense as the attacker knows it; None: unknown, nearest in L2)."""
    names = observation.param_names
    observed = torch.cat([observation.update[n].reshape(-1) for n in names]).detach()
    contrib = contributions(observation.model, inputs, labels, names, config=config,
                            train_mode=observation.train_mode, loss=modality.get(observation.modality).loss)
    kind, scale, _ = noise_model(config)
    return scores(observed.to(contrib), contrib, kind, scale)


@register
class PriorAware(Attack):
    """Hayes et al. 2023's prior-aware attack: the most likely auxiliary candidate under the mechanism."""

    name = "prior_aware"
    Config = PriorAwareConfig
    capabilities = Capabilities(protocols=frozenset({"fedsgd"}), max_samples=1, needs_aux=True,
                                threat=frozenset({"defense"}))
    budgets = {"quick": {"candidates": 64}, "paper": {"candidates": None}}
    paper_budget = ("Hayes et al. 2023: the prior is the candidate set (their figures: 10 candidates); here the "
                    "attacker's auxiliary data, all of it")

    def _reconstruct(self, observation: Observation, knowledge: Knowledge, device: torch.device,
                     gen: torch.Generator) -> Reconstruction:
        aux = knowledge.aux
        n = len(aux.images) if self.config.candidates is None else min(self.config.candidates, len(aux.images))
        pick = torch.randperm(len(aux.images), generator=gen)[:n]
        xs, ys = aux.images[pick].to(device), aux.labels[pick].to(device)
        found = score_candidates(observation, xs, ys, knowledge.defense_config)
        best = int(torch.argmax(found))
        return Reconstruction(inputs=xs[best:best + 1].detach().clone(), labels=ys[best:best + 1].clone(),
                              objective=float(-found[best]),
                              info={"candidates": n, "chosen": int(pick[best]),
                                    "mechanism": "{} noise, scale {}, clip {}".format(*noise_model(knowledge.defense_config))})
