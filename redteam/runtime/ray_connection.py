"""This process's connection to Ray: a local instance (started and stopped whole) or a cluster's head,
every Ray call guarded so that a Ctrl-C is never lost inside Ray (``_sigint_deferred``), and the checks
before connecting (``ray_available``, ``reachable``). A sweep's ``Ray`` backend and a certificate's
``RayJobs`` (``ray_backend``) both run on it.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable
from typing import Any

from guardfl.errors import GuardflError

#: seconds of one ``ray.wait``: a Ctrl-C is raised at most this long after it arrives
POLL_S = 0.5


class BackendError(GuardflError, RuntimeError):
    """The chosen backend cannot run (Ray missing or unreachable, a worker process died)."""


class Ray:
    """Ray tasks of one CPU each: a local instance with ``workers`` CPUs, or the cluster at ``address``."""

    name = "ray"

    def __init__(self, workers: int, address: str | None) -> None:
        import logging
        import os

        os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # Ray 2.5x's FutureWarning on CPU-only tasks
        import ray

        self._ray = ray
        self.address = address
        self.workers = workers
        kwargs: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.ERROR, "log_to_driver": False,
                                  "configure_logging": True}
        local = address in (None, "local")  # a new local instance ('local': even where RAY_ADDRESS is set)
        if local:
            kwargs["num_cpus"] = workers
            # Ray renices its workers to 15: on a small busy host (2 cores, any other process at nice 0) they got
            # ~3% of a core and a run stalled for minutes. Here the workers are the work.
            os.environ.setdefault("RAY_worker_niceness", "0")
        if address is not None:
            kwargs["address"] = address
        self._owned = not ray.is_initialized()
        self._reaper = _Reaper() if self._owned and local else None
        term = _sigterm_handler()
        try:
            if self._owned:
                try:
                    with _sigint_deferred():  # a Ctrl-C while Ray starts is raised once it is up (never lost)
                        ray.init(**kwargs)
                finally:  # ray.init's own handler turns SIGTERM into sys.exit(15): the caller's decides
                    _sigterm_handler(term)
        except BaseException as err:  # ConnectionError, a version mismatch, a timeout; Ctrl-C while starting
            if self._owned:  # the processes a half-done ray.init started: left running, they crashed the exit
                _shutdown(ray, self._reaper)
            if isinstance(err, SystemExit) and err.code == 15 and callable(term):  # SIGTERM under ray.init's handler
                term(15, None)
            if not isinstance(err, Exception):
                raise
            line = (str(err).strip().splitlines() or [type(err).__name__])[0]
            where = "a local Ray instance" if local else f"the Ray cluster at {address}"
            raise BackendError(f"ray: could not start or reach {where}: {line[:200]}") from None
        self._refs: dict[Any, Any] = {}
        self._remote: dict[Callable, Any] = {}
        if not local or not self._owned:
            with _sigint_deferred():
                self.workers = int(ray.cluster_resources().get("CPU", workers))

    def submit(self, key: Any, fn: Callable, arg: Any) -> None:
        remote = self._remote.get(fn)
        if remote is None:
            remote = self._remote[fn] = self._ray.remote(num_cpus=1, max_retries=0)(fn)
        self._refs[remote.remote(arg)] = key

    def next_done(self) -> tuple[Any, Any]:
        ready: list = []
        while not ready:  # short waits, each with Ctrl-C recorded by us (``_sigint_deferred``), never by Ray
            with _sigint_deferred():
                ready, _ = self._ray.wait(list(self._refs), num_returns=1, timeout=POLL_S)
        ref = ready[0]
        key = self._refs.pop(ref)
        try:
            with _sigint_deferred():
                return key, self._ray.get(ref)
        except self._ray.exceptions.RayTaskError as err:
            cause = getattr(err, "cause", None)  # the job's own exception (ConfigError, AttackFailed, ...)
            if isinstance(cause, BaseException):
                raise cause from None
            raise BackendError(f"ray: a sweep job failed: {(str(err).strip().splitlines() or [''])[0][:200]}") from None
        except self._ray.exceptions.RayError as err:
            line = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise BackendError(f"ray: a sweep job was lost ({line[:200]}); rerun with --resume") from None

    def close(self) -> None:
        """Cancel the pending tasks and, for the instance this backend started, stop every Ray process
        (also after a Ctrl-C or a failure: nothing is left running, and the interpreter's exit does not
        meet a half-stopped Ray)."""
        with _sigint_deferred():
            if not self._owned:  # a cluster's tasks outlive this process unless cancelled
                for ref in self._refs:
                    with contextlib.suppress(Exception):
                        self._ray.cancel(ref, force=True)
            # an instance of our own is stopped whole: force-cancelling its tasks as well raced with their
            # replies and aborted Ray's core worker (a C++ check failure and backtrace, exit 1)
            self._refs.clear()
            if self._owned:
                _shutdown(self._ray, self._reaper)

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "workers": self.workers, "address": self.address or "local"}


_UNSET = object()


def _sigterm_handler(handler: Any = _UNSET) -> Any:
    """SIGTERM's handler; with ``handler``, set it back (main thread only; None, a handler set outside
    Python, restores the default)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None
    if handler is _UNSET:
        return signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_DFL if handler is None else handler)
    return handler


