"""``guardfl redteam --config PATH``: exit 0 CERTIFIED, 1 NOT CERTIFIED, 3 INCONCLUSIVE, 2 invalid config
or failure (no verdict).

Exit 0 means exactly: a certificate was written under ``--out`` and it says CERTIFIED. INCONCLUSIVE (3):
the claims were neither certified nor refuted within the budget; the certificate says how many more
updates would most likely decide, and ``--resume`` adds them. Everything else
(a bad config, an attack that failed, a worker process that died, user code that raised or called
``sys.exit``: 2; Ctrl-C: 130; SIGTERM: 143) exits non-zero with one line on stderr, and a failed run leaves
no verdict in ``--out``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from guardfl.redteam.cli.common import guarded, positive_int


def add_parser(sub) -> None:
    p = sub.add_parser(
        "redteam", help="attack a defended client and certify its settings",
        description="Attack a defended client and certify its settings: client updates are drawn at random from "
                    "the configured data and attacked round after round until the config's claims (leak rate below "
                    "certify.max_leak_rate, re-identification rate below certify.max_reid_rate) are decided by an "
                    "anytime-valid rule at certify.confidence, or the budget (certify.max_updates / max_samples / "
                    "max_seconds) runs out. Exit status: 0 a certificate was written and says CERTIFIED; 1 NOT "
                    "CERTIFIED; 3 INCONCLUSIVE (undecided within the budget: --resume adds the updates the certificate "
                    "says would most likely decide); 2 the run failed (no verdict; after a worker process died, continue "
                    "with --resume); 130 interrupted; 143 terminated (SIGTERM). "
                    "A config that names code (model.name or target.* as 'module:callable') imports and runs "
                    "that code: treat such configs as scripts.")
    p.add_argument("--config", required=True,
                   help="red-team YAML (see configs/); 'module:callable' references in it are code that runs")
    p.add_argument("--out", default="redteam-out", help="output folder (certificate.json, report.html, PNGs)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None, help="overrides the config's device")
    p.add_argument("--strength", choices=["auto", "quick", "paper"], default=None,
                   help="attack budgets: quick (fits 2 CPU cores), paper (published budgets), auto (paper on a GPU); "
                        "overrides the config's")
    p.add_argument("--resume", action="store_true",
                   help="continue a killed run (finished attacks are kept), or give a run that ended INCONCLUSIVE at "
                        "its budget the updates its certificate says would most likely decide")
    p.add_argument("--more", type=positive_int("--more"), default=None, metavar="N",
                   help="with --resume of an INCONCLUSIVE run: N more updates instead of the certificate's estimate")
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
                   help="attack at most about N private samples (overrides certify.max_updates / max_samples; the "
                        "certificate says the budget was overridden)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def _fraction(text: str) -> float:
    """An argparse type for --gpus-per-job: a number in (0, 8]."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value <= 8:
        raise argparse.ArgumentTypeError(f"--gpus-per-job: expected a number in (0, 8] (got {text!r})")
    return value


def run(args: argparse.Namespace) -> int:
    from guardfl.redteam.runtime.allocator import tune_malloc
    from guardfl.redteam.certification.run import certify

    tune_malloc()  # the command's own process (workers tune theirs): see allocator.py
    if args.gpus_per_job is not None and args.ray_address is None:
        print("error: --gpus-per-job: only with --ray-address", file=sys.stderr)
        return 2
    if args.more is not None and not args.resume:
        print("error: --more: only with --resume (more updates for a run that ended INCONCLUSIVE)", file=sys.stderr)
        return 2

    def call():
        backend = None
        if args.ray_address is not None:
            from guardfl.redteam.runtime.ray_backend import RayJobs

            backend = RayJobs(args.ray_address, gpus_per_job=args.gpus_per_job)
        return certify(args.config, out=args.out, device=args.device, resume=args.resume, progress=not args.quiet,
                       strength=args.strength, workers=args.workers, threads=args.threads, samples=args.samples,
                       backend=backend, more=args.more)

    cert, failed = guarded(call, args.debug, "verdict")
    if failed is not None:
        return failed
    if not (Path(args.out) / "certificate.json").is_file():  # exit 0 promises a written certificate
        print(f"error: no certificate was written to {args.out}", file=sys.stderr)
        return 2
    _print_summary(cert)
    print(f"{cert.verdict}  ({cert.wall_time_s:.0f}s, strength {cert.strength})  report: {args.out}/report.html")
    return exit_status(cert.verdict)


#: the command's exit status by verdict: only CERTIFIED is 0
EXIT_STATUS = {"CERTIFIED": 0, "NOT CERTIFIED": 1, "INCONCLUSIVE": 3}


def exit_status(verdict: str) -> int:
    """0 CERTIFIED, 1 NOT CERTIFIED, 3 INCONCLUSIVE (2 is a failed run: no verdict)."""
    return EXIT_STATUS[verdict]


def _print_summary(cert) -> None:
    """One line per check, the worst single samples, the population, DP-SGD's epsilon, the client's
    inspection, the warnings and the attacks not run or run once."""
    from guardfl.redteam.reports.certificate import inspection_line, rounds_line

    stop = (cert.evidence or {}).get("stop") or {}
    if stop:
        why = {"decided": "decided", "budget": "budget reached", "max_seconds": "time budget reached"}.get(stop["reason"], stop["reason"])
        print(f"  [info] {stop['updates']} client update(s) of {cert.config['client'].get('batch_size')} sample(s) "
              f"attacked, at most {stop['budget']} ({why}); the unit of every claim is the update")
    for c in cert.checks:
        status = "pass" if c["passed"] else "FAIL"
        if c["metric"] in ("leak_rate", "reid_rate"):
            status = {"CERTIFIED": "pass", "NOT CERTIFIED": "FAIL"}.get(c["status"], "open")
            print(f"  [{status}] {c['metric'].replace('_', ' ')}: {c['status']}: {c['note']} (rule: {c['rule']})")
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
        order = f" of its order shuffled by seed {population['shuffle']}" if population.get("shuffle") is not None else ""
        print(f"  [info] population: {population['source']} from offset {population['offset']}{order}, {population['size']} "
              f"samples; {population['drawn']} drawn at random (seed {population['seed']})")
    if cert.privacy and cert.privacy.get("epsilon") is not None:
        pv = cert.privacy
        print(f"  [info] DP-SGD spends epsilon {pv['epsilon']:.3g} at delta {pv['delta']:g} (noise multiplier "
              f"{pv['noise_multiplier']:.3g}, sample rate {pv['sample_rate']:.3g}, {pv['epochs']} epochs)")
    if (cert.client or {}).get("inspection"):
        server = [r for r in cert.results if r.get("threat", {}).get("server") == "malicious"]
        refused = sum(1 for r in server if (r.get("info") or {}).get("refused"))
        print(f"  [info] the client inspects every received model ({inspection_line(cert)}): refused {refused} of "
              f"{len(server)} malicious-server runs")
    if rounds_line(cert):
        print(f"  [info] {rounds_line(cert)}")
    if getattr(cert, "bound", None):
        from guardfl.redteam.certification.bound import summary_sentence

        print(f"  [bound] {cert.bound.get('status')}: {summary_sentence(cert.verdict, cert.bound)}")
    for w in cert.warnings:
        print(f"  [warn] {w}")
    skipped = [a for a in cert.attacks if a["status"] == "not applicable"]
    for a in skipped:
        print(f"  [n/a ] {a['attack']}: {a['reason']}")
    for a in cert.attacks:
        if a.get("reused"):
            print(f"  [once] {a['attack']}: {a['reused']['note']}")
