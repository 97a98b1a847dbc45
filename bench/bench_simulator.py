"""The cost of simulating what a client transmits (``TransmitSimulator``, the defense as augmentation) per
auxiliary batch, for every defense kind: what learned inversion's preparation pays per draw.

    python bench/bench_simulator.py [--batches 256] [--threads 1] [--batch-size 1]

Setting: the LeNet of Zhu et al. (wide U(-0.5, 0.5) init) on CIFAR-10 (``../shared/data/cifar10-train-5k.npz``,
the first images), FedSGD, batch size 1 (MixUp and Intra-InstaHide mix within the batch: they run at
batch 4 and say so), default chunk (256 batches per vmapped call; DP-SGD 256 / B). Each defense: one
warm-up call on 8 batches, then ``--batches`` batches timed. Writes ``bench/results/simulator.json``.
Not a test: report the machine's load and the thread count with the numbers.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from guardfl.redteam import FedSGD
from guardfl.redteam.client.transmit import TransmitSimulator
from guardfl.redteam.modality.image.models import LeNetZhu, set_model_state

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "cifar10-train-5k.npz"
OUT = ROOT / "bench" / "results"

DEFENSES = {
    "none": None,
    "gradprune 0.99": {"kind": "gradprune", "ratio": 0.99},
    "outpost": {"kind": "outpost"},
    "dpsgd (nm 1, C 1)": {"kind": "dpsgd", "noise_multiplier": 1.0, "max_grad_norm": 1.0},
    "mixup k=4 (B=4)": {"kind": "mixup", "k": 4},
    "instahide intra k=4 (B=4)": {"kind": "instahide", "k": 4},
    "instahide inter k=4": {"kind": "instahide", "k": 4, "mode": "inter", "public": "(attacker's images)"},
    "soteria 0.5": {"kind": "soteria", "prune": 0.5},
    "graddefense": {"kind": "graddefense"},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--only", default=None, help="comma-separated defense names")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    d = np.load(DATA)
    x = torch.from_numpy(d["x"][: 4 * (args.batches + 8)]).permute(0, 3, 1, 2).float() / 255.0
    y = torch.from_numpy(d["y"][: 4 * (args.batches + 8)]).long()
    model = set_model_state(LeNetZhu((3, 32, 32), 10), "wide-init", seed=0)
    out = {}
    for name, config in DEFENSES.items():
        if args.only and name not in args.only.split(","):
            continue
        b = 4 if "(B=4)" in name else args.batch_size
        public = x[-64:] if config and config.get("mode") == "inter" else None
        sim = TransmitSimulator(model, config, FedSGD(), seed=0, public=public)
        xb, yb = x[: (args.batches + 8) * b].view(-1, b, 3, 32, 32), y[: (args.batches + 8) * b].view(-1, b)
        sim.updates(xb[:8], yb[:8])
        t = time.perf_counter()
        sim.updates(xb[8 : 8 + args.batches], yb[8 : 8 + args.batches])
        per = (time.perf_counter() - t) / args.batches
        out[name] = {"seconds_per_batch": per, "batch_size": b}
        print(f"{name:28s} B={b}  {per * 1e3:8.2f} ms per batch", flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "simulator.json").write_text(json.dumps({"threads": args.threads, "batches": args.batches, "results": out}, indent=1))


if __name__ == "__main__":
    main()
