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
from guardfl.redteam.attacks.base import resolve_device
from guardfl.redteam.auxdata import AuxData
from guardfl.errors import ConfigError
from guardfl.redteam import modality
from guardfl.redteam.certification import evidence, judge, reid, repeats
from guardfl.redteam.certification.batches import BatchSource, load_aux, prior_guess
from guardfl.redteam.certification.certificate import Certificate
from guardfl.redteam.certification.fingerprint import fingerprint
from guardfl.redteam.certification.measure import measure
from guardfl.redteam.certification.plan import (check_workers_threads, plan_attacks, plan_jobs, record_name, round_ends,
                                                resolve_strength, with_samples)
from guardfl.redteam.certification.runner import AttackRunner
from guardfl.redteam.certification.state import load_job, open_state, save_job
from guardfl.redteam.client.target import on_path
from guardfl.redteam.config import AttackSection, RedTeamConfig, load_config
from guardfl.redteam.modality.image import metrics
from guardfl.redteam.runtime import allocator
from guardfl.redteam.runtime.files import CERTIFICATE, StateFolder, atomic_write, mark_run, retract_verdict
from guardfl.redteam.runtime.ray_backend import as_backend
from guardfl.redteam.runtime.workers import (Job, RunContext, available_cores, default_workers, job_threads, WorkerPool,
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
    more: int | None = None,
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
    budget = _prepare_budget(cfg, state, resume, more)
    app_dir = cfg.target.app_dir if cfg.target is not None else None
    with on_path(app_dir):
        aux = load_aux(cfg)
        source = BatchSource(cfg, state, aux)
        gallery = _prepare_gallery(cfg, source, aux)
        threads = threads or job_threads(sum(p.numel() for p in source.model.parameters()), args.workers)
        warnings = args.override + judge.defense_warnings(cfg.defense, source.model)
        attacked = _attack(args, source, aux, state, threads, app_dir, progress, attacks, budget, gallery)
    lp = metrics.lpips_status(cfg.certify.lpips_weights)
    found, checks, status, cautions = _judge(cfg, attacked, lp.available)
    _save_budget(state, budget, attacked.stop, found, status)
    cert = _assemble_certificate(args, source, attacked, digest=digest, inputs=inputs, threads=threads, lpips=lp,
                                 priors=attacked.priors, found=found, checks=checks, status=status,
                                 warnings=warnings + cautions, gallery=gallery)
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


#: the state file that keeps a run's budget (and where it stopped) across resumes
BUDGET_FILE = "budget.json"


def _prepare_budget(cfg: RedTeamConfig, state: StateFolder | None, resume: bool, more: int | None) -> int:
    """The most updates this run attacks: the config's ``certify.max_updates``; a resumed run keeps the
    budget it had, and one that ended INCONCLUSIVE when its budget ran out gets more: ``more``, else the
    updates its certificate said would most likely decide (else as many again as it attacked)."""
    budget = cfg.certify.max_updates
    earlier = state.load_json(BUDGET_FILE) if state is not None and resume else None
    if earlier:
        budget = max(budget, int(earlier["budget"]))
        stop = earlier.get("stop") or {}
        if earlier.get("verdict") == evidence.INCONCLUSIVE and stop.get("reason") in ("budget", "max_seconds"):
            extra = more or earlier.get("more") or max(1, int(stop.get("updates", budget)))
            budget = max(budget, int(stop.get("updates", budget)) + int(extra))
    elif more is not None:
        raise ConfigError("more: only with --resume of a run that ended INCONCLUSIVE (there is no earlier run here)")
    if state is not None:
        state.save_json(BUDGET_FILE, {**(earlier or {}), "budget": budget, "finished": False})
    return min(budget, 100_000)


def _save_budget(state: StateFolder | None, budget: int, stop: dict[str, Any], found: dict[str, Any], verdict: str) -> None:
    """Where the run stopped, its verdict and how many more updates would most likely decide its claims
    (what a resume reads)."""
    if state is None:
        return
    more = [((found.get(name) or {}).get("more_updates") or {}).get("more") for name in judge.CLAIMS]
    state.save_json(BUDGET_FILE, {"budget": budget, "finished": True, "stop": stop, "verdict": verdict,
                                  "more": max((m for m in more if m), default=None)})


def _prepare_gallery(cfg: RedTeamConfig, source: BatchSource, aux: AuxData | None) -> reid.Gallery | None:
    """The re-identification gallery (``reid``): the population and the attacker's auxiliary images, for
    an image client whose population the red team draws from; None otherwise (then a re-identification
    claim is refused, one line)."""
    image = modality.of(cfg).name == "image"
    if source.x_all is None or not image:
        if cfg.certify.max_reid_rate is not None:
            why = "a text client" if not image else "a target that brings its own data (ClientApp / NVFlare job)"
            raise ConfigError(f"certify.max_reid_rate: re-identification is measured against a known population of "
                              f"images; this run attacks {why}; allowed: null here")
        return None
    obs_range = source.setting().input_range
    return reid.gallery(source.x_all, aux.images if aux is not None else None,
                        aux.ood if aux is not None else None, obs_range)


@dataclass
class _Attacked:
    """What the attacks gave: the certificate's ``attacks`` lines, the records and reconstructions (by
    record name, plan order within each batch), the preparations, every batch (observation, inputs,
    labels), the prior guess's metrics and the re-identification of each batch, the claims as the last
    round left them, and where the rounds stopped (``stop``)."""

    listing: list[dict[str, Any]]
    results: list[dict[str, Any]]
    recon: dict[str, torch.Tensor]
    preparations: dict[str, Any]
    batches: dict[int, tuple]
    priors: dict[int, list[dict]]
    reid: dict[int, dict]
    found: dict[str, Any]
    stop: dict[str, Any]


def _attack(args: _Arguments, source: BatchSource, aux: AuxData | None, state: StateFolder | None, threads: int,
            app_dir: str | None, progress: bool, attacks: Mapping[str, type] | None, budget: int,
            gallery: reid.Gallery | None) -> _Attacked:
    """Plan the attacks on batch 0's setting, then the rounds (``round_ends``): observe the round's
    batches, run its jobs neither finished nor reused, build the reused records, measure the prior guess
    and the re-identifications, and stop once the claims are decided (``judge.decided``), or at the budget
    (updates, or ``max_seconds`` before a round starts). Then the preparations, the listing's reuse notes
    and the records in order."""
    cfg = args.cfg
    with torch_threads(threads):
        setting = source.setting()
        plans, listing = plan_attacks(cfg, setting, args.strength, aux, attacks)
        runner = AttackRunner(cfg, setting, aux, args.device, progress and args.workers == 1, state, attacks)
        bar = _bar(progress, budget * len(plans))
        done, batches, applied, priors, seen = {}, {}, {}, {}, {}
        prior = prior_guess(aux)
        found: dict[str, Any] = {}
        ends = round_ends(budget, judge.milestones(cfg))
        stop = {"reason": "budget", "budget": budget, "rounds": ends}
        with _executor(args, runner, plans, threads, app_dir) as execute:
            lo = 0
            for hi in ends:
                if lo and cfg.certify.max_seconds is not None and time.time() - args.started >= cfg.certify.max_seconds:
                    stop["reason"] = "max_seconds"
                    break
                # every batch of the round first, through the batch source even when its jobs are done: its
                # observation (saved for a resume), its record (client.batches) and its ground truth
                batches.update({b: source.batch(b) for b in range(lo, hi)})
                jobs = _prepare_jobs(plans, {b: batches[b] for b in range(lo, hi)}, state, runner, aux, bar, attacks)
                execute(jobs)
                applied.update(_apply_reuse(jobs))
                done.update(jobs.done)
                for b in range(lo, hi):
                    priors.update(_prior_metrics(cfg, prior, b, batches[b]))
                    if gallery is not None:
                        seen[b] = reid.identify(gallery, {plan.name: done[record_name(b, i, plan)][1]
                                                          for i, plan in enumerate(plans)
                                                          if done[record_name(b, i, plan)][1] is not None}, source.drawn(b))
                results = [done[record_name(b, i, plan)][0] for b in range(hi) for i, plan in enumerate(plans)]
                found = judge.leak_evidence(cfg, results, priors, {b: y for b, (_, _, y) in batches.items()}, seen)
                lo = hi
                if judge.decided(cfg, found):
                    stop["reason"] = "decided"
                    break
        bar and bar.close()
    n = lo
    stop.update(updates=n, samples=n * cfg.client.n)
    runner.complete(plans)
    for i, line in enumerate(line for line in listing if line.get("status") == "ran"):  # plans' lines, in order
        note = repeats.listing_note(i, applied, plans, n)
        if note is not None:
            line["reused"] = note
    names = [record_name(b, i, plan) for b in range(n) for i, plan in enumerate(plans)]
    recon = {name: done[name][1] for name in names}
    if prior is not None:
        for b in range(n):
            recon[f"b{b}-prior"] = prior.expand_as(batches[b][1]).clone()
    for b in range(n):  # the faces the attacker named (re-identification), for the report
        if b in seen:
            recon[f"b{b}-named"] = gallery.images[seen[b]["named"]].clone()
    return _Attacked(listing, [done[name][0] for name in names], recon, runner.preparations, batches, priors, seen,
                     found, stop)


@contextlib.contextmanager
def _executor(args: _Arguments, runner: AttackRunner, plans: list[AttackSection], threads: int, app_dir: str | None):
    """Yields ``execute(jobs)``, which runs a round's pending jobs: one after the other here, or side by side
    in worker processes (``workers``; a pool kept for the whole run) or as Ray tasks (one connection for the
    run), each with a runner of its own (no progress, no state: the results come back to ``finished``)."""
    pool = rounds = None
    with contextlib.ExitStack() as stack:
        def execute(jobs: _Jobs) -> None:
            nonlocal pool, rounds
            pending = jobs.pending
            if not ((args.workers > 1 and len(pending) > 1) or (args.ray_jobs is not None and pending)):
                for job in pending:
                    jobs.finished(job, runner.run(job.bs, job.i, plans[job.i], [jobs.batches[b] for b in job.bs]))
                return
            callbacks = dict(prepared=lambda i: runner.cache.entries_of(plans[i].name) or None,
                             on_prepared=lambda i, saved, info: runner.adopt_preparation(i, plans[i], saved, info),
                             on_done=jobs.finished)
            worker_runner = AttackRunner(args.cfg, runner.setting, runner.aux, args.device, False, None, runner.attacks)
            app = str(Path(app_dir).resolve()) if app_dir else None
            if args.ray_jobs is not None:
                if rounds is None:
                    rounds = stack.enter_context(args.ray_jobs.session(workers=args.workers, device=args.device))
                rounds.run(RunContext(worker_runner, plans, jobs.batches), pending, threads=threads, app_dir=app, **callbacks)
                return
            if pool is None:
                pool = stack.enter_context(WorkerPool(RunContext(worker_runner, plans, {}),
                                                      workers=min(args.workers, len(pending)), threads=threads, app_dir=app))
            pool.run(pending, jobs.batches, **callbacks)

        yield execute


@dataclass
class _Jobs:
    """A round's jobs: ``done`` maps each record's name to its (record, reconstruction), None while it is
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
                  runner: AttackRunner, aux: AuxData | None, bar: Any,
                  attacks: Mapping[str, type] | None) -> _Jobs:
    """Every (batch, plan) record of a round: reused from another plan's run (``repeats``), finished by a
    killed run (read from the state), or to be made; the jobs that make the missing ones."""
    span = range(min(batches), max(batches) + 1)
    jobs = plan_jobs(plans, span, attacks)
    # a record that repeats another plan's run exactly is built from that run, never computed twice
    reuse = repeats.plan_reuse(plans, {b: obs for b, (obs, _, _) in batches.items()}, aux, runner.seed_of)
    reused = {record_name(b, i, plans[i]): (b, r) for (b, i), r in reuse.items()}
    done = {record_name(b, i, plan): load_job(state, record_name(b, i, plan))
            if state is not None and record_name(b, i, plan) not in reused else None
            for b in span for i, plan in enumerate(plans)}
    pending = [job for job in jobs if any(done[name] is None and name not in reused
                                          for name in (record_name(b, job.i, plans[job.i]) for b in job.bs))]
    bar and bar.update(sum(1 for v in done.values() if v is not None))
    return _Jobs(plans, batches, state, done, reused, pending, bar)


def _apply_reuse(jobs: _Jobs) -> dict[tuple[int, int], repeats.Reuse]:
    """The reused records built from the records they repeat; (batch, plan) -> ``Reuse`` of those built."""
    applied = {}
    for name, (b, r) in jobs.reused.items():
        if jobs.done[name] is None:  # else its own job ran (a chunk with other batches): its own record
            record, rec = jobs.done[record_name(b, r.of, jobs.plans[r.of])]
            jobs.done[name] = (repeats.reused_record(record, name, jobs.plans[r.plan], r), rec)
            applied[(b, r.plan)] = r
            jobs.bar and jobs.bar.update(1)
    return applied


def _prior_metrics(cfg: RedTeamConfig, prior: torch.Tensor | None, b: int, batch: tuple) -> dict[int, list[dict]]:
    """Batch ``b``'s per-sample metrics of the attacker's prior guess (``prior_guess``: no update used);
    nothing without auxiliary data."""
    if prior is None:
        return {}
    obs, x, _ = batch
    return {b: measure(cfg, prior.expand_as(x).clone(), x, batch[2], obs.input_range)["per_image"]}


def _judge(cfg: RedTeamConfig, attacked: _Attacked, lpips_available: bool,
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


def _assemble_certificate(args: _Arguments, source: BatchSource, attacked: _Attacked, *, digest: str,
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


def _bar(enabled: bool, total: int):
    """A progress bar over the run's records (None when not ``enabled``)."""
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="red team", unit="attack")
