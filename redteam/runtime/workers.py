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
pickle, through a pipe that only the worker reads; a worker returns plain records and tensors, and only
the main process writes the state folder and the certificate. A preparation is a job of its own; the jobs of a prepared attack are queued when it
finishes, carrying its state. Each job's seed depends only on (config seed, batch, plan), so for the same
``threads`` a run with N workers gives the same certificate as a sequential run (timings aside); with a
different thread count, results may differ in the last bits of floating point (reduction order).

**Faults.** The main process never waits on a dead worker: every wait includes each worker's exit
sentinel, and a write to a dead worker's pipe fails. A worker that dies at any point (starting, loading
the run, in a job, idle) fails the run with one :class:`WorkerError` line (which worker, its job, its
signal; finished jobs are in the state folder, so ``--resume`` continues), and the others are ended.
Workers ignore SIGINT (they are spawned with it blocked and ignore it first thing, so one still importing
prints nothing, and the main process never loses a Ctrl-C that arrives while it spawns): a Ctrl-C is the
main process's, which ends them; a worker whose main process is gone (even SIGKILLed) exits.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from guardfl.errors import GuardflError
from guardfl.redteam.runtime.allocator import tune_malloc
from guardfl.redteam.runtime.limits import LARGE_MODEL  # noqa: F401  (re-exported)


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


def _exit_with_parent() -> None:
    """End this worker at once when the main process is gone (killed, even by SIGKILL): its spawn pipe,
    held open by the main process, then reads end-of-file. A job may run for minutes; nobody would read it."""
    import multiprocessing
    import threading
    from multiprocessing.connection import wait as wait_for

    parent = multiprocessing.parent_process()
    if parent is None or parent.sentinel is None:
        return

    def watch() -> None:
        with contextlib.suppress(Exception):
            wait_for([parent.sentinel])
        os._exit(0)

    threading.Thread(target=watch, name="guardfl-parent-watch", daemon=True).start()


