"""Certification's entry point: ``certify`` runs the red team a config describes and writes its verdict
last; ``_certify`` is the recipe, a sequence of named steps.

Simulate the deployed client, run every applicable attack on what it transmits, measure what comes back,
and compare the worst case with the thresholds. The recipe: parse and check the arguments, open the state
folder, load the auxiliary data and the batches (refusing overlap), plan the attacks from the registry
(every registered attack is listed in the certificate: ran, or not applicable with the reason), run the
jobs not finished yet (here, in worker processes or as Ray tasks; once-per-setting preparations cached
under ``OUT/state/prepared``), build the records that repeat another plan's run exactly from that run
(``repeats``: iDLG restoring the label DLG is granted, same seed and budget), measure the attacker's prior
guess, judge, assemble the certificate.

Each (client batch, attack) pair is one job whose result is written atomically under ``OUT/state/``
(``state``); ``resume=True`` reuses finished jobs and prepared attacks and runs only the rest, on the very
observations the first run saw. A resumed certificate is the uninterrupted one, timings apart. An attack
that raises fails the run (``AttackFailed``, exit 2): it never drops out of a verdict.

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
from guardfl.redteam.attacks.base import resolve_device
from guardfl.redteam.auxdata import AuxData
from guardfl.redteam.certification import evidence, judge, repeats
from guardfl.redteam.certification.batches import BatchSource, load_aux, prior_guess
from guardfl.redteam.certification.certificate import Certificate
from guardfl.redteam.certification.fingerprint import fingerprint
from guardfl.redteam.certification.measure import measure
from guardfl.redteam.certification.plan import (check_workers_threads, plan_attacks, plan_jobs, record_name,
                                                resolve_strength, with_samples)
from guardfl.redteam.certification.runner import AttackRunner
from guardfl.redteam.certification.state import load_job, open_state, save_job
from guardfl.redteam.client.target import on_path
from guardfl.redteam.config import AttackSection, RedTeamConfig, load_config
from guardfl.redteam.modality.image import metrics
from guardfl.redteam.runtime import allocator
from guardfl.redteam.runtime.files import CERTIFICATE, StateFolder, atomic_write, mark_run, retract_verdict
from guardfl.redteam.runtime.ray_backend import as_backend
from guardfl.redteam.runtime.workers import (Job, RunContext, available_cores, default_workers, job_threads, run_parallel,
                                             torch_threads)


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
) -> Certificate:
    """Run the red team described by ``config``; write results under ``out`` when given.
    ``strength`` ('quick', 'paper', 'auto') overrides the config's. ``workers``: processes running the
    jobs (batch x attack, and preparations) side by side (None: one per available core on a CPU, one
    on a GPU); ``threads``: intra-op threads per job (default:
    ``workers.job_threads``, one for small models). The certificate does not depend on ``workers``.
    ``samples``: attack about this many private samples instead of the config's ``certify.batches``
    (a quick look; the certificate says the claim rests on the override). ``backend``: None (this
    machine's processes), 'ray' or a ``ray_backend.RayJobs`` (the jobs as Ray tasks, on a local instance
    of ``workers`` CPUs or a cluster; the same certificate). ``attacks``: name -> attack class, the
    attacks to plan and run (default: the registry, ``guardfl.redteam.attacks.ATTACKS``).

    With ``out``: before anything else (even reading the config), an earlier verdict there is deleted
    and ``out/run.json`` says "in progress"; it says "failed" or "interrupted" when the run raises, and
    "finished" only once ``certificate.json`` is written (last). A run that fails or is killed therefore
    leaves no ``certificate.json``."""
    if out is None:
        return _certify(config, None, device, resume, progress, strength, workers, threads, samples, backend, attacks)
    out_dir = Path(out)
    retracted = retract_verdict(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = {"resume": resume, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               "config": str(config) if isinstance(config, (str, Path)) else None, "retracted": retracted}
    mark_run(out_dir, "in progress", **started)
    try:
        cert = _certify(config, out_dir, device, resume, progress, strength, workers, threads, samples, backend, attacks)
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
             samples: int | None = None, backend: Any = None, attacks: Mapping[str, type] | None = None) -> Certificate:
    """The recipe: the run's arguments, its state, its batches, the attacks on them, the judge, the
    certificate."""
    args = _prepare_arguments(config, device, strength, workers, threads, samples, backend)
    cfg = args.cfg
    digest, inputs = cfg.digest(args.strength), fingerprint(cfg)
    state = _prepare_state(out_dir, cfg, digest, inputs, resume)
    app_dir = cfg.target.app_dir if cfg.target is not None else None
    with on_path(app_dir):
        aux = load_aux(cfg)
        source = BatchSource(cfg, state, aux)
        threads = threads or job_threads(sum(p.numel() for p in source.model.parameters()), args.workers)
        warnings = args.override + judge.defense_warnings(cfg.defense, source.model)
        attacked = _attack(args, source, aux, state, threads, app_dir, progress, attacks)
    lp = metrics.lpips_status(cfg.certify.lpips_weights)
    priors = _measure_priors(cfg, aux, attacked)
    found, checks, status, cautions = _judge(cfg, attacked, priors, lp.available)
    cert = _assemble_certificate(args, source, attacked, digest=digest, inputs=inputs, threads=threads, lpips=lp,
                                 priors=priors, found=found, checks=checks, status=status, warnings=warnings + cautions)
    cert.bound = _prove(cfg, aux, source, attacked)
    return cert


def _prove(cfg: RedTeamConfig, aux: AuxData | None, source: BatchSource, attacked: _Attacked) -> dict[str, Any]:
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
                       samples: int | None, backend: Any) -> _Arguments:
    """The config parsed and the arguments checked (one-line ConfigErrors, before anything is built); the
    device, the strength and the worker count resolved; a Ray address reached."""
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


@dataclass
class _Attacked:
    """What the attacks gave: the certificate's ``attacks`` lines, the records and reconstructions (by
    record name, plan order within each batch), the preparations, and every batch (observation, inputs, labels)."""

    listing: list[dict[str, Any]]
    results: list[dict[str, Any]]
    recon: dict[str, torch.Tensor]
    preparations: dict[str, Any]
    batches: dict[int, tuple]


def _attack(args: _Arguments, source: BatchSource, aux: AuxData | None, state: StateFolder | None, threads: int,
            app_dir: str | None, progress: bool, attacks: Mapping[str, type] | None) -> _Attacked:
    """Plan the attacks on batch 0's setting, observe every batch, run the jobs neither finished nor reused,
    build the reused records; then the preparations, the listing's reuse notes and the records in order."""
    cfg, n_batches = args.cfg, args.cfg.certify.batches
    with torch_threads(threads):
        setting = source.setting()
        plans, listing = plan_attacks(cfg, setting, args.strength, aux, attacks)
        runner = AttackRunner(cfg, setting, aux, args.device, progress and args.workers == 1, state, attacks)
        # every batch first, through the batch source even when its jobs are done: its observation
        # (saved for a resume), its record (client.batches) and its ground truth
        batches = {b: source.batch(b) for b in range(n_batches)}
        jobs = _prepare_jobs(plans, batches, state, runner, aux, progress, attacks)
        _run_jobs(jobs, args, runner, threads, app_dir)
        applied = _apply_reuse(jobs)
    runner.complete(plans)
    for i, line in enumerate(line for line in listing if line.get("status") == "ran"):  # plans' lines, in order
        note = repeats.listing_note(i, applied, plans, n_batches)
        if note is not None:
            line["reused"] = note
    names = [record_name(b, i, plan) for b in range(n_batches) for i, plan in enumerate(plans)]
    return _Attacked(listing, [jobs.done[name][0] for name in names], {name: jobs.done[name][1] for name in names},
                     runner.preparations, batches)


