"""The leak limit across rounds (``inspect_model(..., leak_limit=k, history=LeakHistory())``): what it costs,
what it changes for honest FedSGD on one batch, and what it does to the red team's ``threshold_bins``.

1. Cost: FC-2 on 64 centred CIFAR-10 images, honest FedSGD rounds on that batch (lr 0.01, a limit no round
   reaches), the inspection's time in round r with the history against without it in the same run (ratio),
   and the history's size per remembered round (``to_bytes``).
2. Honest FedSGD on one batch (the same setting, 3 seeds, 10 rounds): the samples read per update and with
   the history, and the first round a limit of 0 refuses, each way.
3. ``threshold_bins`` (FC-2, 64 LFW faces in [0, 1], limit 0): a client that limits each update alone
   against one that keeps its history, and against that history the four-direction crossings
   (``directions: 4, spread: 3, slope: 20000``; the history meets its views, ``guardfl.inspect_meets``,
   since 2026-11-28: 25 faces exactly before, 0 after): models refused, faces read exactly (SSIM >= 0.95)
   and past SSIM 0.4.

    .venv/bin/python bench/bench_leak_history.py [--rounds 32] [--no-bins]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from guardfl.inspect import inspect_model  # noqa: E402
from guardfl.inspect_history import LeakHistory  # noqa: E402
from guardfl.redteam.modality.image.models import FC2  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "cifar10-train-5k.npz"


def cifar(n: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    d = np.load(DATA)
    x = torch.tensor(d["x"][: offset + n]).permute(0, 3, 1, 2).float() / 255
    y = torch.tensor(d["y"][: offset + n])
    mu, sd = x.mean((0, 2, 3), keepdim=True), x.std((0, 2, 3), keepdim=True)
    return (x[offset:] - mu) / sd, y[offset:]


def step(model, opt, x, y) -> None:
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


def cost(rounds: int) -> None:
    torch.manual_seed(0)
    model, (x, y) = FC2(), cifar(64, 0)
    opt, history = torch.optim.SGD(model.parameters(), lr=0.01), LeakHistory()
    print(f"1. cost (FC-2, 64 centred CIFAR-10 images, honest FedSGD lr 0.01, limit 64)\n   round | without history s | with s | ratio")
    for r in range(rounds):
        t0 = time.perf_counter()
        inspect_model(model, model, batch=(x, y), leak_limit=64)
        t1 = time.perf_counter()
        inspect_model(model, model, batch=(x, y), leak_limit=64, history=history)
        t2 = time.perf_counter()
        if r in (0, 1, 4, 8, 16, 32, 64, rounds - 1):
            print(f"   {r:5d} | {t1 - t0:17.3f} | {t2 - t1:6.3f} | {(t2 - t1) / (t1 - t0):5.1f}")
        step(model, opt, x, y)
    size = len(history.to_bytes())
    print(f"   history after {rounds} rounds: {size / 1e6:.1f} MB ({size / rounds / 1e3:.0f} kB per round)")


def honest(seeds: int = 3, rounds: int = 10) -> None:
    print("2. honest FedSGD on one batch (FC-2, 64 centred CIFAR-10 images, lr 0.01)\n"
          "   seed | read per update, by round | read with the history | first round refused at limit 0: alone / with")
    for seed in range(seeds):
        torch.manual_seed(seed)
        model, (x, y) = FC2(), cifar(64, 64 * seed)
        opt, history = torch.optim.SGD(model.parameters(), lr=0.01), LeakHistory()
        alone, together = [], []
        for _ in range(rounds):
            check = inspect_model(model, model, batch=(x, y), leak_limit=64, history=history).checks["leak_limit"]
            alone.append(check["read"])
            together.append(check["read_with_history"])
            step(model, opt, x, y)
        first = lambda counts: next((r for r, c in enumerate(counts) if c > 0), None)  # noqa: E731
        print(f"   {seed:4d} | {alone} | {together} | {first(alone)} / {first(together)}")


def bins() -> None:
    from guardfl.redteam.attacks import Setting, get
    from guardfl.redteam.auxdata import AuxData
    from guardfl.redteam.client.simulate import ClientQuery, FedSGD
    from guardfl.redteam.modality.image import metrics
    from guardfl.redteam.modality.image.data import lfw_faces
    from guardfl.redteam.threat import ThreatModel

    faces, labels = lfw_faces(10)
    x, y, aux = faces[:64], labels[:64], AuxData(faces[64:], labels[64:])
    shape = tuple(x.shape[1:])
    print("3. threshold_bins (FC-2, 64 LFW faces in [0, 1], leak_limit 0, 65 thresholds a direction)\n"
          "   client                 | models refused | exact (SSIM >= 0.95) | past SSIM 0.4 | best SSIM | s")
    crossing = {"directions": 4, "spread": 3.0, "slope": 20000.0}
    for name, keep, kw in (("per update", False, {}), ("history", True, {}), ("history, 4 directions", True, crossing)):
        torch.manual_seed(0)
        model = FC2(shape, 10)
        client = ClientQuery(x, y, None, FedSGD(), inspect=True, reference=model, leak_limit=0, leak_history=keep)
        t0 = time.perf_counter()
        rec = get("threshold_bins", seed=0, **kw).interrogate(client, Setting(model, FedSGD(), 64, shape, 10, (0.0, 1.0), None),
                                                              ThreatModel(server="malicious", labels="known", aux=aux))
        ssim = [r["ssim"] for r in metrics.evaluate(rec.inputs, x, exact_ssim=0.95)["per_image"]]
        print(f"   {name:22s} | {client.refused:14d} | {sum(s >= 0.95 for s in ssim):20d} | "
              f"{sum(s > 0.4 for s in ssim):13d} | {max(ssim):9.3f} | {time.perf_counter() - t0:.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=32)
    parser.add_argument("--no-bins", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cost(args.rounds)
    honest()
    if not args.no_bins:
        bins()


if __name__ == "__main__":
    main()