def ignore_sigint() -> None:
    """A spawned process's first step: SIGINT ignored (the main process handles Ctrl-C and ends its
    workers), then unblocked, so a Ctrl-C held since the spawn (``sigint_held``) is discarded."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _worker_main(conn, app_dir: str | None, threads: int) -> None:
    """A worker's life: the run's pickle (bytes), then tasks until ``None`` or end-of-file. SIGINT is
    ignored (the main process handles Ctrl-C and ends its workers); any exception of a task is sent back."""
    ignore_sigint()
    _exit_with_parent()
    tune_malloc()  # a guardfl process: keep the blocks every iteration reuses (allocator.py)
    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # only settable before any inter-op work
        torch.set_num_interop_threads(1)
    if app_dir is not None:
        sys.path.insert(0, app_dir)
    context: RunContext | None = None
    broken: BaseException | None = None
    try:
        context = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return
    except BaseException as err:  # a user class that does not import here: every task reports it
        broken = err
    try:
        conn.send(("ready", None, None))
    except (EOFError, OSError):
        return
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        if task[0] == "batches":  # a new round's batches: no reply (its tasks follow on the same pipe)
            if context is not None:
                with contextlib.suppress(Exception):  # one that does not load fails its jobs (KeyError)
                    context.batches.update(pickle.loads(task[1]))
            continue
        try:
            if broken is not None:
                raise broken
            reply = ("ok", _run_task(context, task), None)
        except BaseException as err:  # the job's own error (AttackFailed, ConfigError, sys.exit in user code)
            reply = ("error", err, "".join(traceback.format_exception(err)))
        try:
            conn.send(reply)
        except (EOFError, OSError):
            return
        except Exception as err:  # an exception that does not pickle: its type and first line
            line = (str(reply[1]).strip().splitlines() or [""])[0]
            conn.send(("error", RuntimeError(f"{type(reply[1]).__name__}: {line}" if reply[0] == "error"
                                             else f"a job's result could not be sent back: {err}"), reply[2]))


class RemoteTraceback(GuardflError):
    """The traceback of a job's error in its worker (the ``__cause__`` of the error raised in the main
    process, shown by ``--debug``)."""

    def __str__(self) -> str:
        return f"\n\"\"\"\n{self.args[0]}\"\"\"" if self.args and self.args[0] else ""


def _run_task(ctx: RunContext, task: tuple) -> Any:
    if task[0] == "prepare":
        i = task[1]
        return ctx.runner.prepare_only(i, ctx.plans[i])
    _, bs, i, prepared = task
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


@contextlib.contextmanager
def sigint_held() -> Iterator[None]:
    """SIGINT blocked (held pending, never lost) while a worker is spawned. The blocked mask is inherited
    through fork and exec, so a Ctrl-C that reaches a worker still starting (importing torch) waits there
    until ``_worker_main`` ignores SIGINT and unblocks it (then it is discarded: no traceback in a worker),
    and the main process's own Ctrl-C is delivered as soon as the spawn returns. (Ignoring SIGINT in the
    main process around the spawn, as before, lost a Ctrl-C that arrived in that window: the run went on.)
    Only the main thread's mask is changed; elsewhere this does nothing. A terminal's Ctrl-C is sent to the
    process: another thread of the main process with SIGINT unblocked (one a library started earlier) may
    take it, and Python then raises ``KeyboardInterrupt`` in the main thread at once, inside the spawn:
    not lost either (a worker half started has ``daemon`` set and dies with its parent). multiprocessing's
    resource tracker is started first: the first spawn starts it, and its start unblocks SIGINT (CPython's
    ``ensure_running``), so the first worker was spawned with Ctrl-C deliverable (a CI run printed its
    ``KeyboardInterrupt`` traceback from ``site``)."""
    import threading

    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()  # started inside, it would unblock SIGINT before the worker's spawn
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


class _Worker:
    """One spawned worker and the main process's end of its pipe. The spawn itself carries only the
    pipe and two small arguments: the run's pickle goes through the pipe, which the worker alone reads,
    so a worker killed while reading it makes the write fail instead of blocking forever (a large
    ``ProcessPoolExecutor`` initializer argument is written to the spawn pipe while the main process
    still holds its read end: a worker killed before reading it all hung the run)."""

    def __init__(self, mp, number: int, app_dir: str | None, threads: int) -> None:
        self.number = number
        self.conn, child = mp.Pipe(duplex=True)
        self.process = mp.Process(target=_worker_main, args=(child, app_dir, threads),
                                  name=f"guardfl-worker-{number}", daemon=True)
        with sigint_held():
            self.process.start()
        child.close()
        self.ready = False  # it has loaded the run
        self.task: tuple[str, Any] | None = None  # what it runs now
        self.doing = ""  # the same in words

    def died(self) -> WorkerError:
        """The one-line error for this worker's death (its exit signal or status when known)."""
        self.process.join(timeout=2)  # its exit status, once the kernel has it
        code = self.process.exitcode
        if code is None:
            how = "its pipe closed"
        elif code < 0:
            with contextlib.suppress(ValueError):
                code = signal.Signals(-code).name
            how = f"killed by {code}" if isinstance(code, str) else f"killed by signal {-code}"
        else:
            how = f"exit status {code}"
        stage = self.doing if self.task is not None else "while idle" if self.ready else "while starting"
        return WorkerError(f"red-team worker {self.number} (pid {self.process.pid}) died {stage} ({how}: a kill, the "
                           "out-of-memory killer, or code that ended the process); finished jobs are kept: continue "
                           "with --resume (--workers 1 shows where code ends the process)")

    def stop(self, grace: float) -> None:
        """Ask it to leave, then end it: SIGTERM after ``grace`` seconds, SIGKILL if that does not do."""
        with contextlib.suppress(Exception):
            if self.process.is_alive() and grace > 0:
                self.conn.send(None)
        self.process.join(timeout=grace)
        for end in (self.process.terminate, self.process.kill):
            if self.process.exitcode is not None:
                break
            with contextlib.suppress(Exception):
                end()
            self.process.join(timeout=5)
        with contextlib.suppress(Exception):
            self.conn.close()