def _shutdown(ray, reaper: _Reaper | None) -> None:
    """``ray.shutdown()``, whatever state Ray is in, a second Ctrl-C included; then the local instance's
    processes that outlived it are ended (``reaper``)."""
    with _sigint_deferred():
        with contextlib.suppress(Exception):
            ray.shutdown()
        if reaper is not None:
            reaper.end_leftovers()


class _Reaper:
    """The processes a local Ray instance leaves behind, ended. Ray's raylet starts agents (dashboard,
    runtime env) and workers that it does not stop when it is itself killed: a Ctrl-C to the process group
    while Ray was starting left two agents running, SIGINT blocked and SIGTERM ignored. On Linux this
    process becomes a child subreaper while Ray runs, so every orphaned descendant becomes its child, and
    after ``ray.shutdown()`` the children that were not there before are given a few seconds, then
    SIGKILLed and reaped. Elsewhere it does nothing."""

    GRACE = 5.0  # seconds for Ray's own processes to exit after ray.shutdown()

    def __init__(self) -> None:
        self.active = _set_subreaper(True)
        self.before = _child_pids() if self.active else set()

    def end_leftovers(self) -> None:
        import os
        import signal
        import time

        if not self.active:
            return
        deadline = time.monotonic() + self.GRACE
        while True:  # Ray's own processes: a few seconds to exit (exited ones reaped)
            for pid in _child_pids() - self.before:
                with contextlib.suppress(ChildProcessError, OSError):
                    os.waitpid(pid, os.WNOHANG)
            if not {pid for pid in _child_pids() - self.before if _alive(pid)} or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        for _ in range(50):  # ending one reparents its children here (a raylet's agents): until none is left
            left = _child_pids() - self.before
            if not left:
                break
            for pid in left:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            for pid in left:
                with contextlib.suppress(ChildProcessError, OSError):
                    os.waitpid(pid, 0)
        _set_subreaper(False)
        self.active = False


def _set_subreaper(on: bool) -> bool:
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(36, int(on), 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except Exception:
        return False


def _stat(pid: str | int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _child_pids() -> set[int]:
    import os

    me = os.getpid()
    found = set()
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc"):
            if name.isdigit():
                fields = _stat(name)
                if fields is not None and int(fields[1]) == me:
                    found.add(int(name))
    return found


def _alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


@contextlib.contextmanager
def _sigint_deferred():
    """A Ctrl-C during the block is raised after it (once), so that a cleanup or a Ray call runs to its end.

    Robust against code inside the block that loses the signal: Ray's ``DeferSigint`` (``_raylet``) takes
    SIGINT over while it runs and drops it when an exception passes through its context, and a
    ``KeyboardInterrupt`` raised inside Ray's own code can be swallowed there (a Ctrl-C during ``ray.init``
    once let a sweep finish with exit 0). So the block runs with a handler that only records the signal
    (nothing is raised inside Ray), and with a wakeup fd: the interpreter's C-level handler writes every
    signal's number there whichever Python handler Ray has put in place, so a SIGINT that Ray recorded and
    then dropped is still seen. Both are put back after the block (a wakeup fd that was set before, e.g. an
    event loop's, gets the bytes read here)."""
    import os
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    os.set_blocking(write_end, False)
    before = signal.signal(signal.SIGINT, lambda *_: caught.append(True))
    try:
        old_fd = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    except (ValueError, OSError):
        old_fd = None
    error: BaseException | None = None
    try:
        yield
    except BaseException as err:  # raised after the handlers are back; a Ctrl-C during the block wins
        error = err
    finally:
        if old_fd is not None:
            with contextlib.suppress(ValueError, OSError):
                signal.set_wakeup_fd(old_fd)
        signal.signal(signal.SIGINT, signal.SIG_DFL if before is None else before)
        seen = b""
        with contextlib.suppress(OSError):
            while chunk := os.read(read_end, 512):
                seen += chunk
        os.close(read_end)
        os.close(write_end)
        if seen and old_fd is not None and old_fd >= 0:
            with contextlib.suppress(OSError):
                os.write(old_fd, seen)
    if (caught or signal.SIGINT in seen) and callable(before) and not isinstance(error, KeyboardInterrupt):
        raise KeyboardInterrupt from error
    if error is not None:
        raise error


def ray_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("ray") is not None


def reachable(address: str, timeout: float = 5.0) -> str | None:
    """None when ``host:port`` (or ``ray://host:port``) accepts a TCP connection within ``timeout``
    seconds, else why not. 'auto' (an already running local cluster) is left to Ray; 'local' starts one."""
    if address in ("auto", "local"):
        return None
    target = address.removeprefix("ray://")
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        return f"expected host:port, ray://host:port or 'auto' (got {address!r})"
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return None
    except OSError as err:
        return f"{type(err).__name__}: {err.strerror or err}"

