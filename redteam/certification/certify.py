"""Certification: simulate the deployed client, run every applicable attack on what it transmits,
measure what comes back, and compare the worst case with the thresholds.

``certify`` reads as a recipe: resolve the strength, load the private and auxiliary data (refusing
overlap), observe the client, plan the attacks from the registry (every registered attack is listed in
the certificate: ran, or not applicable with the reason), prepare the attacks that need a once-per-setting
step (cached under ``OUT/state/prepared``), attack every batch, check the thresholds, write the report.
A record that would repeat another plan's run exactly (iDLG restoring the label DLG is granted, same seed
and budget) is built from that run instead of computed again, and says so (``repeats``).

Each (client batch, attack) pair is one job whose result is written atomically under ``OUT/state/``;
``resume=True`` reuses finished jobs and prepared attacks and runs only the rest. The client's observation
for a batch is saved too, so that a resumed run attacks the very update the first run saw. A resume needs
the same key: the config's hash AND the content of every file the run reads (data, checkpoint, auxiliary
data, the code of a ``module:callable``; ``fingerprint``); the state holds only JSON and tensors (read
with ``weights_only=True``), listed in its manifest (``files.StateFolder``). A resumed certificate is the
uninterrupted one, timings apart. An attack that raises fails the run (``AttackFailed``, exit 2): it never
drops out of a verdict.

With ``out``, the folder's earlier verdict is deleted before anything else and ``run.json`` says "in
progress" until ``certificate.json`` (written last, after the report) is there: a run that fails or is
killed leaves no verdict.
"""

from __future__ import annotations

import contextlib
import copy
import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import guardfl
from guardfl.defenses import from_config, untouched_layers
from guardfl.errors import ConfigError, GuardflError
from guardfl.inspect import DSNR_MIN_BATCH, DSNR_THRESHOLD
from guardfl.redteam import attacks as attack_registry
from guardfl.redteam.modality.image import data as data_mod
from guardfl.redteam.runtime import allocator
from guardfl.redteam.certification import evidence
from guardfl.redteam.modality.image import metrics
from guardfl.redteam.client import privacy
from guardfl.redteam.certification import repeats
from guardfl.redteam.attacks.analytic.encoded import attack_view, decode, public_set
from guardfl.redteam.attacks.base import THREAT_FIELDS, AttackFailed, PreparedCache, Setting, resolve_device
from guardfl.redteam.attacks.malicious.server import ServerAttack
from guardfl.redteam.auxdata import AuxData
from guardfl.redteam.client.simulate import ClientQuery, FedAvg, FedSGD, Observation, SideKnowledge, bn_layers, simulate_client
from guardfl.redteam.runtime.files import CERTIFICATE, StateFolder, atomic_write, mark_run, retract_verdict
from guardfl.redteam.certification.fingerprint import changed_inputs, fingerprint, resume_key, run_inputs
from guardfl.redteam.config import AttackSection, RedTeamConfig, ThreatSection, load_config
from guardfl.redteam.modality.image.models import build_model, set_model_state
from guardfl.redteam.certification.sampling import Population
from guardfl.redteam.client.target import (flower_run_config, load_object, nvflare_result_filters, observe, on_path, run_clientapp,
                                   run_nvflare, run_train_fn)
from guardfl.redteam.threat import ThreatModel, inter_instahide
from guardfl.redteam.runtime.ray_backend import as_backend
from guardfl.redteam.runtime.workers import Job, RunContext, available_cores, default_workers, job_threads, run_parallel, torch_threads

@dataclass
class Certificate:
    certified: bool
    checks: list[dict[str, Any]]
    results: list[dict[str, Any]]
    config: dict[str, Any]
    config_hash: str
    environment: dict[str, Any]
    wall_time_s: float
    lpips: dict[str, Any]
    #: what was attacked: a simulated client, or the user's ClientApp / train_fn (per batch: steps, samples)
    client: dict[str, Any] = field(default_factory=dict)
    #: 'quick' or 'paper' (the budgets every attack ran with)
    strength: str = "quick"
    #: every registered attack: ran / not applicable (reason) / not requested, its budget vs the paper's;
    #: ``reused`` on a line that ran: the batches where its run was another attack's exactly (``repeats``)
    attacks: list[dict[str, Any]] = field(default_factory=list)
    #: once-per-setting preparations (e.g. the trained inverter): key, cached, seconds, what was learned
    preparations: dict[str, Any] = field(default_factory=dict)
    #: DP-SGD accounting of the deployment (epsilon at delta), None without DP-SGD
    privacy: dict[str, Any] | None = None
    #: what a reviewer should know that the thresholds do not say, e.g. layers the defense never changes
    warnings: list[str] = field(default_factory=list)
    #: per batch, the metrics of the attacker's prior guess (mean auxiliary image, no update used)
    priors: dict[str, Any] = field(default_factory=dict)
    #: sha256 of every file the run read, by config field (``fingerprint``): what was certified
    inputs: dict[str, str] = field(default_factory=dict)
    #: CERTIFIED, NOT CERTIFIED or INSUFFICIENT EVIDENCE (too few samples for the claim, none leaked)
    status: str = ""
    #: the population the claim is about (source, offset, size) and the samples drawn from it
    population: dict[str, Any] = field(default_factory=dict)
    #: the population claim: leak rate with its confidence bound, per attack, per class, per update
    evidence: dict[str, Any] = field(default_factory=dict)
    #: per image threshold, the single most leaking (attack, image): shown first in the report
    worst: list[dict[str, Any]] = field(default_factory=list)
    reconstructions: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    originals: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def verdict(self) -> str:
        return self.status or ("CERTIFIED" if self.certified else "NOT CERTIFIED")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("reconstructions")
        d.pop("originals")
        d["verdict"] = self.verdict
        return d


def untimed(obj: Any, ignore: tuple[str, ...] = ()) -> Any:
    """A certificate (``to_dict()`` or a part of it) without its timings: ``wall_time_s`` and every key
    ending in ``seconds``, and the keys in ``ignore``. Two runs of one config with a seeded defense give
    equal ``untimed`` certificates (resumed or not, any worker count)."""
    if isinstance(obj, dict):
        return {k: untimed(v, ignore) for k, v in obj.items()
                if k != "wall_time_s" and not k.endswith("seconds") and k not in ignore}
    if isinstance(obj, list):
        return [untimed(v, ignore) for v in obj]
    return obj


def resolve_strength(strength: str, device: torch.device) -> str:
    """'auto' is 'paper' on a GPU and 'quick' on a CPU."""
    if strength == "auto":
        return "paper" if device.type == "cuda" else "quick"
    if strength not in ("quick", "paper"):
        raise ConfigError(f"strength: {strength!r}; allowed: 'auto', 'quick' or 'paper'")
    return strength