@dataclass
class _Jobs:
    """The run's jobs: ``done`` maps each record's name to its (record, reconstruction), None while it is
    to be made; ``reused`` the records another plan's run gives (name -> (batch, ``repeats.Reuse``));
    ``pending`` the jobs to run. ``finished`` takes a job's results (into the state too)."""

    plans: list[AttackSection]
    batches: dict[int, tuple]
    state: StateFolder | None
    done: dict[str, Any]
    reused: dict[str, tuple[int, repeats.Reuse]]
    pending: list[Job]
    bar: Any = None

    def finished(self, job: Job, results: list[tuple[dict, torch.Tensor]]) -> None:
        for b, result in zip(job.bs, results):
            name = record_name(b, job.i, self.plans[job.i])
            fresh = self.done[name] is None
            self.done[name] = result
            if self.state is not None:
                save_job(self.state, name, *result)
            self.bar and fresh and self.bar.update(1)


def _prepare_jobs(plans: list[AttackSection], batches: dict[int, tuple], state: StateFolder | None,
                  runner: AttackRunner, aux: AuxData | None, progress: bool,
                  attacks: Mapping[str, type] | None) -> _Jobs:
    """Every (batch, plan) record: reused from another plan's run (``repeats``), finished by a killed run
    (read from the state), or to be made; the jobs that make the missing ones, and the progress bar."""
    n_batches = len(batches)
    jobs = plan_jobs(plans, n_batches, attacks)
    # a record that repeats another plan's run exactly is built from that run, never computed twice
    reuse = repeats.plan_reuse(plans, {b: obs for b, (obs, _, _) in batches.items()}, aux, runner.seed_of)
    reused = {record_name(b, i, plans[i]): (b, r) for (b, i), r in reuse.items()}
    done = {record_name(b, i, plan): load_job(state, record_name(b, i, plan))
            if state is not None and record_name(b, i, plan) not in reused else None
            for b in range(n_batches) for i, plan in enumerate(plans)}
    pending = [job for job in jobs if any(done[name] is None and name not in reused
                                          for name in (record_name(b, job.i, plans[job.i]) for b in job.bs))]
    bar = _bar(progress, len(done))
    bar and bar.update(sum(1 for v in done.values() if v is not None))
    return _Jobs(plans, batches, state, done, reused, pending, bar)


