"""What the ``redteam`` and ``sweep`` commands share: argument types, and running the command's work
with Ctrl-C, SIGTERM and failures turned into one line on stderr and an exit status."""

from __future__ import annotations

import argparse
import sys
import traceback

from guardfl.errors import GuardflError


def positive_int(flag: str, bounded: bool = False):
    """An argparse type: an integer >= 1; ``bounded``: at most ``certify.max_threads()`` (4 x the cores
    available to this process), for --threads and --workers."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"{flag}: expected an integer >= 1 (got {text!r})")
        if bounded:
            from guardfl.redteam.certification.plan import THREADS_PER_CORE, max_threads
            from guardfl.redteam.runtime.workers import available_cores

            if value > max_threads():
                raise argparse.ArgumentTypeError(f"{flag}: expected an integer in [1, {max_threads()}] ({THREADS_PER_CORE} "
                                                 f"x the {available_cores()} cores available) (got {text!r})")
        return value

    return parse


class Terminated(KeyboardInterrupt):
    """SIGTERM (a CI job's timeout, ``kill``): handled as Ctrl-C is (workers and Ray stopped, the run
    marked interrupted), reported as terminated, exit 143."""


_SIGTERM: list[int] = []  # set when SIGTERM arrived: Ray's calls turn any KeyboardInterrupt into a plain one


def _terminate(signum, frame) -> None:
    _SIGTERM.append(signum)
    raise Terminated


def guarded(call, debug: bool, what: str):
    """``(call(), None)``, or ``(None, exit status)`` with one line on stderr: 130 interrupted, 143
    terminated (SIGTERM; both times ``what`` can be continued with --resume), 2 for a bad config, a
    failed run (a worker process that died included), or user code that called ``sys.exit``; ``debug``
    adds the traceback. The ``redteam`` and ``sweep`` commands share it."""
    import signal
    import threading

    main = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, _terminate) if main else None
    _SIGTERM.clear()
    try:
        return call(), None
    except KeyboardInterrupt as err:
        if isinstance(err, Terminated) or _SIGTERM:
            print(f"terminated: no {what} (continue with --resume)", file=sys.stderr)
            return None, 143
        print(f"interrupted: no {what} (continue with --resume)", file=sys.stderr)
        return None, 130
    except (GuardflError, ValueError, FileNotFoundError, OSError) as err:
        if debug:
            traceback.print_exc()
        print(f"error: {err}", file=sys.stderr)
        return None, 2
    except SystemExit as err:  # user code that guardfl did not call through userref.calling
        print(f"error: the run's code called sys.exit({err.code!r}); no {what}", file=sys.stderr)
        return None, 2
    except Exception as err:  # unexpected failures still exit 2
        if debug:
            traceback.print_exc()
        print(f"error: {type(err).__name__}: {err} (run with --debug for the traceback)", file=sys.stderr)
        return None, 2
    finally:
        if main:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if before is None else before)  # None: set outside Python
