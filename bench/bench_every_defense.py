"""Every defense kind against the whole red team: learned inversion next to the best optimisation attack.

    python bench/bench_every_defense.py [--rows sign,dpsgd] [--targets 8] [--label after] [--workers 1]

The setting of issue 35's measurement: the LeNet of Zhu et al. (wide U(-0.5, 0.5) init), FedSGD, one
CIFAR-10 image per update (batch 8 for the input encodings, whose k = 4 mixes need 4 distinct images; a
no-defense row at batch 8 beside them), quick strength (the certificates' CPU budget), labels known, the
defense configuration known (the certificate's strongest threat). Each defense kind runs at its default
setting, or where it has none the one the papers use (Gaussian sigma 0.1 and Laplace scale 0.1 as in Wu et
al.'s Table 1, GradPrune 0.9 as in Huang et al.'s Table 2; DP-SGD: noise multiplier 1.0, clip 1.0, as in
``bench_attacks.py redteam``; Inter-InstaHide: a public set of 500 other CIFAR-10 images).

Data: ``../shared/data/cifar10-train-5k.npz`` split per class into two npz files written under
``bench/results/every-defense/``: the attacker's auxiliary data (the first 450 images of every class) and
the private population (the last 50 of every class, 500 images, interleaved by class); the Inter-InstaHide
public set is taken from the auxiliary side's last 50 per class and excluded from the aux file, so the
three sets are disjoint. ``certify`` draws ``--targets`` private images from the population (seed 0), so
every row attacks the same targets. The claim is sized to the sample: with 8 images and none leaking, the
95% upper bound on the leak rate is 0.31, so ``max_leak_rate: 0.35`` (a weak claim, chosen so that a
verdict can be CERTIFIED at all with 8 targets; the leaked counts are printed too).

Prints, per row: the verdict, learned inversion's mean and worst (largest) SSIM over the targets, the best
optimisation attack's (DLG, iDLG, Inverting Gradients, GradInversion: the one with the largest worst-case
SSIM), the learned inversion's preparation time, or why an attack did not run. Writes
``bench/results/every-defense-LABEL.json``; with both ``before`` and ``after`` files present, prints the
verdicts side by side. Not a test: run it on a quiet machine (timings are per process, one worker).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "cifar10-train-5k.npz"
OUT = ROOT / "bench" / "results"
SPLIT = OUT / "every-defense"
OPTIMISATION = ("dlg", "idlg", "inverting_gradients", "gradinversion")
PUBLIC = SPLIT / "public.npz"

ROWS: dict[str, tuple[int, dict | None]] = {
    # name: (batch, defense config at its default setting)
    "none": (1, None),
    "gaussian": (1, {"kind": "gaussian", "sigma": 0.1}),
    "laplace": (1, {"kind": "laplace", "scale": 0.1}),
    "gradprune": (1, {"kind": "gradprune", "ratio": 0.9}),
    "sign": (1, {"kind": "sign"}),
    "outpost": (1, {"kind": "outpost"}),
    "soteria": (1, {"kind": "soteria"}),
    "graddefense": (1, {"kind": "graddefense"}),
    "dpsgd": (1, {"kind": "dpsgd", "noise_multiplier": 1.0, "max_grad_norm": 1.0, "epochs": 5}),
    "none (B=8)": (8, None),
    "mixup (B=8)": (8, {"kind": "mixup"}),
    "instahide intra (B=8)": (8, {"kind": "instahide"}),
    "instahide inter (B=8)": (8, {"kind": "instahide", "mode": "inter", "public": str(PUBLIC)}),
}


def split_data() -> tuple[Path, Path]:
    """aux (450 - 50 per class), public (50 per class), population (the last 50 per class), as npz files."""
    SPLIT.mkdir(parents=True, exist_ok=True)
    aux, pop = SPLIT / "aux.npz", SPLIT / "population.npz"
    if aux.is_file() and pop.is_file() and PUBLIC.is_file():
        return aux, pop
    d = np.load(DATA)
    x, y = d["x"], d["y"]
    by_class = [np.flatnonzero(y == c) for c in range(10)]
    take = lambda lo, hi: np.stack([idx[lo:hi] for idx in by_class], 1).reshape(-1)  # interleaved by class
    for path, idx in ((aux, take(0, 400)), (PUBLIC, take(400, 450)), (pop, take(450, 500))):
        np.savez(path, x=x[idx], y=y[idx])
    return aux, pop


def config(batch: int, defense: dict | None, targets: int, aux: Path, pop: Path) -> dict:
    return {
        "model": {"name": "lenet", "num_classes": 10, "state": "wide-init"},
        "data": {"source": "npz", "path": str(pop)},
        "aux": {"source": "npz", "path": str(aux)},
        "client": {"protocol": "fedsgd", "batch_size": batch, "dataset_size": 4000},
        "defense": defense,
        "attacks": "all",
        "strength": "quick",
        "certify": {"max_ssim": 0.4, "max_leak_rate": 0.35, "max_updates": max(1, targets // batch)},
        "seed": 0,
    }


def per_attack(cert) -> dict[str, dict]:
    """Per attack: mean and worst SSIM over the attacked images (the certificate's own metrics)."""
    out: dict[str, list[float]] = {}
    for r in cert.results:
        if r.get("metrics"):
            out.setdefault(r["attack"], []).extend(p["ssim"] for p in r["metrics"]["per_image"] if p.get("ssim") is not None)
    return {a: {"mean": statistics.fmean(v), "worst": max(v), "n": len(v)} for a, v in out.items() if v}


def lti_prep_seconds(cert) -> float | None:
    for key, prep in (cert.preparations or {}).items():
        if key.endswith("-learned_inversion") and isinstance(prep, dict):
            return prep.get("seconds")
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=None, help="comma-separated substrings of row names")
    ap.add_argument("--targets", type=int, default=8)
    ap.add_argument("--label", default="after", help="names the JSON (e.g. before / after)")
    ap.add_argument("--workers", type=int, default=1)
    args = ap.parse_args()
    from guardfl.redteam.certification.run import certify

    aux, pop = split_data()
    keys = [k.strip().lower() for k in args.rows.split(",")] if args.rows else None
    rows = []
    print(f"{'defense':24s} {'verdict':18s} {'LTI mean/worst':>15s} {'best optimisation':>28s} {'LTI prep':>9s}")
    for name, (batch, defense) in ROWS.items():
        if keys is not None and not any(k in name.lower() for k in keys):
            continue
        slug = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
        t0 = time.time()
        try:
            cert = certify(config(batch, defense, args.targets, aux, pop), out=OUT / "every-defense" / args.label / slug,
                           workers=args.workers)
        except Exception as err:  # a row that cannot run says why, the others still run
            rows.append({"defense": name, "error": f"{type(err).__name__}: {err}"})
            print(f"{name:24s} error: {type(err).__name__}: {str(err)[:160]}", flush=True)
            continue
        attacks = per_attack(cert)
        lti = attacks.get("learned_inversion")
        opt = max(((a, attacks[a]) for a in OPTIMISATION if a in attacks), key=lambda t: t[1]["worst"], default=None)
        skipped = {a["attack"]: a.get("reason") for a in cert.attacks if a.get("status") == "not applicable"}
        leak = cert.evidence["leak_rate"]
        row = {"defense": name, "batch": batch, "config": defense, "verdict": cert.verdict, "attacks": attacks,
               "leaked": f"{leak['leaked']}/{leak['samples']}",
               "learned_inversion": lti, "best_optimisation": None if opt is None else {"attack": opt[0], **opt[1]},
               "lti_prep_seconds": lti_prep_seconds(cert), "not_applicable": skipped, "seconds": time.time() - t0}
        rows.append(row)
        lti_s = "not applicable" if lti is None else f"{lti['mean']:.3f}/{lti['worst']:.3f}"
        opt_s = "-" if opt is None else f"{opt[0]} {opt[1]['mean']:.3f}/{opt[1]['worst']:.3f}"
        prep = row["lti_prep_seconds"]
        print(f"{name:24s} {cert.verdict + ' ' + row['leaked']:18s} {lti_s:>15s} {opt_s:>28s} {'' if prep is None else format(prep, '.0f') + ' s':>9s}"
              f"  ({row['seconds']:.0f} s)", flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"every-defense-{args.label}.json"
    path.write_text(json.dumps({"setting": "LeNet wide-init, CIFAR-10 per-class split, FedSGD, quick, labels known",
                                "targets": args.targets, "rows": rows}, indent=1, default=str))
    print(f"wrote {path}")
    before, after = OUT / "every-defense-before.json", OUT / "every-defense-after.json"
    if before.is_file() and after.is_file():
        b = {r["defense"]: r for r in json.loads(before.read_text())["rows"]}
        print(f"\n{'defense':24s} {'before':18s} {'after':18s}")
        for r in json.loads(after.read_text())["rows"]:
            print(f"{r['defense']:24s} {b.get(r['defense'], {}).get('verdict', '-'):18s} {r.get('verdict', r.get('error', '-'))}")


if __name__ == "__main__":
    main()
