"""The sequential rule on simulated deployments of known leak rate (issue 64): how often it certifies
falsely, how often it decides, and how many updates it needs, beside the fixed-sample rule it replaced.

    python bench/bench_sequential.py [--claim 0.1] [--confidence 0.95] [--budget 76] [--runs 4000]
                                     [--json bench/results/sequential.json]

Each simulated run draws i.i.d. 0/1 updates (one sample each) at a true rate of 0.5x, 0.9x, 1.0x, 1.1x and
2x the claim, plus a clean deployment (rate 0), and applies, at the round ends the certification uses
(``plan.round_ends``):

- **sequential**: ``sequential.decide`` after every round, stopping once decided (the certificate's rule;
  refutation at the level one claim gets);
- **fixed**: Clopper-Pearson once, at the fixed sample size the old default used (the zero-leak count,
  ``evidence.samples_needed``: 29 for 10% at 95%), certified when the bound is below the claim;
- **fixed, peeked**: the same bound looked at after every round, stopping at the first certification
  (what a reviewer who re-runs with more samples until it passes does): its error is not controlled.

A "false CERTIFIED" is a certification of a deployment at or above the claim (rates >= 1.0x); "false NOT
CERTIFIED" a refutation of one below it. Printed as a markdown table; the JSON holds every figure.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from guardfl.redteam.certification import evidence, sequential  # noqa: E402
from guardfl.redteam.certification.plan import round_ends  # noqa: E402


def _tables(claim: float, alpha: float, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """certify[n, k], refute[n, k]: whether the sequential rule has decided after n updates with k leaks."""
    cert = np.zeros((budget + 1, budget + 1), dtype=bool)
    ref = np.zeros_like(cert)
    level = math.log(1 / alpha)
    for n in round_ends(budget, (sequential.zero_leak_updates(claim, alpha),)):
        for k in range(n + 1):
            xs = [1.0] * k + [0.0] * (n - k)
            cert[n, k] = sequential.log_capital_certify(xs, claim) >= level
            ref[n, k] = sequential.log_capital_refute(xs, claim) >= level
    return cert, ref


def simulate(rate: float, claim: float, confidence: float, budget: int, runs: int, seed: int) -> dict:
    alpha = 1 - confidence
    ends = round_ends(budget, (sequential.zero_leak_updates(claim, alpha),))
    cert, ref = _tables(claim, alpha, budget)
    fixed_n = evidence.samples_needed(claim, confidence)
    rng = np.random.default_rng(seed)
    draws = rng.random((runs, max(budget, fixed_n))) < rate
    out = {"rate": rate, "ratio": rate / claim}
    seq = {"certified": 0, "refuted": 0, "undecided": 0, "updates": []}
    peek = {"certified": 0, "updates": []}
    fixed = {"certified": 0}
    for row in draws:
        k = np.cumsum(row)
        for n in ends:
            if cert[n, k[n - 1]] and not ref[n, k[n - 1]]:
                seq["certified"] += 1
                seq["updates"].append(n)
                break
            if ref[n, k[n - 1]] and not cert[n, k[n - 1]]:
                seq["refuted"] += 1
                seq["updates"].append(n)
                break
        else:
            seq["undecided"] += 1
            seq["updates"].append(budget)
        fixed["certified"] += evidence.upper_bound(int(k[fixed_n - 1]), fixed_n, confidence) < claim
        for n in ends:
            if evidence.upper_bound(int(k[n - 1]), n, confidence) < claim:
                peek["certified"] += 1
                peek["updates"].append(n)
                break
        else:
            peek["updates"].append(budget)
    out["sequential"] = {"certified": seq["certified"] / runs, "not_certified": seq["refuted"] / runs,
                         "inconclusive": seq["undecided"] / runs, "mean_updates": float(np.mean(seq["updates"]))}
    out["fixed"] = {"certified": fixed["certified"] / runs, "updates": fixed_n}
    out["fixed_peeked"] = {"certified": peek["certified"] / runs, "mean_updates": float(np.mean(peek["updates"]))}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--claim", type=float, default=0.1)
    ap.add_argument("--confidence", type=float, default=0.95)
    ap.add_argument("--budget", type=int, default=None, help="default: the certificate's (2x the zero-leak updates)")
    ap.add_argument("--runs", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "sequential.json"))
    args = ap.parse_args(argv)
    alpha = 1 - args.confidence
    budget = args.budget or 2 * sequential.zero_leak_updates(args.claim, alpha)
    rows = [simulate(r * args.claim, args.claim, args.confidence, budget, args.runs, args.seed + i)
            for i, r in enumerate((0.0, 0.5, 0.9, 1.0, 1.1, 2.0))]
    print(f"claim {args.claim:g} at {args.confidence:.0%}; budget {budget} updates (rounds end at {round_ends(budget, (sequential.zero_leak_updates(args.claim, alpha),))}); "
          f"{args.runs} runs per rate; fixed rule: {rows[0]['fixed']['updates']} samples\n")
    print("| true rate | sequential: CERTIFIED | NOT CERTIFIED | INCONCLUSIVE | mean updates | fixed: CERTIFIED | "
          "fixed, peeked: CERTIFIED | mean updates |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        s, f, p = r["sequential"], r["fixed"], r["fixed_peeked"]
        flag = " (false)" if r["ratio"] >= 1 else ""
        print(f"| {r['rate']:.3g} ({r['ratio']:.1f}x) | {s['certified']:.3f}{flag} | {s['not_certified']:.3f}"
              f"{' (false)' if r['ratio'] <= 1 else ''} | {s['inconclusive']:.3f} | {s['mean_updates']:.1f} | "
              f"{f['certified']:.3f}{flag} | {p['certified']:.3f}{flag} | {p['mean_updates']:.1f} |")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"claim": args.claim, "confidence": args.confidence, "budget": budget,
                                           "runs": args.runs, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
