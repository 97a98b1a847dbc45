"""One certificate's jobs as Ray tasks (issue 36): ``certify(..., backend=RayJobs(address))`` and
``guardfl redteam --ray-address ADDRESS``.

**What runs where.** The driver (the process that called ``certify``) builds the run as for local
processes (data, client observations, auxiliary data, the attack plan: ``workers.RunContext``), puts
it in Ray's object store **once** (``ray.put`` of its pickle) and passes the ObjectRef to every task
nested in a list, so that Ray does not fetch it per task: a Ray worker process loads the context the
first time it meets that ref and keeps it for the following jobs (one context per worker process).
Preparations run first (``prepare`` tasks); the prepared states they return are put in the store once
per plan, and the jobs of that plan, queued when it finishes, carry that ref (adopted once per worker
process). A task returns its result as one pickle (plain records and tensors), which the driver alone
writes to the state folder and into the certificate, exactly as with processes.

**Same certificate.** A job's seed depends only on (config seed, batch, plan) and each task runs with
the run's ``threads`` intra-op threads (set per task, put back after it: a Ray worker process runs many
tasks), so the certificate equals the local run's with the same ``threads``, in any order of completion
and on any number of nodes (timings and ``environment`` apart: ``certify.untimed``).

**Resources.** A task declares ``num_cpus = threads`` (the intra-op threads it uses), and on CUDA
``num_gpus = gpus_per_job`` (default 1; a fraction such as 0.25 lets four jobs share a GPU: choose it
by the attack's measured peak memory; Ray does not enforce GPU memory).

**Faults.** Jobs are deterministic and idempotent, so a task lost to a system failure (its worker
process or node died) is retried by Ray (``max_retries``, default 3), on another node if its node is
gone; only the jobs that were running there are redone. A job's own error (``AttackFailed``, a config
error) is not retried: it fails the run, as locally, with the worker's traceback as its cause. A job
lost more often than ``max_retries`` fails the run with one :class:`~guardfl.redteam.runtime.workers.WorkerError`
line; finished jobs are in the state folder, and ``--resume`` continues on any backend (the state folder
does not say which backend wrote it). The driver itself must survive: it holds the run context and
writes the state.

**Ctrl-C.** Every Ray call of the driver runs under ``ray_connection._sigint_deferred`` (short waits of
``POLL_S``): a Ctrl-C is never lost inside Ray and is raised within half a second; the driver then
cancels its tasks on a cluster, or stops the local instance it started.

**Nested.** Called inside a Ray task (a sweep point on Ray), ``RayJobs(None)`` uses that connection:
the point's jobs become tasks of the same cluster. Ray releases the CPU of a task blocked in
``ray.wait`` / ``ray.get``, so points waiting for their jobs do not starve them of CPUs on a small
cluster. A config that imports user code (``target.app_dir``, ``module:callable``) needs that code at the
same path on every node.
"""

from __future__ import annotations

import contextlib
import pickle
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from guardfl.errors import ConfigError
from guardfl.redteam.runtime.workers import Job, RemoteTraceback, RunContext, WorkerError, _run_task