def plan_attacks(cfg: RedTeamConfig, setting: Setting, strength: str, aux: AuxData | None,
                 ) -> tuple[list[AttackSection], list[dict[str, Any]]]:
    """The attacks to run, and a line for every registered attack (the certificate's ``attacks``).

    ``attacks: all``: every registered attack, at the strongest threat (labels known, except a causal
    LM's, which are the private text itself: inferred; the defense's configuration known, BN statistics
    exact when the model has BatchNorm, FedAvg hyperparameters known, Inter-InstaHide's public set known,
    the auxiliary data when there is some) adjusted by the attack's own ``default_threat`` (iDLG restores
    labels), with its budget for ``strength``; those that do not apply are listed with the reason.
    Configured attacks: their threat and budget (over the strength's budget); one that does not apply to
    this setting is a config error."""
    listing: list[dict[str, Any]] = []
    plans: list[AttackSection] = []
    if cfg.attacks is None:
        # a causal LM's labels are its next tokens, i.e. the private text: granting them grants the answer
        text_is_label = setting.modality == "text" and getattr(setting.model, "task", None) == "causal-lm"
        strongest = ThreatSection(labels="inferred" if text_is_label else "known",
                                  bn="exact" if bn_layers(setting.model) else "none", defense="known", fedavg="known",
                                  public_data="known" if inter_instahide(setting.defense_config) else "unknown")
        # a field the attack never reads stays at its default: the certificate records what it tested
        candidates = [(name, {}, strongest.model_copy(update={**{k: ThreatSection.model_fields[k].default for k in
                                                                 THREAT_FIELDS if k not in cls.capabilities.threat},
                                                              **cls.default_threat}))
                      for name, cls in sorted(attack_registry.ATTACKS.items())]
    else:
        candidates = [(a.name, a.budget, a.threat) for a in cfg.attacks]
    for i, (name, overrides, threat) in enumerate(candidates):
        cls = attack_registry.ATTACKS[name]
        budget = {**cls.budget_for(strength), **overrides}
        reason = cls.applicable(setting, ThreatModel(**threat.model_dump(), aux=aux)) or cls(**budget).refuses(setting)
        if reason is None and cfg.target is not None and cls.capabilities.server == "malicious":
            reason = ("sends the client a model of its own making, which needs the simulated client; a "
                      "target (your ClientApp / train_fn) cannot be queried that way yet")
        line = {"attack": name, "threat": threat.model_dump(), "budget": budget, "strength": strength,
                "paper_budget": cls.budget_for("paper"), "paper_reference": cls.paper_budget}
        if reason is not None:
            if cfg.attacks is not None:
                raise ConfigError(f"attacks[{i}] {name}: not applicable to this client: {reason}")
            line.update(status="not applicable", reason=reason)
        else:
            line.update(status="ran")
            plans.append(AttackSection(name=name, budget=budget, threat=threat))
        listing.append(line)
    for name in sorted(attack_registry.ATTACKS):
        if not any(line["attack"] == name for line in listing):
            listing.append({"attack": name, "status": "not requested", "reason": "not in the config's attacks list"})
    return plans, listing


def load_aux(cfg: RedTeamConfig) -> AuxData | None:
    """The attacker's auxiliary data from the config's ``aux`` section (None without one)."""
    a = cfg.aux
    if a is None:
        return None
    k = cfg.model.num_classes

    def take(section, limit):
        need = section.offset + limit if limit else None
        if cfg.modality == "text":  # the client's tokenizer and sequence length; the task the source's
            d = cfg.data
            task = "causal-lm" if section.source in ("text", "wikitext") else "classification"
            x, y = data_mod.load_text_data(section.source, path=section.path, seq_len=d.seq_len, tokenizer=d.tokenizer,
                                           task=task, num_classes=k, split=section.split, limit=need, field="aux")
            x, y = x[section.offset : need], y[section.offset : need]
            if not len(x):
                raise ConfigError(f"aux: {section.source} has no sequences from offset {section.offset}")
            return x, y
        x, y = data_mod.load(section.source, root=section.root, path=section.path, download=section.download,
                             image_size=section.image_size or cfg.data.image_size, num_classes=k, limit=need)
        x, y = x[section.offset : need], y[section.offset : need]
        if not len(x):
            raise ConfigError(f"aux: {section.source} has no images from offset {section.offset}")
        return x, y

    images, labels = (take(a, a.limit) if a.source is not None else (torch.zeros(0), torch.zeros(0, dtype=torch.long)))
    ood = take(a.ood, a.ood.limit)[0] if a.ood is not None else None
    if len(labels) and cfg.modality == "image" and int(labels.max()) >= k:
        raise ConfigError(f"aux: {a.source} has label {int(labels.max())} but model.num_classes={k}")
    return AuxData(images, labels, ood=ood, ood_samples=a.ood.samples if a.ood is not None else 0,
                   name=f"{a.source or ''}{'+ood:' + a.ood.source if a.ood else ''}")


def _protocol(cfg: RedTeamConfig):
    c = cfg.client
    if c.protocol == "fedsgd":
        return FedSGD()
    return FedAvg(epochs=c.epochs, batch_size=c.batch_size, lr=c.lr, momentum=c.momentum, weight_decay=c.weight_decay)


def prior_guess(aux: AuxData | None) -> torch.Tensor | None:
    """The attacker's best guess without looking at the update: the mean auxiliary image (in-distribution
    images when it has them, else its OOD images). None without auxiliary data."""
    if aux is None:
        return None
    if not aux.images.is_floating_point():  # token ids: the most frequent auxiliary token at each position
        return aux.images.mode(0).values if len(aux.images) else None
    return (aux.images if len(aux.images) else aux.ood).mean(0)


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


#: the per-image thresholds: metric -> (config field, "max" when a larger value leaks more)
IMAGE_THRESHOLDS = {"ssim": ("max_ssim", "max"), "psnr": ("max_psnr", "max"), "lpips": ("min_lpips", "min")}
#: the per-sample thresholds of a text client (``textmetrics``)
TEXT_THRESHOLDS = {"rouge1": ("max_rouge1", "max"), "rouge2": ("max_rouge2", "max"), "token_acc": ("max_token_acc", "max")}


def _thresholds(cfg: RedTeamConfig) -> dict[str, tuple[str, str]]:
    """The per-sample thresholds of the config's modality (image thresholds never judge text, nor the reverse)."""
    return TEXT_THRESHOLDS if cfg.modality == "text" else IMAGE_THRESHOLDS


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


def _sample_leaks(cfg: RedTeamConfig, results: list[dict], priors: dict[int, list[dict]] | None,
                  ) -> dict[tuple[int, int], list[dict[str, Any]]]:
    """(batch, image) -> every (attack, metric) that reconstructed that private sample past its limit."""
    leaks: dict[tuple[int, int], list[dict[str, Any]]] = {
        (r["batch"], p["index"]): [] for r in results if r.get("metrics") for p in r["metrics"]["per_image"]}
    for r, p, metric, limit, excess in _measured(cfg, results, priors):
        if excess > 0:
            leaks[(r["batch"], p["index"])].append({"attack": r["attack"], "metric": metric, "value": p[metric], "limit": limit})
    return leaks


