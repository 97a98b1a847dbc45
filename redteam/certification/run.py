"""Certification's entry point: ``certify`` runs the red team a config describes and writes its verdict
last; ``_certify`` is the recipe, a sequence of named steps.

Simulate the deployed client, run every applicable attack on what it transmits, measure what comes back,
and decide the config's claims. The recipe: parse and check the arguments, open the state folder and
the budget, load the auxiliary data and the population (refusing overlap), build the re-identification
gallery, plan the attacks from the registry (every registered attack is listed in the certificate: ran,
or not applicable with the reason), then attack **round after round** (``plan.round_ends``): each round
observes its client updates (each an independent draw of the population, ``sampling``), runs the jobs
not finished yet (here, in worker processes kept for the run, or as Ray tasks; once-per-setting
preparations cached under ``OUT/state/prepared``), builds the records that repeat another plan's run
exactly from that run (``repeats``: iDLG restoring the label DLG is granted, same seed and budget),
measures the attacker's prior guess and who the reconstructions re-identify, and asks the sequential rule
(``sequential``, anytime-valid) whether the claims are decided; it stops when they are, or when the
budget (``certify.max_updates`` / ``max_samples`` / ``max_seconds``) runs out. Then judge, assemble the
certificate.

Each (client batch, attack) pair is one job whose result is written atomically under ``OUT/state/``
(``state``); ``resume=True`` reuses finished jobs and prepared attacks and runs only the rest, on the very
observations the first run saw. A resumed certificate is the uninterrupted one, timings apart. A resume
of a run that ended INCONCLUSIVE at its budget gives it more updates: ``more`` of them, else as many as
its certificate said would most likely decide (``budget.json`` in the state folder keeps the budget). An
attack that raises fails the run (``AttackFailed``, exit 2): it never drops out of a verdict.

With ``out``, the folder's earlier verdict is deleted before anything else and ``run.json`` says "in
progress" until ``certificate.json`` (written last, after the report) is there: a run that fails or is
killed leaves no verdict.
"""

from __future__ import annotations

import contextlib
import json
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

