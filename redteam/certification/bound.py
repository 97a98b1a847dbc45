"""The certificate's proven bound: what a theorem guarantees beside what the attacks found.

``certificate_bound(cfg, kappa, kappa_source, claim)`` is the certificate's ``bound`` entry (a dict, JSON as
it is): the reconstruction bound of the configured client (``guardfl.bounds``) for the prior's baseline
``kappa``, PROVEN when it is below the claimed leak rate (``certify.max_leak_rate``), with the curves the
report plots (bound against rounds, where the client's budget stops, and against kappa).
``kappa_from_aux(cfg, aux, private)`` estimates kappa with this certificate's own success criterion (the
judge's per-sample limits: threshold, or the prior guess plus ``prior_margin``); ``summary_sentence`` says
in words how the empirical verdict and the bound combine.

The keys of the entry: ``status`` (PROVEN, NOT PROVEN, NO MECHANISM), ``rero`` (the bound; None without
one), ``kappa``, ``kappa_source``, ``claim``, ``mechanism`` (in words), ``leaf``, ``accountant``,
``neighbouring`` (the reference the bound compares with), ``rounds``, ``steps``, ``steps_per_round``,
``sample_rate``, ``noise_multiplier`` / ``epsilon``, ``assumption``, ``reason`` (why not PROVEN),
``others`` (further mechanisms of a stack, whose bounds are larger), ``curve_rounds`` ([rounds, bound]
pairs), ``curve_kappa`` ([kappa, bound] pairs, at the configured rounds).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from guardfl.bounds import (ASSUMPTION, COMPUTED, NO_MECHANISM, NOT_PROVEN, PROVEN, Client, KappaEstimate,
                            defense_bound, estimate_kappa, rero, verdict)
from guardfl.integrations.budget import MAX_ROUNDS_LIMIT
from guardfl.integrations.round import bn_layers
from guardfl.redteam import modality
from guardfl.redteam.certification import evidence
from guardfl.redteam.certification.judge import _image_limits
from guardfl.redteam.config import RedTeamConfig

#: the kappa axis of the report's curve
KAPPAS = (1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 0.5)
#: rounds plotted without a budget
UNBUDGETED_ROUNDS = 256
#: the most auxiliary samples tried as guesses when kappa is estimated (a seeded draw): the SSIM of every
#: (guess, private sample) pair is computed, and the Bonferroni correction grows with the guesses
MAX_GUESSES = 256


def client_facts(cfg: RedTeamConfig, model: torch.nn.Module | None = None) -> Client:
    """What the bound needs of the configured client; ``model`` (the global model) gives the number of
    entries the noise covers and whether a FedAvg client sends BatchNorm running statistics unnoised."""
    c = cfg.client
    dimension = released = None
    if model is not None:
        dimension = sum(p.numel() for p in model.parameters() if p.requires_grad)
        released = ()
        if c.protocol == "fedavg" and c.train_mode:  # FedAvg sends the trained state, BatchNorm's buffers included
            released = tuple(f"{name}.running_mean" for name, m in model.named_modules()
                             if m in set(bn_layers(model)) and getattr(m, "running_mean", None) is not None)
    return Client(protocol=c.protocol, batch_size=c.batch_size, samples=c.n, epochs=c.epochs, dataset_size=c.dataset_size,
                  max_rounds=c.max_rounds, dimension=dimension, released=released or ())


def kappa_from_aux(cfg: RedTeamConfig, aux: torch.Tensor, private: torch.Tensor,
                   data_range: tuple[float, float] = (0.0, 1.0)) -> KappaEstimate | str:
    """kappa's upper confidence bound (``certify.confidence``) from the attacker's auxiliary images (the
    guesses) against the private images, with the judge's own criterion: a guess succeeds on a private
    image when its SSIM or PSNR there is past that image's limit (the threshold, or the mean auxiliary
    image's score plus ``prior_margin``, as ``judge._image_limits``). A reason (str) when it cannot be
    estimated: text (use ``certify.kappa``), or LPIPS as the only threshold."""
    if modality.of(cfg).tokenized:  # token ids: the image metrics below do not apply
        return (f"kappa is estimated from auxiliary images only; for a {modality.of(cfg).name} client give certify.kappa "
                "(1/n for a known candidate set of n)")
    from guardfl.redteam.modality.image import metrics

    guesses, targets = aux.detach().float().cpu(), private.detach().float().cpu()
    span = float(data_range[1] - data_range[0])
    prior = guesses.mean(0, keepdim=True).expand_as(targets)
    prior_ssim = metrics.ssim_pairs(prior, targets, span)
    prior_mse = (prior - targets).pow(2).flatten(1).mean(1).double().numpy()
    limits = [_image_limits(cfg, {"ssim": float(s), "psnr": metrics.psnr(float(m), span)})
              for s, m in zip(prior_ssim, prior_mse)]
    usable = {"ssim", "psnr"} & set(limits[0]) if limits else set()
    if not usable:
        return "kappa: the certificate's thresholds are LPIPS / label accuracy only, which the estimate does not compute"

    def success(g: torch.Tensor, t: torch.Tensor) -> np.ndarray:
        hits = np.zeros((len(g), len(t)), dtype=bool)
        if "ssim" in usable:
            s = metrics.ssim_matrix(g, t, span).T  # (guesses, targets)
            hits |= s > np.array([lim["ssim"][0] for lim in limits])[None]
        if "psnr" in usable:
            mse = (torch.cdist(g.flatten(1).double(), t.flatten(1).double()).pow(2) / g[0].numel()).numpy()
            with np.errstate(divide="ignore"):
                psnr = np.where(mse > 0, 10 * np.log10(span ** 2 / np.maximum(mse, 1e-300)), np.inf)
            hits |= psnr > np.array([lim["psnr"][0] for lim in limits])[None]
        return hits

    return estimate_kappa(guesses, targets, success, cfg.certify.confidence)


def certificate_bound(cfg: RedTeamConfig, kappa: float | None, kappa_source: str, claim: float | None = None, *,
                      model: torch.nn.Module | None = None, curves: bool = True) -> dict[str, Any]:
    """The certificate's ``bound`` entry (module docstring) for ``cfg``'s client and defense, a prior of
    baseline ``kappa`` (None: unknown, NOT PROVEN) from ``kappa_source``, and the claim (default:
    ``certify.max_leak_rate``). ``model``: the global model (the Laplace noise's dimension, BatchNorm's
    released statistics). ``curves``: compute the report's curves (a PLD per rounds point)."""
    if claim is None:  # the leak claim's rate; a config that claims re-identification only: that rate
        claim = cfg.certify.max_leak_rate if cfg.certify.max_leak_rate is not None else cfg.certify.max_reid_rate
    client = client_facts(cfg, model)
    entry: dict[str, Any] = {"status": NOT_PROVEN, "rero": None, "kappa": kappa, "kappa_source": kappa_source,
                             "claim": claim, "mechanism": None, "leaf": None, "accountant": None, "neighbouring": None,
                             "rounds": client.max_rounds, "steps": None, "steps_per_round": None, "sample_rate": None,
                             "assumption": ASSUMPTION + _kappa_assumption(kappa_source), "reason": "", "others": [],
                             "curve_rounds": [], "curve_kappa": []}
    if cfg.target is not None:
        entry["assumption"] += "; the user's client code runs the configured defense as guardfl's client does"
    probe = defense_bound(cfg.defense, client, kappa if kappa is not None else 0.5)
    mech = probe.mechanism
    if mech is not None:
        entry.update(mechanism=mech.description, leaf=mech.leaf, accountant=mech.accountant, neighbouring=mech.reference,
                     steps_per_round=mech.steps_per_round, sample_rate=mech.sample_rate,
                     others=[m.description for m in probe.others],
                     **({"noise_multiplier": mech.noise_multiplier} if mech.noise == "gaussian" else {"epsilon": mech.epsilon}))
    if kappa is None:
        missing = (f"no kappa ({kappa_source}): give certify.kappa, or auxiliary data to estimate it from"
                   if kappa_source else "no kappa: give certify.kappa, or auxiliary data to estimate it from")
        if probe.status == NO_MECHANISM:
            entry.update(status=NO_MECHANISM, reason=probe.reason)
        else:
            entry.update(reason="; ".join([missing] + ([probe.reason] if probe.reason else [])))
        return entry
    bound = probe if kappa == 0.5 else defense_bound(cfg.defense, client, kappa)
    status, reason = verdict(bound, claim)
    entry.update(status=status, reason=reason, rero=bound.rero, steps=bound.steps)
    if curves and mech is not None:
        budget = client.max_rounds
        entry["curve_rounds"] = [[r, rero(mech, kappa, r)] for r in rounds_axis(budget)]
        at = budget or 1
        entry["curve_kappa"] = [[k, rero(mech, k, at)] for k in sorted(set(KAPPAS) | {kappa})]
        entry["curve_kappa_rounds"] = at
    return entry


