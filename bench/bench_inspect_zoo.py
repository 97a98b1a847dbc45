"""guardfl.inspect_model on the benign model zoo (``tests/benign_zoo.py``): false positives per check.

    .venv/bin/python bench/bench_inspect_zoo.py [--cache DIR] [--json out.json] [--only SUBSTRING] [--no-heavy]

Every zoo model is inspected as a deployed client inspects what it receives (``GuardedTrainer``, the Flower
mod): the received state against the client's own model of that architecture (``reference``), with the
client's first batch, at the default thresholds. A model is a false positive when the inspection refuses
it; each refusal is attributed to the checks whose reasons it gives (a reason's prefix), and each
remaining finding's reason is printed whole, so that whoever reads the table sees why it fired.

``--cache DIR`` keeps each built model (state dict, reference, batch) so that a second run re-inspects
without training. Prints one table (check, models examined, flagged, rate with its exact 95% upper bound)
and, with ``--json``, writes every model's verdict and its checks' headline values.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from guardfl import inspect_model  # noqa: E402
from guardfl.inspect_rates import check_of, upper_bound  # noqa: E402
from tests import benign_zoo as Z  # noqa: E402


def load_or_build(r, cache: Path | None):
    if cache is None:
        return Z.build(r)
    path = cache / (Z.name_of(r).replace("/", "_").replace(" ", "_") + ".pt")
    if path.exists():
        saved = torch.load(path, weights_only=False)
        model = Z.make(r["arch"], r["data"], 0)
        model.load_state_dict(saved["model"])
        ref = Z.make(r["arch"], r["data"], 10_000 + r["seed"])
        return Z.Benign(Z.name_of(r), r, model, ref, saved["batch"], saved["notes"])
    b = Z.build(r)
    cache.mkdir(parents=True, exist_ok=True)
    torch.save({"model": b.model.state_dict(), "batch": b.batch, "notes": b.notes}, path)
    return b


def headline(checks: dict) -> dict:
    """The values the table's statistics come from (JSON-friendly)."""
    out = {}
    pr = checks.get("parallel_rows", {})
    out["parallel_max_cos"] = pr.get("max_cos")
    out["parallel_layers"] = {k: {kk: v[kk] for kk in v if kk in ("max_cos", "rows", "null_cos", "excess")}
                              for k, v in pr.get("layers", {}).items()}
    iso = checks.get("isolation", {})
    if "layers" in iso:
        out["isolation"] = {k: {"isolated": v["isolated"], "by_pairs": v.get("by_pairs"), "judged": v.get("judged", True),
                                "baseline": iso.get("baseline", {}).get(k), "baseline_by_pairs": iso.get("baseline_by_pairs", {}).get(k)}
                            for k, v in iso["layers"].items()}
    sc = checks.get("shared_columns", {})
    out["shared_columns_max_cos"] = sc.get("max_cos")
    gc = checks.get("gradient_concentration", {})
    out["concentration"] = {k: gc.get(k) for k in ("sample_share", "class_share")}
    cf = checks.get("class_fishing", {})
    out["class_fishing"] = {k: cf.get(k) for k in ("zero_row_share", "rank_ratio", "bias_gap")}
    out["imprint"] = checks.get("imprint")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--only", default=None, help="only recipes whose name contains this")
    ap.add_argument("--heavy", action=argparse.BooleanOptionalAction, default=True, help="include ResNet-18")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.time()
    rows, flagged_by, examined = [], Counter(), Counter()
    recipes = [r for r in Z.recipes(heavy=args.heavy) if args.only is None or args.only in Z.name_of(r)]
    for i, r in enumerate(recipes):
        t0 = time.time()
        b = load_or_build(r, args.cache)
        t1 = time.time()
        result = inspect_model(b.model.state_dict(), b.reference, batch=b.batch)
        t2 = time.time()
        checks = sorted({check_of(reason) for reason in result.reasons})
        for c in checks:
            flagged_by[c] += 1
        for c in result.checks:
            if "skipped" not in result.checks[c]:
                examined[c] += 1
        rows.append({"name": b.name, "recipe": r, "ok": result.ok, "checks_fired": checks, "reasons": result.reasons,
                     "notes": b.notes, "headline": headline(result.checks), "build_s": t1 - t0, "inspect_s": t2 - t1})
        mark = "ok " if result.ok else "REFUSED"
        print(f"[{i + 1}/{len(recipes)}] {mark} {b.name} ({t1 - t0:.1f} s + {t2 - t1:.1f} s)"
              + ("" if result.ok else "\n      " + "\n      ".join(result.reasons)), flush=True)
    n = len(rows)
    refused = sum(not r["ok"] for r in rows)
    print(f"\n{n} benign models, {refused} refused: {refused / max(n, 1):.1%} (95% upper bound "
          f"{upper_bound(refused, n):.1%}), {time.time() - start:.0f} s\n")
    print("| check | models examined | refused by it | rate | 95% upper bound |")
    print("|---|---|---|---|---|")
    for c in sorted(set(examined) | set(flagged_by)):
        e = examined.get(c, n)
        print(f"| {c} | {e} | {flagged_by[c]} | {flagged_by[c] / max(e, 1):.1%} | {upper_bound(flagged_by[c], e):.1%} |")
    old = [r for r in rows if r["recipe"]["kind"] == "old12"]
    if old:
        print(f"\nthe old set of 12 (fc2, lenet, convnet x 4 seeds, SGD lr 0.05 momentum 0.9, 2 epochs of 1,024 CIFAR-10 "
              f"images): {sum(not r['ok'] for r in old)} of {len(old)} refused")
    if args.json:
        args.json.write_text(json.dumps({"models": n, "refused": refused, "flagged_by": dict(flagged_by),
                                         "examined": dict(examined), "rows": rows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