import guardfl
from guardfl.errors import ConfigError
from guardfl.redteam import modality
from guardfl.redteam.attacks.base import resolve_device
from guardfl.redteam.auxdata import AuxData
from guardfl.redteam.certification import evidence, judge, reid, rounds
from guardfl.redteam.certification.batches import BatchSource, load_aux
from guardfl.redteam.certification.budget import prepare_budget, save_budget
from guardfl.redteam.certification.certificate import Certificate
from guardfl.redteam.certification.fingerprint import fingerprint
from guardfl.redteam.certification.plan import check_workers_threads, resolve_strength, with_samples
from guardfl.redteam.certification.rounds import Attacked
from guardfl.redteam.certification.state import open_state
from guardfl.redteam.client.target import on_path
from guardfl.redteam.config import RedTeamConfig, load_config
from guardfl.redteam.modality.image import metrics
from guardfl.redteam.runtime import allocator
from guardfl.redteam.runtime.files import CERTIFICATE, StateFolder, atomic_write, mark_run, retract_verdict
from guardfl.redteam.runtime.ray_backend import as_backend
from guardfl.redteam.runtime.workers import available_cores, default_workers, job_threads


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
    attacks: Mapping[str, type] | None = None,
    more: int | None = None,
) -> Certificate:
    """Run the red team described by ``config`` (a ``RedTeamConfig``, a dict, or a YAML path) and return its
    ``Certificate``; write ``certificate.json`` and ``report.html`` under ``out`` when given. ``device``
    ('cpu', 'cuda', 'auto') overrides the config's. ``resume``: continue the run in ``out`` (its finished
    jobs kept; refused when the config or a file it reads changed); ``more``: with ``resume``, attack this
    many more updates than the budget the run stopped at (an INCONCLUSIVE run's next step).
    ``strength`` ('quick', 'paper', 'auto') overrides the config's. ``workers``: processes running the
    jobs (batch x attack, and preparations) side by side (None: one per available core on a CPU, one
    on a GPU); ``threads``: intra-op threads per job (default:
    ``workers.job_threads``, one for small models). The certificate does not depend on ``workers``.
    ``samples``: attack about this many private samples instead of the config's ``certify.max_updates``
    (a quick look; the certificate says the claim rests on the override). ``backend``: None (this
    machine's processes), 'ray' or a ``ray_backend.RayJobs`` (the jobs as Ray tasks, on a local instance
    of ``workers`` CPUs or a cluster; the same certificate). ``attacks``: name -> attack class, the
    attacks to plan and run (default: the registry, ``guardfl.redteam.attacks.ATTACKS``).

    With ``out``: before anything else (even reading the config), an earlier verdict there is deleted
    and ``out/run.json`` says "in progress"; it says "failed" or "interrupted" when the run raises, and
    "finished" only once ``certificate.json`` is written (last). A run that fails or is killed therefore
    leaves no ``certificate.json``."""
    if out is None:
        return _certify(config, None, device, resume, progress, strength, workers, threads, samples, backend, attacks, more)
    out_dir = Path(out)
    retracted = retract_verdict(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = {"resume": resume, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               "config": str(config) if isinstance(config, (str, Path)) else None, "retracted": retracted}
    mark_run(out_dir, "in progress", **started)
    try:
        cert = _certify(config, out_dir, device, resume, progress, strength, workers, threads, samples, backend, attacks, more)
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



def _certify(config, out_dir: Path | None, device: str | None, resume: bool, progress: bool,
             strength: str | None, workers: int | None = 1, threads: int | None = None,
             samples: int | None = None, backend: Any = None, attacks: Mapping[str, type] | None = None,
             more: int | None = None) -> Certificate:
    """The recipe: the run's arguments, its state and budget, its population and gallery, the rounds of
    attacks, the judge, the certificate."""
    args = _prepare_arguments(config, device, strength, workers, threads, samples, backend, more)
    cfg = args.cfg
    digest, inputs = cfg.digest(args.strength), fingerprint(cfg)
    state = _prepare_state(out_dir, cfg, digest, inputs, resume)
    budget = prepare_budget(cfg, state, resume, more)
    app_dir = cfg.target.app_dir if cfg.target is not None else None
    with on_path(app_dir):
        aux = load_aux(cfg)
        source = BatchSource(cfg, state, aux)
        gallery = _prepare_gallery(cfg, source, aux)
        threads = threads or job_threads(sum(p.numel() for p in source.model.parameters()), args.workers)
        warnings = args.override + judge.defense_warnings(cfg.defense, source.model)
        attacked = rounds.attack(args, source, aux, state, threads, app_dir, progress, attacks, budget, gallery)
    lp = metrics.lpips_status(cfg.certify.lpips_weights)
    found, checks, status, cautions = _judge(cfg, attacked, lp.available)
    save_budget(state, budget, attacked.stop, found, status)
    cert = _assemble_certificate(args, source, attacked, digest=digest, inputs=inputs, threads=threads, lpips=lp,
                                 priors=attacked.priors, found=found, checks=checks, status=status,
                                 warnings=warnings + cautions, gallery=gallery)
    cert.bound = _prove(cfg, aux, source, attacked)
    return cert


def _prove(cfg: RedTeamConfig, aux: AuxData | None, source: BatchSource, attacked: Attacked) -> dict[str, Any]:
    """The proven bound beside the verdict (``certification.bound.run_bound``): kappa from the config, or
    estimated from the auxiliary data against the population (the attacked samples for a target that
    loads its own data)."""
    from guardfl.redteam.certification.bound import run_bound

    private = source.x_all if source.x_all is not None else torch.cat([x for _, x, _ in attacked.batches.values()])
    first = next(iter(attacked.batches.values()))[0]
    return run_bound(cfg, aux, private, source.model, tuple(first.input_range))


@dataclass
class _Arguments:
    """The run's arguments, checked and resolved (``_prepare_arguments``)."""

    cfg: RedTeamConfig
    #: the warning of a ``samples`` override (empty without one)
    override: list[str]
    #: when the run started (after the arguments were checked)
    started: float
    device: torch.device
    strength: str
    workers: int
    ray_jobs: Any


def _prepare_arguments(config, device: str | None, strength: str | None, workers: int | None, threads: int | None,
                       samples: int | None, backend: Any, more: int | None = None) -> _Arguments:
    """The config parsed and the arguments checked (one-line ConfigErrors, before anything is built); the
    device, the strength and the worker count resolved; a Ray address reached."""
    if more is not None and (not isinstance(more, int) or isinstance(more, bool) or not 1 <= more <= 100_000):
        raise ConfigError(f"more: expected an integer in [1, 100000] (more updates for a resumed run; got {more!r})")
    cfg = config if isinstance(config, RedTeamConfig) else load_config(config)
    ray_jobs = as_backend(backend)
    cfg, override = with_samples(cfg, samples)
    check_workers_threads(workers, threads)
    started = time.time()
    dev = resolve_device(device or cfg.device)
    level = resolve_strength(strength or cfg.strength, dev)
    workers = workers or default_workers(dev)
    if ray_jobs is not None:
        ray_jobs.check()  # an unreachable address: one line, before anything is built
    return _Arguments(cfg, override, started, dev, level, workers, ray_jobs)


def _prepare_state(out_dir: Path | None, cfg: RedTeamConfig, digest: str, inputs: dict[str, str],
                   resume: bool) -> StateFolder | None:
    """The state folder ``out_dir/state`` (fresh, or the earlier run's with ``resume``); None without ``out``."""
    return open_state(out_dir / "state", cfg, digest, inputs, resume) if out_dir is not None else None


def _prepare_gallery(cfg: RedTeamConfig, source: BatchSource, aux: AuxData | None) -> reid.Gallery | None:
    """The re-identification gallery (``reid``): the population and the attacker's auxiliary images, for
    an image client whose population the red team draws from; None otherwise (then a re-identification
    claim is refused, one line)."""
    image = not modality.of(cfg).tokenized  # re-identification compares pictures (SSIM, eigenfaces)
    if source.x_all is None or not image:
        if cfg.certify.max_reid_rate is not None:
            why = "a text client" if not image else "a target that brings its own data (ClientApp / NVFlare job)"
            raise ConfigError(f"certify.max_reid_rate: re-identification is measured against a known population of "
                              f"images; this run attacks {why}; allowed: null here")
        return None
    obs_range = source.setting().input_range
    return reid.gallery(source.x_all, aux.images if aux is not None else None,
                        aux.ood if aux is not None else None, obs_range)


def _judge(cfg: RedTeamConfig, attacked: Attacked, lpips_available: bool,
           ) -> tuple[dict[str, Any], list[dict], str, list[str]]:
    """The claims (as the last round left them), the checks, the verdict, and the warnings on the claims'
    strength."""
    found = attacked.found
    found["stop"] = attacked.stop
    checks = judge.verdict_checks(cfg, attacked.results, lpips_available, found)
    return found, checks, judge.verdict_status(checks), (judge.evidence_warnings(cfg, found, attacked.stop)
                                                         + judge.refusal_warnings(cfg, attacked.results, len(attacked.batches))
                                                         + judge.budget_warnings(cfg, attacked.results)
                                                         + judge.unadapted_warnings(cfg, attacked.results))


def _assemble_certificate(args: _Arguments, source: BatchSource, attacked: Attacked, *, digest: str,
                          inputs: dict[str, str], threads: int, lpips: Any, priors: dict[int, list[dict]],
                          found: dict[str, Any], checks: list[dict], status: str, warnings: list[str],
                          gallery: reid.Gallery | None = None) -> Certificate:
    """The certificate of the run (its wall time read last)."""
    cfg, dev, ray_jobs = args.cfg, args.device, args.ray_jobs
    if gallery is not None and "reid_rate" in found:
        found["reid_rate"]["gallery"] = {**gallery.describe(), "chance_rate": gallery.chance(cfg.client.n)}
    return Certificate(
        certified=status == evidence.CERTIFIED,
        status=status,
        checks=checks,
        results=attacked.results,
        client=source.describe(),
        config=cfg.model_dump(mode="json"),
        config_hash=digest,
        environment={
            "guardfl": guardfl.__version__, "torch": torch.__version__, "python": platform.python_version(),
            "device": str(dev), "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
            "threads": threads, "workers": args.workers, "cores": available_cores(), "allocator": allocator.state(),
            "backend": ray_jobs.describe() if ray_jobs is not None else "processes",
        },
        wall_time_s=time.time() - args.started,
        lpips={"available": lpips.available, "reason": lpips.reason},
        strength=args.strength,
        attacks=attacked.listing,
        preparations=attacked.preparations,
        priors={str(b): p for b, p in priors.items()},
        privacy=source.privacy,
        warnings=warnings,
        inputs=inputs,
        population=source.population,
        evidence=found,
        worst=judge.worst_images(cfg, attacked.results, priors),
        reconstructions=attacked.recon,
        originals={b: x for b, (_, x, _) in attacked.batches.items()},
    )
