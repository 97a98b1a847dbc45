"""``guardfl redteam --config PATH``: exit 0 certified, 1 not certified, 2 invalid config or failure.

Exit 0 means exactly: a certificate was written under ``--out`` and it says CERTIFIED. Everything else
(a bad config, an attack that failed, a worker process that died, user code that raised or called
``sys.exit``: 2; Ctrl-C: 130; SIGTERM: 143) exits non-zero with one line on stderr, and a failed run leaves
no verdict in ``--out``.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

from guardfl.errors import GuardflError


def add_parser(sub) -> None:
    p = sub.add_parser(
        "redteam", help="attack a defended client and certify its settings",
        description="Attack a defended client and certify its settings: the private samples attacked are "
                    "drawn at random from the configured data, and the verdict is a population claim (the leak rate's "
                    "one-sided confidence bound below certify.max_leak_rate). Exit status: 0 a certificate was "
                    "written and says CERTIFIED; 1 NOT CERTIFIED or INSUFFICIENT EVIDENCE; 2 the run failed (no verdict; "
                    "after a worker process died, continue with --resume); 130 interrupted; 143 terminated (SIGTERM). "
                    "A config that names code (model.name or target.* as 'module:callable') imports and runs "
                    "that code: treat such configs as scripts.")
    p.add_argument("--config", required=True,
                   help="red-team YAML (see configs/); 'module:callable' references in it are code that runs")
    p.add_argument("--out", default="redteam-out", help="output folder (certificate.json, report.html, PNGs)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None, help="overrides the config's device")
    p.add_argument("--strength", choices=["auto", "quick", "paper"], default=None,
                   help="attack budgets: quick (fits 2 CPU cores), paper (published budgets), auto (paper on a GPU); "
                        "overrides the config's")
    p.add_argument("--resume", action="store_true", help="continue a killed run: finished attacks are kept")
    p.add_argument("--workers", type=positive_int("--workers", bounded=True), default=None,
                   help="processes running attacks side by side, at most 4 x the cores available (default: the cores "
                        "available to this process on a CPU, 1 on a GPU); the certificate does not depend on it")
    p.add_argument("--ray-address", default=None, metavar="ADDRESS",
                   help="run the attacks as tasks of a Ray cluster: host:port or ray://host:port (its head), 'auto' (the "
                        "cluster running on this machine) or 'local' (a new local instance of --workers CPUs); the "
                        "certificate is the local run's; lost jobs are retried; --resume works across backends")
    p.add_argument("--gpus-per-job", type=_fraction, default=None, metavar="G",
                   help="with --ray-address and a CUDA device: GPUs one attack holds (default 1; 0.25 lets four share a GPU)")
    p.add_argument("--threads", type=positive_int("--threads", bounded=True), default=None,
                   help="intra-op threads per attack, at most 4 x the cores available (default: 1 for small models, "
                        "robust on a busy machine; the worker's share of the cores for large ones)")
    p.add_argument("--samples", type=positive_int("--samples"), default=None,
                   help="attack about N private samples instead of the config's certify.batches (a quick look: the "
                        "certificate says the claim rests on the override; too few for the claim gives INSUFFICIENT "
                        "EVIDENCE, exit 1)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


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


def _fraction(text: str) -> float:
    """An argparse type for --gpus-per-job: a number in (0, 8]."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value <= 8:
        raise argparse.ArgumentTypeError(f"--gpus-per-job: expected a number in (0, 8] (got {text!r})")
    return value


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


def run(args: argparse.Namespace) -> int:
    from guardfl.redteam.runtime.allocator import tune_malloc
    from guardfl.redteam.certification.run import certify

    tune_malloc()  # the command's own process (workers tune theirs): see allocator.py
    if args.gpus_per_job is not None and args.ray_address is None:
        print("error: --gpus-per-job: only with --ray-address", file=sys.stderr)
        return 2

    def call():
        backend = None
        if args.ray_address is not None:
            from guardfl.redteam.runtime.ray_backend import RayJobs

            backend = RayJobs(args.ray_address, gpus_per_job=args.gpus_per_job)
        return certify(args.config, out=args.out, device=args.device, resume=args.resume, progress=not args.quiet,
                       strength=args.strength, workers=args.workers, threads=args.threads, samples=args.samples,
                       backend=backend)

    cert, failed = guarded(call, args.debug, "verdict")
    if failed is not None:
        return failed
    if not (Path(args.out) / "certificate.json").is_file():  # exit 0 promises a written certificate
        print(f"error: no certificate was written to {args.out}", file=sys.stderr)
        return 2
    for c in cert.checks:
        status = "pass" if c["passed"] else "FAIL"
        if c["metric"] == "leak_rate":
            print(f"  [{status}] leak rate: {c['note']} (rule: {c['rule']})")
            continue
        worst = c.get("worst")
        worst = f"{worst:.3f}" if isinstance(worst, float) else worst
        print(f"  [{status}] {c['metric']} {c.get('rule', '')}: worst {worst} {c.get('note', '')}".rstrip())
    for w in cert.worst:
        if w.get("worst") is not None:
            where = w["where"]
            print(f"  [info] worst single sample by {w['metric']}: {w['worst']:.3f} ({where['attack']}, batch {where['batch']}; "
                  f"limit there {where['threshold_here']:.3f}{', past it' if w['exceeds'] else ''})")
    population = cert.population
    if population:
        print(f"  [info] population: {population['source']} from offset {population['offset']}, {population['size']} "
              f"samples; {population['drawn']} drawn at random (seed {population['seed']})")
    if cert.privacy and cert.privacy.get("epsilon") is not None:
        pv = cert.privacy
        print(f"  [info] DP-SGD spends epsilon {pv['epsilon']:.3g} at delta {pv['delta']:g} (noise multiplier "
              f"{pv['noise_multiplier']:.3g}, sample rate {pv['sample_rate']:.3g}, {pv['epochs']} epochs)")
    if (cert.client or {}).get("inspection"):
        from guardfl.redteam.reports.certificate import inspection_line

        server = [r for r in cert.results if r.get("threat", {}).get("server") == "malicious"]
        refused = sum(1 for r in server if (r.get("info") or {}).get("refused"))
        print(f"  [info] the client inspects every received model ({inspection_line(cert)}): refused {refused} of "
              f"{len(server)} malicious-server runs")
    for w in cert.warnings:
        print(f"  [warn] {w}")
    skipped = [a for a in cert.attacks if a["status"] == "not applicable"]
    for a in skipped:
        print(f"  [n/a ] {a['attack']}: {a['reason']}")
    for a in cert.attacks:
        if a.get("reused"):
            print(f"  [once] {a['attack']}: {a['reused']['note']}")
    print(f"{cert.verdict}  ({cert.wall_time_s:.0f}s, strength {cert.strength})  report: {args.out}/report.html")
    return 0 if cert.certified else 1
