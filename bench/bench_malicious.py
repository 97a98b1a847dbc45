"""A malicious server against defended clients: Robbing the Fed and Fishing on CIFAR-10 (issue 16).

    python bench/bench_malicious.py [--models convnet resnet18] [--batches 64 128] [--fishing-iterations 300]
                                    [--defenses none outpost gradprune dpsgd] [--json bench/results/malicious.json]

For each model (the small CNN ``convnet`` and ResNet-18 with the CIFAR stem, PyTorch's default init, train
mode) x batch size x defense, one client batch of the shared CIFAR-10 sample (``../shared/data/
cifar10-train-5k.npz``, images 0..B-1 in order) is attacked by

- ``robbing_the_fed`` (bins 4 per sample, cut-offs from the brightness of images 4000-4999 as the
  attacker's public data): how many private images come back EXACTLY (SSIM > 0.95 after matching), and
  the best SSIM;
- ``fishing`` (class fishing on the batch's rarest class, then Inverting Gradients at
  ``--fishing-iterations`` x 2 restarts: far below the paper's 24,000, a CPU budget, so its SSIMs are
  lower bounds): the fished sample's SSIM (the best over the batch) and whether it is exact;

(``--eval-mode``: Fishing also against a client in eval mode, labelled as a comparison only), and
``guardfl.inspect_model`` (when present) judges each crafted model against the honest one: its
verdict and first reason. Defenses: none, Outpost (paper defaults), GradPrune 0.9, DP-SGD (noise 1.0,
clip 1.0; Opacus refuses BatchNorm, so the DP rows train ``guardfl.dp_compatible(model)``, GroupNorm).
The client is simulated through the real defense path (``ClientQuery`` -> ``simulate_client``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

import guardfl
from guardfl.redteam import ThreatModel, simulate_client
from guardfl.redteam.modality.image import metrics
from guardfl.redteam.attacks import Setting, get
from guardfl.redteam.client.simulate import ClientQuery, FedSGD
from guardfl.redteam.modality.image.models import build_model

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "cifar10-train-5k.npz"
DEFENSES = {
    "none": None,
    "outpost": {"kind": "outpost"},
    "gradprune": {"kind": "gradprune", "ratio": 0.9},
    "dpsgd": {"kind": "dpsgd", "noise_multiplier": 1.0, "max_grad_norm": 1.0},
}


def load(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    d = np.load(path)
    x = torch.from_numpy(d["x"]).permute(0, 3, 1, 2).float() / 255.0
    return x, torch.from_numpy(d["y"]).long()


def inspect(sent: torch.nn.Module, honest: torch.nn.Module) -> str:
    if not hasattr(guardfl, "inspect_model"):
        return "n/a (no guardfl.inspect_model)"
    verdict = guardfl.inspect_model(sent, reference=honest)
    return "ok" if verdict.ok else f"flagged: {verdict.reasons[0][:70]}"


def one(attack: str, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, defense, aux, fishing_iterations: int,
        train_mode: bool = True):
    protocol = FedSGD()
    setting = Setting.of(simulate_client(model, x, y, defense, protocol, train_mode=train_mode))
    client = ClientQuery(x, y, defense, protocol, train_mode=train_mode)
    budget = {"seed": 0} if attack == "robbing_the_fed" else {"seed": 0, "iterations": fishing_iterations, "restarts": 2}
    threat = ThreatModel(server="malicious", labels="known", aux=aux if attack == "robbing_the_fed" else None)
    t0 = time.perf_counter()
    rec = get(attack, **budget).interrogate(client, setting, threat)
    seconds = time.perf_counter() - t0
    ssim = [p["ssim"] for p in metrics.evaluate(rec, x, y, data_range=(0, 1))["per_image"]]
    return {"exact": sum(s > 0.95 for s in ssim), "best_ssim": max(ssim), "seconds": seconds,
            "queries": rec.info.get("queries"), "inspect": inspect(rec.info["malicious_model"], model),
            **{k: rec.info[k] for k in ("candidates", "target_class", "target_samples") if k in rec.info}}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["convnet", "resnet18"])
    ap.add_argument("--batches", nargs="+", type=int, default=[64, 128])
    ap.add_argument("--defenses", nargs="+", default=list(DEFENSES), choices=list(DEFENSES))
    ap.add_argument("--attacks", nargs="+", default=["robbing_the_fed", "fishing"])
    ap.add_argument("--fishing-iterations", type=int, default=300)
    ap.add_argument("--eval-mode", action="store_true",
                    help="also run Fishing against a client in eval mode: a labelled comparison (Wang et al. 2024 "
                         "found Fishing's published strength needs it); a real client trains in train mode")
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "malicious.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    x_all, y_all = load(args.data)
    aux = (x_all[4000:], y_all[4000:])
    rows = []
    print("model | B | defense | attack | exact | best SSIM | s | queries | inspect_model")
    for name in args.models:
        for b in args.batches:
            x, y = x_all[:b], y_all[:b]
            for dname in args.defenses:
                torch.manual_seed(0)
                model = build_model(name, (3, 32, 32), 10)
                if dname == "dpsgd":
                    model = guardfl.dp_compatible(model)
                runs = [(a, True) for a in args.attacks]
                if args.eval_mode and "fishing" in args.attacks:
                    runs.append(("fishing", False))
                for attack, train_mode in runs:
                    label = attack if train_mode else f"{attack} [EVAL-MODE client: comparison only]"
                    if dname == "dpsgd" and not train_mode:
                        continue  # Opacus trains in train mode only
                    row = {"model": name, "batch": b, "defense": dname, "attack": label, "train_mode": train_mode}
                    try:
                        row.update(one(attack, model, x, y, DEFENSES[dname], aux, args.fishing_iterations, train_mode))
                    except Exception as err:  # noqa: BLE001  a row that cannot run is reported, not skipped
                        row.update(exact=0, best_ssim=float("nan"), seconds=0.0, queries=None,
                                   inspect=f"ERROR {type(err).__name__}: {str(err)[:80]}")
                    rows.append(row)
                    print(f"{name} | {b} | {dname} | {label} | {row['exact']} of {b} | {row['best_ssim']:.3f} | "
                          f"{row['seconds']:.1f} | {row['queries']} | {row['inspect']}", flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"rows": rows, "fishing_iterations": args.fishing_iterations}, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
