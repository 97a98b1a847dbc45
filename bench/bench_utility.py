"""Utility of each defense: test accuracy and wall time of a small CNN trained with it, relative to no
defense (the utility half of Huang et al. 2021, Table 2), all trained side by side in one run.

    python bench/bench_utility.py [--epochs 5] [--train 4000] [--test 1000] [--only soteria,graddefense]
                                  [--model small_cnn|fc2bn] [--clip-lr LR]

Data: the 5,000-image CIFAR-10 sample in ``../shared/data`` (benchmarks only), shuffled with a fixed
seed: the first ``--train`` for training, the last ``--test`` for testing. Every defense goes through ``guardfl.protect``; input
encodings train on encoded images with soft labels and are tested on clean images (as InstaHide does).
Soteria and GradDefense run at the Outpost paper's settings (Wang et al. 2024, Sec. V): Soteria prunes 50%
of the FC layer's gradient (here the classifier, the model's only nn.Linear), GradDefense 10 slices, 5
perturbed, noise 0.01, clipping on. ``--only`` (comma-separated substrings of the row names, case-insensitive)
runs a subset; the no-defense row always runs first, so time ratios are measured in the same run.
Writes ``bench/results/<out>.json`` and ``<out>.png`` (``--out``, default ``utility``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import guardfl
from guardfl.defenses import (DPSGD, GaussianNoise, GradDefense, GradPrune, Identity, InstaHide, MixUp, Outpost,
                              SignCompression, Soteria, Stack)
from guardfl.ops.sensitivity import joint_norm

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "cifar10-train-5k.npz"
OUT = ROOT / "bench" / "results"


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
        nn.Flatten(), nn.Linear(64 * 16, 10),
    )


DEFENSES = {
    "none": lambda: Identity(),
    "GradPrune 0.9": lambda: GradPrune(0.9),
    "GradPrune 0.99": lambda: GradPrune(0.99),
    "SignCompression": lambda: SignCompression(),
    "Outpost (defaults)": lambda: Outpost(),
    "Soteria (prune 0.5 of the FC layer)": lambda: Soteria(prune=0.5),
    "GradDefense (10 slices, 5 noised, 0.01, clip)": lambda: GradDefense(),
    "DP-SGD (sigma 0.5, C 1.0)": lambda: DPSGD(noise_multiplier=0.5, max_grad_norm=1.0),
    "DP-SGD (sigma 1.0, C 1.0)": lambda: DPSGD(noise_multiplier=1.0, max_grad_norm=1.0),
    "MixUp k=4": lambda: MixUp(k=4),
    "InstaHide k=4": lambda: InstaHide(k=4),
    "InstaHide k=4 + GradPrune 0.9": lambda: Stack(InstaHide(k=4), GradPrune(0.9)),
    # fixed-scale noise, and the same bounded first (``clip``: the update's joint norm, against a malicious
    # server's boost; README "Defenses against a malicious server")
    "Gaussian 0.01": lambda: GaussianNoise(0.01),
    "Gaussian 0.01 clip 10": lambda: GaussianNoise(0.01, clip=10.0),
    "Gaussian 0.01 clip 1": lambda: GaussianNoise(0.01, clip=1.0),
    "Gaussian 0.01 clip 0.3": lambda: GaussianNoise(0.01, clip=0.3),
    "Gaussian 0.01 clip 0.1": lambda: GaussianNoise(0.01, clip=0.1),
}


def fc2bn() -> nn.Module:
    """The FC-2 with BatchNorm that SEER's figures are measured on (``bench_seer.py``)."""
    from guardfl.redteam.modality.image.models import build_model

    return build_model("fc2bn", (3, 32, 32), 10)