def run_bound(cfg: RedTeamConfig, aux: Any, private: torch.Tensor | None, model: torch.nn.Module | None,
              data_range: tuple[float, float] = (0.0, 1.0)) -> dict[str, Any]:
    """The certification recipe's step: the bound entry with kappa from ``certify.kappa``, else estimated
    from the auxiliary data (at most ``MAX_GUESSES`` of it, drawn with ``cfg.seed``) against ``private`` (the
    population the certificate speaks for), else unknown. kappa is estimated only when the defense has a
    mechanism (nothing to bound otherwise)."""
    if cfg.certify.kappa is not None:
        return certificate_bound(cfg, cfg.certify.kappa, "certify.kappa", model=model)
    if aux is None or not len(aux.images) or private is None or not len(private):
        return certificate_bound(cfg, None, "no certify.kappa and no auxiliary data to estimate it from", model=model)
    if certificate_bound(cfg, None, "", model=model, curves=False)["mechanism"] is None:
        return certificate_bound(cfg, None, "not estimated: no mechanism to bound", model=model)
    guesses = aux.images
    if len(guesses) > MAX_GUESSES:
        pick = torch.randperm(len(guesses), generator=torch.Generator().manual_seed(cfg.seed))[:MAX_GUESSES]
        guesses = guesses[pick]
    est = kappa_from_aux(cfg, guesses, private, data_range)
    if isinstance(est, str):
        return certificate_bound(cfg, None, est, model=model)
    return certificate_bound(cfg, est.kappa, est.describe(), model=model)