def _run_jobs(jobs: _Jobs, args: _Arguments, runner: AttackRunner, threads: int, app_dir: str | None) -> None:
    """The pending jobs: one after the other here, or side by side in worker processes (``workers``) or as
    Ray tasks, each with a runner of its own (no progress, no state: the results come back to ``finished``)."""
    pending, plans, batches = jobs.pending, jobs.plans, jobs.batches
    if (args.workers > 1 and len(pending) > 1) or (args.ray_jobs is not None and pending):
        worker_runner = AttackRunner(args.cfg, runner.setting, runner.aux, args.device, False, None, runner.attacks)
        context = RunContext(worker_runner, plans, batches)
        parallel = dict(threads=threads, app_dir=str(Path(app_dir).resolve()) if app_dir else None,
                        prepared=lambda i: runner.cache.entries_of(plans[i].name) or None,
                        on_prepared=lambda i, saved, info: runner.adopt_preparation(i, plans[i], saved, info),
                        on_done=jobs.finished)
        if args.ray_jobs is not None:
            args.ray_jobs.run(context, pending, workers=args.workers, device=args.device, **parallel)
        else:
            run_parallel(context, pending, workers=min(args.workers, len(pending)), **parallel)
    else:
        for job in pending:
            jobs.finished(job, runner.run(job.bs, job.i, plans[job.i], [batches[b] for b in job.bs]))


def _apply_reuse(jobs: _Jobs) -> dict[tuple[int, int], repeats.Reuse]:
    """The reused records built from the records they repeat; (batch, plan) -> ``Reuse`` of those built."""
    applied = {}
    for name, (b, r) in jobs.reused.items():
        if jobs.done[name] is None:  # else its own job ran (a chunk with other batches): its own record
            record, rec = jobs.done[record_name(b, r.of, jobs.plans[r.of])]
            jobs.done[name] = (repeats.reused_record(record, name, jobs.plans[r.plan], r), rec)
            applied[(b, r.plan)] = r
            jobs.bar and jobs.bar.update(1)
    jobs.bar and jobs.bar.close()
    return applied


def _measure_priors(cfg: RedTeamConfig, aux: AuxData | None, attacked: _Attacked) -> dict[int, list[dict]]:
    """Per batch, the per-sample metrics of the attacker's prior guess (``prior_guess``: no update used);
    each guess joins the reconstructions as ``b{b}-prior``. Empty without auxiliary data."""
    prior = prior_guess(aux)
    priors = {}
    if prior is not None:
        for b, (obs, x, y) in attacked.batches.items():
            guess = prior.expand_as(x).clone()
            priors[b] = measure(cfg, guess, x, y, obs.input_range)["per_image"]
            attacked.recon[f"b{b}-prior"] = guess
    return priors


def _judge(cfg: RedTeamConfig, attacked: _Attacked, priors: dict[int, list[dict]], lpips_available: bool,
           ) -> tuple[dict[str, Any], list[dict], str, list[str]]:
    """The population claim, the checks, the verdict, and the warnings on the claim's strength."""
    found = judge.leak_evidence(cfg, attacked.results, priors, {b: y for b, (_, _, y) in attacked.batches.items()})
    checks = judge.verdict_checks(cfg, attacked.results, lpips_available, found)
    return found, checks, judge.verdict_status(checks), (judge.evidence_warnings(cfg, found)
                                                         + judge.refusal_warnings(cfg, attacked.results, len(attacked.batches))
                                                         + judge.budget_warnings(cfg, attacked.results)
                                                         + judge.unadapted_warnings(cfg, attacked.results))


def _assemble_certificate(args: _Arguments, source: BatchSource, attacked: _Attacked, *, digest: str,
                          inputs: dict[str, str], threads: int, lpips: Any, priors: dict[int, list[dict]],
                          found: dict[str, Any], checks: list[dict], status: str, warnings: list[str]) -> Certificate:
    """The certificate of the run (its wall time read last)."""
    cfg, dev, ray_jobs = args.cfg, args.device, args.ray_jobs
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


def _bar(enabled: bool, total: int):
    """A progress bar over the run's records (None when not ``enabled``)."""
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="red team", unit="attack")
