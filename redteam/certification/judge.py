"""The judge: the per-sample thresholds and limits, the leaks they find, the population claim (leak rate
with its confidence bound), the checks the verdict requires, the verdict, and the warnings a reviewer
should read beside it.

A reconstruction leaks a private sample when it is past the sample's limit: the threshold, or the
attacker's prior guess (no update used) plus ``prior_margin``, whichever is larger.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from guardfl.defenses import untouched_layers
from guardfl.redteam import modality
from guardfl.redteam.attacks.malicious.server import AUTO_REPEATS, fresh_noise
from guardfl.redteam.certification import evidence, sequential
from guardfl.redteam.config import RedTeamConfig
from guardfl.redteam.threat import defense_kinds


def defense_warnings(defense: dict | None, model: torch.nn.Module) -> list[str]:
    """Parameter tensors the configured defense never changes (``guardfl.defenses.untouched_layers``): an
    attack can use them as if there were no defense. Nothing for no defense or the deliberate Identity
    baseline (the certificate says there is none)."""
    if defense is None or defense.get("kind") == "identity":
        return []
    untouched = untouched_layers(defense, model)
    if not untouched:
        return []
    total = sum(1 for _ in model.parameters())
    by_reason: dict[str, list[str]] = {}
    for u in untouched:
        by_reason.setdefault(u.reason, []).append(u.name)
    listed = "; ".join(f"{', '.join(names)} ({reason})" for reason, names in by_reason.items())
    return [f"the defense never changes {len(untouched)} of the model's {total} parameter tensors, which an "
            f"attacker can use as if undefended: {listed}"]


def _thresholds(cfg: RedTeamConfig) -> Mapping[str, tuple[str, str]]:
    """The per-sample thresholds of the config's modality (image thresholds never judge text, nor the reverse)."""
    return modality.of(cfg).thresholds


def _image_limits(cfg: RedTeamConfig, prior_row: dict | None) -> dict[str, tuple[float, str]]:
    """metric -> (the limit for ONE private image, kind). With the attacker's prior guess on that image
    (the mean auxiliary image, no update used) and ``prior_margin``, the limit of max_ssim / max_psnr is
    ``max(threshold, prior + margin)``: a reconstruction leaks the image only if it also beats what the
    attacker knew without the update by more than the margin (0.05 SSIM; 2 dB PSNR)."""
    c = cfg.certify
    margin = {"ssim": c.prior_margin, "psnr": None if c.prior_margin is None else 40 * c.prior_margin,
              # text: the prior guess (most frequent auxiliary tokens) scores the common words of any sentence
              "rouge1": c.prior_margin, "rouge2": c.prior_margin, "token_acc": c.prior_margin}
    limits = {}
    for metric, (name, kind) in _thresholds(cfg).items():
        threshold = getattr(c, name)
        if threshold is None:
            continue
        limit = threshold
        if prior_row is not None and margin.get(metric) is not None and prior_row.get(metric) is not None:
            limit = max(threshold, prior_row[metric] + margin[metric])
        limits[metric] = (limit, kind)
    return limits


def _excess(value: float, limit: float, kind: str) -> float:
    """How far ``value`` is past ``limit`` in the leaking direction (> 0: the image leaked)."""
    return value - limit if kind == "max" else limit - value


def _measured(cfg: RedTeamConfig, results: list[dict], priors: dict[int, list[dict]] | None):
    """Every (result, per-image row, metric, limit, excess) of the run, each image's limits computed once:
    what both the leak count and the worst image read."""
    for r in results:
        if not r.get("metrics"):
            continue
        prior = (priors or {}).get(r["batch"])
        for p in r["metrics"]["per_image"]:
            for metric, (limit, kind) in _image_limits(cfg, prior[p["index"]] if prior else None).items():
                if p.get(metric) is not None:
                    yield r, p, metric, limit, _excess(p[metric], limit, kind)


def sample_leaks(cfg: RedTeamConfig, results: list[dict], priors: dict[int, list[dict]] | None,
                  ) -> dict[tuple[int, int], list[dict[str, Any]]]:
    """(batch, image) -> every (attack, metric) that reconstructed that private sample past its limit.
    An attack's read counts against one image at most (``_one_image_per_read``)."""
    leaks: dict[tuple[int, int], list[dict[str, Any]]] = {
        (r["batch"], p["index"]): [] for r in results if r.get("metrics") for p in r["metrics"]["per_image"]}
    hits: dict[tuple[int, int], list[tuple[str, float, float]]] = {}
    for r, p, metric, limit, excess in _measured(cfg, results, priors):
        if excess > 0:
            hits.setdefault((id(r), p["index"]), []).append((metric, limit, excess))
    for r in results:
        for p in _one_image_per_read(cfg, r, hits):
            leaks[(r["batch"], p["index"])] += [{"attack": r["attack"], "metric": metric, "value": p[metric], "limit": limit}
                                                for metric, limit, _ in hits[(id(r), p["index"])]]
    return leaks


