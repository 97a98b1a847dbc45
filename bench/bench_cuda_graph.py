"""CUDA graphs in the attacks' batched optimiser: iterations per second eager vs graphed, and how far apart
the two final iterates are (issue 14, "GPU").

    python bench/bench_cuda_graph.py [--model resnet18|lenet] [--batch 16] [--iterations 200] [--restarts 4]

The setting of ``configs/papers/huang2021-gradprune-0.9-b16.yaml``: ResNet-18 (CIFAR stem, train mode), FedSGD,
GradPrune 0.9, GradInversion's objective (cosine on the kept coordinates, TV 0.05, BatchNorm prior 1e-3
with exact statistics, group consistency every 500), random CIFAR-sized images in [0, 1] (the speed does
not depend on the pixels). Both loops start from the same images; each is timed after its own warm-up,
with a device synchronisation before reading the clock. Prediction before measuring: the eager loop is
host-bound (~75 ms per iteration at B=1 and at B=16 alike on an H100), the GPU work a few ms, so the
graphed loop should be >= 5x faster and agree to float32 rounding (sign of the gradient: a handful of
coordinates can flip where the gradient is ~0, so agreement is checked on the objective too).
"""

from __future__ import annotations

import argparse
import time

import torch

from guardfl.defenses import GradPrune
from guardfl.redteam import ThreatModel, simulate_client
from guardfl.redteam.attacks.optimisation.engine import ObjectiveWeights, Replica
from guardfl.redteam.attacks.optimisation.optimiser import evaluate_batched, optimise_batched
from guardfl.redteam.modality.image.models import LeNetZhu, resnet18_cifar, wide_init_


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="resnet18", choices=["resnet18", "lenet"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--iterations", type=int, default=200)
    ap.add_argument("--restarts", type=int, default=4)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = resnet18_cifar((3, 32, 32), 10) if args.model == "resnet18" else wide_init_(LeNetZhu((3, 32, 32), 10))
    x = torch.rand(args.batch, 3, 32, 32)
    y = torch.arange(args.batch) % 10
    obs = simulate_client(model, x, y, GradPrune(0.9, seed=0)).to(dev)
    bn = "exact" if args.model == "resnet18" else "none"
    knowledge = ThreatModel(labels="known", bn=bn).knowledge(obs).to(dev)
    replica = Replica(obs, knowledge, ObjectiveWeights("cosine", tv=0.05, bn=1e-3 if bn == "exact" else 0.0,
                                                       group=1e-2), dev)
    f = lambda z, a: replica.objective(z, knowledge.labels, a)  # noqa: E731
    x0 = torch.rand(args.restarts, args.batch, 3, 32, 32, generator=torch.Generator().manual_seed(1)).to(dev)
    out = {}
    for graphed in (False, True):
        optimise_batched(f, x0, iterations=3, lr=0.1, bounds=(0, 1), group_every=500, cuda_graph=graphed)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        xs = optimise_batched(f, x0, iterations=args.iterations, lr=0.1, bounds=(0, 1), group_every=500, cuda_graph=graphed)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        out[graphed] = (xs, dt, evaluate_batched(f, xs).cpu())
        print(f"{'graphed' if graphed else 'eager  '}: {args.iterations / dt:7.1f} it/s ({1000 * dt / args.iterations:.2f} ms/it), "
              f"objectives {[round(float(v), 5) for v in out[graphed][2]]}", flush=True)
    (xe, te, oe), (xg, tg, og) = out[False], out[True]
    print(f"speed-up x{te / tg:.1f}; max |x_eager - x_graph| {float((xe - xg).abs().max()):.2e}, "
          f"mean {float((xe - xg).abs().mean()):.2e}; max objective difference {float((oe - og).abs().max()):.2e}; "
          f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
