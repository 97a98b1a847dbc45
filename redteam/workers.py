"""Threads and worker processes for the red team's jobs: fast on an idle machine, robust on a busy one.

**Threads.** The red team's tensors are small (a LeNet, one 32x32 image, a few restarts). With two
intra-op threads every operator ends in a barrier, and when another process holds a core the barrier
waits for a descheduled thread: the same Inverting Gradients run drops from ~100 to ~1.4 iterations/s
next to one busy process. So a job gets **one intra-op thread** unless its model is large (>=
``LARGE_MODEL`` parameters, e.g. ResNet-18), where a matmul or convolution is big enough to split; then
``cores // workers``. Inter-op threads are 1 in workers (jobs are the parallelism).

**Workers.** Independent jobs (a chunk of private batches x attack, and the once-per-setting preparations such as
training the learned-inversion model) run in ``workers`` spawned processes. The main process builds the
run (data, client observations, auxiliary data, the attack plan) once and hands it to each worker as one
pickle; a worker returns plain records and tensors, and only the main process writes the state folder
and the certificate. A preparation is a job of its own; the jobs of a prepared attack are queued when it
finishes, carrying its state. Each job's seed depends only on (config seed, batch, plan), so for the same
``threads`` a run with N workers gives the same certificate as a sequential run (timings aside); with a
different thread count, results may differ in the last bits of floating point (reduction order).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

import torch

from guardfl.errors import GuardflError
from guardfl.redteam.allocator import tune_malloc

#: parameters from which a model's operators are large enough to use several intra-op threads
LARGE_MODEL = 2_000_000


class WorkerError(GuardflError, RuntimeError):
    """A worker process died (killed, out of memory, or user code that ended the process)."""


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, e.g. a container's or taskset's limit)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def default_workers(device: torch.device) -> int:
    """One worker per available core on the CPU; one process on a GPU (jobs share the device)."""
    return 1 if device.type == "cuda" else available_cores()


def job_threads(model_params: int, workers: int, cores: int | None = None) -> int:
    """Intra-op threads per job: 1 for small models (robust under load, and as fast idle), else the
    worker's share of the cores."""
    cores = cores or available_cores()
    if model_params < LARGE_MODEL:
        return 1
    return max(1, cores // max(1, workers))


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run with ``n`` intra-op threads, restoring the caller's setting afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# -- worker side ------------------------------------------------------------------------------------
@dataclass
class RunContext:
    """What a worker needs, built once by the main process: pickled as bytes and loaded after
    ``app_dir`` is on the worker's path (a user model class must be importable there)."""

    runner: Any  # certify._AttackRunner (config, setting, aux data, device), without a state folder
    plans: list[Any]
    batches: dict[int, tuple[Any, torch.Tensor, torch.Tensor]]  # b -> (observation, inputs, labels)


_CONTEXT: RunContext | None = None


def _init_worker(payload: bytes, app_dir: str | None, threads: int) -> None:
    global _CONTEXT
    tune_malloc()  # a guardfl process: keep the blocks every iteration reuses (allocator.py)
    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # only settable before any inter-op work
        torch.set_num_interop_threads(1)
    if app_dir is not None:
        sys.path.insert(0, app_dir)
    _CONTEXT = pickle.loads(payload)


def _prepare_task(i: int) -> tuple[dict[str, Any], dict[str, Any]]:
    ctx = _CONTEXT
    return ctx.runner.prepare_only(i, ctx.plans[i])


def _job_task(bs: tuple[int, ...], i: int, prepared: dict[str, Any] | None) -> list[tuple[dict, torch.Tensor]]:
    ctx = _CONTEXT
    if prepared:
        ctx.runner.cache.adopt(prepared)
    return ctx.runner.run(bs, i, ctx.plans[i], [ctx.batches[b] for b in bs])


# -- main side --------------------------------------------------------------------------------------
@dataclass
class Job:
    name: str
    bs: tuple[int, ...]  # the private batches it attacks (one, or a chunk for attacks that batch samples)
    i: int
    prepares: bool  # the plan has a once-per-setting preparation (its jobs wait for it)


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
    """Run ``jobs`` in ``workers`` processes. ``prepared(i)``: plan i's prepared states when the main
    process has them (a resumed run), else None (a preparation task runs first). ``on_prepared(i, states,
    info)`` and ``on_done(job, result)`` are called in the main process as results arrive. The first error
    cancels the rest and is raised here."""
    import multiprocessing

    payload = pickle.dumps(context)
    states: dict[int, dict[str, Any]] = {}
    waiting: dict[int, list[Job]] = {}
    for job in jobs:
        if job.prepares and job.i not in states:
            ready = prepared(job.i)
            if ready is not None:
                states[job.i] = ready
            else:
                waiting.setdefault(job.i, []).append(job)
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_init_worker, initargs=(payload, app_dir, threads))
    futures: dict[Future, tuple[str, Any]] = {}
    try:
        for i in waiting:  # the long preparations first
            futures[pool.submit(_prepare_task, i)] = ("prepare", i)
        for job in jobs:
            if not job.prepares or job.i in states:
                futures[pool.submit(_job_task, job.bs, job.i, states.get(job.i))] = ("job", job)
        while futures:
            done, _ = wait(futures, return_when=FIRST_COMPLETED)
            for future in done:
                kind, what = futures.pop(future)
                try:
                    result = future.result()
                except BrokenProcessPool:
                    raise WorkerError("a red-team worker process died (killed, out of memory, or code that ended "
                                      "the process); run with --workers 1 to see where") from None
                if kind == "prepare":
                    saved, info = result
                    states[what] = saved
                    on_prepared(what, saved, info)
                    for job in waiting.pop(what):
                        futures[pool.submit(_job_task, job.bs, job.i, saved)] = ("job", job)
                else:
                    on_done(what, result)
    except BaseException:
        for future in futures:
            future.cancel()
        for process in list(getattr(pool, "_processes", {}).values()):
            with contextlib.suppress(Exception):
                process.terminate()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