@dataclass
class RayStats:
    """What a run on Ray cost the driver, for ``bench/bench_ray.py``: bytes it put in the object store
    (the context once, prepared states once per plan), bytes of results it fetched, seconds it spent
    outside its waits (submitting, fetching, unpickling: ``driver_seconds``; in the certificate's
    callbacks, which write the state folder: ``callback_seconds``)."""

    tasks: int = 0
    puts: int = 0
    put_bytes: int = 0
    fetched_bytes: int = 0
    driver_seconds: float = 0.0
    callback_seconds: float = 0.0
    start_seconds: float = 0.0  # connecting, or starting the local instance
    stop_seconds: float = 0.0  # disconnecting, or stopping the local instance
    wall_seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class RayJobs:
    """Run a certificate's jobs on Ray.

    ``address``: None (the Ray this process is connected to, else a new local instance), ``'local'`` (a
    new local instance with ``cpus`` CPUs; default: the certificate's ``workers``), ``'auto'`` (the
    cluster already running on this machine), ``host:port`` or ``ray://host:port`` (a cluster's head;
    an unreachable one is a one-line error). ``gpus_per_job``: GPUs a CUDA job holds (default 1; a
    fraction to share a GPU); ``max_retries``: retries of a job lost to a system failure."""

    name = "ray"

    def __init__(self, address: str | None = None, *, gpus_per_job: float | None = None, max_retries: int = 3) -> None:
        if address is not None and (not isinstance(address, str) or not address.strip()):
            raise ConfigError(f"ray_address: expected host:port, ray://host:port, 'auto' or 'local' (got {address!r})")
        if gpus_per_job is not None and not (isinstance(gpus_per_job, (int, float)) and 0 < gpus_per_job <= 8):
            raise ConfigError(f"gpus_per_job: expected a number in (0, 8] (got {gpus_per_job!r})")
        if not isinstance(max_retries, int) or isinstance(max_retries, bool) or not 0 <= max_retries <= 100:
            raise ConfigError(f"max_retries: expected an integer in [0, 100] (got {max_retries!r})")
        self.address = address
        self.gpus_per_job = gpus_per_job
        self.max_retries = max_retries
        self.stats = RayStats()
        self.cluster_cpus: int | None = None

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "address": self.address or "local", "cpus": self.cluster_cpus,
                "max_retries": self.max_retries, **({"gpus_per_job": self.gpus_per_job} if self.gpus_per_job else {})}

    def check(self) -> None:
        """A one-line error now (before the run builds anything) when the address is unreachable."""
        from guardfl.redteam.runtime.ray_connection import BackendError, ray_available, reachable

        if not ray_available():
            raise BackendError("--ray-address: ray is not installed (pip install 'guardfl[flower]' installs it)")
        if self.address is not None:
            why = reachable(self.address)
            if why is not None:
                raise BackendError(f"--ray-address: cannot reach the Ray cluster at {self.address} ({why}); check the "
                                   "address, or drop --ray-address to run on this machine's processes")

    def run(self, context: RunContext, jobs: list[Job], *, workers: int, threads: int, device: torch.device,
            app_dir: str | None, prepared: Callable[[int], dict[str, Any] | None],
            on_prepared: Callable[[int, dict[str, Any], dict[str, Any]], None],
            on_done: Callable[[Job, list[tuple[dict, torch.Tensor]]], None]) -> None:
        """``pool.run_parallel``'s contract on Ray: ``prepared(i)`` (a resumed run's states, else
        None: a preparation task runs first), ``on_prepared`` and ``on_done`` called in this process as
        results arrive; the first error cancels the rest and is raised here. One round of a :meth:`session`."""
        with self.session(workers=workers, device=device) as rounds:
            rounds.run(context, jobs, threads=threads, app_dir=app_dir, prepared=prepared, on_prepared=on_prepared,
                       on_done=on_done)

    @contextlib.contextmanager
    def session(self, *, workers: int, device: torch.device):
        """A connection kept for a whole run (the sequential rule's rounds: a local instance is started
        once, not per round); yields an object whose ``run(context, jobs, ...)`` runs one round (its own
        context in the store: the round's batches)."""
        from guardfl.redteam.runtime.ray_connection import Ray

        started = time.perf_counter()
        stats = self.stats = RayStats()  # this run's
        connection = Ray(workers, self.address)
        stats.start_seconds = time.perf_counter() - started  # connecting, or starting the local instance
        rounds = _Rounds(self, connection, stats, device)
        try:
            yield rounds
        finally:
            connection._refs.update({ref: None for ref in rounds.running})  # cancelled on a cluster; a local instance stops
            t_stop = time.perf_counter()
            connection.close()
            stats.stop_seconds = time.perf_counter() - t_stop
            stats.driver_seconds -= stats.callback_seconds  # reported apart
            stats.wall_seconds = time.perf_counter() - started


class _Rounds:
    """The rounds of one :meth:`RayJobs.session`: each a driver over its own context."""

    def __init__(self, jobs: RayJobs, connection, stats: RayStats, device: torch.device) -> None:
        self.jobs, self.connection, self.stats, self.device = jobs, connection, stats, device
        self.running: dict[Any, tuple[str, Any]] = {}

    def run(self, context: RunContext, jobs: list[Job], *, threads: int, app_dir: str | None,
            prepared: Callable[[int], dict[str, Any] | None],
            on_prepared: Callable[[int, dict[str, Any], dict[str, Any]], None],
            on_done: Callable[[Job, list[tuple[dict, torch.Tensor]]], None]) -> None:
        from guardfl.redteam.runtime.ray_connection import _sigint_deferred

        ray, stats = self.connection._ray, self.stats
        gpus = (self.jobs.gpus_per_job or 1.0) if self.device.type == "cuda" else 0
        resources = {"num_cpus": threads, "num_gpus": gpus, "max_retries": self.jobs.max_retries, "retry_exceptions": False}
        driver = _Driver(ray, stats, _sigint_deferred, context, resources, threads, app_dir)
        self.running = driver.running
        with _sigint_deferred():
            self.jobs.cluster_cpus = int(ray.cluster_resources().get("CPU", 0))
        tick = time.perf_counter()
        remote = ray.remote(_ray_task)
        _feasible(ray, threads, gpus)
        driver.submit_first(remote, jobs, prepared)
        tick = driver.collect(tick, on_prepared, on_done, self.jobs.max_retries)
        stats.driver_seconds += time.perf_counter() - tick