def _one_image_per_read(cfg: RedTeamConfig, r: dict, hits: dict[tuple[int, int], list]) -> list[dict]:
    """The rows of result ``r`` whose leaks count: of the rows past a limit that copy the same read (an
    attack's read repeated to the batch size, ``metrics.first_copies``), only the one it leaks most (the most
    metrics past their limits, then the furthest past on the modality's main metric). One picture is not
    many people's: a face-like read passes a limit against several faces that look alike."""
    main = modality.of(cfg).recovery.metric
    best: dict[Any, tuple[tuple[int, float], dict]] = {}
    for p in (r.get("metrics") or {}).get("per_image", []):
        found = hits.get((id(r), p["index"]))
        if not found:
            continue
        key = (len(found), max((excess for metric, _, excess in found if metric == main), default=0.0))
        read = p.get("read", ("row", p["index"]))
        if read not in best or key > best[read][0]:
            best[read] = (key, p)
    return [p for _, p in best.values()]


def worst_images(cfg: RedTeamConfig, results: list[dict], priors: dict[int, list[dict]] | None) -> list[dict]:
    """Per image threshold, the single most leaking (attack, image) over the run, with its own limit:
    what a reviewer looks at first. Information beside the verdict; the verdict is the leak rate."""
    best: dict[str, tuple] = {}
    for r, p, metric, limit, excess in _measured(cfg, results, priors):
        if metric not in best or excess > best[metric][0]:
            best[metric] = (excess, p[metric], {"batch": r["batch"], "attack": r["attack"], "image": p["index"],
                                                "threshold_here": limit})
    rows = []
    for metric, (name, kind) in _thresholds(cfg).items():
        threshold = getattr(cfg.certify, name)
        if threshold is None:
            continue
        rule = f"{'<=' if kind == 'max' else '>='} {threshold}"
        if priors and metric != "lpips" and cfg.certify.prior_margin is not None:
            rule += " (or within the margin of the prior guess)"
        found = best.get(metric)
        rows.append({"metric": metric, "threshold": threshold, "rule": rule, "worst": None if found is None else found[1],
                     "where": None if found is None else found[2], "exceeds": found is not None and found[0] > 0})
    return rows


def _per_update(keys: list[tuple[int, int]], hit) -> tuple[list[int], list[float]]:
    """The attacked updates in order and, for each, the share of its samples for which ``hit((b, i))``."""
    by: dict[int, list[bool]] = {}
    for key in keys:
        by.setdefault(key[0], []).append(bool(hit(key)))
    updates = sorted(by)
    return updates, [sum(by[b]) / len(by[b]) for b in updates]


def milestones(cfg: RedTeamConfig) -> tuple[int, ...]:
    """The fewest leak-free updates that certify each claim (``sequential.zero_leak_updates``): rounds end
    there too, so a clean deployment stops as soon as it can."""
    alpha = 1 - cfg.certify.confidence
    return tuple(sorted({sequential.zero_leak_updates(r, alpha) or 0
                         for r in (cfg.certify.max_leak_rate, cfg.certify.max_reid_rate) if r is not None}))


def claims_made(cfg: RedTeamConfig) -> int:
    """How many claims the config makes (the refute side's level is shared among them: Bonferroni)."""
    return sum(r is not None for r in (cfg.certify.max_leak_rate, cfg.certify.max_reid_rate))


