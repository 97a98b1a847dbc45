"""The main process's side of the worker processes: a pool kept for a whole run (``WorkerPool``, one round
of jobs at a time: the sequential rule's rounds) and ``run_parallel``, one round of such a pool; the queue
of preparations and jobs, what each worker runs, and what comes back (``workers`` has the worker side, the
threads, and the fault model).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import torch

from guardfl.redteam.runtime.workers import Job, RemoteTraceback, RunContext, _Worker


def run_parallel(
    context: RunContext,
    jobs: list[Job],
    *,
    workers: int,
    threads: int,
    app_dir: str | None,
    prepared: Callable[[int], dict[str, Any] | None],
    on_prepared: Callable[[int, dict[str, Any], dict[str, Any]], None],
    on_done: Callable[[Job, list[tuple[dict, torch.Tensor]]], None],
) -> None:
    """Run ``jobs`` in ``workers`` processes (one :class:`WorkerPool` round). ``prepared(i)``: plan i's
    prepared states when the main process has them (a resumed run), else None (a preparation task runs
    first). ``on_prepared(i, states, info)`` and ``on_done(job, result)`` are called in the main process as
    results arrive. The first error cancels the rest and is raised here.

    A worker that dies, at any point (starting, loading the run, running a job, idle), raises
    :class:`WorkerError` naming the worker, its job and its exit signal; the others are ended and the main
    process never waits on a dead one (every wait includes each worker's exit sentinel). Workers ignore
    SIGINT: a Ctrl-C is the main process's ``KeyboardInterrupt``, which ends them too."""
    batches, bare = context.batches, RunContext(context.runner, context.plans, {})
    with WorkerPool(bare, workers=workers, threads=threads, app_dir=app_dir) as pool:
        pool.run(jobs, batches, prepared=prepared, on_prepared=on_prepared, on_done=on_done)


class WorkerPool:
    """``workers`` spawned processes kept for a whole run: the run's context (without batches) is sent
    once, when the first round needs the pool; each round sends its new batches, then its jobs
    (:meth:`run`). The sequential rule attacks round after round, and a pool per round would pay the
    workers' start (importing torch, loading the run) every time. Used as a context manager: leaving it
    ends the workers (with a grace period when every round finished cleanly)."""

    def __init__(self, context: RunContext, *, workers: int, threads: int, app_dir: str | None) -> None:
        self.context, self.workers, self.threads, self.app_dir = context, workers, threads, app_dir
        self.pool: list[_Worker] = []
        self.clean = True

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        clean = self.clean and exc[0] is None
        for worker in self.pool:
            worker.stop(grace=10 if clean else 0)
        self.pool = []

    def run(self, jobs: list[Job], batches: dict[int, tuple], *, prepared: Callable[[int], dict[str, Any] | None],
            on_prepared: Callable[[int, dict[str, Any], dict[str, Any]], None],
            on_done: Callable[[Job, list[tuple[dict, torch.Tensor]]], None]) -> None:
        """One round: ``batches`` (b -> observation, inputs, labels) sent to every worker, then ``jobs``
        (``run_parallel``'s contract)."""
        import multiprocessing
        from multiprocessing.connection import wait as wait_for

        self.clean = False
        self.context.batches.update(batches)  # the pickle of a pool started now carries them
        if not self.pool:
            mp = multiprocessing.get_context("spawn")
            _start_pool(self.pool, mp, self.workers, self.app_dir, self.threads, pickle.dumps(self.context))
        else:
            payload = pickle.dumps(batches)
            for worker in self.pool:
                try:
                    worker.conn.send(("batches", payload))  # read before the round's tasks (one pipe, in order)
                except OSError:
                    raise worker.died() from None
        states, waiting, queue = _first_queue(jobs, prepared)
        pool = self.pool
        while queue or any(w.task for w in pool):
            _hand_out(pool, queue, states, self.context)
            listening = _listening(pool)
            ready = wait_for(list(listening), timeout=30)
            # messages first: a worker that sent its result and then died is reported after it is recorded
            for handle in sorted(ready, key=lambda h: isinstance(h, int)):
                _receive(listening[handle], handle, states, waiting, queue, on_prepared, on_done)
            for worker in pool:  # a death its sentinel has not shown yet
                if worker.process.exitcode is not None:
                    raise worker.died()
        self.clean = True


def _first_queue(jobs: list[Job], prepared: Callable[[int], dict[str, Any] | None],
                 ) -> tuple[dict[int, dict[str, Any]], dict[int, list[Job]], list[tuple[str, Any]]]:
    """The prepared states the main process has (by plan), the jobs waiting for a preparation (by plan),
    and the first queue of tasks: the (long) preparations first, then the jobs that can run now."""
    states: dict[int, dict[str, Any]] = {}
    waiting: dict[int, list[Job]] = {}
    for job in jobs:
        if job.prepares and job.i not in states:
            ready = prepared(job.i)
            if ready is not None:
                states[job.i] = ready
            else:
                waiting.setdefault(job.i, []).append(job)
    # the long preparations first
    queue: list[tuple[str, Any]] = [("prepare", i) for i in waiting]
    queue += [("job", job) for job in jobs if not job.prepares or job.i in states]
    return states, waiting, queue


def _start_pool(pool: list[_Worker], mp, workers: int, app_dir: str | None, threads: int, payload: bytes) -> None:
    """Spawn ``workers`` workers into ``pool`` (the caller ends those started, whatever happens) and send
    each the run's pickle."""
    for number in range(1, workers + 1):
        pool.append(_Worker(mp, number, app_dir, threads))
    for worker in pool:
        try:
            worker.conn.send_bytes(payload)  # fails, never blocks, once the worker is dead: it alone reads
        except OSError:
            raise worker.died() from None


def _hand_out(pool: list[_Worker], queue: list[tuple[str, Any]], states: dict[int, dict[str, Any]],
              context: RunContext) -> None:
    """Give each idle worker that has loaded the run the next task of ``queue``."""
    for worker in pool:
        if worker.ready and worker.task is None and queue:
            kind, what = worker.task = queue.pop(0)
            task = ("prepare", what) if kind == "prepare" else ("job", what.bs, what.i, states.get(what.i))
            worker.doing = (f"running job {what.name}" if kind == "job" else
                            f"preparing attack {getattr(context.plans[what], 'name', what)} (plan {what})")
            try:
                worker.conn.send(task)
            except OSError:
                raise worker.died() from None


def _listening(pool: list[_Worker]) -> dict[Any, _Worker]:
    """What to wait on, by handle: every worker's exit sentinel, and the pipe of each that is busy or
    still loading the run."""
    listening = {}
    for worker in pool:
        listening[worker.process.sentinel] = worker
        if worker.task is not None or not worker.ready:
            listening[worker.conn] = worker
    return listening


def _receive(worker: _Worker, handle: Any, states: dict[int, dict[str, Any]], waiting: dict[int, list[Job]],
             queue: list[tuple[str, Any]], on_prepared: Callable[[int, dict[str, Any], dict[str, Any]], None],
             on_done: Callable[[Job, list[tuple[dict, torch.Tensor]]], None]) -> None:
    """What ``handle`` shows of ``worker``: its death (raised), its having loaded the run, a preparation's
    states (its plan's jobs then go to the front of ``queue``), a job's result, or an error (raised)."""
    if isinstance(handle, int):  # its exit sentinel
        raise worker.died()
    try:
        status, result, remote = worker.conn.recv()
    except (EOFError, OSError):
        raise worker.died() from None
    if status == "ready":
        worker.ready = True
        return
    kind, what = worker.task
    worker.task = None
    if status == "error":
        raise result from RemoteTraceback(remote)
    if kind == "prepare":
        saved, info = result
        states[what] = saved
        on_prepared(what, saved, info)
        queue[:0] = [("job", job) for job in waiting.pop(what)]
    else:
        on_done(what, result)
