"""Trap weights against SEER's D-SNR check (issue 34): which constructions pass every check and leak.

    python bench/bench_dsnr_trap.py [--data cifar|lfw] [--batch 64] [--trials 10] [--defense none|0.9|0.99]

FC-2 (PyTorch's default init, a fresh seed per trial) and one FedSGD client batch per trial (CIFAR-10:
drawn from images 0-3999 of the shared 5k sample, the attacker's aux data images 4000-4999; LFW: drawn
from the first 64 faces, aux the other 36). Per construction of ``trap_weights``, the crafted model is
judged by ``inspect_model(model, honest, batch=client batch, disaggregation=True)`` (every check, D-SNR
included) and the client's update (GradPrune at ``--defense`` or none, through ``ClientQuery``) is
attacked whatever the verdict, so that what a passing model leaks is measured. Prints per construction:
how many models passed, the checks that refused the others, D-SNR per trial, and the private images read
exactly (SSIM > 0.9 after matching) and past SSIM 0.4 (on LFW, the mean aux face alone is past 0.4 for a
third of the faces: read the exact counts there).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from guardfl.inspect import inspect_model
from guardfl.redteam.modality.image import metrics
from guardfl.redteam.attacks import Setting, get
from guardfl.redteam.auxdata import AuxData
from guardfl.redteam.client.simulate import ClientQuery, FedSGD
from guardfl.redteam.modality.image.models import FC2
from guardfl.redteam.threat import ThreatModel

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "top, 4 chains x 2 rows, boost 1000": dict(chains=4, rows=2, boost=1000),
    "top, 8 rows": dict(chains=1, rows=8),
    "middle, 6 rows, boost 1000": dict(chains=1, rows=6, boost=1000, cuts="middle"),
    "middle, 8 rows, boost 1000": dict(chains=1, rows=8, boost=1000, cuts="middle"),
}


def data(name: str):
    if name == "cifar":
        d = np.load(ROOT.parent / "shared/data/cifar10-train-5k.npz")
        x = torch.tensor(d[d.files[0]]).permute(0, 3, 1, 2).float() / 255
        y = torch.tensor(d[d.files[1]]).long()
        return x[:4000], y[:4000], AuxData(x[4000:], y[4000:])
    from guardfl.redteam.modality.image.data import lfw_faces

    x, y = lfw_faces()
    return x[:64], y[:64], AuxData(x[64:], y[64:])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", choices=["cifar", "lfw"], default="cifar")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--defense", default="none", help="none, or a GradPrune ratio")
    args = p.parse_args()
    torch.set_num_threads(1)
    pool_x, pool_y, aux = data(args.data)
    shape = tuple(pool_x.shape[1:])
    defense = None if args.defense == "none" else {"kind": "gradprune", "ratio": float(args.defense)}
    print(f"{args.data}, FC-2, FedSGD batch {args.batch}, defense {defense}, {args.trials} trials")
    for name, kw in VARIANTS.items():
        rows = []
        for t in range(args.trials):
            idx = torch.randperm(len(pool_x), generator=torch.Generator().manual_seed(100 + t))[:args.batch]
            x, y = pool_x[idx], pool_y[idx]
            torch.manual_seed(t)
            model = FC2(in_shape=shape)
            setting = Setting(model, FedSGD(), args.batch, shape, 10, (0.0, 1.0), defense)
            threat = ThreatModel(server="malicious", labels="known", aux=aux)
            rec = get("trap_weights", seed=t, **kw).interrogate(ClientQuery(x, y, defense, FedSGD()), setting, threat)
            verdict = inspect_model(rec.info["malicious_model"], model, batch=(x, y), disaggregation=True)
            per = metrics.evaluate(rec.inputs, x)["per_image"]
            rows.append((sorted({r.split(":")[0] for r in verdict.reasons}), verdict.checks["disaggregation"]["max"],
                         sum(r["ssim"] > 0.9 for r in per), sum(r["ssim"] > 0.4 for r in per)))
        refused = [r[0] for r in rows if r[0]]
        print(f"{name}: passed {args.trials - len(refused)} of {args.trials}; refused by {refused}; "
              f"D-SNR {[round(r[1], 3) for r in rows]}; exact {[r[2] for r in rows]}; past 0.4 {[r[3] for r in rows]}",
              flush=True)


if __name__ == "__main__":
    main()