def leak_evidence(cfg: RedTeamConfig, results: list[dict], priors: dict[int, list[dict]] | None,
                  labels: dict[int, torch.Tensor], reid: dict[int, dict] | None = None) -> dict[str, Any]:
    """The claims (``evidence.claim_evidence``: the leak rate, and the re-identification rate when ``reid``
    holds each update's ``reid.identify``), from the per-sample leaks, and their breakdowns: per attack (and
    per metric within it), per class of the private samples. The unit is the client update: each claim's
    statistic is the share of an update's samples that leaked (were re-identified)."""
    c = cfg.certify
    alpha = 1 - c.confidence
    refute_alpha = alpha / max(1, claims_made(cfg))
    leaks = sample_leaks(cfg, results, priors)
    samples = sorted(leaks)
    leaked = [key for key in samples if leaks[key]]
    n = cfg.client.n
    _, shares = _per_update(samples, lambda key: leaks[key])
    out: dict[str, Any] = {"unit": "update", "samples_per_update": n,
                           "leak_rate": evidence.claim_evidence(shares, c.max_leak_rate, c.confidence, refute_alpha,
                                                                per_update_samples=n, leaked=len(leaked), what="leak",
                                                                seed=cfg.seed)}
    if reid:
        hits = {(b, i): bool(row["reidentified"][i]) for b, row in reid.items() for i in range(len(row["reidentified"]))}
        keys = sorted(hits)
        _, reid_shares = _per_update(keys, lambda key: hits[key])
        out["reid_rate"] = evidence.claim_evidence(reid_shares, c.max_reid_rate, c.confidence, refute_alpha,
                                                   per_update_samples=n, leaked=sum(hits.values()),
                                                   what="re-identification", seed=cfg.seed + 1)
        out["reid_rate"]["per_attack"] = _reid_per_attack(reid)
        out["reid_rate"]["per_batch"] = {str(b): {"named": row["named"], "reidentified": row["reidentified"]}
                                         for b, row in sorted(reid.items())}
    per_attack: dict[str, Any] = {}
    for attack in sorted({r["attack"] for r in results if r.get("metrics")}):
        hits_a = [{h["metric"] for h in leaks[key] if h["attack"] == attack} for key in samples]
        k = sum(1 for metrics_hit in hits_a if metrics_hit)
        per_attack[attack] = {"leaked": k, "of": len(samples),
                              "by_metric": {m: sum(m in mh for mh in hits_a) for m in _image_limits(cfg, None)},
                              "upper_bound": sequential.upper_bound([float(bool(h)) for h in hits_a], alpha)}
    out["per_attack"] = per_attack
    classes: dict[int, list[tuple[int, int]]] = {}
    for b, i in samples:  # a classifier's classes (a causal LM's targets are its text: no classes)
        if b in labels and labels[b].dim() == 1 and i < len(labels[b]):
            classes.setdefault(int(labels[b][i]), []).append((b, i))
    per_class = []
    for label, keys in classes.items():
        k = sum(1 for key in keys if leaks[key])
        per_class.append({"class": label, "samples": len(keys), "leaked": k, "observed_rate": k / len(keys),
                          "upper_bound": sequential.upper_bound([float(bool(leaks[key])) for key in keys], alpha)})
    out["per_class"] = sorted(per_class, key=lambda row: (-row["observed_rate"], row["class"]))
    out["breakdowns"] = ("per attack and per class: samples counted one by one, with the same anytime bound: "
                         "information beside the claims, which count updates")
    out["leaked_samples"] = [{"batch": b, "image": i, "by": leaks[(b, i)]} for b, i in leaked]
    return out


def _reid_per_attack(reid: dict[int, dict]) -> dict[str, Any]:
    """Per attack and similarity: how often the true sample was the nearest candidate (rank 1), and the
    median rank (a diagnostic: for a batch, each sample's best rank over the attack's reconstructions)."""
    import statistics

    ranks: dict[str, dict[str, list[int]]] = {}
    for row in reid.values():
        for attack, by in row["ranks"].items():
            for sim, values in by.items():
                ranks.setdefault(attack, {}).setdefault(sim, []).extend(values)
    return {attack: {sim: {"rank1": sum(v == 1 for v in values), "of": len(values), "median_rank": statistics.median(values)}
                     for sim, values in by.items()} for attack, by in sorted(ranks.items())}


def _claim_check(metric: str, rate: dict[str, Any]) -> dict[str, Any]:
    """A claim as one of the verdict's checks, with the note the CLI prints."""
    what = "leaked (some attack past a threshold)" if metric == "leak_rate" else "re-identified among the candidates"
    note = (f"{rate['leaked']} of {rate['samples']} private samples {what} in {rate['updates']} update(s); mean share "
            f"{0 if rate['observed_rate'] is None else rate['observed_rate']:.3g}, {rate['confidence']:.0%} bounds "
            f"[{rate['lower_bound']:.3g}, {rate['upper_bound']:.3g}]")
    more = rate.get("more_updates") or {}
    if rate["status"] == evidence.INCONCLUSIVE:
        note += (f"; undecided: about {more['more']} more update(s) would most likely decide"
                 if more.get("more") else f"; undecided: {more.get('note', '')}")
        if rate["updates_needed_without_leaks"] and rate["updates"] < rate["updates_needed_without_leaks"]:
            note += f" (no fewer than {rate['updates_needed_without_leaks']} leak-free updates can certify it)"
    return {"metric": metric, "threshold": rate["max_rate"], "rule": f"upper bound < {rate['max_rate']:g}",
            "worst": rate["upper_bound"], "lower": rate["lower_bound"], "status": rate["status"],
            "passed": rate["status"] == evidence.CERTIFIED, "note": note}