class _Driver:
    """One run's tasks as the driver sees them: the objects it puts in the store (counted in ``stats``),
    the tasks it submits and those running, the prepared states by plan, and the jobs waiting for one.
    ``deferred``: the context that holds a Ctrl-C until a Ray call returns (``_sigint_deferred``)."""

    def __init__(self, ray, stats: RayStats, deferred: Callable, context: RunContext, resources: dict[str, Any],
                 threads: int, app_dir: str | None) -> None:
        self.ray, self.stats, self.deferred = ray, stats, deferred
        self.context, self.resources, self.threads, self.app_dir = context, resources, threads, app_dir
        self.running: dict[Any, tuple[str, Any]] = {}
        self.states: dict[int, Any] = {}
        self.waiting: dict[int, list[Job]] = {}
        self.remote = self.context_ref = None

    def put(self, value: bytes):
        self.stats.puts += 1
        self.stats.put_bytes += len(value)
        with self.deferred():
            return self.ray.put(value)

    def submit_first(self, remote, jobs: list[Job], prepared: Callable[[int], dict[str, Any] | None]) -> None:
        """Put the context and the states a resumed run has; submit the (long) preparations first, then
        the jobs that can run now."""
        self.remote = remote
        self.context_ref = self.put(pickle.dumps(self.context))
        for job in jobs:
            if job.prepares and job.i not in self.states:
                ready = prepared(job.i)
                if ready is not None:
                    self.states[job.i] = self.put(pickle.dumps(ready))
                else:
                    self.waiting.setdefault(job.i, []).append(job)
        for i in self.waiting:  # the long preparations first
            self.submit("prepare", i)
        for job in jobs:
            if not job.prepares or job.i in self.states:
                self.submit("job", job)

    def submit(self, kind: str, what: Any) -> None:
        if kind == "prepare":
            task, name = ("prepare", what), f"prepare-{what}-{getattr(self.context.plans[what], 'name', what)}"
        else:
            ref = self.states.get(what.i)
            task, name = ("job", what.bs, what.i, None if ref is None else [ref]), what.name
        with self.deferred():
            options = self.remote.options(name=name, **self.resources)
            pending = options.remote([self.context_ref], task, self.threads, self.app_dir)
            self.running[pending] = (kind, what)
        self.stats.tasks += 1

    def collect(self, tick: float, on_prepared: Callable[[int, dict[str, Any], dict[str, Any]], None],
                on_done: Callable[[Job, list[tuple[dict, torch.Tensor]]], None], retries: int) -> float:
        """Hand each result to its callback as it arrives (a preparation's states are put and its plan's
        jobs submitted) until none runs; the time of the last arrival (driver time is counted from it)."""
        stats, running = self.stats, self.running
        while running:
            stats.driver_seconds += time.perf_counter() - tick
            ready: list = []
            while not ready:  # short waits: a Ctrl-C is ours to raise (ray_connection._sigint_deferred)
                with self.deferred():
                    ready, _ = self.ray.wait(list(running), num_returns=1, timeout=POLL_S)
            tick = time.perf_counter()
            ref = ready[0]
            kind, what = running.pop(ref)
            blob = _fetch(self.ray, ref, kind, what, retries)
            stats.fetched_bytes += len(blob)
            result = pickle.loads(blob)
            t_call = time.perf_counter()
            if kind == "prepare":
                saved, info = result
                on_prepared(what, saved, info)
                stats.callback_seconds += time.perf_counter() - t_call
                self.states[what] = self.put(pickle.dumps(saved))
                for job in self.waiting.pop(what):
                    self.submit("job", job)
            else:
                on_done(what, result)
                stats.callback_seconds += time.perf_counter() - t_call
        return tick


#: seconds of one ``ray.wait``: a Ctrl-C is raised at most this long after it arrives
POLL_S = 0.5


