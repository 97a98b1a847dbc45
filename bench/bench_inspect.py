"""guardfl.inspect_model: detection rate on malicious-server models, false-positive rate on benign ones.

Malicious (tests/malicious.py, from the papers' descriptions): Robbing the Fed's imprint block in front
of the small CNN, LeNet and ResNet-18 (64 to 512 bins); class fishing (breaching's cls_attack, and with
the trained target row kept) and feature fishing on the last layer of the small CNN, LeNet, ResNet-18
(CIFAR stem) and torchvision's ResNet-18, untrained and trained, every target class. Benign: PyTorch
default initialisations (small CNN, LeNet, ResNet-18, a linear model, FC-2) and DLG's wide
initialisation over many seeds, checkpoints trained 1-5 epochs on
CIFAR-10 images, and FedAvg global models over rounds (4 IID clients, and 4 non-IID clients of 2-3
classes each). Every model is inspected with and without the client's first batch (32 CIFAR-10 images
it was not trained on) and, for benign ones, a non-IID batch (mostly one class).

    .venv/bin/python bench/bench_inspect.py [--seeds 20] [--images 1024]

Prints a table and the largest benign value of each measured statistic next to its threshold.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torchvision

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from guardfl import inspect as I  # noqa: E402
from guardfl import inspect_model  # noqa: E402
from guardfl.redteam.models import FC2  # noqa: E402
from tests import malicious as M  # noqa: E402


def non_iid(x, y, clients=4, classes_per_client=3):
    shards = []
    for c in range(clients):
        keep = torch.isin(y, torch.tensor([(c * 2 + k) % 10 for k in range(classes_per_client)]))
        shards.append((x[keep], y[keep]))
    return shards


def fedavg_non_iid(model, x, y, rounds):
    import copy

    current, history = copy.deepcopy(model), []
    for rnd in range(rounds):
        states = [M.train(copy.deepcopy(current), xs, ys, epochs=1, seed=rnd * 10 + c).state_dict()
                  for c, (xs, ys) in enumerate(non_iid(x, y))]
        current.load_state_dict({k: torch.stack([s[k].double() for s in states]).mean(0).to(v.dtype) if v.is_floating_point()
                                 else states[0][k] for k, v in current.state_dict().items()})
        history.append(copy.deepcopy(current))
    return history


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=20, help="seeds per default / wide initialisation")
    ap.add_argument("--images", type=int, default=1024, help="training images for the checkpoints")
    args = ap.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    start = time.time()
    x, y = M.cifar(args.images)
    batch = M.cifar(32, offset=4000)
    xb, yb = M.cifar(32, offset=4100)
    skewed = (xb, torch.where(torch.arange(32) < 28, torch.tensor(3), yb))  # a non-IID client: 28 of 32 one label

    benign: dict[str, list] = {}
    for s in range(args.seeds):
        benign.setdefault("default init: small CNN", []).append(M.small_cnn(s))
        benign.setdefault("default init: LeNet", []).append(M.lenet(s))
        benign.setdefault("wide init: LeNet", []).append(M.lenet(s, wide=True))
        benign.setdefault("default init: linear", []).append(M.linear_model(s))
        torch.manual_seed(s)
        benign.setdefault("default init: FC-2 (3072-256-10)", []).append(FC2())
    for s in range(max(2, args.seeds // 5)):
        benign.setdefault("default init: ResNet-18", []).append(M.resnet18(s))
        torch.manual_seed(s)
        benign.setdefault("default init: torchvision ResNet-18", []).append(torchvision.models.resnet18(num_classes=10))
    for s in range(3):
        for epochs in (1, 3, 5):
            benign.setdefault("trained: small CNN", []).append(M.train(M.small_cnn(s), x, y, epochs=epochs, seed=s))
            benign.setdefault("trained: LeNet", []).append(M.train(M.lenet(s), x, y, epochs=epochs, lr=0.1, seed=s))
            benign.setdefault("trained: LeNet wide init", []).append(M.train(M.lenet(s, wide=True), x, y, epochs=epochs, lr=0.01, seed=s))
            benign.setdefault("trained: linear", []).append(M.train(M.linear_model(s), x, y, epochs=epochs, lr=0.01, seed=s))
            torch.manual_seed(s)
            benign.setdefault("trained: FC-2", []).append(M.train(FC2(), x, y, epochs=epochs, lr=0.01, seed=s))
    benign["trained: ResNet-18 (1 epoch)"] = [M.train(M.resnet18(0), x[:512], y[:512], epochs=1, lr=0.05)]
    for s in range(2):
        benign.setdefault("FedAvg IID rounds: small CNN", []).extend(M.fedavg(M.small_cnn(s), x, y, clients=4, rounds=5))
        benign.setdefault("FedAvg IID rounds: LeNet", []).extend(M.fedavg(M.lenet(s), x, y, clients=4, rounds=5, lr=0.1))
        benign.setdefault("FedAvg non-IID rounds: small CNN", []).extend(fedavg_non_iid(M.small_cnn(s), x, y, rounds=5))

    trained_cnn = benign["trained: small CNN"][1]
    trained_lenet = benign["trained: LeNet"][1]
    tv = torchvision.models.resnet18(num_classes=10)
    bases = {"small CNN": M.small_cnn(0), "small CNN trained": trained_cnn, "LeNet": M.lenet(0),
             "LeNet trained": trained_lenet, "ResNet-18": M.resnet18(0), "torchvision ResNet-18": tv}
    malicious: dict[str, list] = {}
    for bins in (64, 128, 512):
        for name in ("small CNN", "small CNN trained", "LeNet", "ResNet-18"):
            malicious.setdefault("Robbing the Fed imprint", []).append((M.with_imprint(bases[name], bins=bins, seed=bins), bases[name]))
    for name, base in bases.items():
        for t in range(10):
            malicious.setdefault("class fishing (cls_attack)", []).append((M.class_fishing(base, t), base))
            malicious.setdefault("class fishing, target row kept", []).append((M.class_fishing(base, t, keep_target_row=True), base))
            malicious.setdefault("feature fishing", []).append((M.feature_fishing(base, t, feature=3 * t), base))

    stats = {"class rank ratio (min)": [], "bias gap (max)": [], "mean top probability, unanimous (max)": [],
             "sample gradient share (max)": [], "label gradient share (max)": [], "imprint rank ratio (min)": []}
    rows = []
    for group, models in benign.items():
        flagged = 0
        for model in models:
            results = [inspect_model(model, batch=b) for b in (None, batch, skewed)] + [inspect_model(model.state_dict(), model)]
            flagged += any(not r.ok for r in results)
            for r in results[1:3]:
                c = r.checks
                stats["class rank ratio (min)"].append(c["class_fishing"]["rank_ratio"])
                stats["bias gap (max)"].append(c["class_fishing"]["bias_gap"])
                if c["output_collapse"]["unanimous"]:
                    stats["mean top probability, unanimous (max)"].append(c["output_collapse"]["mean_probability"])
                stats["sample gradient share (max)"].append(c["gradient_concentration"]["sample_share"])
                stats["label gradient share (max)"].append(c["gradient_concentration"]["class_share"])
                if c["imprint"]["min_rank_ratio"] is not None:
                    stats["imprint rank ratio (min)"].append(c["imprint"]["min_rank_ratio"])
        rows.append(("benign", group, len(models), flagged, flagged / len(models)))
    for group, models in malicious.items():
        caught = caught_weights = caught_batch = 0
        for model, expected in models:
            weights_only = inspect_model(model)
            with_ref = inspect_model(model, expected, batch=batch)
            caught_weights += not weights_only.ok
            caught_batch += any(r.startswith("gradient concentration") for r in with_ref.reasons)
            caught += not (weights_only.ok and with_ref.ok)
        rows.append(("malicious", group, len(models), caught, caught / len(models), caught_weights, caught_batch))

    print(f"inspect_model: {sum(r[2] for r in rows if r[0] == 'benign')} benign and "
          f"{sum(r[2] for r in rows if r[0] == 'malicious')} malicious models, {time.time() - start:.0f} s\n")
    print("| set | models | flagged | rate | by weights alone | by the batch checks |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if r[0] == "benign":
            print(f"| {r[1]} | {r[2]} | {r[3]} | FP {r[4]:.0%} | | |")
        else:
            print(f"| {r[1]} | {r[2]} | {r[3]} | detection {r[4]:.0%} | {r[5]} | {r[6]} |")
    fp = sum(r[3] for r in rows if r[0] == "benign")
    n = sum(r[2] for r in rows if r[0] == "benign")
    det = sum(r[3] for r in rows if r[0] == "malicious")
    m = sum(r[2] for r in rows if r[0] == "malicious")
    print(f"\ndetection {det}/{m} = {det / m:.1%}; false positives {fp}/{n} = {fp / n:.1%}\n")
    thresholds = {"class rank ratio (min)": f"< {I.RANK_ONE_RATIO:g}", "imprint rank ratio (min)": f"< {I.RANK_ONE_RATIO:g}",
                  "bias gap (max)": f"> {I.BIAS_GAP_LOGITS:g}", "mean top probability, unanimous (max)": "(reported only)",
                  "sample gradient share (max)": f"> {I.CONCENTRATION_SHARE}", "label gradient share (max)": f"> {I.CONCENTRATION_SHARE}"}
    print("| benign statistic | worst benign value | flagged when |")
    print("|---|---|---|")
    for k, v in stats.items():
        worst = (min(v) if "(min)" in k else max(v)) if v else float("nan")
        print(f"| {k} | {worst:.3g} | {thresholds[k]} |")


if __name__ == "__main__":
    main()