#: the checks that are claims (decided by the sequential rule), in the order the certificate lists them
CLAIMS = ("leak_rate", "reid_rate")


def verdict_checks(cfg: RedTeamConfig, results: list[dict], lpips_available: bool, found: dict[str, Any]) -> list[dict]:
    """What the verdict requires: the claims (leak rate; re-identification rate), the label accuracy (per
    update, worst case), LPIPS being measurable when it is a threshold, and at least one attack having run."""
    c = cfg.certify
    ran = [r for r in results if r.get("metrics")]
    checks = [_claim_check(name, found[name]) for name in CLAIMS
              if name in found and found[name]["status"] != evidence.NO_CLAIM]
    if c.max_label_acc is not None:
        accs = [(r["metrics"]["summary"].get("label_acc"), r) for r in ran]
        accs = [(a, r) for a, r in accs if a is not None]
        check = {"metric": "label_acc", "threshold": c.max_label_acc, "rule": f"<= {c.max_label_acc}"}
        if accs:
            acc, r = max(accs, key=lambda pair: pair[0])
            check.update(worst=acc, where={"batch": r["batch"], "attack": r["attack"]}, passed=acc <= c.max_label_acc)
        else:
            check.update(worst=None, passed=False, note="no attack produced this metric")
        checks.append(check)
    if c.min_lpips is not None and not lpips_available and "lpips" in _thresholds(cfg):
        checks.append({"metric": "lpips", "threshold": c.min_lpips, "rule": f">= {c.min_lpips}", "passed": False,
                       "note": "LPIPS unavailable: the threshold cannot be verified"})
    if not ran:
        checks.append({"metric": "attacks", "passed": False, "note": "no attack could run against this client"})
    return checks


def verdict_status(checks: list[dict]) -> str:
    """The verdict: NOT CERTIFIED when a requirement that is not a claim failed or a claim was refuted;
    CERTIFIED when every claim is; INCONCLUSIVE otherwise (a claim undecided within the budget)."""
    if not all(ch["passed"] for ch in checks if ch["metric"] not in CLAIMS):
        return evidence.NOT_CERTIFIED
    statuses = [ch["status"] for ch in checks if ch["metric"] in CLAIMS]
    if evidence.NOT_CERTIFIED in statuses:
        return evidence.NOT_CERTIFIED
    if statuses and all(st == evidence.CERTIFIED for st in statuses):
        return evidence.CERTIFIED
    return evidence.INCONCLUSIVE


def decided(cfg: RedTeamConfig, found: dict[str, Any]) -> bool:
    """Whether the run can stop: a claim refuted (the verdict cannot become CERTIFIED) or every claim
    certified. Requirements that are not claims (label accuracy, LPIPS) are judged at the end."""
    statuses = [found[name]["status"] for name in CLAIMS if name in found and found[name]["status"] != evidence.NO_CLAIM]
    return evidence.NOT_CERTIFIED in statuses or (bool(statuses) and all(s == evidence.CERTIFIED for s in statuses))


def refusal_warnings(cfg: RedTeamConfig, results: list[dict], batches: int) -> list[str]:
    """The batches on which the client refused the honest global model (``client.inspect_leak_limit``): it
    sent nothing there, privately, and trained nothing, which a reviewer must weigh as the deployment's
    cost (the verdict counts only what leaks)."""
    refused = sorted({int(r["batch"]) for r in results
                      if (r.get("threat") or {}).get("server") != "malicious" and (r.get("info") or {}).get("refused")})
    if not refused:
        return []
    return [f"the client's inspection refused the honest global model on {len(refused)} of {batches} batches "
            f"(client.inspect_leak_limit: {cfg.client.inspect_leak_limit}): a server would read more samples than that from "
            f"the honest model's own update; the client sent and learned nothing there (centred inputs, a larger batch or a defense "
            f"on the update lower the count; inspect_model's checks['leak_limit'] names the layers)"]


def rounds_averaged(results: list[dict]) -> int:
    """The most rounds of one model a malicious-server attack averaged (its ``repeats`` line; 1 without)."""
    heads = [str((r.get("info") or {}).get("repeats", "")).split(" ")[0] for r in results
             if (r.get("threat") or {}).get("server") == "malicious"]
    return max((int(h) for h in heads if h.isdigit()), default=1)


