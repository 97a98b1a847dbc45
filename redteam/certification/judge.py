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
from guardfl.redteam.certification import evidence
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


def leak_evidence(cfg: RedTeamConfig, results: list[dict], priors: dict[int, list[dict]] | None,
              labels: dict[int, torch.Tensor]) -> dict[str, Any]:
    """The population claim (``evidence.leak_rate``) from the per-sample leaks, and its breakdowns: per
    attack (and per metric within it), per class of the private samples, per client update."""
    c = cfg.certify
    leaks = sample_leaks(cfg, results, priors)
    samples = sorted(leaks)
    leaked = [key for key in samples if leaks[key]]
    out: dict[str, Any] = {"leak_rate": evidence.leak_rate(len(leaked), len(samples), c.max_leak_rate, c.confidence)}
    per_attack: dict[str, Any] = {}
    for attack in sorted({r["attack"] for r in results if r.get("metrics")}):
        hits = [{h["metric"] for h in leaks[key] if h["attack"] == attack} for key in samples]
        k = sum(1 for metrics_hit in hits if metrics_hit)
        per_attack[attack] = {"leaked": k, "of": len(samples),
                              "by_metric": {m: sum(m in mh for mh in hits) for m in _image_limits(cfg, None)},
                              "upper_bound": evidence.upper_bound(k, len(samples), c.confidence)}
    out["per_attack"] = per_attack
    classes: dict[int, list[tuple[int, int]]] = {}
    for b, i in samples:  # a classifier's classes (a causal LM's targets are its text: no classes)
        if b in labels and labels[b].dim() == 1 and i < len(labels[b]):
            classes.setdefault(int(labels[b][i]), []).append((b, i))
    per_class = []
    for label, keys in classes.items():
        k = sum(1 for key in keys if leaks[key])
        per_class.append({"class": label, "samples": len(keys), "leaked": k, "observed_rate": k / len(keys),
                          "upper_bound": evidence.upper_bound(k, len(keys), c.confidence)})
    out["per_class"] = sorted(per_class, key=lambda row: (-row["observed_rate"], row["class"]))
    updates = sorted({b for b, _ in samples})
    leaked_updates = sorted({b for b, _ in leaked})
    out["per_update"] = {"updates": len(updates), "leaked": len(leaked_updates),
                         "upper_bound": evidence.upper_bound(len(leaked_updates), len(updates), c.confidence)}
    out["leaked_samples"] = [{"batch": b, "image": i, "by": leaks[(b, i)]} for b, i in leaked]
    return out


def verdict_checks(cfg: RedTeamConfig, results: list[dict], lpips_available: bool, found: dict[str, Any]) -> list[dict]:
    """What the verdict requires: the leak rate (the population claim), the label accuracy (per update,
    worst case), LPIPS being measurable when it is a threshold, and at least one attack having run."""
    c = cfg.certify
    ran = [r for r in results if r.get("metrics")]
    rate = found["leak_rate"]
    note = (f"{rate['leaked']} of {rate['samples']} private samples leaked (some attack past a threshold); "
            f"{rate['confidence']:.0%} upper bound {rate['upper_bound']:.3g}")
    if rate["status"] == evidence.INSUFFICIENT:
        note += f"; too few samples for the claim: {rate['samples_needed']} without a leak would support it"
    elif rate["status"] == evidence.NOT_CERTIFIED and rate["samples_needed"]:
        note += f"; at this observed rate about {rate['samples_needed']} samples could support the claim"
    checks = [{"metric": "leak_rate", "threshold": c.max_leak_rate, "rule": f"upper bound < {c.max_leak_rate:g}",
               "worst": rate["upper_bound"], "status": rate["status"], "passed": rate["status"] == evidence.CERTIFIED,
               "note": note}]
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
    """The verdict: the leak rate's (CERTIFIED / NOT CERTIFIED / INSUFFICIENT EVIDENCE) unless another
    requirement failed (then NOT CERTIFIED)."""
    if not all(ch["passed"] for ch in checks if ch["metric"] != "leak_rate"):
        return evidence.NOT_CERTIFIED
    return next(ch["status"] for ch in checks if ch["metric"] == "leak_rate")



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


def evidence_warnings(cfg: RedTeamConfig, found: dict[str, Any]) -> list[str]:
    """What a reviewer must know about the strength of the population claim."""
    out = []
    rate = found["leak_rate"]
    if rate["status"] == evidence.INSUFFICIENT:
        per = cfg.client.n
        out.append(f"{rate['samples']} samples cannot support a leak rate below {rate['max_leak_rate']:g} at "
                   f"{rate['confidence']:.0%} confidence even with no leak: {rate['samples_needed']} samples are needed "
                   f"(certify.batches: {-(-rate['samples_needed'] // per)} at {per} sample(s) per update, or null)")
    if cfg.client.n > 1:
        upd = found["per_update"]
        out.append(f"each client update holds {cfg.client.n} samples, whose leaks are correlated (one update, one attack "
                   f"run): the per-sample bound is optimistic; per update, {upd['leaked']} of {upd['updates']} leaked, "
                   f"upper bound {upd['upper_bound']:.3g}")
    return out
