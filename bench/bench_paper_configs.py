"""The shipped paper configs at paper strength: wall time, peak GPU memory, and the certificate's worst-case
metrics next to the papers' figures (issue 14, "GPU").

    python bench/bench_paper_configs.py [CONFIG ...] [--device cuda] [--cifar-npz PATH] [--scale 1]
                                        [--workers 1] [--json bench/results/paper_configs.json]

Default configs: ``configs/papers/huang2021-*.yaml`` that name ``device: cuda`` (the ResNet-18 rows of Huang et al.
2021, Table 2) and ``configs/papers/outpost2024-scenario*.yaml`` (Wang et al. 2024, Table III). Each runs through
``certify`` exactly as ``guardfl redteam --config X --strength paper`` runs it (same plan, budgets, seeds,
metrics), in this process, so ``torch.cuda.max_memory_allocated`` is the run's peak.

``--cifar-npz PATH``: an offline machine has no torchvision CIFAR-10; the configs' ``source: cifar10``
(private data and the attacker's auxiliary data) then read this npz (``x`` uint8 NHWC, ``y``), e.g. the
5,000-image sample ``../shared/data/cifar10-train-5k.npz``. The auxiliary ``offset``/``limit`` are kept
and cut to the file (the outpost configs' aux 1,000..6,000 becomes 1,000..5,000).

``--scale F`` (< 1): a **probe**, not a verdict: every attack's iterations (and the learned inversion's
epochs) are multiplied by F. The table then gives the measured time and the projection to paper strength
(time / F for the attack jobs; preparations and client simulation are not scaled, so the projection is an
upper bound). Probe rows are labelled as such and their metrics are not the papers' comparison.

The papers' figures. Huang et al. 2021, Table 2 (ResNet-18, CIFAR-10, 50 images, their strongest attack):
LPIPS mean and best (the worst case for privacy); guardfl's certificate reports LPIPS only where AlexNet's
ImageNet weights are present (``certify.lpips_weights``), and SSIM always. Wang et al. 2024 (Outpost),
Table III: SSIM of DLG and csDLG (= Inverting Gradients) against Outpost, "the worst defense result in 10
trials" (the best reconstruction); their CIFAR-10 rows are scenario 3 (n=1, B=1) and 4 (n=16, B=16); their
n=2 row is EMNIST. They use a wide initialisation, our outpost configs PyTorch's default one.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results"

#: the papers' figures for each shipped config: (metric, value, where)
PAPER = {
    "huang2021-gradprune-0.99-b1": "LPIPS mean 0.52, best 0.32 (Table 2, B=1, GradPrune p=0.99)",
    "huang2021-gradprune-0.9-b16": "LPIPS mean 0.51, best 0.31 (Table 2, B=16, GradPrune p=0.9)",
    "huang2021-gradprune-0.9-b32": "LPIPS mean 0.52, best 0.31 (Table 2, B=32, GradPrune p=0.9)",
    "huang2021-instahide-k4-b16": "LPIPS mean 0.62, best 0.41 (Table 2, B=16, Intra-InstaHide k=4)",
    "huang2021-instahide-k4-prune0.9-b32": "LPIPS mean 0.73, best 0.65 (Table 2, B=32, p=0.9 + Intra-InstaHide k=4)",
    "outpost2024-scenario1": "SSIM DLG 0.021, csDLG 0.034 (Table III, CIFAR-10 n=1 B=1, Outpost)",
    "outpost2024-scenario2": "SSIM DLG 0.064, csDLG 0.038 (Table III, n=2 B=1; EMNIST in the paper)",
    "outpost2024-scenario3": "SSIM DLG 0.017, csDLG 0.031 (Table III, CIFAR-10 n=16 B=16, Outpost)",
}


def default_configs() -> list[Path]:
    from guardfl.yamlio import load_yaml

    huang = [p for p in sorted((ROOT / "configs" / "papers").glob("huang2021-*.yaml")) if load_yaml(p).get("device") == "cuda"]
    return huang + sorted((ROOT / "configs" / "papers").glob("outpost2024-scenario*.yaml"))


def rehome_cifar(cfg: dict[str, Any], npz: str) -> dict[str, Any]:
    """``source: cifar10`` sections read ``npz`` instead (an offline machine)."""
    import numpy as np

    with np.load(npz) as d:
        size = len(d["y"])
    cfg = copy.deepcopy(cfg)
    for key in ("data", "aux"):
        sec = cfg.get(key)
        if isinstance(sec, dict) and sec.get("source") == "cifar10":
            sec.update(source="npz", path=str(Path(npz).resolve()), download=False)
            sec.pop("root", None)
            if key == "aux" and sec.get("limit"):
                sec["limit"] = min(sec["limit"], size - sec.get("offset", 0))
    return cfg


def scale_budgets(cfg: dict[str, Any], factor: float) -> dict[str, Any]:
    """Every attack's paper budget with its iterations (epochs for a trained attack) times ``factor``."""
    from guardfl.redteam.attacks import registry

    cfg = copy.deepcopy(cfg)
    attacks = cfg.get("attacks")
    if attacks in (None, "all"):
        attacks = [{"name": n} for n in registry.ATTACKS]
    out = []
    for a in attacks:
        a = {"name": a} if isinstance(a, str) else dict(a)
        cls = registry.ATTACKS[a["name"]]
        budget = {**cls.budgets.get("paper", {}), **(a.get("budget") or {})}
        for key in ("iterations", "epochs"):
            if key in budget:
                budget[key] = max(1, round(budget[key] * factor))
        if "group_every" in budget and "iterations" in budget:
            budget["group_every"] = max(1, min(budget["group_every"], budget["iterations"]))
        a["budget"] = budget
        out.append(a)
    cfg["attacks"] = out
    return cfg