def budget_warnings(cfg: RedTeamConfig, results: list[dict]) -> list[str]:
    """A malicious server attacked a defense that draws fresh noise each round, and the client sets no round
    budget: the attacks averaged ``AUTO_REPEATS`` rounds of one model (``repeats``), and a server that gets
    more rounds reads more, so the verdict holds for that many rounds only (``client.max_rounds`` certifies
    a budget the client keeps)."""
    noisy = fresh_noise(cfg.defense)
    malicious = [r for r in results if (r.get("threat") or {}).get("server") == "malicious"]
    if not noisy or not malicious or cfg.client.max_rounds is not None:
        return []
    averaged = rounds_averaged(malicious)
    return [f"the client's defense draws fresh noise every round ({', '.join(noisy)}) and the client sets no round budget "
            f"(client.max_rounds): the malicious-server attacks averaged up to {averaged} round{'s' * (averaged != 1)} of "
            f"one model (repeats; {AUTO_REPEATS} with auto), and a server that gets more rounds divides the noise further, "
            f"so this verdict holds for {averaged}; set client.max_rounds to the budget the client keeps "
            f"(local_update(..., max_rounds=), flower RoundBudgetMod) and certify that"]


#: defense kind -> the malicious-server construction adapted to it (by name). A certificate of a client
#: defended by that kind against a malicious server, in which that construction did not run (not in the plan,
#: or not applicable to the model), says its verdict rests on attacks that do not target the defense
ADAPTED_BY = {"sign": "sign_bits"}

#: the client's checks of a received model (``client.<field>``) -> the malicious-server constructions built
#: to pass them (any one that ran will do): the disguised traps, fishing and SEER pass the inspection
#: (README's check table); only the threshold bins pass a leak limit, which refuses every other construction
#: and the honest model's own leak
CHECKS_ADAPTED_BY = {
    "inspect": ("trap_weights", "fishing", "seer", "threshold_bins"),
    "inspect_leak_limit": ("threshold_bins",),
}


def _checks_on(client) -> list[str]:
    """The client's checks in ``CHECKS_ADAPTED_BY`` that it runs (a leak limit only with the inspection)."""
    if not client.inspect:
        return []
    return ["inspect"] + (["inspect_leak_limit"] if client.inspect_leak_limit is not None else [])


def unadapted_warnings(cfg: RedTeamConfig, results: list[dict]) -> list[str]:
    """A malicious server attacked a client whose defense has a stage in ``ADAPTED_BY``, or that runs a check
    in ``CHECKS_ADAPTED_BY``, and no construction adapted to it ran: the verdict rests on constructions that
    do not target that stage, or that the check was built to refuse."""
    if not any((r.get("threat") or {}).get("server") == "malicious" for r in results):
        return []
    ran = {r["attack"] for r in results}
    kinds = sorted(kind for kind in {leaf.kind for leaf in defense_kinds(cfg.defense)} & set(ADAPTED_BY)
                   if ADAPTED_BY[kind] not in ran)
    out = [f"the malicious-server construction adapted to {kind} ({ADAPTED_BY[kind]}) did not run (not in the plan, or "
           f"not applicable to this model), so this verdict rests on attacks that do not target {kind}" for kind in kinds]
    for check in _checks_on(cfg.client):
        if not ran & set(CHECKS_ADAPTED_BY[check]):
            out.append(f"the client runs client.{check} and no malicious-server construction built to pass it "
                       f"({' / '.join(CHECKS_ADAPTED_BY[check])}) ran (not in the plan, or not applicable to this model), "
                       f"so this verdict rests on constructions the check was built to refuse")
    return out


def evidence_warnings(cfg: RedTeamConfig, found: dict[str, Any], stop: dict[str, Any]) -> list[str]:
    """What a reviewer must know about the strength of the claims: a budget too small to certify any
    claim even without a leak, and a run that a time budget stopped."""
    out = []
    for name in CLAIMS:
        rate = found.get(name)
        if not rate or rate["status"] == evidence.NO_CLAIM:
            continue
        need = rate.get("updates_needed_without_leaks")
        if need and cfg.certify.max_updates < need:
            out.append(f"certify.max_updates {cfg.certify.max_updates} cannot support the {name.replace('_', ' ')} claim "
                       f"(below {rate['max_rate']:g} at {rate['confidence']:.0%}) even with no leak: at least {need} "
                       f"updates are needed; the verdict can only be NOT CERTIFIED or INCONCLUSIVE")
    if stop.get("reason") == "max_seconds":
        out.append(f"the time budget (certify.max_seconds: {cfg.certify.max_seconds:g}) stopped the run after "
                   f"{stop['updates']} update(s): on a faster machine the same config attacks more")
    return out
