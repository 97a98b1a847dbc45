"""Step-time cost of each gradient defense on ResNet-18, measured side by side in one run.

    python bench/bench_defenses.py [--device cpu|cuda|auto] [--steps 15] [--json out.json]

For each defense it reports:
- the median step-time ratio guarded/plain (forward + backward + defense + SGD-momentum step);
- the defense's own median cost next to its floor, all measured in this run on the same gradients:
  an elementwise pass over all gradients (floor for sign), one ``torch.randn`` of the model's size
  (floor for noise), a straightforward per-layer ``kthvalue`` selection (floor for pruning/Outpost);
- the targets of the core issue, checked (CPU: sign ratio <= 1.05, noise <= 1.5x randn floor,
  GradPrune >= 2x faster than kthvalue, Outpost's firing step <= one kthvalue + 1.5x randn;
  GPU: every step ratio <= 1.05).
Plain and guarded steps are interleaved so that machine drift affects both alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import torchvision

from guardfl import wrap
from guardfl.defenses import GaussianNoise, GradPrune, Identity, LaplaceNoise, Outpost, SignCompression, StepContext


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn, device, repeats, setup=None):
    times = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--steps", type=int, default=15, help="timed steps per configuration")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).to(device)
    x = torch.randn(args.batch, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (args.batch,), device=device)
    defenses = {
        "identity": Identity(),
        "sign": SignCompression(),
        "gaussian": GaussianNoise(0.01),
        "laplace": LaplaceNoise(0.01),
        "gradprune-0.9": GradPrune(0.9),
        "gradprune-0.99": GradPrune(0.99),
        "gradprune-0.9-global": GradPrune(0.9, scope="global"),
        "outpost": Outpost(),
    }
    plain = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    guarded = {k: wrap(torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9), d) for k, d in defenses.items()}

    snapshot = [p.detach().clone() for p in model.parameters()]

    def restore():  # every timed step starts from the same weights (no drift, no divergence)
        with torch.no_grad():
            torch._foreach_copy_(list(model.parameters()), snapshot)

    def train_step(opt):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    # -- step-time ratios, interleaved -----------------------------------------------------------------
    for opt in [plain, *guarded.values()]:
        train_step(opt)  # warm-up
    step_times = {k: [] for k in ["plain", *guarded]}
    order = [("plain", plain), *guarded.items()]
    for rep in range(args.steps):
        r = rep % len(order)  # rotate, so that no configuration always runs first
        for k, opt in order[r:] + order[:r]:
            if k == "outpost":
                opt.new_round()  # measure the worst step: Outpost always fires at i = 1
            restore()
            _sync(device)
            t0 = time.perf_counter()
            train_step(opt)
            _sync(device)
            step_times[k].append(time.perf_counter() - t0)
    step = {k: statistics.median(v) for k, v in step_times.items()}

    # -- defense costs on fixed gradients, next to their floors ------------------------------------------
    restore()
    plain.zero_grad()
    F.cross_entropy(model(x), y).backward()
    params = [p for p in model.parameters()]
    grads0 = [p.grad.detach().clone() for p in params]
    work = [g.clone() for g in grads0]
    n_model = sum(g.numel() for g in grads0)

    def reset():
        torch._foreach_copy_(work, grads0)

    gen = torch.Generator(device=device).manual_seed(0)
    floors = {
        "elementwise pass": _median_time(lambda: torch._foreach_mul_(work, 1.0), device, args.steps, reset),
        "randn(model size)": _median_time(lambda: torch.randn(n_model, generator=gen, device=device), device, args.steps),
        "per-layer kthvalue": _median_time(
            lambda: [g.abs().reshape(-1).kthvalue(max(1, int(0.9 * g.numel()))) for g in work], device, args.steps, reset
        ),
    }
    weights = [p.detach() for p in params]
    # a fresh context per call, as every optimizer step builds one (a context records which gradients it has
    # seen finite; reusing it would skip the input check on the timed calls)
    cost = {k: _median_time(lambda d=d: d.apply_(work, StepContext(iteration=1, params=weights)), device, args.steps, reset)
            for k, d in defenses.items()}

    # -- report -------------------------------------------------------------------------------------------
    ms = lambda s: f"{1e3 * s:8.2f} ms"  # noqa: E731
    print(f"device: {device}  threads: {torch.get_num_threads()}  torch {torch.__version__}  "
          f"ResNet-18 ({n_model / 1e6:.2f}M params), batch {args.batch}, {args.steps} timed steps")
    print(f"\nplain step: {ms(step['plain'])}")
    print(f"{'defense':24s} {'step':>11s} {'ratio':>7s} {'defense cost':>13s}")
    for k in guarded:
        print(f"{k:24s} {ms(step[k])} {step[k] / step['plain']:7.3f} {ms(cost[k])}")
    print("\nfloors:")
    for k, v in floors.items():
        print(f"  {k:22s} {ms(v)}")

    sel, rnd, ew = floors["per-layer kthvalue"], floors["randn(model size)"], floors["elementwise pass"]
    if device.type == "cpu":
        targets = {
            "sign step ratio <= 1.05": step["sign"] / step["plain"] <= 1.05,
            "gaussian cost <= 1.5x randn": cost["gaussian"] <= 1.5 * rnd,
            "laplace cost <= 1.5x randn": cost["laplace"] <= 1.5 * rnd,
            "gradprune-0.9 >= 2x faster than kthvalue": cost["gradprune-0.9"] * 2 <= sel,
            "gradprune-0.99 >= 2x faster than kthvalue": cost["gradprune-0.99"] * 2 <= sel,
            "outpost firing step <= kthvalue + 1.5x randn": cost["outpost"] <= sel + 1.5 * rnd,
        }
    else:
        targets = {f"{k} step ratio <= 1.05": step[k] / step["plain"] <= 1.05 for k in guarded}
    print("\ntargets:")
    for k, ok in targets.items():
        print(f"  [{'PASS' if ok else 'MISS'}] {k}")
    ratios_vs_floor = {
        "sign cost / elementwise pass": cost["sign"] / ew,
        "gaussian cost / randn": cost["gaussian"] / rnd,
        "laplace cost / randn": cost["laplace"] / rnd,
        "gradprune-0.9 cost / kthvalue": cost["gradprune-0.9"] / sel,
        "outpost cost / (kthvalue + 1.5 randn)": cost["outpost"] / (sel + 1.5 * rnd),
    }
    for k, v in ratios_vs_floor.items():
        print(f"  {k:40s} {v:6.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "threads": torch.get_num_threads(), "step_s": step, "cost_s": cost,
                       "floors_s": floors, "targets": targets, "ratios_vs_floor": ratios_vs_floor}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