ARCHITECTURES = {"small_cnn": small_cnn, "fc2bn": fc2bn}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--train", type=int, default=4000)
    ap.add_argument("--test", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--clip-lr", type=float, default=None,
                    help="the learning rate of the rows with a clip (a clip that binds every step scales it down); default --lr")
    ap.add_argument("--only", default=None, help="comma-separated substrings of row names (the no-defense row always runs)")
    ap.add_argument("--out", default="utility", help="name of the result files in bench/results")
    ap.add_argument("--model", default="small_cnn", choices=sorted(ARCHITECTURES))
    args = ap.parse_args(argv)
    keys = [k.strip().lower() for k in args.only.split(",")] if args.only else None
    chosen = {name: make for name, make in DEFENSES.items()
              if name == "none" or keys is None or any(k in name.lower() for k in keys)}
    d = np.load(DATA)
    order = torch.randperm(len(d["y"]), generator=torch.Generator().manual_seed(0))  # the file is sorted by class
    x = (torch.from_numpy(d["x"]).permute(0, 3, 1, 2).float() / 255.0)[order]
    y = torch.from_numpy(d["y"]).long()[order]
    mean, std = x[: args.train].mean((0, 2, 3), keepdim=True), x[: args.train].std((0, 2, 3), keepdim=True)
    x = (x - mean) / std
    train = TensorDataset(x[: args.train], y[: args.train])
    xt, yt = x[-args.test :], y[-args.test :]
    OUT.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, make in chosen.items():
        torch.manual_seed(0)
        model = ARCHITECTURES[args.model]()
        lr = args.clip_lr if args.clip_lr is not None and "clip" in name else args.lr
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        loader = DataLoader(train, batch_size=args.batch, shuffle=True)
        model, opt, loader = guardfl.protect(model, opt, loader, make())
        t0, norms = time.perf_counter(), []
        for _ in range(args.epochs):
            model.train()
            if hasattr(opt, "new_round"):
                opt.new_round()  # one FL round per epoch (Outpost's counter restarts)
            for xb, yb in loader:
                if len(xb) == 0:
                    continue
                opt.zero_grad()
                guardfl.soft_cross_entropy(model(xb), yb).backward()
                if name == "none":  # the honest step's norm, to choose a clip by (timed with the rest: small)
                    norms.append(joint_norm([p.grad for p in model.parameters() if p.grad is not None]))
                opt.step()
        seconds = time.perf_counter() - t0
        model.eval()
        with torch.no_grad():
            acc = float((model(xt).argmax(1) == yt).float().mean())
        eps = opt.epsilon(1e-5)
        rows.append({"defense": name, "test_acc": acc, "train_s": seconds, "epsilon@1e-5": eps})
        print(f"{name:46s} acc {acc:6.3f}  time {seconds:6.1f}s  eps {eps:.2f}", flush=True)
        if norms:
            q = np.quantile(np.array(norms, dtype=float), [0.1, 0.5, 0.9])
            rows[-1]["update_norm_q10_50_90"] = [float(v) for v in q]
            print(f"{'':46s} honest step norm: median {q[1]:.3g} (10%-90%: {q[0]:.3g}-{q[2]:.3g})", flush=True)
    base = rows[0]
    print(f"\n{'defense':46s} {'acc':>6s} {'d-acc':>7s} {'time x':>7s}")
    for r in rows:
        r["acc_delta"] = r["test_acc"] - base["test_acc"]
        r["time_ratio"] = r["train_s"] / base["train_s"]
        print(f"{r['defense']:46s} {r['test_acc']:6.3f} {r['acc_delta']:+7.3f} {r['time_ratio']:7.2f}")
    meta = {"model": args.model, "lr": args.lr, "clip_lr": args.clip_lr, "epochs": args.epochs, "train": args.train, "test": args.test, "batch": args.batch,
            "torch_threads": torch.get_num_threads()}
    (OUT / f"{args.out}.json").write_text(json.dumps({**meta, "rows": rows}, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.barh([r["defense"] for r in rows][::-1], [r["test_acc"] for r in rows][::-1], color="#4a7ab8")
    ax.set_xlabel(f"test accuracy ({args.model}, {args.epochs} epochs, CIFAR-10 sample)")
    for i, r in enumerate(rows[::-1]):
        ax.text(r["test_acc"] + 0.005, i, f"{r['time_ratio']:.1f}x time", va="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT / f"{args.out}.png", dpi=110)
    print(f"wrote {OUT / (args.out + '.json')} and {args.out}.png")


if __name__ == "__main__":
    main()
