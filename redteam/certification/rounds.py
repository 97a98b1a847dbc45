"""The rounds of a certification: the sequential rule's loop (``attack``) over client updates.

Each round (``plan.round_ends``) observes its updates through the batch source (saved for a resume), runs
the jobs neither finished nor reused (``_executor``: here, a worker pool kept for the run, or a Ray
session), builds the records that repeat another plan's run (``repeats``), measures the attacker's prior
guess and who the reconstructions re-identify (``reid``), and asks the judge whether the claims are
decided (``judge.decided``, anytime-valid: stopping there costs no error). The run stops then, or when the
budget runs out: ``certify.max_updates`` (the last round ends there) or ``certify.max_seconds`` (checked
before a round starts).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from guardfl.redteam.auxdata import AuxData
from guardfl.redteam.certification import judge, reid, repeats
from guardfl.redteam.certification.batches import BatchSource, prior_guess
from guardfl.redteam.certification.measure import measure
from guardfl.redteam.certification.plan import plan_attacks, plan_jobs, record_name, round_ends
from guardfl.redteam.certification.runner import AttackRunner
from guardfl.redteam.certification.state import load_job, save_job
from guardfl.redteam.config import AttackSection, RedTeamConfig
from guardfl.redteam.runtime.files import StateFolder
from guardfl.redteam.runtime.pool import WorkerPool
from guardfl.redteam.runtime.workers import Job, RunContext, torch_threads


@dataclass
class Attacked:
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


@dataclass
class _Rounds:
    """The state the rounds build up: every record made (``done``), every batch observed, the reused
    records applied, the prior's metrics, the re-identifications, the claims so far."""

    cfg: RedTeamConfig
    source: BatchSource
    plans: list[AttackSection]
    gallery: reid.Gallery | None
    prior: torch.Tensor | None
    done: dict[str, Any] = field(default_factory=dict)
    batches: dict[int, tuple] = field(default_factory=dict)
    applied: dict[tuple[int, int], Any] = field(default_factory=dict)
    priors: dict[int, list[dict]] = field(default_factory=dict)
    seen: dict[int, dict] = field(default_factory=dict)
    found: dict[str, Any] = field(default_factory=dict)

    def observe(self, lo: int, hi: int) -> dict[int, tuple]:
        """The round's batches, through the batch source even when their jobs are done: each one's
        observation (saved for a resume), its record (client.batches) and its ground truth."""
        fresh = {b: self.source.batch(b) for b in range(lo, hi)}
        self.batches.update(fresh)
        return fresh

    def record(self, jobs: "_Jobs", lo: int, hi: int) -> None:
        """A finished round: its records, the prior's metrics and the re-identifications of its batches,
        and the claims over every update so far."""
        self.applied.update(_apply_reuse(jobs))
        self.done.update(jobs.done)
        for b in range(lo, hi):
            self.priors.update(_prior_metrics(self.cfg, self.prior, b, self.batches[b]))
            if self.gallery is not None:
                recons = {plan.name: self.done[record_name(b, i, plan)][1] for i, plan in enumerate(self.plans)}
                self.seen[b] = reid.identify(self.gallery, {k: v for k, v in recons.items() if v is not None},
                                             self.source.drawn(b))
        results = [self.done[record_name(b, i, plan)][0] for b in range(hi) for i, plan in enumerate(self.plans)]
        labels = {b: y for b, (_, _, y) in self.batches.items()}
        self.found = judge.leak_evidence(self.cfg, results, self.priors, labels, self.seen)

    def outcome(self, n: int, listing: list[dict[str, Any]], preparations: dict[str, Any], stop: dict[str, Any]) -> Attacked:
        """The first ``n`` updates' records in order, the listing's reuse notes, the pictures the report
        shows beside the reconstructions (the prior guess; the faces the attacker named)."""
        for i, line in enumerate(line for line in listing if line.get("status") == "ran"):  # plans' lines, in order
            note = repeats.listing_note(i, self.applied, self.plans, n)
            if note is not None:
                line["reused"] = note
        names = [record_name(b, i, plan) for b in range(n) for i, plan in enumerate(self.plans)]
        recon = {name: self.done[name][1] for name in names}
        for b in range(n):
            if self.prior is not None:
                recon[f"b{b}-prior"] = self.prior.expand_as(self.batches[b][1]).clone()
            if b in self.seen:  # the faces the attacker named (re-identification)
                recon[f"b{b}-named"] = self.gallery.images[self.seen[b]["named"]].clone()
        return Attacked(listing, [self.done[name][0] for name in names], recon, preparations, self.batches,
                        self.priors, self.seen, self.found, stop)


def attack(args: Any, source: BatchSource, aux: AuxData | None, state: StateFolder | None, threads: int,
           app_dir: str | None, progress: bool, attacks: Mapping[str, type] | None, budget: int,
           gallery: reid.Gallery | None) -> Attacked:
    """Plan the attacks on batch 0's setting, then the rounds (module docstring) until the claims are
    decided or the budget runs out; ``args``: the run's checked arguments (``run._Arguments``)."""
    cfg = args.cfg
    with torch_threads(threads):
        setting = source.setting()
        plans, listing = plan_attacks(cfg, setting, args.strength, aux, attacks)
        runner = AttackRunner(cfg, setting, aux, args.device, progress and args.workers == 1, state, attacks)
        bar = _bar(progress, budget * len(plans))
        rounds = _Rounds(cfg, source, plans, gallery, prior_guess(aux))
        ends = round_ends(budget, judge.milestones(cfg))
        stop: dict[str, Any] = {"reason": "budget", "budget": budget, "rounds": ends}
        lo = 0
        with _executor(args, runner, plans, threads, app_dir) as execute:
            for hi in ends:
                if lo and cfg.certify.max_seconds is not None and time.time() - args.started >= cfg.certify.max_seconds:
                    stop["reason"] = "max_seconds"
                    break
                jobs = _prepare_jobs(plans, rounds.observe(lo, hi), state, runner, aux, bar, attacks)
                execute(jobs)
                rounds.record(jobs, lo, hi)
                lo = hi
                if judge.decided(cfg, rounds.found):
                    stop["reason"] = "decided"
                    break
        bar and bar.close()
    stop.update(updates=lo, samples=lo * cfg.client.n)
    runner.complete(plans)
    return rounds.outcome(lo, listing, runner.preparations, stop)


@contextlib.contextmanager
def _executor(args: Any, runner: AttackRunner, plans: list[AttackSection], threads: int, app_dir: str | None):
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




def _bar(enabled: bool, total: int):
    """A progress bar over the run's records (None when not ``enabled``)."""
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="red team", unit="attack")
