"""``guardfl sweep --config PATH``: exit 0 a setting certified (the chosen one written), 1 none did,
2 invalid config or failure (one line on stderr), 130 interrupted, 143 terminated (SIGTERM); the
sweep's processes (a local Ray instance's included) are stopped in every case."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    from guardfl.redteam.cli.common import positive_int

    p = sub.add_parser(
        "sweep", help="sweep defense settings: the least accuracy loss that still certifies",
        description="Red-team and train the client at every setting of the sweep's axes (or bisect each monotone "
                    "axis with autotune), choose the certified setting with the least accuracy drop, and write "
                    "sweep.json, tradeoff.png, report.html and chosen-defense.yaml under --out. Points run on Ray (a "
                    "local instance, or --ray-address), else local processes. Exit status: 0 a setting certified; 1 "
                    "none did; 2 the sweep failed; 130 interrupted; 143 terminated (SIGTERM).")
    p.add_argument("--config", required=True, help="sweep YAML (see configs/sweep-default.yaml)")
    p.add_argument("--out", default="sweep-out", help="output folder (points/<id>/ hold each red-team run)")
    p.add_argument("--backend", choices=["auto", "ray", "processes", "sequential"], default="auto",
                   help="where points run (auto: Ray when installed and more than one worker, else processes)")
    p.add_argument("--workers", type=positive_int("--workers"), default=None, help="points side by side (default: the cores available)")
    p.add_argument("--threads", type=positive_int("--threads", bounded=True), default=None,
                   help="intra-op threads per point, at most 4 x the cores available (default 1; results do not "
                        "depend on --workers for a given value)")
    p.add_argument("--ray-address", default=None, help="an existing Ray cluster (host:port, ray://host:port or auto)")
    p.add_argument("--fallback-local", action="store_true",
                   help="when --ray-address cannot be reached, run on local processes instead of failing")
    p.add_argument("--resume", action="store_true", help="reuse finished points (same key) and continue unfinished ones")
    p.add_argument("--strength", choices=["auto", "quick", "paper"], default=None, help="overrides the base config's")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None, help="overrides the base config's")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from guardfl.redteam.runtime.allocator import tune_malloc
    from guardfl.redteam.cli.common import guarded
    from guardfl.redteam.sweep.run import sweep

    tune_malloc()  # the command's own process (workers tune theirs): see allocator.py

    result, failed = guarded(lambda: sweep(args.config, out=args.out, backend=args.backend, workers=args.workers,
                                           threads=args.threads, ray_address=args.ray_address,
                                           fallback_local=args.fallback_local, resume=args.resume,
                                           strength=args.strength, device=args.device, progress=not args.quiet),
                             args.debug, "sweep result")
    if failed is not None:
        return failed
    for w in result.warnings:
        print(f"  [warn] {w}")
    data = result.to_dict()
    for a in data["axes"]:
        print(f"  [axis] {a['label']}: evaluated {len(a['evaluated'])} of {len(a['values'])}; weakest certified: "
              f"{a['weakest_certified'] if a['weakest_certified'] is not None else 'none'}")
    c = result.chosen
    if c is None:
        print(f"NO SETTING CERTIFIED  ({result.wall_time_s:.0f}s)  report: {args.out}/report.html")
        return 1
    print(f"CHOSEN {c['label']}: {c['verdict']}, accuracy {c['utility']['accuracy']:.3f} "
          f"(drop {100 * c['utility']['accuracy_drop']:+.1f} points)  ({result.wall_time_s:.0f}s)  "
          f"defense: {args.out}/chosen-defense.yaml  report: {args.out}/report.html")
    return 0
