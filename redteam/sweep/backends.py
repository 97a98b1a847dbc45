"""Where a sweep's points run: Ray (a local instance, or a cluster at ``--ray-address``), local worker
processes, or this process. One interface: ``submit(key, fn, arg)`` and ``next_done() -> (key, result)``.

Every point is an independent job (``sweep.evaluate_point``, a picklable spec in, a plain record out), so
the backend changes only where and when it runs, never its result: each job sets its own thread count
and seeds. ``backend='auto'``: Ray when it is installed (a local instance over the available cores),
else local processes (one per core), else, for one worker, this process.

An unreachable ``--ray-address`` is an error of one line; only ``fallback=True`` (``--fallback-local``)
turns it into local processes, with a warning.
"""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from guardfl.redteam.runtime.allocator import tune_malloc
from guardfl.redteam.runtime.ray_connection import BackendError, Ray, ray_available, reachable

BACKENDS = ("auto", "ray", "processes", "sequential")


class Sequential:
    """This process, one job at a time: a job runs when its result is asked for, so that each result is
    recorded (and shown) before the next job starts."""

    name = "sequential"

    def __init__(self) -> None:
        self._queue: list[tuple[Any, Callable, Any]] = []

    def submit(self, key: Any, fn: Callable, arg: Any) -> None:
        self._queue.append((key, fn, arg))

    def next_done(self) -> tuple[Any, Any]:
        key, fn, arg = self._queue.pop(0)
        return key, fn(arg)

    def close(self) -> None:
        pass

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "workers": 1}


def _start_worker() -> None:
    """A sweep worker's start: Ctrl-C ignored (``workers.ignore_sigint``), the allocator tuned
    (guardfl's own process: allocator.py)."""
    from guardfl.redteam.runtime.workers import ignore_sigint

    ignore_sigint()
    tune_malloc()


class Processes:
    """Spawned local processes (a fresh interpreter each: no inherited thread pools or CUDA state)."""

    name = "processes"

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                                         initializer=_start_worker)
        self._futures: dict[Future, Any] = {}

    def submit(self, key: Any, fn: Callable, arg: Any) -> None:
        from guardfl.redteam.runtime.workers import sigint_held

        with sigint_held():  # a worker it spawns holds Ctrl-C until it ignores it (no traceback from one still starting)
            self._futures[self._pool.submit(fn, arg)] = key

    def next_done(self) -> tuple[Any, Any]:
        done, _ = wait(self._futures, return_when=FIRST_COMPLETED)
        future = next(iter(done))
        key = self._futures.pop(future)
        try:
            return key, future.result()
        except BrokenProcessPool:
            raise BackendError("a sweep worker process died (killed or out of memory); rerun with --resume") from None

    def close(self) -> None:
        """After the last result, the workers leave; with jobs still pending (Ctrl-C, SIGTERM, a failed
        point) they are terminated, not waited for: a point runs for minutes."""
        for future in self._futures:
            future.cancel()
        if self._futures:
            for process in list((getattr(self._pool, "_processes", None) or {}).values()):
                with contextlib.suppress(Exception):
                    process.terminate()
        self._pool.shutdown(wait=not self._futures, cancel_futures=True)

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "workers": self.workers}


def open_backend(backend: str, workers: int, address: str | None = None, fallback: bool = False,
                 warn: Callable[[str], None] = lambda line: None):
    """The backend to run a sweep's jobs on (see the module doc)."""
    if backend not in BACKENDS:
        raise BackendError(f"backend: unknown {backend!r}; allowed: {', '.join(BACKENDS)}")
    if address is not None and backend in ("processes", "sequential"):
        raise BackendError(f"--ray-address: given with backend {backend!r}; drop one of them")
    if address is not None:
        why = reachable(address)
        if why is not None:
            if not fallback:
                raise BackendError(f"--ray-address: cannot reach the Ray cluster at {address} ({why}); "
                                   "check the address, or add --fallback-local to run on this machine's processes")
            warn(f"the Ray cluster at {address} is unreachable ({why}); running on {workers} local process(es) "
                 "(--fallback-local)")
            return Processes(workers) if workers > 1 else Sequential()
    if backend == "ray" or (backend == "auto" and (address is not None or (workers > 1 and ray_available()))):
        if not ray_available():
            raise BackendError("backend: ray is not installed (pip install 'guardfl[flower]' installs it); "
                               "use --backend processes")
        try:
            return Ray(workers, address)
        except BackendError as err:
            if not fallback or address is None:
                raise
            warn(f"{err}; running on {workers} local process(es) (--fallback-local)")
            return Processes(workers) if workers > 1 else Sequential()
    if backend == "processes" or (backend == "auto" and workers > 1):
        return Processes(workers)
    return Sequential()