def _feasible(ray, cpus: int, gpus: float) -> None:
    """A one-line error, instead of tasks that wait forever, when no live node has ``cpus`` CPUs and
    ``gpus`` GPUs (an autoscaling cluster's future nodes are not known here)."""
    from guardfl.redteam.runtime.ray_connection import BackendError, _sigint_deferred

    with _sigint_deferred():
        nodes = [n.get("Resources") or {} for n in ray.nodes() if n.get("Alive")]
    if any(r.get("CPU", 0) >= cpus and r.get("GPU", 0) >= gpus for r in nodes):
        return
    largest = max(((r.get("CPU", 0), r.get("GPU", 0)) for r in nodes), default=(0, 0))
    need = f"{cpus} CPU(s)" + (f" and {gpus:g} GPU(s)" if gpus else "")
    fix = "--gpus-per-job or a cluster with GPUs" if gpus and largest[1] < gpus else "--threads"
    raise BackendError(f"ray: a job needs {need} on one node (--threads {cpus}{f', --gpus-per-job {gpus:g}' if gpus else ''}); "
                       f"the largest node has {largest[0]:g} CPU(s) and {largest[1]:g} GPU(s): lower {fix}")


def _fetch(ray, ref, kind: str, what: Any, retries: int) -> bytes:
    """A finished task's pickle; its job's own error raised as in the worker (cause: the remote
    traceback), or a :class:`WorkerError` line for a task that Ray lost more often than it retries."""
    from guardfl.redteam.runtime.ray_connection import _sigint_deferred

    label = f"job {what.name}" if kind == "job" else f"the preparation of plan {what}"
    try:
        with _sigint_deferred():
            return ray.get(ref)
    except ray.exceptions.RayTaskError as err:
        cause = getattr(err, "cause", None)  # the job's own exception (AttackFailed, ConfigError, ...)
        if isinstance(cause, BaseException) and not isinstance(cause, ray.exceptions.RayError):
            raise cause from RemoteTraceback(str(err))
        raise WorkerError(f"ray: {label} failed: {_line(err)}") from None
    except ray.exceptions.RayError as err:  # its worker or node died more often than max_retries, or cancelled
        raise WorkerError(f"ray: {label} was lost ({type(err).__name__}: {_line(err)}) after {retries} retr"
                          f"{'y' if retries == 1 else 'ies'}: its worker process or node died (a kill, the out-of-memory "
                          "killer, or code that ended the process); finished jobs are kept: continue with --resume") from None


def _line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]


# -- in a Ray worker process -----------------------------------------------------------------------
#: the run context this worker process loaded (its ref's id -> context) and the prepared states it adopted
_LOADED: dict[str, Any] = {}


def _ray_task(context_ref: list, task: tuple, threads: int, app_dir: str | None) -> bytes:
    """One job (or preparation) in a Ray worker: the run's context loaded once per worker process (the
    ref arrives nested, so Ray does not fetch it for every task), the plan's prepared states adopted once,
    ``threads`` intra-op threads for this task only; the result as one pickle."""
    import ray

    from guardfl.redteam.runtime.allocator import tune_malloc
    from guardfl.redteam.runtime.workers import torch_threads

    key = context_ref[0].hex()
    if _LOADED.get("key") != key:
        _LOADED.clear()  # one run's context per worker process: an earlier run's is dropped
        tune_malloc()
        with contextlib.suppress(RuntimeError):  # only settable before any inter-op work
            torch.set_num_interop_threads(1)
        if app_dir is not None and app_dir not in sys.path:
            sys.path.insert(0, app_dir)
        _LOADED.update(key=key, context=pickle.loads(ray.get(context_ref[0])), adopted=set())
    context: RunContext = _LOADED["context"]
    if task[0] == "job" and task[3] is not None:
        states_ref = task[3][0]
        if states_ref.hex() not in _LOADED["adopted"]:
            context.runner.cache.adopt(pickle.loads(ray.get(states_ref)))
            _LOADED["adopted"].add(states_ref.hex())
        task = (*task[:3], None)
    with torch_threads(threads):
        return pickle.dumps(_run_task(context, task))


def inside_ray_task() -> bool:
    """Whether this process runs a Ray task now (a sweep point on Ray): its certificate's jobs can then be
    tasks of the same cluster. Never imports Ray."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return False
    try:
        return ray.get_runtime_context().get_task_id() is not None
    except Exception:
        return False


def as_backend(backend: Any) -> RayJobs | None:
    """``certify``'s ``backend`` argument: None or 'processes' (this machine's processes, ``workers``),
    'ray' (Ray: the connected instance, else a new local one), or a :class:`RayJobs`."""
    if backend is None or backend == "processes":
        return None
    if backend == "ray":
        return RayJobs()
    if isinstance(backend, RayJobs):
        return backend
    raise ConfigError(f"backend: expected None, 'processes', 'ray' or a RayJobs (got {backend!r})")