def _worst_images(cfg: RedTeamConfig, results: list[dict], priors: dict[int, list[dict]] | None) -> list[dict]:
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


def _evidence(cfg: RedTeamConfig, results: list[dict], priors: dict[int, list[dict]] | None,
              labels: dict[int, torch.Tensor]) -> dict[str, Any]:
    """The population claim (``evidence.leak_rate``) from the per-sample leaks, and its breakdowns: per
    attack (and per metric within it), per class of the private samples, per client update."""
    c = cfg.certify
    leaks = _sample_leaks(cfg, results, priors)
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


def _checks(cfg: RedTeamConfig, results: list[dict], lpips_available: bool, found: dict[str, Any]) -> list[dict]:
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
    if c.min_lpips is not None and not lpips_available and cfg.modality != "text":
        checks.append({"metric": "lpips", "threshold": c.min_lpips, "rule": f">= {c.min_lpips}", "passed": False,
                       "note": "LPIPS unavailable: the threshold cannot be verified"})
    if not ran:
        checks.append({"metric": "attacks", "passed": False, "note": "no attack could run against this client"})
    return checks


def _status(checks: list[dict]) -> str:
    """The verdict: the leak rate's (CERTIFIED / NOT CERTIFIED / INSUFFICIENT EVIDENCE) unless another
    requirement failed (then NOT CERTIFIED)."""
    if not all(ch["passed"] for ch in checks if ch["metric"] != "leak_rate"):
        return evidence.NOT_CERTIFIED
    return next(ch["status"] for ch in checks if ch["metric"] == "leak_rate")