def summarise(cert) -> dict[str, Any]:
    """Worst case per attack over batches: SSIM (max of per-batch best), LPIPS (min of best), and means."""
    rows: dict[str, dict[str, Any]] = {}
    for r in cert.results:
        s = (r.get("metrics") or {}).get("summary") or {}
        row = rows.setdefault(r["attack"], {"ssim_best": None, "ssim_means": [], "lpips_best": None,
                                           "lpips_means": [], "seconds": 0.0, "jobs": 0})
        row["seconds"] += float(r.get("seconds") or 0.0)
        row["jobs"] += 1
        if s.get("ssim"):
            row["ssim_best"] = max(row["ssim_best"] or -1.0, s["ssim"]["best"])
            row["ssim_means"].append(s["ssim"]["mean"])
        if s.get("lpips"):
            row["lpips_best"] = min(row["lpips_best"] if row["lpips_best"] is not None else 9.0, s["lpips"]["best"])
            row["lpips_means"].append(s["lpips"]["mean"])
    for row in rows.values():
        for key in ("ssim", "lpips"):
            means = row.pop(f"{key}_means")
            row[f"{key}_mean"] = sum(means) / len(means) if means else None
    return rows


def run_one(path: Path, args) -> dict[str, Any]:
    import torch

    from guardfl.redteam.certification.run import certify
    from guardfl.yamlio import load_yaml

    cfg = load_yaml(path)
    if args.cifar_npz:
        cfg = rehome_cifar(cfg, args.cifar_npz)
    if args.scale != 1:
        cfg = scale_budgets(cfg, args.scale)
    if args.lpips_weights:
        cfg.setdefault("certify", {})["lpips_weights"] = args.lpips_weights
    cuda = torch.cuda.is_available() and args.device != "cpu"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    row: dict[str, Any] = {"config": path.stem, "scale": args.scale, "paper": PAPER.get(path.stem, "")}
    try:
        cert = certify(cfg, out=Path(args.out) / path.stem, device=args.device, strength="paper",
                       workers=args.workers, progress=not args.quiet)
    except Exception as err:  # one failed config must not hide the others: reported, never dropped
        row.update(error=f"{type(err).__name__}: {err}", seconds=time.time() - t0)
        return row
    row.update(
        verdict=cert.verdict, seconds=time.time() - t0, certify_seconds=cert.wall_time_s,
        peak_gpu_gib=(torch.cuda.max_memory_allocated() / 2**30) if cuda else None,
        peak_gpu_reserved_gib=(torch.cuda.max_memory_reserved() / 2**30) if cuda else None,
        device=(torch.cuda.get_device_name() if cuda else "cpu"), attacks=summarise(cert),
        preparations={k: v.get("seconds") for k, v in cert.preparations.items() if isinstance(v, dict)},
        lpips_available=bool(cert.lpips.get("available")),
    )
    attack_seconds = sum(a["seconds"] for a in row["attacks"].values())
    row["projected_paper_seconds"] = row["seconds"] + attack_seconds * (1 / args.scale - 1)
    return row


def fmt(v, spec=".3f") -> str:
    return "-" if v is None else format(v, spec)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("configs", nargs="*", type=Path)
    ap.add_argument("--device", default="cuda", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--cifar-npz", default=None, help="read source: cifar10 from this npz (offline machines)")
    ap.add_argument("--scale", type=float, default=1.0, help="< 1: a labelled probe (budgets x F), projected to 1")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--lpips-weights", default=None, help="AlexNet ImageNet weights for LPIPS (certify.lpips_weights)")
    ap.add_argument("--out", default=str(OUT / "paper_configs"))
    ap.add_argument("--json", default=str(OUT / "paper_configs.json"))
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if not 0 < args.scale <= 1:
        raise SystemExit(f"--scale: expected a number in (0, 1] (got {args.scale})")
    configs = args.configs or default_configs()
    rows = []
    for path in configs:
        print(f"== {path.stem} (scale {args.scale:g})", flush=True)
        row = run_one(path, args)
        rows.append(row)
        print(json.dumps(row, default=str), flush=True)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=2, default=str))
    label = "" if args.scale == 1 else f"  [PROBE: budgets x{args.scale:g}; 'paper s' projects the attack time]"
    print(f"\nconfig | verdict | s | paper s | peak GiB | attack: worst SSIM (mean) [worst LPIPS] s | paper{label}")
    for r in rows:
        if "error" in r:
            print(f"{r['config']} | FAILED | {r['seconds']:.0f} | - | - | {r['error']} | {r['paper']}")
            continue
        attacks = "; ".join(f"{n}: {fmt(a['ssim_best'])} ({fmt(a['ssim_mean'])}) [{fmt(a['lpips_best'])}] {a['seconds']:.0f}"
                            for n, a in r["attacks"].items())
        print(f"{r['config']} | {r['verdict']} | {r['seconds']:.0f} | {r['projected_paper_seconds']:.0f} | "
              f"{fmt(r['peak_gpu_gib'], '.2f')} | {attacks} | {r['paper']}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
