"""How to batch restarts and samples of a gradient-matching attack on a GPU: milliseconds per Adam iteration
of GradInversion's objective on ResNet-18 (issue 14, "GPU"), for each way of batching, in one run.

    python bench/bench_gpu_objective.py [--batch 16] [--restarts 4] [--samples 1 4] [--iterations 30]
                                        [--modes vmap loop floor] [--profile]

The setting of ``configs/papers/huang2021-gradprune-0.9-b16.yaml`` (ResNet-18 CIFAR stem, train mode, FedSGD,
GradPrune 0.9, cosine on kept coordinates + TV + BatchNorm prior + group consistency), every iteration
recorded as a CUDA graph (``optimise_batched``'s GPU path). Modes:

- ``vmap``: samples x restarts as one nested ``torch.func.vmap`` (the default on a GPU);
- ``loop``: one ordinary forward per (sample, restart), summed before the one backward;
- ``floor``: NOT the attack: one forward + gradient + double backward of a single batch holding all
  S x R x B images (no per-restart weight gradients), the cost floor of that many images on this model.

``--plain-convs`` runs each mode first with PyTorch's own convolution double backward (what the replica
used before ``second_order_convs_``), then as the attacks run. ``--benchmark``: cuDNN autotuning, as the
attacks' optimiser does on CUDA; ``--tf32``: allow TF32 (the attacks run in exact float32).

Prints ms per iteration and the GPU's achieved images per second for each; ``--profile`` adds the top CUDA
kernels of one graphed-free iteration of each mode (torch.profiler), to see where the time goes.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

from guardfl.defenses import GradPrune
from guardfl.redteam import ThreatModel, simulate_client
from guardfl.redteam.attacks.compute import exact_float32
from guardfl.redteam.attacks.optimisation.second_order import SecondOrderConv2d
from guardfl.redteam.attacks.optimisation.engine import ObjectiveWeights, Replica
from guardfl.redteam.attacks.optimisation.optimiser import optimise_batched
from guardfl.redteam.attacks.optimisation.targets import observation_target, stack_targets
from guardfl.redteam.modality.image.models import resnet18_cifar


def setting(samples: int, batch: int, dev: torch.device):
    torch.manual_seed(0)
    model = resnet18_cifar((3, 32, 32), 10)
    observations = []
    for s in range(samples):
        x = torch.rand(batch, 3, 32, 32)
        y = (torch.arange(batch) + s) % 10
        observations.append(simulate_client(model, x, y, GradPrune(0.9, seed=s)).to(dev))
    threat = ThreatModel(labels="known", bn="exact")
    knowledge = threat.knowledge(observations[0]).to(dev)
    replica = Replica(observations[0], knowledge, ObjectiveWeights("cosine", tv=0.05, bn=1e-3, group=1e-2), dev)
    targets = stack_targets([{**observation_target(o, threat.knowledge(o).to(dev), replica.pruned, dev),
                              "labels": threat.knowledge(o).to(dev).labels} for o in observations])
    return replica, targets


def run_mode(mode: str, samples: int, restarts: int, batch: int, iterations: int, dev: torch.device, profile: bool,
             channels_last: bool = False, plain_convs: bool = False):
    replica, targets = setting(samples, batch, dev)
    if plain_convs:  # PyTorch's own convolution double backward (with its unneeded weight-of-weight term)
        for m in replica.model.modules():
            if isinstance(m, SecondOrderConv2d):
                m.__class__ = torch.nn.Conv2d
    x0 = torch.rand(samples, restarts, batch, 3, 32, 32, generator=torch.Generator().manual_seed(1)).to(dev)
    if channels_last:
        # NHWC images and weights (what the H100's convolution kernels read), through the vmap folding
        replica.model.to(memory_format=torch.channels_last)
        replica.params = {n: p.detach() for n, p in replica.model.named_parameters() if n in replica.params}
        x0 = x0.permute(0, 1, 2, 4, 5, 3).contiguous().permute(0, 1, 2, 5, 3, 4)
    if mode == "floor":
        # one plain client batch of S*R*B images: forward, gradient, distance, double backward
        flat = x0.reshape(-1, 3, 32, 32)
        flat = flat.contiguous(memory_format=torch.channels_last) if channels_last else flat
        y = torch.arange(flat.shape[0], device=dev) % 10
        obj = lambda z, a: replica.objective(z.reshape(-1, 3, 32, 32), y)  # noqa: E731
        x0, call = flat[None], dict(iterations=iterations, lr=0.1, bounds=(0, 1), group_every=0)
    else:
        obj = lambda z, a, t: replica.objective(z, t["labels"], a, t)  # noqa: E731
        call = dict(iterations=iterations, lr=0.1, bounds=(0, 1), group_every=500, targets=targets,
                    vmap_restarts=mode == "vmap")
    torch.cuda.reset_peak_memory_stats()
    call["autotune"] = torch.backends.cudnn.benchmark
    optimise_batched(obj, x0, **{**call, "iterations": 3})  # warm-up (cuDNN plans)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    optimise_batched(obj, x0, **call)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / iterations
    images = samples * restarts * batch
    print(f"{mode:6s}{' NHWC' if channels_last else ''}{' plain-convs' if plain_convs else ''} S={samples} R={restarts} B={batch}: {1000 * dt:8.2f} ms/it, {images / dt:9.0f} images/s, "
          f"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB", flush=True)
    if profile:
        from torch.profiler import ProfilerActivity, profile as prof

        with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as p:
            optimise_batched(obj, x0, **{**call, "iterations": 2, "cuda_graph": False})
            torch.cuda.synchronize()
        print(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=70), flush=True)
        ops = [e for e in p.key_averages(group_by_input_shape=True) if e.key.startswith("aten::")]
        ops.sort(key=lambda e: -e.device_time_total)
        for e in ops[:25]:
            print(f"  {e.device_time_total / 2000:8.2f} ms/it  x{e.count // 2:<4d} {e.key:34s} {str(e.input_shapes)[:110]}")
    return dt


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--restarts", type=int, default=4)
    ap.add_argument("--samples", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--modes", nargs="+", default=["vmap", "loop", "floor"])
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--benchmark", action="store_true", help="torch.backends.cudnn.benchmark (autotuned kernels)")
    ap.add_argument("--channels-last", action="store_true", help="also run each mode in NHWC")
    ap.add_argument("--plain-convs", action="store_true", help="also run each mode with PyTorch's convolution backward")
    ap.add_argument("--tf32", action="store_true", help="allow TF32 (the attacks run without: exact_float32)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    dev = torch.device("cuda")
    torch.backends.cudnn.benchmark = args.benchmark
    with contextlib.nullcontext() if args.tf32 else exact_float32():
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
              f"TF32 convolutions {torch.backends.cudnn.allow_tf32}, matmul {torch.backends.cuda.matmul.allow_tf32}, "
              f"cudnn benchmark {torch.backends.cudnn.benchmark}", flush=True)
        measure(args, dev)


def measure(args, dev) -> None:
    for s in args.samples:
        base = None
        for mode in args.modes:
            for plain in (True, False) if args.plain_convs else (False,):
                for nhwc in (False, True) if args.channels_last else (False,):
                    dt = run_mode(mode, s, args.restarts, args.batch, args.iterations, dev, args.profile, nhwc, plain)
                    base = base or dt
                    print(f"    ratio to the first: {base / dt:.2f}x", flush=True)


if __name__ == "__main__":
    main()
