"""The Cocktail Party Attack vs gradient matching on FC-2 (Kariyappa et al. 2023, Table 1 direction).

    python bench/bench_cpa.py [--batch-sizes 16,64,256] [--strength quick|paper] [--ig-iterations N]
                              [--lpips-weights PATH] [--protocol fedsgd|fedavg]

FC-2 (Linear(3072, 256) - ReLU - Linear(256, 10), PyTorch's default init) on CIFAR-10 images of the shared
5k sample (interleaved by class, so a batch holds every class), FedSGD (or FedAvg: one epoch in
mini-batches of 8, lr 0.01, the paper's update inversion). For each batch size: CPA (ICA on the first
layer's update, scale and sign from the bias update) and guardfl's Inverting Gradients (the paper's GMA
baseline: cosine + TV, labels known) on the same batch in the same run. Prints mean SSIM / PSNR after
Hungarian matching (LPIPS with ``--lpips-weights``: the paper's metric; AlexNet weights cannot be
downloaded here), the share of images above SSIM 0.6, and wall time. Writes ``bench/results/cpa.json``.
Not a test: run it on a quiet machine.

The paper (LPIPS, lower is better; CIFAR-10 FC-2, GIA): B=32 CPA 0.197 / GMA 0.491, B=64 0.352 / 0.569,
B=128 0.521 / 0.610, B=256 0.610 / 0.614.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from guardfl.redteam import FedAvg, FedSGD, ThreatModel, attacks, simulate_client
from guardfl.redteam.modality.image import metrics
from guardfl.redteam.attacks.compute import resolve_device
from guardfl.redteam.modality.image.models import FC2, set_model_state

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "cifar10-train-5k.npz"
OUT = ROOT / "bench" / "results"
PAPER_LPIPS = {32: (0.197, 0.491), 64: (0.352, 0.569), 128: (0.521, 0.610), 256: (0.610, 0.614)}


def cifar_interleaved() -> tuple[torch.Tensor, torch.Tensor]:
    d = np.load(DATA)
    x = torch.from_numpy(d["x"]).permute(0, 3, 1, 2).float() / 255.0
    y = torch.from_numpy(d["y"]).long()
    order = torch.stack([torch.nonzero(y == c).flatten() for c in range(10)], 1).flatten()
    return x[order], y[order]


def summary(m: dict) -> dict:
    rows = m["per_image"]
    out = {k: float(np.mean([r[k] for r in rows])) for k in ("ssim", "psnr")}
    out["share_ssim_0.6"] = float(np.mean([r["ssim"] >= 0.6 for r in rows]))
    lp = [r["lpips"] for r in rows if r.get("lpips") is not None]
    out["lpips"] = float(np.mean(lp)) if lp else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="16,64,256")
    ap.add_argument("--strength", choices=["quick", "paper"], default=None, help="default: paper on a GPU, else quick")
    ap.add_argument("--ig-iterations", type=int, default=None)
    ap.add_argument("--protocol", choices=["fedsgd", "fedavg"], default="fedsgd")
    ap.add_argument("--lpips-weights", default=None)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    device = resolve_device(args.device)
    strength = args.strength or ("paper" if device.type == "cuda" else "quick")
    x, y = cifar_interleaved()
    model = set_model_state(FC2((3, 32, 32), 10), "default", seed=0)
    protocol = FedSGD() if args.protocol == "fedsgd" else FedAvg(epochs=1, batch_size=8, lr=0.01)
    print(f"device {device} ({torch.get_num_threads()} threads), strength {strength}, FC-2 CIFAR-10, {args.protocol}")
    print(f"{'B':>5s} | {'CPA ssim':>8s} {'psnr':>6s} {'>=0.6':>6s} {'lpips':>6s} {'s':>6s} | {'IG ssim':>8s} {'psnr':>6s} {'>=0.6':>6s} {'lpips':>6s} {'s':>6s} | paper LPIPS CPA / GMA")
    rows = []
    for b in (int(v) for v in args.batch_sizes.split(",")):
        xb, yb = x[:b], y[:b]
        obs = simulate_client(model, xb, yb, None, protocol)
        threat = ThreatModel(labels="known")
        cpa_budget = {**attacks.ATTACKS["cocktail_party"].budget_for(strength), "seed": 0, "device": str(device)}
        ig_budget = {**attacks.ATTACKS["inverting_gradients"].budget_for(strength), "seed": 0, "device": str(device)}
        if args.ig_iterations:
            ig_budget["iterations"] = args.ig_iterations
        result = {"batch": b}
        for name, budget in (("cpa", cpa_budget), ("ig", ig_budget)):
            attack = attacks.get("cocktail_party" if name == "cpa" else "inverting_gradients", **budget)
            t0 = time.time()
            rec = attack.reconstruct(obs, threat)
            seconds = time.time() - t0
            m = metrics.evaluate(rec, xb, yb, lpips_weights=args.lpips_weights)
            result[name] = {**summary(m), "seconds": seconds, "budget": budget, "info": {k: str(v) for k, v in rec.info.items()}}
        c, g = result["cpa"], result["ig"]
        fmt = lambda v: "  n/a " if v is None else f"{v:6.3f}"  # noqa: E731
        paper = PAPER_LPIPS.get(b)
        print(f"{b:5d} | {c['ssim']:8.3f} {c['psnr']:6.2f} {c['share_ssim_0.6']:6.2f} {fmt(c['lpips'])} {c['seconds']:6.1f} | "
              f"{g['ssim']:8.3f} {g['psnr']:6.2f} {g['share_ssim_0.6']:6.2f} {fmt(g['lpips'])} {g['seconds']:6.1f} | "
              f"{'%.3f / %.3f' % paper if paper else 'n/a'}", flush=True)
        rows.append(result)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "cpa.json").write_text(json.dumps({"device": str(device), "threads": torch.get_num_threads(), "strength": strength,
                                              "protocol": args.protocol, "results": rows}, indent=2, default=str))


if __name__ == "__main__":
    main()
