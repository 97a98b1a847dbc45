"""Exclusively activated neurons (``exclusive_neurons``): what an honest-but-curious server reads from the
honest FC-2's own first layer, per defense, against the oracle bound (issue 34's honest fallback).

    python bench/bench_exclusive_neurons.py [--data lfw|cifar] [--seeds 3] [--batch 64] [--centre]
                                            [--protocol fedsgd|fedavg] [--hidden 256] [--defenses none ...]

FC-2 (``--hidden`` units, 256 by default) at PyTorch's default initialisation (a fresh seed per trial), one
client batch per trial (LFW: the first 64 faces; CIFAR-10: images drawn from the shared 5k sample), inputs
in [0, 1] (``--centre``: shifted and scaled to zero mean and unit variance). Each defense runs through
``simulate_client`` (the client's real path), and the attack knows the defense's configuration and the
labels. Prints per defense, over the seeds: the samples the attack checked (claimed as exact without the
truth), the private images read exactly (SSIM > 0.9 after one-to-one matching) and past SSIM 0.4, wrongly
checked samples (checked but not within 1e-3 of any private image: must be 0), and the attack's time. The
ORACLE column is a bound, not an attack: each private image matched to its nearest candidate ``G_i / g_i``
of the first, unpeeled reading by the ground truth (so it counts the units exclusive at the start; peeling
can read more than it).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from guardfl.redteam.attacks import get
from guardfl.redteam.attacks.analytic import exclusive
from guardfl.redteam.client.simulate import FedAvg, FedSGD, simulate_client
from guardfl.redteam.modality.image import metrics
from guardfl.redteam.modality.image.models import FC2
from guardfl.redteam.threat import ThreatModel
from malicious_defenses import DEFENSES  # bench/, beside this script

ROOT = Path(__file__).resolve().parents[1]


def data(name: str, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    if name == "cifar":
        d = np.load(ROOT.parent / "shared/data/cifar10-train-5k.npz")
        x = torch.tensor(d[d.files[0]]).permute(0, 3, 1, 2).float() / 255
        y = torch.tensor(d[d.files[1]]).long()
        pick = torch.randperm(4000, generator=torch.Generator().manual_seed(seed))[:batch]
        return x[pick], y[pick]
    from guardfl.redteam.modality.image.data import lfw_faces

    x, y = lfw_faces(10)
    return x[:batch], y[:batch]


def oracle(update: dict, x: torch.Tensor, span: tuple[float, float]) -> int:
    """ORACLE bound: private images whose nearest first-reading candidate (by the truth) is past SSIM 0.9."""
    rows, cands = exclusive.ratios(update["net.1.weight"], update["net.1.bias"], 1e-4)
    if not rows.numel():
        return 0
    cands = cands.float().clamp(*span).view(-1, *x.shape[1:])
    dist = (x.flatten(1)[:, None] - cands.flatten(1)[None]).pow(2).mean(2)
    nearest = dist.argmin(1)
    return sum(metrics.ssim(cands[int(j)], x[i], span[1] - span[0]) > 0.9 for i, j in enumerate(nearest))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", choices=["lfw", "cifar"], default="lfw")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--centre", action="store_true")
    ap.add_argument("--protocol", choices=["fedsgd", "fedavg"], default="fedsgd")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--defenses", nargs="+", choices=list(DEFENSES), default=list(DEFENSES))
    args = ap.parse_args()
    torch.set_num_threads(1)
    protocol = FedSGD() if args.protocol == "fedsgd" else FedAvg(epochs=2, batch_size=16, lr=0.1)
    print(f"FC-2 ({args.hidden} units), {args.data}, batch {args.batch}, {'centred' if args.centre else 'inputs in [0, 1]'}, {args.protocol}, "
          f"{args.seeds} seeds; per defense, over the seeds: checked / exact (SSIM > 0.9) / past 0.4 / wrongly "
          f"checked / ORACLE bound / seconds")
    defenses = {name: DEFENSES[name] for name in args.defenses}
    results: dict[str, list[tuple]] = {name: [] for name in defenses}
    for seed in range(args.seeds):
        x, y = data(args.data, args.batch, seed)
        span = (0.0, 1.0)
        if args.centre:
            x = (x - x.mean()) / x.std()
            span = (float(x.min()), float(x.max()))
        torch.manual_seed(seed)
        model = FC2(tuple(x.shape[1:]), 10, hidden=args.hidden)
        for name, defense in defenses.items():
            obs = simulate_client(model, x, y, defense, protocol, input_range=span)
            t0 = time.perf_counter()
            rec = get("exclusive_neurons").reconstruct(obs, ThreatModel(labels="known", defense="known"))
            seconds = time.perf_counter() - t0
            ssim = [r["ssim"] for r in metrics.evaluate(rec, x, y, data_range=span)["per_image"]]
            checked = rec.info["checked"]
            wrong = 0
            if checked:
                diff = (rec.inputs[:checked].flatten(1)[:, None] - x.flatten(1)[None]).abs().amax(2).min(1).values
                wrong = int((diff > 1e-3).sum())
            results[name].append((checked, sum(s > 0.9 for s in ssim), sum(s > 0.4 for s in ssim), wrong,
                                  oracle(obs.update, x, span), seconds))
    for name, rows in results.items():
        cols = list(zip(*rows))
        fmt = lambda v: " ".join(str(int(a)) for a in v)  # noqa: E731
        print(f"{name:>15}: checked {fmt(cols[0]):>12} | exact {fmt(cols[1]):>12} | past 0.4 {fmt(cols[2]):>12} | "
              f"wrongly checked {sum(cols[3])} | ORACLE {fmt(cols[4]):>12} | {np.mean(cols[5]):.2f} s")


if __name__ == "__main__":
    main()
