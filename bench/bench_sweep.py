"""``guardfl sweep`` at benchmark size: a GradPrune-ratio sweep and a DP-SGD noise sweep on a small CNN
with the shared CIFAR-10 sample; the full grid on 1 worker vs on Ray over all cores, in one run, and
autotune (bisection) vs the full grid.

    python bench/bench_sweep.py [--values 8] [--batches 7] [--ig-iterations 200] [--train 2000]
                                [--test 500] [--epochs 5] [--skip-sequential] [--out bench/results/sweep]

Setting: the small ReLU CNN of bench_utility.py (3 conv layers, no BatchNorm, so DP-SGD can train it;
``bench_sweep:small_cnn``), FedSGD with one image per update, the images of
``../shared/data/cifar10-train-5k.npz`` (benchmark data only): the red team's private population is the first
500, the utility task trains on ``--train`` others and tests on ``--test`` more (disjoint, shuffled with a
fixed seed). Attacks: iDLG and Inverting Gradients (1 restart, ``--ig-iterations``), quick strength; the
claim: leak rate below 30% at 90% confidence over ``--batches`` images. Axes: GradPrune ratio and DP-SGD
noise multiplier (clipping norm 1), ``--values`` settings each.

Three sweeps of the same config: (1) the full grid on 1 worker (sequential, this process), (2) the
full grid on Ray with one worker per available core, (3) autotune on Ray. Prints wall times, the
speed-up of (2) over (1) (target: >= 1.6x on 2 cores), whether (1) and (2) gave the same points
(they must: each point is seeded by the sweep), and (3)'s evaluations and chosen setting against (1)'s
(target: the same choice with at most half the evaluations). Writes ``<out>.json``; the sweep folders
(with their report.html) under ``<out>/``. Not a test: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from torch import nn

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "cifar10-train-5k.npz"


def small_cnn(in_shape=(3, 32, 32), num_classes: int = 10) -> nn.Module:
    """bench_utility.py's CNN (ReLU, max-pooling, no BatchNorm): DP-SGD trains it as it is."""
    return nn.Sequential(
        nn.Conv2d(in_shape[0], 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
        nn.Flatten(), nn.Linear(64 * 16, num_classes),
    )


def config(args) -> dict:
    import numpy as np

    with np.load(DATA) as d:
        n = len(d["y"])
    # the npz is sorted by class: a shuffled copy (fixed seed) so that every part sees every class
    shuffled = Path(args.out) / "cifar10-shuffled.npz"
    if not shuffled.is_file():
        shuffled.parent.mkdir(parents=True, exist_ok=True)
        with np.load(DATA) as d:
            order = np.random.default_rng(0).permutation(n)
            np.savez(shuffled, x=d["x"][order], y=d["y"][order])
    # the utility task reads from image 500 on: a second copy without the private population
    utility = Path(args.out) / "cifar10-utility.npz"
    if not utility.is_file():
        with np.load(shuffled) as d:
            np.savez(utility, x=d["x"][500:], y=d["y"][500:])
    grid = args.values
    ratios = [0.5, 0.7, 0.8, 0.9, 0.95, 0.99, 0.995, 0.999][:grid] if grid <= 8 else None
    noise = [0.01, 0.03, 0.1, 0.3, 0.5, 1.0, 2.0, 4.0][:grid] if grid <= 8 else None
    return {
        "base": {
            "model": {"name": "bench_sweep:small_cnn", "num_classes": 10, "state": "default"},
            "data": {"source": "npz", "path": str(shuffled.resolve()), "limit": 500},
            "client": {"protocol": "fedsgd", "batch_size": 1, "dataset_size": 500},
            "attacks": ["idlg", {"name": "inverting_gradients", "budget": {"restarts": 1, "iterations": args.ig_iterations}}],
            "strength": "quick",
            "certify": {"max_ssim": 0.4, "max_leak_rate": 0.3, "confidence": 0.9, "max_updates": args.batches},
            "seed": 0,
        },
        "axes": [
            {"defense": {"kind": "gradprune"}, "param": "ratio", "label": "GradPrune ratio",
             **({"values": ratios} if ratios else {"range": {"start": 0.5, "stop": 0.999, "num": grid}})},
            {"defense": {"kind": "dpsgd", "max_grad_norm": 1.0}, "param": "noise_multiplier", "label": "DP-SGD noise multiplier",
             **({"values": noise} if noise else {"range": {"start": 0.01, "stop": 4.0, "num": grid, "scale": "log"}})},
        ],
        "utility": {"source": "npz", "path": str(utility.resolve()), "train": args.train, "test": args.test,
                    "epochs": args.epochs, "batch_size": 32, "lr": 0.05, "momentum": 0.9, "repeats": 1},
        "autotune": False,
        "seed": 0,
    }


def untimed(point: dict) -> dict:
    out = {k: v for k, v in point.items() if k not in ("seconds", "redteam_seconds", "report")}
    out["utility"] = {k: v for k, v in point["utility"].items() if "seconds" not in k and k != "time_ratio"}
    return out


def run(cfg: dict, out: Path, **kw) -> tuple[dict, float]:
    from guardfl.redteam.sweep.run import sweep

    if out.exists():
        shutil.rmtree(out)
    started = time.perf_counter()
    result = sweep(cfg, out=out, say=lambda line: print("   ", line, flush=True), **kw)
    return result.to_dict(), time.perf_counter() - started


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--values", type=int, default=8, help="settings per axis (2 axes)")
    ap.add_argument("--batches", type=int, default=7, help="private images attacked per setting")
    ap.add_argument("--ig-iterations", type=int, default=200)
    ap.add_argument("--train", type=int, default=2000)
    ap.add_argument("--test", type=int, default=500)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--workers", type=int, default=None, help="Ray workers (default: the available cores)")
    ap.add_argument("--skip-sequential", action="store_true", help="only the Ray sweeps (no speed-up figure)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "sweep"))
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "bench"))  # model.name bench_sweep:small_cnn, here and in every worker
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "bench"), os.environ.get("PYTHONPATH")]))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from guardfl.redteam.runtime.workers import available_cores

    workers = args.workers or available_cores()
    cfg = config(args)
    out = Path(args.out)
    report: dict = {"cores": available_cores(), "workers": workers, "args": vars(args)}
    grid = None
    if not args.skip_sequential:
        print(f"(1) full grid, 1 worker ({2 * args.values} settings + the undefended baseline)", flush=True)
        grid, seconds = run(cfg, out / "grid-sequential", backend="sequential", workers=1)
        report["sequential"] = {"seconds": seconds, "evaluations": grid["evaluations"]}
    print(f"(2) full grid, Ray on {workers} workers", flush=True)
    ray_grid, seconds = run(cfg, out / "grid-ray", backend="ray", workers=workers)
    report["ray"] = {"seconds": seconds, "evaluations": ray_grid["evaluations"]}
    print("(3) autotune, Ray", flush=True)
    tuned, seconds = run({**cfg, "autotune": True}, out / "autotune-ray", backend="ray", workers=workers)
    report["autotune"] = {"seconds": seconds, "evaluations": tuned["evaluations"]}
    reference = grid or ray_grid
    if grid is not None:
        report["speedup"] = report["sequential"]["seconds"] / report["ray"]["seconds"]
        report["identical_points"] = [untimed(p) for p in grid["points"]] == [untimed(p) for p in ray_grid["points"]]
    pick = lambda d: None if d["chosen"] is None else d["chosen"]["label"]  # noqa: E731
    report["chosen"] = {"grid": pick(reference), "autotune": pick(tuned)}
    report["per_axis"] = [{"axis": a["label"], "grid": a["weakest_certified"], "autotune": b["weakest_certified"],
                           "evaluated_autotune": len(b["evaluated"]), "of": len(a["values"])}
                          for a, b in zip(reference["axes"], tuned["axes"])]
    report["points"] = [{"label": p["label"], "verdict": p["verdict"], "worst_ssim": p["worst"].get("ssim"),
                         "leak_bound": p["leak_rate"]["upper_bound"] if p.get("leak_rate") else None,
                         "accuracy": p["utility"]["accuracy"], "drop": p["utility"]["accuracy_drop"],
                         "epsilon": p["utility"].get("epsilon"), "seconds": p["seconds"]} for p in reference["points"]]
    print()
    print(f"{'setting':34s} {'verdict':15s} {'worst SSIM':>10s} {'bound':>6s} {'accuracy':>8s} {'drop':>6s} {'epsilon':>8s} {'s':>5s}")
    for p in report["points"]:
        eps = f"{p['epsilon']:.3g}" if p["epsilon"] is not None else "-"
        ssim = f"{p['worst_ssim']:.3f}" if p["worst_ssim"] is not None else "-"
        bound = f"{p['leak_bound']:.2f}" if p["leak_bound"] is not None else "-"
        print(f"{p['label'][:34]:34s} {str(p['verdict']):15s} {ssim:>10s} {bound:>6s} {p['accuracy']:8.3f} "
              f"{100 * p['drop']:+6.1f} {eps:>8s} {p['seconds']:5.0f}")
    print()
    if grid is not None:
        print(f"full grid: 1 worker {report['sequential']['seconds']:.0f} s, Ray x{workers} {report['ray']['seconds']:.0f} s: "
              f"speed-up {report['speedup']:.2f}x over {grid['evaluations'] + 1} jobs (target >= 1.6x on 2 cores); "
              f"identical points: {report['identical_points']}")
    print(f"autotune: {tuned['evaluations']} of {tuned['grid_size']} settings in {report['autotune']['seconds']:.0f} s; "
          f"chosen {report['chosen']['autotune']!r} vs the grid's {report['chosen']['grid']!r} "
          f"(same: {report['chosen']['autotune'] == report['chosen']['grid']})")
    for row in report["per_axis"]:
        print(f"  {row['axis']}: weakest certified {row['grid']} (grid) / {row['autotune']} (autotune, "
              f"{row['evaluated_autotune']} of {row['of']} evaluated)")
    Path(f"{args.out}.json").write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {args.out}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
