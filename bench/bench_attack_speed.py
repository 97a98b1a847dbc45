"""Attack speed: Inverting Gradients iterations per second, batched restarts vs a straightforward loop.

    python bench/bench_attack_speed.py [--device auto] [--iterations 10] [--restarts 4]

Both run the same maths (cosine + TV, signed Adam, box constraint) on the same observation, measured in
the same run: the straightforward loop is module-based (``autograd.grad(create_graph=True)``) and runs
the restarts one after another; guardfl's engine runs all restarts at once (``torch.func.vmap``).
Reported: restart-iterations per second and the speed-up (target >= 2x).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from guardfl.redteam import ThreatModel, simulate_client
from guardfl.redteam.attacks.optimisation import objectives as obj
from guardfl.redteam.attacks.optimisation.engine import ObjectiveWeights, Replica
from guardfl.redteam.attacks.optimisation.optimiser import optimise_batched
from guardfl.redteam.attacks.compute import resolve_device
from guardfl.redteam.modality.image.models import LeNetZhu, resnet18_cifar


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def straightforward(model, observed, labels, x0, iterations, lr=0.1, tv=1e-2):
    """The textbook loop: one restart after another, module forward, autograd.grad(create_graph=True)."""
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for r in range(x0.shape[0]):
        x = x0[r].clone().requires_grad_(True)
        opt = torch.optim.Adam([x], lr=lr)
        for _ in range(iterations):
            opt.zero_grad()
            g = torch.autograd.grad(F.cross_entropy(model(x), labels), params, create_graph=True)
            loss = obj.cosine_distance(obj.flatten(g), obj.flatten(observed)) + tv * obj.total_variation(x)
            loss.backward()
            x.grad.sign_()
            opt.step()
            with torch.no_grad():
                x.clamp_(0, 1)
        out.append(x.detach())
    return torch.stack(out)


def measure(name, model, shape, batch, restarts, iterations, device):
    torch.manual_seed(0)
    x = torch.rand(batch, *shape)
    y = torch.arange(batch) % 10
    obs = simulate_client(model, x, y).to(device)
    knowledge = ThreatModel(labels="known").knowledge(obs)
    replica = Replica(obs, knowledge, ObjectiveWeights("cosine", tv=1e-2), device)
    labels = knowledge.labels
    x0 = torch.rand(restarts, batch, *shape, device=device)
    f = lambda xi, a: replica.objective(xi, labels, a)  # noqa: E731

    victim = obs.model.to(device).train()
    observed = [obs.update[n] for n in obs.param_names]
    # warm-up both
    optimise_batched(f, x0, iterations=1, lr=0.1, bounds=(0, 1))
    straightforward(victim, observed, labels, x0[:1], 1)
    _sync(device)
    t = time.perf_counter()
    optimise_batched(f, x0, iterations=iterations, lr=0.1, bounds=(0, 1))
    _sync(device)
    batched = time.perf_counter() - t
    t = time.perf_counter()
    straightforward(victim, observed, labels, x0, iterations)
    _sync(device)
    loop = time.perf_counter() - t
    work = restarts * iterations
    return {"model": name, "batch": batch, "restarts": restarts, "iterations": iterations,
            "batched_it_per_s": work / batched, "loop_it_per_s": work / loop, "speedup": loop / batched}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--restarts", type=int, default=4)
    ap.add_argument("--models", default="lenet,resnet18")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    rows = []
    for name in args.models.split(","):
        for batch in (1, 4):
            model = LeNetZhu((3, 32, 32), 10) if name == "lenet" else resnet18_cifar((3, 32, 32), 10)
            iters = args.iterations if name == "lenet" or device.type == "cuda" else max(2, args.iterations // 5)
            rows.append(measure(name, model, (3, 32, 32), batch, args.restarts, iters, device))
            r = rows[-1]
            print(f"{device.type}  {r['model']:9s} batch {r['batch']}  {r['restarts']} restarts  "
                  f"batched {r['batched_it_per_s']:8.2f} it/s   loop {r['loop_it_per_s']:8.2f} it/s   "
                  f"speed-up {r['speedup']:5.2f}x  [{'PASS' if r['speedup'] >= 2 else 'MISS'} >= 2x]", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": str(device), "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
