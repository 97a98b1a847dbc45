"""What the integrations cost, measured side by side in one run (interleaved repeats, medians).

    python bench/bench_integrations.py [--rounds 5] [--model resnet18|lenet] [--json out.json]

- ``local_update`` round vs the same round written by hand with ``guardfl.wrap`` (Identity and Outpost):
  the helper's overhead (state-dict snapshot and delta) should be small (target <= 1.10x);
- ``GuardUpdateMod`` on a reply of the model's size vs Flower's own ``LocalDpMod`` on the same reply (both
  convert the ArrayRecord to NumPy and back; target <= 2x);
- NVFlare: ``GuardUpdateFilter(GradPrune(0.9))`` vs NVFlare's own ``PercentilePrivacy(percentile=90)`` on the
  same ``WEIGHT_DIFF`` task result (time per result, target <= 2x; and what each sends: the fraction of
  zeros and of the delta's squared norm kept). ``PercentilePrivacy`` takes one cutoff over all arrays and
  clips what it keeps to +-gamma (run here with gamma large enough not to clip, and at its defaults
  percentile=10, gamma=0.01, for reference); GradPrune keeps each array's top 10 %;
- a red-team ``train_fn`` round under ``TrainingCapture`` (global forward hooks + TorchFunctionMode) vs the
  same round without it (target <= 1.25x).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import guardfl
from guardfl.defenses import GradPrune, Identity, Outpost
from guardfl.integrations.torch import local_update
from guardfl.redteam.client.capture import TrainingCapture
from guardfl.redteam.modality.image.models import LeNetZhu, resnet18_cifar


def hand_round(model, loader, defense):
    opt = guardfl.wrap(torch.optim.SGD(model.parameters(), lr=0.01), defense, model=model)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt.new_round()
    for x, y in loader:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return {k: v - start[k] for k, v in model.state_dict().items()}


def interleaved(fns: dict, repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5, help="timed repeats per configuration")
    ap.add_argument("--model", default="resnet18", choices=["resnet18", "lenet"])
    ap.add_argument("--batches", type=int, default=4, help="local steps per round")
    ap.add_argument("--json", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's); 1 on a machine shared with "
                    "other jobs, where OpenMP's threads wait on each other")
    args = ap.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    make = (lambda: resnet18_cifar((3, 32, 32), 10)) if args.model == "resnet18" else (lambda: LeNetZhu((3, 32, 32), 10))
    base = make()
    data = TensorDataset(torch.rand(16 * args.batches, 3, 32, 32), torch.randint(0, 10, (16 * args.batches,)))
    loader = DataLoader(data, batch_size=16)
    params = sum(p.numel() for p in base.parameters())
    print(f"model {args.model} ({params / 1e6:.2f}M params), {args.batches} local steps of 16, {torch.get_num_threads()} threads")
    results: dict[str, dict] = {}
    fresh = lambda: copy.deepcopy(base)  # noqa: E731
    sgd = lambda p: torch.optim.SGD(p, lr=0.01)  # noqa: E731

    for label, defense in (("identity", Identity()), ("outpost", Outpost())):
        t = interleaved({
            "hand": lambda: hand_round(fresh(), loader, defense),
            "local_update": lambda: local_update(fresh(), loader, sgd, defense),
        }, args.rounds)
        ratio = t["local_update"] / t["hand"]
        results[f"local_update_{label}"] = {"hand_s": t["hand"], "helper_s": t["local_update"], "ratio": ratio,
                                            "pass": ratio <= 1.10}
        print(f"local_update ({label}): {t['local_update']:.3f}s vs hand-written {t['hand']:.3f}s -> {ratio:.2f}x "
              f"[{'PASS' if ratio <= 1.10 else 'MISS'} <= 1.10]")

    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    try:
        from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
        from flwr.clientapp.mod import LocalDpMod

        from guardfl.integrations.flower import GuardUpdateMod, train_message
    except ImportError:
        print("flwr not installed: GuardUpdateMod not measured (pip install 'guardfl[flower]')")
    else:
        import logging

        logging.getLogger("flwr").setLevel(logging.WARNING)
        sent = base.state_dict()
        msg = train_message(sent)
        trained = {k: v + 0.01 * torch.randn_like(v) if v.is_floating_point() else v for k, v in sent.items()}
        reply_content = lambda: RecordDict({"arrays": ArrayRecord({k: Array(v.numpy()) for k, v in trained.items()}),  # noqa: E731
                                            "metrics": MetricRecord({"num-examples": 1})})
        app = lambda m, c: Message(reply_content(), reply_to=m)  # noqa: E731
        ctx = Context(run_id=0, node_id=1, node_config={}, state=RecordDict(), run_config={})
        ours, flowers = GuardUpdateMod(GradPrune(0.9)), LocalDpMod(clipping_norm=10.0, sensitivity=1.0, epsilon=1.0, delta=1e-5)
        t = interleaved({
            "app only": lambda: app(msg, ctx),
            "LocalDpMod": lambda: flowers(msg, ctx, app),
            "GuardUpdateMod": lambda: ours(msg, ctx, app),
        }, args.rounds)
        own = t["GuardUpdateMod"] - t["app only"]
        ref = t["LocalDpMod"] - t["app only"]
        ratio = own / ref
        results["update_mod"] = {"mod_s": own, "localdp_s": ref, "ratio": ratio, "pass": ratio <= 2.0}
        print(f"GuardUpdateMod(GradPrune 0.9): {own * 1e3:.1f} ms vs LocalDpMod {ref * 1e3:.1f} ms on the same reply "
              f"-> {ratio:.2f}x [{'PASS' if ratio <= 2.0 else 'MISS'} <= 2.0]")

    try:
        import numpy as np
        from nvflare.apis.dxo import DXO, DataKind, from_shareable
        from nvflare.apis.fl_context import FLContext
        from nvflare.app_common.filters import PercentilePrivacy

        from guardfl.integrations.nvflare import GuardUpdateFilter
    except ImportError:
        print("nvflare not installed: GuardUpdateFilter not measured (pip install 'guardfl[nvflare]')")
    else:
        import logging

        logging.getLogger("nvflare").setLevel(logging.WARNING)
        diff = {k: (0.01 * torch.randn_like(v)).numpy() if v.is_floating_point() else np.zeros_like(v.numpy())
                for k, v in base.state_dict().items()}
        result = lambda: DXO(DataKind.WEIGHT_DIFF, {k: v.copy() for k, v in diff.items()}).to_shareable()  # noqa: E731
        fl_ctx = FLContext()
        filters = {"GuardUpdateFilter": GuardUpdateFilter(GradPrune(0.9)),
                   "PercentilePrivacy": PercentilePrivacy(percentile=90, gamma=1e9),
                   "PercentilePrivacy defaults": PercentilePrivacy()}
        fns = {"result only": result, **{name: (lambda f=f: f.process(result(), fl_ctx)) for name, f in filters.items()}}
        # the first call of each is reported as "cold", then four untimed calls, then the timed ones
        cold = interleaved(fns, 1)
        for _ in range(4):
            interleaved(fns, 1)
        t = interleaved(fns, args.rounds)
        total = sum(float((v.astype(np.float64) ** 2).sum()) for v in diff.values())
        sent = {}
        for name, f in filters.items():
            out = from_shareable(f.process(result(), fl_ctx)).data
            flat = np.concatenate([np.asarray(v, dtype=np.float64).ravel() for v in out.values()])
            kept = sum(float((np.asarray(v, dtype=np.float64) ** 2).sum()) for v in out.values())
            sent[name] = {"s": t[name] - t["result only"], "cold_s": cold[name] - cold["result only"], "zero_fraction": float((flat == 0).mean()), "energy_kept": kept / total}
        own, ref = sent["GuardUpdateFilter"]["s"], sent["PercentilePrivacy"]["s"]
        ratio = own / ref
        results["nvflare_filter"] = {**{k.replace(" ", "_"): v for k, v in sent.items()}, "ratio": ratio, "pass": ratio <= 2.0}
        for name, row in sent.items():
            print(f"  {name}: {row['s'] * 1e3:.1f} ms per result warm ({row['cold_s'] * 1e3:.0f} ms cold), {row['zero_fraction']:.3f} zeros, "
                  f"{row['energy_kept']:.3f} of the delta's squared norm kept")
        print(f"GuardUpdateFilter(GradPrune 0.9) vs PercentilePrivacy(90): {ratio:.2f}x [{'PASS' if ratio <= 2.0 else 'MISS'} <= 2.0]")

    def train_fn():
        model = fresh()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()

    def captured():
        with TrainingCapture():
            train_fn()

    t = interleaved({"plain": train_fn, "captured": captured}, args.rounds)
    ratio = t["captured"] / t["plain"]
    results["capture"] = {"plain_s": t["plain"], "captured_s": t["captured"], "ratio": ratio, "pass": ratio <= 1.25}
    print(f"TrainingCapture: {t['captured']:.3f}s vs {t['plain']:.3f}s -> {ratio:.2f}x [{'PASS' if ratio <= 1.25 else 'MISS'} <= 1.25]")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"model": args.model, "params": params, "results": results}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
