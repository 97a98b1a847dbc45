"""Inter-InstaHide with the public set known: an UPPER-BOUND experiment on the client's TRUE encodings.

    python bench/bench_instahide_public.py --data /work/shared/data/cifar10-train-5k.npz [--n 16] [--public 64]

No gradient attack: the encodings the client trained on (what a perfect gradient attack would return) are
decoded without any oracle (partners, coefficients and sign masks unknown) by ``decode_public`` with the
public set, and as |encoding| without it; SSIM against the private images. FedSGD (one encoding per
image) and FedAvg with 2 and 3 epochs (that many encodings per image, rows shuffled within each epoch).
Real gradient attacks return noisy encodings; the ``--noise`` rows add Gaussian noise of that std to them.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from guardfl.data import from_array
from guardfl.defenses import InstaHide
from guardfl.redteam.attacks.analytic.demix_public import decode_public
from guardfl.redteam.modality.image.metrics import ssim


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="an npz with x (N, H, W, C uint8) and y")
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--public", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--noise", type=float, nargs="*", default=[0.0, 0.01, 0.03])
    args = ap.parse_args()
    d = np.load(args.data)
    x_all, y_all = from_array(d["x"][: 1000 + args.public], d["y"][: 1000 + args.public])
    private, labels, public = x_all[: args.n], y_all[: args.n], x_all[1000 : 1000 + args.public]
    rows = []
    for epochs in (1, 2, 3):
        defense = InstaHide(k=args.k, mode="inter", public=public, seed=epochs)
        g = torch.Generator().manual_seed(epochs)
        enc = []
        for e in range(epochs):
            order = torch.randperm(args.n, generator=g) if e else torch.arange(args.n)
            enc.append(defense.encode(private, labels, 10)[0][order])
        clean = torch.cat(enc).abs()
        for sigma in args.noise:
            noisy = (clean + sigma * torch.randn(clean.shape, generator=g)).abs()
            t0 = time.time()
            est, _, info = decode_public(noisy, public, args.n, args.k, 0.65, (0.0, 1.0))
            seconds = time.time() - t0
            known = [max(ssim(e, p, 1.0) for p in private) for e in est]
            raw = [max(ssim(e, p, 1.0) for p in private) for e in noisy[: args.n].clamp(0, 1)]
            rows.append({"epochs": epochs, "noise": sigma, "known_mean": float(np.mean(known)),
                         "known_min": float(np.min(known)), "known_median": float(np.median(known)),
                         "abs_mean": float(np.mean(raw)), "seconds": round(seconds, 1), **info})
            print(json.dumps(rows[-1]))


if __name__ == "__main__":
    main()