def certify(
    config: RedTeamConfig | dict | str | Path,
    *,
    out: str | Path | None = None,
    device: str | None = None,
    resume: bool = False,
    progress: bool = False,
    strength: str | None = None,
    workers: int | None = 1,
    threads: int | None = None,
    samples: int | None = None,
    backend: Any = None,
) -> Certificate:
    """Run the red team described by ``config``; write results under ``out`` when given.
    ``strength`` ('quick', 'paper', 'auto') overrides the config's. ``workers``: processes running the
    jobs (batch x attack, and preparations) side by side (None: one per available core on a CPU, one
    on a GPU); ``threads``: intra-op threads per job (default:
    ``workers.job_threads``, one for small models). The certificate does not depend on ``workers``.
    ``samples``: attack about this many private samples instead of the config's ``certify.batches``
    (a quick look; the certificate says the claim rests on the override). ``backend``: None (this
    machine's processes), 'ray' or a ``ray_backend.RayJobs`` (the jobs as Ray tasks, on a local instance
    of ``workers`` CPUs or a cluster; the same certificate).

    With ``out``: before anything else (even reading the config), an earlier verdict there is deleted
    and ``out/run.json`` says "in progress"; it says "failed" or "interrupted" when the run raises, and
    "finished" only once ``certificate.json`` is written (last). A run that fails or is killed therefore
    leaves no ``certificate.json``."""
    if out is None:
        return _certify(config, None, device, resume, progress, strength, workers, threads, samples, backend)
    out_dir = Path(out)
    retracted = retract_verdict(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = {"resume": resume, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               "config": str(config) if isinstance(config, (str, Path)) else None, "retracted": retracted}
    mark_run(out_dir, "in progress", **started)
    try:
        cert = _certify(config, out_dir, device, resume, progress, strength, workers, threads, samples, backend)
        from guardfl.redteam.reports.certificate import write_report

        write_report(cert, out_dir)
        # the verdict last: with it there, everything else of this run is there too
        atomic_write(out_dir / CERTIFICATE, json.dumps(cert.to_dict(), indent=2, default=str))
    except BaseException as err:
        status = "interrupted" if isinstance(err, KeyboardInterrupt) else "failed"
        with contextlib.suppress(Exception):  # the run's own error is the one to report
            line = (str(err).strip().splitlines() or [""])[0]
            mark_run(out_dir, status, **started, error=f"{type(err).__name__}: {line}".rstrip(": "))
        raise
    mark_run(out_dir, "finished", **started, certificate=CERTIFICATE)
    return cert


def with_samples(cfg: RedTeamConfig, samples: int | None) -> tuple[RedTeamConfig, list[str]]:
    """``cfg`` attacking about ``samples`` private samples (``certify.batches = ceil(samples / n)``), and
    the warning the certificate then carries; ``cfg`` unchanged for None."""
    if samples is None:
        return cfg, []
    if not isinstance(samples, int) or isinstance(samples, bool) or samples < 1:
        raise ConfigError(f"samples: expected an integer >= 1 (got {samples!r})")
    configured = cfg.certify.batches * cfg.client.n
    batches = -(-samples // cfg.client.n)
    data = cfg.model_dump(mode="json")
    data["certify"]["batches"] = batches
    weaker = "fewer samples than the config's, so a weaker claim" if batches * cfg.client.n < configured else "not the config's count"
    return load_config(data), [f"the sample count was set on the command line (--samples {samples}: {batches * cfg.client.n} "
                               f"samples; the config asks for {configured}): {weaker}"]


#: private batches per job for attacks that reconstruct many client updates in one batched optimisation
#: (``Capabilities.batches_samples``); fixed, so that the results do not depend on the worker count
CHUNK = 16


def plan_jobs(plans: list[AttackSection], batches: int) -> list[Job]:
    """One job per (chunk of private batches, attack): chunks of ``CHUNK`` consecutive batches for the
    attacks that batch samples natively, single batches for the others."""
    jobs = []
    for i, plan in enumerate(plans):
        cls = attack_registry.ATTACKS[plan.name]
        size = CHUNK if cls.capabilities.batches_samples else 1
        for lo in range(0, batches, size):
            bs = tuple(range(lo, min(batches, lo + size)))
            label = f"b{bs[0]}" if len(bs) == 1 else f"b{bs[0]}-{bs[-1]}"
            jobs.append(Job(f"{label}-{i}-{plan.name}", bs, i, cls.capabilities.prepares))
    return jobs


#: intra-op threads per job (and worker processes) at most this many per core available to the process:
#: more only oversubscribes the cores (and thousands of threads can exhaust the process's thread limit)
THREADS_PER_CORE = 4


def max_threads() -> int:
    """The most ``threads`` (per job) and ``workers`` a run accepts: ``THREADS_PER_CORE`` x the cores
    available to this process."""
    return THREADS_PER_CORE * available_cores()


def _record_name(b: int, i: int, plan: AttackSection) -> str:
    """The state (and report) name of one private batch's result under plan i."""
    return f"b{b}-{i}-{plan.name}"


def _certify(config, out_dir: Path | None, device: str | None, resume: bool, progress: bool,
             strength: str | None, workers: int | None = 1, threads: int | None = None,
             samples: int | None = None, backend: Any = None) -> Certificate:
    cfg = config if isinstance(config, RedTeamConfig) else load_config(config)
    ray_jobs = as_backend(backend)
    cfg, override = with_samples(cfg, samples)
    if workers is not None and (not isinstance(workers, int) or workers < 1):
        raise ConfigError(f"workers: expected an integer >= 1 (got {workers!r})")
    if threads is not None and (not isinstance(threads, int) or not 1 <= threads <= max_threads()):
        raise ConfigError(f"threads: expected an integer in [1, {max_threads()}] ({THREADS_PER_CORE} x the "
                          f"{available_cores()} cores available) (got {threads!r})")
    if workers is not None and workers > max_threads():
        raise ConfigError(f"workers: expected an integer in [1, {max_threads()}] ({THREADS_PER_CORE} x the "
                          f"{available_cores()} cores available) (got {workers!r})")
    started = time.time()
    dev = resolve_device(device or cfg.device)
    level = resolve_strength(strength or cfg.strength, dev)
    workers = workers or default_workers(dev)
    if ray_jobs is not None:
        ray_jobs.check()  # an unreachable address: one line, before anything is built
    digest = cfg.digest(level)
    inputs = fingerprint(cfg)
    state = _open_state(out_dir / "state", cfg, digest, inputs, resume) if out_dir is not None else None
    n_batches = cfg.certify.batches

    app_dir = cfg.target.app_dir if cfg.target is not None else None
    with on_path(app_dir):
        aux = load_aux(cfg)
        source = _BatchSource(cfg, state, aux)
        threads = threads or job_threads(sum(p.numel() for p in source.model.parameters()), workers)
        warnings = override + defense_warnings(cfg.defense, source.model)
        with torch_threads(threads):
            setting = source.setting()
            plans, listing = plan_attacks(cfg, setting, level, aux)
            runner = _AttackRunner(cfg, setting, aux, dev, progress and workers == 1, state)
            jobs = plan_jobs(plans, n_batches)
            # every batch first, through the batch source even when its jobs are done: its observation
            # (saved for a resume), its record (client.batches) and its ground truth
            batches = {b: source.batch(b) for b in range(n_batches)}
            originals = {b: x for b, (_, x, _) in batches.items()}
            # a record that repeats another plan's run exactly is built from that run, never computed twice
            reuse = repeats.plan_reuse(plans, {b: obs for b, (obs, _, _) in batches.items()}, aux, runner._seed)
            reused = {_record_name(b, i, plans[i]): (b, r) for (b, i), r in reuse.items()}
            done = {_record_name(b, i, plan): _load_job(state, _record_name(b, i, plan))
                    if state is not None and _record_name(b, i, plan) not in reused else None
                    for b in range(n_batches) for i, plan in enumerate(plans)}
            pending = [job for job in jobs if any(done[name] is None and name not in reused
                                                  for name in (_record_name(b, job.i, plans[job.i]) for b in job.bs))]
            bar = _bar(progress, len(done))
            bar and bar.update(sum(1 for v in done.values() if v is not None))

            def finished(job: Job, results: list[tuple[dict, torch.Tensor]]) -> None:
                for b, result in zip(job.bs, results):
                    name = _record_name(b, job.i, plans[job.i])
                    fresh = done[name] is None
                    done[name] = result
                    if state is not None:
                        _save_job(state, name, *result)
                    bar and fresh and bar.update(1)

            if (workers > 1 and len(pending) > 1) or (ray_jobs is not None and pending):
                context = RunContext(_AttackRunner(cfg, setting, aux, dev, False, None), plans, batches)
                parallel = dict(threads=threads, app_dir=str(Path(app_dir).resolve()) if app_dir else None,
                                prepared=lambda i: runner.cache.entries_of(plans[i].name) or None,
                                on_prepared=lambda i, saved, info: runner.adopt_preparation(i, plans[i], saved, info),
                                on_done=finished)
                if ray_jobs is not None:
                    ray_jobs.run(context, pending, workers=workers, device=dev, **parallel)
                else:
                    run_parallel(context, pending, workers=min(workers, len(pending)), **parallel)
            else:
                for job in pending:
                    finished(job, runner.run(job.bs, job.i, plans[job.i], [batches[b] for b in job.bs]))
            applied = {}
            for name, (b, r) in reused.items():
                if done[name] is None:  # else its own job ran (a chunk with other batches): its own record
                    record, rec = done[_record_name(b, r.of, plans[r.of])]
                    done[name] = (repeats.reused_record(record, name, plans[r.plan], r), rec)
                    applied[(b, r.plan)] = r
                    bar and bar.update(1)
            bar and bar.close()
        runner.complete(plans)
        for i, line in enumerate(line for line in listing if line.get("status") == "ran"):  # plans' lines, in order
            note = repeats.listing_note(i, applied, plans, n_batches)
            if note is not None:
                line["reused"] = note
        names = [_record_name(b, i, plan) for b in range(n_batches) for i, plan in enumerate(plans)]
        results = [done[name][0] for name in names]
        recon = {name: done[name][1] for name in names}

    lp = metrics.lpips_status(cfg.certify.lpips_weights)
    prior = prior_guess(aux)
    priors = {}
    if prior is not None:
        for b, x in originals.items():
            guess = prior.expand_as(x).clone()
            priors[b] = measure(cfg, guess, x, batches[b][2], source.batch(b)[0].input_range)["per_image"]
            recon[f"b{b}-prior"] = guess
    found = _evidence(cfg, results, priors, {b: y for b, (_, _, y) in batches.items()})
    checks = _checks(cfg, results, lp.available, found)
    status = _status(checks)
    warnings += _evidence_warnings(cfg, found)
    return Certificate(
        certified=status == evidence.CERTIFIED,
        status=status,
        checks=checks,
        results=results,
        client=source.describe(),
        config=cfg.model_dump(mode="json"),
        config_hash=digest,
        environment={
            "guardfl": guardfl.__version__, "torch": torch.__version__, "python": platform.python_version(),
            "device": str(dev), "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
            "threads": threads, "workers": workers, "cores": available_cores(), "allocator": allocator.state(),
            "backend": ray_jobs.describe() if ray_jobs is not None else "processes",
        },
        wall_time_s=time.time() - started,
        lpips={"available": lp.available, "reason": lp.reason},
        strength=level,
        attacks=listing,
        preparations=runner.preparations,
        priors={str(b): p for b, p in priors.items()},
        privacy=source.privacy,
        warnings=warnings,
        inputs=inputs,
        population=source.population,
        evidence=found,
        worst=_worst_images(cfg, results, priors),
        reconstructions=recon,
        originals=originals,
    )


def _evidence_warnings(cfg: RedTeamConfig, found: dict[str, Any]) -> list[str]:
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


class _AttackRunner:
    """Runs one (batch, attack) job: builds the attack with its budget, prepares it once per plan (from
    the cache when a killed run already did), reconstructs, measures. Any error of the attack is an
    ``AttackFailed`` (the run fails), never a skipped row."""

    def __init__(self, cfg: RedTeamConfig, setting: Setting, aux: AuxData | None, device: torch.device,
                 progress: bool, state: StateFolder | None) -> None:
        self.cfg, self.setting, self.aux, self.device, self.progress = cfg, setting, aux, device, progress
        self.state = state
        self.cache = _StateCache(state)
        self.preparations: dict[str, Any] = {}

    def _prepared(self, key: str, info: dict[str, Any]) -> None:
        """A plan's preparation, as the run that made it recorded it (saved in the state), so that a
        resumed certificate says what the uninterrupted one says."""
        if key in self.preparations:
            return
        info = json.loads(json.dumps(info, default=str))
        if self.state is not None:
            saved = self.state.load_json(f"preparation-{key}.json")
            if saved is None:
                self.state.save_json(f"preparation-{key}.json", info)
            else:
                info = saved
        self.preparations[key] = info

    def complete(self, plans: list[AttackSection]) -> None:
        """After the jobs: the preparations of plans whose every job a killed run finished (this run did
        not prepare them) come from the state; all in plan order."""
        for i, plan in enumerate(plans):
            key = f"{i}-{plan.name}"
            if key not in self.preparations and self.state is not None:
                saved = self.state.load_json(f"preparation-{key}.json")
                if saved is not None:
                    self.preparations[key] = saved
        order = {f"{i}-{plan.name}": i for i, plan in enumerate(plans)}
        self.preparations = dict(sorted(self.preparations.items(), key=lambda kv: order.get(kv[0], len(order))))

    def prepare_only(self, i: int, plan: AttackSection) -> tuple[dict[str, Any], dict[str, Any]]:
        """Plan i's once-per-setting preparation alone (a worker's task): its prepared states (memory
        cache entries) and what it reported."""
        attack, _ = self._attack(plan, i, 0)
        cache, info = PreparedCache(), {}
        try:
            attack.prepare(self.setting, ThreatModel(**plan.threat.model_dump(), aux=self.aux), cache=cache,
                           on_done=info.update)
        except (KeyboardInterrupt, GuardflError):
            raise
        except Exception as err:
            raise AttackFailed(f"attack {plan.name} failed while preparing: {type(err).__name__}: {err}") from err
        return cache.entries(), info

    def adopt_preparation(self, i: int, plan: AttackSection, saved: dict[str, Any], info: dict[str, Any]) -> None:
        """A worker prepared plan i: keep its states (in the state folder too) and its record."""
        self.cache.adopt(saved)
        self._prepared(f"{i}-{plan.name}", info)

    def _seed(self, cls: type, b: int) -> int:
        """Batch b's seed: a prepared attack keeps one seed for every batch (its preparation is shared);
        the others get a different seed per batch (different restarts)."""
        return self.cfg.seed if cls.capabilities.prepares else self.cfg.seed + b

    def _attack(self, plan: AttackSection, i: int, b: int):
        cls = attack_registry.ATTACKS[plan.name]
        budget = {"seed": self._seed(cls, b), **plan.budget, "device": str(self.device), "progress": self.progress}
        return attack_registry.get(plan.name, **budget), budget

    def run(self, bs: tuple[int, ...], i: int, plan: AttackSection,
            items: list[tuple[Observation, torch.Tensor, torch.Tensor]]) -> list[tuple[dict, torch.Tensor]]:
        """Plan i against private batches ``bs`` (their observation, inputs, labels) in one
        ``reconstruct_many`` call: one (record, reconstruction) per batch, each seeded by its batch."""
        attack, budget = self._attack(plan, i, bs[0])
        seeds = [self._seed(type(attack), b) for b in bs]
        threat = ThreatModel(**plan.threat.model_dump(), aux=self.aux)
        where = f"client batch {bs[0]}" if len(bs) == 1 else f"client batches {bs[0]}-{bs[-1]}"
        t0 = time.time()
        out = []
        try:
            if attack.capabilities.prepares:
                # the first preparation of a plan is the one that trained (or loaded a killed run's state);
                # later batches reuse it from memory
                attack.prepare(self.setting, threat, cache=self.cache,
                               on_done=lambda info: self._prepared(f"{i}-{plan.name}", info))
            known = threat.defense == "known"
            if isinstance(attack, ServerAttack):
                # a malicious server queries each client with models of its own making
                views = [None] * len(items)
                recs = [attack.interrogate(self._client_query(obs, x, y), self.setting, threat, seed)
                        for (obs, x, y), seed in zip(items, seeds)]
            elif attack.capabilities.inverts_encodings:  # answers with the private images of an encoding client
                views = [None] * len(items)
                recs = attack.reconstruct_many([obs for obs, _, _ in items], threat, seeds)
            else:
                views = [attack_view(obs, known) for obs, _, _ in items]  # an input encoding: attack the encodings
                recs = attack.reconstruct_many(views, threat, seeds)
            seconds = (time.time() - t0) / len(bs)
            for b, seed, (obs, x, y), view, raw in zip(bs, seeds, items, views, recs):
                public = self.public_set() if view is not None and threat.public_data == "known" else None
                rec, encodings = decode(raw, obs, known, public=public) if view is not None else (raw, None)
                m = measure(self.cfg, rec, x, y, obs.input_range)
                record: dict[str, Any] = {
                    "job": _record_name(b, i, plan), "batch": b, "attack": plan.name, "threat": plan.threat.model_dump(),
                    "budget": {k: v for k, v in {**budget, "seed": seed}.items() if k != "progress"}}
                if encodings is not None:
                    record["encodings"] = _encoding_metrics(encodings, obs, view)
                record["recovered"] = _recovered(m, self.cfg)
                info = {k: (type(v).__name__ if isinstance(v, torch.nn.Module) else str(v)) for k, v in rec.info.items()}
                record.update(metrics=m, objective=rec.objective, restart_objectives=rec.restart_objectives,
                              info=info, seconds=seconds, batched_with=len(bs))
                # as the state file holds it: a job read back by a resume is this very record
                out.append((json.loads(json.dumps(record, default=str)), rec.inputs.detach().cpu()))
        except (KeyboardInterrupt, GuardflError) as err:
            if isinstance(err, KeyboardInterrupt):
                raise
            raise AttackFailed(f"attack {plan.name} failed on {where}: {err}") from err
        except Exception as err:
            raise AttackFailed(f"attack {plan.name} failed on {where}: {type(err).__name__}: {err}") from err
        return out


    def public_set(self) -> torch.Tensor:
        """Inter-InstaHide's public set, as the defense's configuration names it (read once per runner): what
        an attacker under ``threat.public_data: known`` holds."""
        if getattr(self, "_public", None) is None:
            self._public = public_set(inter_instahide(self.setting.defense_config))
        return self._public

    def _client_query(self, obs: Observation, x: torch.Tensor, y: torch.Tensor) -> ClientQuery:
        """The simulated client of this batch as a malicious server reaches it (its private batch, the
        configured defense, the protocol and mode it was observed with)."""
        return ClientQuery(x, y, self.setting.defense_config, obs.protocol, input_range=obs.input_range,
                           train_mode=obs.train_mode, inspect=self.cfg.client.inspect, reference=self.setting.model,
                           disaggregation=self.cfg.client.inspect_disaggregation)


class _StateCache(PreparedCache):
    """Prepared attack states in the run's state folder (``prepared/NAME-KEY.pt``): listed in its
    manifest, tensors and plain data only, read back with ``weights_only=True``."""

    def __init__(self, state: StateFolder | None) -> None:
        super().__init__(None)
        self.state = state

    def read(self, entry: str) -> Any | None:
        return self.state.load_tensors(f"prepared/{entry}.pt") if self.state is not None else None

    def write(self, entry: str, state: Any) -> None:
        if self.state is not None:
            self.state.save_tensors(f"prepared/{entry}.pt", state)

    def adopt(self, entries: dict[str, Any]) -> None:
        """Take states another process prepared, and store them in the state folder."""
        for entry, state in entries.items():
            super().adopt({entry: state})
            self.write(entry, state)

    def entries_of(self, name: str) -> dict[str, Any]:
        """Prepared states of attack ``name`` this run holds (memory, or listed in the state folder)."""
        found = {k: v for k, v in self.entries().items() if k.startswith(f"{name}-")}
        if self.state is not None:
            for file in self.state.files:
                if file.startswith(f"prepared/{name}-") and file.endswith(".pt"):
                    entry = file.removeprefix("prepared/").removesuffix(".pt")
                    if entry not in found:
                        loaded = self.state.load_tensors(file)
                        if loaded is not None:
                            found[entry] = loaded
        return found


#: SSIM from which a reconstruction counts as the private image itself (Robbing the Fed's "exact" recoveries)
EXACT_SSIM = 0.95


def measure(cfg: RedTeamConfig, reconstruction, inputs: torch.Tensor, labels: torch.Tensor | None,
            input_range: tuple[float, float]) -> dict[str, Any]:
    """Per-sample and summary metrics of a reconstruction (a ``Reconstruction`` or a tensor) against the
    private batch: ``metrics.evaluate`` for images; for text ``textmetrics.evaluate_text`` (ROUGE, token
    accuracy, bag of words, after matching) and, for a classifier, the restored labels' accuracy."""
    if cfg.modality != "text":
        return metrics.evaluate(reconstruction, inputs, labels, data_range=input_range,
                                lpips_weights=cfg.certify.lpips_weights)
    from guardfl.redteam.modality.text import metrics as textmetrics
    from guardfl.redteam.modality.text.tokenizer import load_tokenizer

    recon = reconstruction.inputs if hasattr(reconstruction, "inputs") else reconstruction
    if recon.dim() == 1:  # one guess for every sample (the prior)
        recon = recon.expand_as(inputs)
    tok = load_tokenizer(cfg.data.tokenizer)
    classifier = labels is not None and labels.dim() == 1
    # a classifier's sentences are padded with end-of-text: padding is no private token
    ignore = (tok.eos_id,) if classifier and tok.eos_id is not None else ()
    m = textmetrics.evaluate_text(recon.cpu(), inputs.cpu(), tok, ignore_ids=ignore)
    rec_labels = getattr(reconstruction, "labels", None)
    if rec_labels is not None and classifier:
        rl = rec_labels.detach().cpu().reshape(-1)
        for row in m["per_image"]:
            j = row.get("matched", row["index"])
            row["label_correct"] = bool(rl[j] == labels[row["index"]]) if j < len(rl) else False
        m["summary"]["label_acc"] = sum(r["label_correct"] for r in m["per_image"]) / max(1, len(m["per_image"]))
    return m


def _recovered(m: dict, cfg: RedTeamConfig) -> dict[str, Any] | None:
    """How many private samples came back past the main threshold (the fraction a reviewer reads): SSIM for
    images, ROUGE-1 for text; "exact": SSIM >= 0.95, or every token right."""
    metric, limit, exact_at = ("ssim", cfg.certify.max_ssim, EXACT_SSIM) if cfg.modality != "text" else \
        ("rouge1", cfg.certify.max_rouge1, None)
    if limit is None:
        return None
    above = sum(1 for p in m["per_image"] if p.get(metric) is not None and p[metric] > limit)
    if exact_at is None:
        exact = sum(1 for p in m["per_image"] if p.get("token_acc") == 1.0)
    else:
        exact = sum(1 for p in m["per_image"] if p.get(metric) is not None and p[metric] >= exact_at)
    return {f"above_max_{metric}": above, "exact": exact, "of": len(m["per_image"]),
            "fraction": above / max(1, len(m["per_image"]))}


def _encoding_metrics(encodings: torch.Tensor, obs: Observation, view: Observation) -> dict[str, Any] | None:
    """Diagnostic, not part of the verdict: the reconstructed encodings against those the client really
    trained on (first step of the decode chain; the verdict compares private images only)."""
    if not obs.side.trained:
        return None
    truth = torch.cat([x for x, _ in obs.side.trained]).cpu()
    if truth.shape != encodings.shape:
        return {"note": f"the client trained on {truth.shape[0]} encodings, the attack reconstructed {encodings.shape[0]}"}
    summary = metrics.evaluate(encodings, truth, data_range=view.input_range)["summary"]
    return {"vs": "the encodings the client trained on (diagnostic)", "ssim": summary["ssim"], "mse": summary["mse"]}


def _open_state(root: Path, cfg: RedTeamConfig, config_hash: str, inputs: dict[str, str], resume: bool) -> StateFolder:
    """The run's state folder. ``resume``: the earlier run's, when its key (config hash and the content of
    every input) is this run's, else a ConfigError of one line naming what changed. Otherwise (or with no
    earlier state) a fresh one: the files an earlier guardfl run listed are removed, nothing else, and a
    folder of files guardfl did not write is refused."""
    key = resume_key(config_hash, inputs)
    manifest = StateFolder.read_manifest(root) if resume else None
    if manifest is not None:
        old = manifest.get("meta") or {}
        if old.get("key") == key:
            return StateFolder.reopen(root, manifest)
        if old.get("config_hash") != config_hash:
            raise ConfigError(f"--resume: {root} holds a run of another config (hash {old.get('config_hash')}, this one "
                              f"{config_hash}); use another --out or drop --resume")
        paths = run_inputs(cfg)
        changed = [f"{name} ({paths[name][0]})" if name in paths and paths[name][0] else name
                   for name in changed_inputs(old.get("inputs") or {}, inputs)]
        raise ConfigError(f"--resume: {', '.join(changed) or 'an input file'} changed since the run in {root} (content "
                          "hash); resuming would mix two versions in one certificate; use another --out or drop --resume")
    return StateFolder.fresh(root, {"key": key, "config_hash": config_hash, "inputs": inputs})


def _pack_observation(obs: Observation) -> dict[str, Any]:
    """An observation as tensors and plain data (the global model as its state dict and train flags)."""
    side = obs.side
    return {
        "protocol": asdict(obs.protocol),
        "model": {"state": dict(obs.model.state_dict()), "training": [m.training for m in obs.model.modules()]},
        "update": dict(obs.update), "num_samples": obs.num_samples, "input_shape": tuple(obs.input_shape),
        "num_classes": obs.num_classes, "input_range": tuple(obs.input_range), "defense_config": obs.defense_config,
        "released_bn_stats": [tuple(p) for p in obs.released_bn_stats],
        "side": {"labels": side.labels, "bn_batch_stats": [tuple(p) for p in side.bn_batch_stats],
                 "defense_stats": json.loads(json.dumps(list(side.defense_stats), default=str)),  # logs
                 "input_hashes": tuple(side.input_hashes),
                 "trained": [tuple(p) for p in side.trained]},
        "train_mode": obs.train_mode, "modality": obs.modality,
    }


def _unpack_observation(d: dict[str, Any], model: torch.nn.Module) -> Observation:
    """The observation ``_pack_observation`` saved; ``model``: the run's global model (architecture),
    copied and given the saved state."""
    proto = dict(d["protocol"])
    protocol = FedSGD() if proto.get("name") == "fedsgd" else FedAvg(**proto)
    global_model = copy.deepcopy(model)
    global_model.load_state_dict(d["model"]["state"], strict=True)
    modules = list(global_model.modules())
    if len(modules) != len(d["model"]["training"]):
        raise ConfigError("--resume: a saved observation does not match this run's model; drop --resume to start over")
    for module, training in zip(modules, d["model"]["training"]):
        module.training = bool(training)
    side = d["side"]
    return Observation(
        protocol=protocol, model=global_model, update=dict(d["update"]), num_samples=d["num_samples"],
        input_shape=tuple(d["input_shape"]), num_classes=d["num_classes"], input_range=tuple(d["input_range"]),
        defense_config=d["defense_config"], released_bn_stats=[tuple(p) for p in d["released_bn_stats"]],
        side=SideKnowledge(labels=side["labels"], bn_batch_stats=[tuple(p) for p in side["bn_batch_stats"]],
                           defense_stats=list(side["defense_stats"]), input_hashes=tuple(side["input_hashes"]),
                           trained=[tuple(p) for p in side["trained"]]),
        train_mode=d["train_mode"], modality=d.get("modality", "image"),
    )


class _BatchSource:
    """Where each certified batch comes from: the simulated client (``simulate_client`` on the data
    section's images), or the user's ``target`` (a ClientApp fed the global model, or a train_fn fed the
    data section's images). Each batch's observation and ground truth are saved under ``OUT/state`` so a
    resumed run attacks the very update the first run saw. Auxiliary data that shares an image with any
    private batch is refused (content hashes): up front for simulated clients, per batch for targets."""

    def __init__(self, cfg: RedTeamConfig, state: StateFolder | None, aux: AuxData | None = None) -> None:
        self.cfg, self.state, self.aux = cfg, state, aux
        self.target = cfg.target
        #: the configured defense with DP-SGD's noise resolved for the deployment, and its accounting
        self.defense_config, self.privacy = privacy.resolve(cfg.defense, cfg.client.batch_size, cfg.client.dataset_size)
        self._cache: dict[int, tuple[Observation, torch.Tensor, torch.Tensor]] = {}
        self._runs: dict[int, dict[str, Any]] = {}
        self.x_all = self.y_all = None
        #: the population the certificate speaks for, and the drawn samples (indices into x_all)
        self.population: dict[str, Any] = {}
        self.drawn: list[int] = []
        #: a text client's tokenizer (None for images)
        self.tokenizer = None
        if cfg.modality == "text":
            self.model = self._text_model()
            self._load_data(task=self.model.task)
            set_model_state(self.model, cfg.model.state, seed=cfg.seed)
            if aux is not None:
                aux.check_disjoint(self.x_all[self.drawn])
            return
        if self.target is not None and (self.target.clientapp is not None or self.target.nvflare is not None):
            in_shape = tuple(cfg.model.input_shape) if cfg.model.input_shape else None
            if in_shape is None and ":" not in cfg.model.name:
                raise ConfigError("model.input_shape: needed with a target.clientapp / target.nvflare and a built-in model "
                                  "(or use model.name 'module:callable', the app's own model factory)")
        else:
            self._load_data()
            in_shape = tuple(self.x_all.shape[1:])
            if aux is not None:
                aux.check_disjoint(self.x_all[self.drawn])
        self.model = build_model(cfg.model.name, in_shape, cfg.model.num_classes)
        set_model_state(self.model, cfg.model.state, seed=cfg.seed)
        if self.target is not None:
            self._client = self._load_client()

    def _text_model(self) -> torch.nn.Module:
        """The text model: built for the tokenizer's vocabulary, checked against the protocol, the
        vocabulary and the sequence length (one-line errors naming the field)."""
        from guardfl.redteam.modality.text.models import is_text_model
        from guardfl.redteam.modality.text.tokenizer import load_tokenizer

        d, name = self.cfg.data, self.cfg.model.name
        self.tokenizer = load_tokenizer(d.tokenizer)
        model = build_model(name, (d.seq_len,), self.cfg.model.num_classes, self.tokenizer.vocab_size)
        if not is_text_model(model):
            raise ConfigError(f"model.name: {name} is not a text model (it needs .task 'causal-lm' or 'classification', "
                              "get_input_embeddings() and forward(tokens) / forward(inputs_embeds=...))")
        vocab = model.get_input_embeddings().num_embeddings
        if vocab != self.tokenizer.vocab_size:
            raise ConfigError(f"data.tokenizer: {d.tokenizer!r} has {self.tokenizer.vocab_size} tokens, the model's "
                              f"embedding {vocab}; use the model's own tokenizer")
        context = getattr(model, "context", None)
        if context is not None and d.seq_len > context:
            raise ConfigError(f"data.seq_len: {d.seq_len} tokens is longer than the model's context ({context}); "
                              f"allowed: 2..{context}")
        return model

    def _load_data(self, task: str | None = None) -> None:
        """The population (the data section's images from ``offset``, ``limit`` of them; a text model's
        sequences, ``textdata``) and the ``batches x n`` private samples drawn from it at random
        (``sampling``)."""
        cfg = self.cfg
        d = cfg.data
        n = cfg.client.n
        need = cfg.certify.batches * n
        limit = d.offset + d.limit if d.limit else None
        if task is not None:
            x, y = data_mod.load_text_data(d.source, path=d.path, seq_len=d.seq_len, tokenizer=d.tokenizer, task=task,
                                           num_classes=cfg.model.num_classes, split=d.split, limit=limit)
        else:
            x, y = data_mod.load(d.source, root=d.root, path=d.path, download=d.download, image_size=d.image_size,
                                 num_classes=cfg.model.num_classes, limit=limit)
        self.x_all, self.y_all = x[d.offset :], y[d.offset :]
        population = Population(d.source, d.offset, len(self.x_all), d.path)
        if population.size < need:
            raise ConfigError(f"data: {d.source} has {population.size} images from offset {d.offset}"
                              f"{f' (limit {d.limit})' if d.limit else ''}; certify.batches={cfg.certify.batches} x "
                              f"{n} samples needs {need} distinct ones (fewer batches, or a larger population)")
        if task is None and int(self.y_all.max()) >= cfg.model.num_classes:
            raise ConfigError(f"model.num_classes={cfg.model.num_classes} but the data has label {int(self.y_all.max())}")
        self.drawn = population.draw(need, cfg.seed)
        self.population = population.describe(self.drawn, cfg.seed)

    def _load_client(self):
        t = self.target
        if t.clientapp is not None:
            return load_object(t.clientapp, "target.clientapp")
        if t.nvflare is not None:
            self._result_filters = nvflare_result_filters(t.job, t.result_filters)
            return load_object(t.nvflare, "target.nvflare")
        return load_object(t.train_fn, "target.train_fn")

    def _private(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.cfg.client.n
        rows = self.drawn[b * n : (b + 1) * n]
        return self.x_all[rows], self.y_all[rows]

    def batch(self, b: int) -> tuple[Observation, torch.Tensor, torch.Tensor]:
        if b in self._cache:
            return self._cache[b]
        name = f"observation-b{b}.pt"
        saved = self.state.load_tensors(name) if self.state is not None else None
        if saved is not None:
            self._runs[b] = saved["run"]
            self._cache[b] = (_unpack_observation(saved["observation"], self.model), saved["inputs"], saved["labels"])
            return self._cache[b]
        cfg = self.cfg
        if self.target is None:
            x, y = self._private(b)
            defense = from_config(self.defense_config) if self.defense_config is not None else None
            obs = simulate_client(self.model, x, y, defense, _protocol(cfg), train_mode=cfg.client.train_mode)
            self._runs[b] = {"kind": "simulated", "samples": int(x.shape[0])}
        else:
            obs, x, y = self._run_target(b)
            if self.aux is not None:
                self.aux.check_disjoint(x, obs.input_range)
        self._runs[b] = json.loads(json.dumps(self._runs[b], default=str))  # as a resume reads it back
        if self.state is not None:
            self.state.save_tensors(name, {"observation": _pack_observation(obs), "inputs": x, "labels": y,
                                           "run": self._runs[b]})
        self._cache[b] = (obs, x, y)
        return self._cache[b]

    def _run_target(self, b: int) -> tuple[Observation, torch.Tensor, torch.Tensor]:
        t, cfg = self.target, self.cfg
        protocol = _protocol(cfg)
        if t.clientapp is not None:
            node_config = dict(t.node_config)
            if t.partition_key:
                node_config.setdefault(t.partition_key, b)
            run_config = flower_run_config(t.app_dir, t.run_config)
            returned, steps = run_clientapp(self._client, self.model, config=t.config, node_config=node_config,
                                            run_config=run_config)
            field_name, extra = "target.clientapp", {"node_config": node_config}
        elif t.nvflare is not None:
            site = f"site-{b + 1}"
            returned, steps = run_nvflare(self._client, self.model, site=site, kwargs=t.run_config,
                                          filters=self._result_filters)
            field_name = "target.nvflare"
            extra = {"site": site, "result_filters": [type(f).__name__ for f in self._result_filters]}
        else:
            x, y = self._private(b)
            returned, steps = run_train_fn(self._client, self.model, x, y, cfg.client.batch_size)
            field_name, extra = "target.train_fn", {}
        declared = cfg.client.samples if "samples" in cfg.client.model_fields_set else None
        run = observe(self.model, returned, steps, protocol, cfg.defense, field_name, declared)
        self._runs[b] = {"kind": field_name.split(".")[1], "ref": t.clientapp or t.train_fn or t.nvflare, "samples": int(run.inputs.shape[0]),
                         "steps": run.steps, "batch_sizes": run.batch_sizes, **extra}
        return run.observation, run.inputs, run.labels

    def setting(self) -> Setting:
        """What every batch shares (model, protocol, geometry, the defense as configured): from batch 0."""
        obs = self.batch(0)[0]
        return Setting.of(obs)

    def describe(self) -> dict[str, Any]:
        if self.target is None:
            kind = "simulated"
            note = ("the red team ran guardfl's client simulation with the configured defense"
                    if self.cfg.defense is not None else "the red team ran guardfl's client simulation without a defense (defense: null)")
        else:
            kind = "clientapp" if self.target.clientapp else "nvflare" if self.target.nvflare else "train_fn"
            note = ("the red team ran the user's own client code; the configured defense is what the attacker "
                    "is told the client runs (the client applies its own)")
        out = {"kind": kind, "ref": self.target and (self.target.clientapp or self.target.train_fn or self.target.nvflare), "note": note,
               "batches": {str(b): r for b, r in sorted(self._runs.items())}}
        if self.target is None and self.cfg.client.inspect:
            out["inspection"] = inspection_summary(self.cfg.client.inspect_disaggregation)
        return out


def inspection_summary(disaggregation: bool) -> dict[str, Any]:
    """What an inspecting simulated client runs on every model a malicious server sends (the certificate's
    ``client.inspection``): ``inspect_model``, strict, with the honest global model as the reference and its
    own first batch; the checks, and the opt-in check left out when it is."""
    checks = ["architecture", "imprint", "class_fishing", "gradient_concentration", "isolation"]
    summary: dict[str, Any] = {"function": "guardfl.inspect_model", "strict": True,
                               "reference": "the honest global model", "batch": "the client's first batch",
                               "disaggregation": disaggregation}
    if disaggregation:
        checks.append("disaggregation")
        summary["disaggregation_rule"] = (f"SEER's D-SNR (Garov et al. 2024), train mode: refused above {DSNR_THRESHOLD:g} "
                                          f"on batches of {DSNR_MIN_BATCH} or more")
    else:
        summary["not_run"] = ["disaggregation (SEER's D-SNR, opt-in: client.inspect_disaggregation: true)"]
    summary["checks"] = checks
    return summary


def _load_job(state: StateFolder, job: str):
    record = state.load_json(f"{job}.json")
    if record is None:
        return None
    rec = state.load_tensors(f"{job}.pt")
    if record.get("metrics") is not None and rec is None:
        return None
    return record, rec


def _save_job(state: StateFolder, job: str, record: dict, rec: torch.Tensor | None) -> None:
    if rec is not None:
        state.save_tensors(f"{job}.pt", rec)
    state.save_json(f"{job}.json", record)  # written last: marks the job done


def _bar(enabled: bool, total: int):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="red team", unit="attack")