def rounds_axis(budget: int | None) -> list[int]:
    """The rounds the report plots: powers of two up to 4x the budget (or ``UNBUDGETED_ROUNDS``), the
    budget itself among them."""
    top = min(MAX_ROUNDS_LIMIT, max(16, 4 * budget) if budget else UNBUDGETED_ROUNDS)
    axis = {1 << i for i in range(top.bit_length()) if 1 << i <= top}
    if budget:
        axis.add(budget)
    return sorted(axis)


def _kappa_assumption(source: str) -> str:
    if source and source.startswith("estimated"):
        return ("; kappa is an upper confidence bound from the auxiliary data (the best auxiliary guess; a guess "
                "outside them could do better), so the bound holds at that confidence")
    return ""


def summary_sentence(verdict_status: str, bound: dict[str, Any]) -> str:
    """The empirical verdict and the proven bound in one sentence a reviewer reads."""
    status, claim = bound.get("status"), bound.get("claim")
    rero_, kappa, rounds = bound.get("rero"), bound.get("kappa"), bound.get("rounds")
    theorem = (f"a theorem bounds ANY attacker's success at {rero_:.3g} per sample (below the claimed {claim:g}), for "
               f"{rounds} round{'s' * (rounds != 1)} of {bound.get('mechanism')}, with kappa {kappa:.3g} "
               f"({bound.get('kappa_source')})") if status == PROVEN else ""
    missing = ("no theorem bounds this: " + (bound.get("reason") or "")).rstrip(": ")
    if verdict_status == evidence.CERTIFIED:
        if status == PROVEN:
            return f"CERTIFIED and PROVEN: our attacks missed, and {theorem}."
        if status == NO_MECHANISM:
            return f"CERTIFIED with NO MECHANISM: our attacks missed; the defense has no randomised mechanism with bounded sensitivity, so {missing}."
        return f"CERTIFIED and NOT PROVEN: our attacks missed; {missing}."
    if verdict_status == evidence.INCONCLUSIVE:
        head = "INCONCLUSIVE (the attacked updates decided no claim within the budget)"
        return f"{head} but PROVEN: {theorem}." if status == PROVEN else f"{head}, and NOT PROVEN: {missing}."
    if status == PROVEN:
        return (f"NOT CERTIFIED although PROVEN: {theorem}, yet the attacks' leak rate is not shown below the claim: a "
                "sample-size effect, or a violated assumption of the bound (kappa's estimate, one guess per target); "
                "read both before signing off.")
    return f"NOT CERTIFIED: the attacked updates refuted a claim (samples leaked or were re-identified); {missing}."


__all__ = ["COMPUTED", "certificate_bound", "client_facts", "kappa_from_aux", "rounds_axis", "run_bound", "summary_sentence"]
