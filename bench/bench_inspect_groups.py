"""What the isolation check's group test (``guardfl.inspect_groups``) costs ``inspect_model``: a ratio against
the same inspection without it (pairs of rows only) in the same run.

Models: FC-2 on 64 LFW faces in [0, 1] (honest, where units firing for every face form a large group, and
with the whole-layer trap of 3 rows per cut, ``trap_weights columns: 3``), FC-2 on a batch of 32 normalised
CIFAR-10 images (honest), and ResNet-18 on that batch (honest, no reference: the torch adapter's call).
Each inspection is timed with and without the group test, interleaved, ``--repeats`` times; medians.

Then (``--wide``, on by default) what testing wide group pairs at the batch's width (``_factor``, 2026-11-27)
saves against testing each at its own width, one by one (the baseline, the same run: the code before): the honest FC-2 with 4,096 units
on 12 CIFAR-10 images in [0, 1] (units firing for all but a few images form large groups), and a server's
stall: FC-2 with 1,600 units on 64 normalised CIFAR-10 images, 800 rows firing for every image and 800 each
cut at the bottom of its own direction (all but one or two images), so that hundreds of group pairs hold
~800 rows each.

    .venv/bin/python bench/bench_inspect_groups.py [--repeats 3] [--threads 2] [--no-resnet] [--no-wide]

Measure on a quiet machine (see the README's note on 2 busy cores).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import guardfl.inspect_groups as groups
import guardfl.inspect_isolation as isolation
from guardfl.inspect import inspect_model
from guardfl.redteam.attacks.malicious.trap_chain import auto_rho, disguise
from guardfl.redteam.attacks.malicious.trap_weights import craft, trap_layers
from guardfl.redteam.modality.image.data import lfw_faces
from guardfl.redteam.modality.image.models import FC2, resnet18_cifar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests import malicious as M  # noqa: E402 - the benchmark's CIFAR-10 sample, as bench_inspect.py

WITH_GROUPS = isolation.group_sets


def without_groups(d, *args):
    return torch.zeros(0, d.shape[0], dtype=torch.bool), {}


def seconds(received, reference, batch, groups: bool) -> float:
    isolation.group_sets = WITH_GROUPS if groups else without_groups
    try:
        start = time.perf_counter()
        inspect_model(received, reference, batch=batch)
        return time.perf_counter() - start
    finally:
        isolation.group_sets = WITH_GROUPS


def cases(resnet: bool):
    faces, labels = lfw_faces(10)
    x, y, aux = faces[:64], labels[:64], faces[64:]
    torch.manual_seed(0)
    fc2 = FC2((1, 25, 25), 10)
    gen = torch.Generator().manual_seed(0)
    trap = craft(fc2, trap_layers(fc2, (1, 25, 25)), (1, 25, 25), aux, 2, 0.0, (0.0, 1.0), gen, samples=64, per_cut=3)
    disguise(trap.rows(), auto_rho(), (1, 25, 25), aux, gen)
    yield "FC-2, 64 LFW faces in [0, 1], honest", fc2, fc2, (x, y)
    yield "FC-2, 64 LFW faces in [0, 1], trap of 3 rows per cut", trap.sent, fc2, (x, y)
    cifar = M.cifar(32, offset=4000)
    torch.manual_seed(0)
    model = FC2()
    yield "FC-2, 32 normalised CIFAR-10 images, honest", model, model, cifar
    if resnet:
        torch.manual_seed(0)
        net = resnet18_cifar()
        yield "ResNet-18, 32 normalised CIFAR-10 images, no reference", net, None, cifar


def stall(units: int = 1600, n: int = 64):
    """The server's stall (see the module docstring): half the rows fire for every image (bias 1, tiny
    weights), half are cut at the bottom of their own direction on the attacker's images (quantile 1.5 / n)."""
    x, y = M.cifar(n, offset=4500)
    aux, _ = M.cifar(512, offset=3000)
    torch.manual_seed(0)
    model = FC2((3, 32, 32), 10, hidden=units)
    first = model.net[1]
    g = torch.Generator().manual_seed(0)
    half = units // 2
    with torch.no_grad():
        first.weight[:half] = 1e-4 * torch.randn(half, first.in_features, generator=g)
        first.bias[:half] = 1.0
        m = torch.nn.functional.normalize(torch.randn(units - half, first.in_features, generator=g), dim=1)
        first.weight[half:] = m
        first.bias[half:] = -torch.quantile(aux.flatten(1) @ m.T, 1.5 / n, dim=0)
    return model, (x, y)


def wide_cases():
    x, y = M.cifar(12, offset=2000)
    torch.manual_seed(0)
    honest = FC2((3, 32, 32), 10, hidden=4096)
    yield "FC-2 (4,096 units), 12 CIFAR-10 images in [0, 1], honest", honest, honest, (x * M.CIFAR_STD + M.CIFAR_MEAN, y)
    model, batch = stall()
    yield "FC-2 (1,600 units), 64 normalised CIFAR-10 images, 800 + 800 stalling rows", model, None, batch


PARTS = groups._parts


def own_width_parts(d, jobs, members):
    """The baseline: pairs of up to ``BATCH_ROWS`` rows as ``_parts`` batches them, wider ones one by one
    at their own width (their rows themselves, no ``_factor``)."""
    rows = [torch.cat([members[big], members[small]]) for big, small in jobs]
    yield from PARTS(d, [job for job, r in zip(jobs, rows) if r.numel() <= groups.BATCH_ROWS], members)
    for job, r in zip(jobs, rows):
        if r.numel() > groups.BATCH_ROWS:
            yield [job], d[:, r][None]


def factored_seconds(received, reference, batch, factored: bool) -> tuple[float, dict]:
    groups._parts = PARTS if factored else own_width_parts
    try:
        start = time.perf_counter()
        found = inspect_model(received, reference, batch=batch)
        return time.perf_counter() - start, found.checks["isolation"]["layers"]
    finally:
        groups._parts = PARTS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--resnet", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--wide", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"inspect_model with the group test / without it (pairs only), median of {args.repeats}, {args.threads} threads\n")
    print("| model | with groups (s) | pairs only (s) | ratio |\n|---|---|---|---|")
    for label, received, reference, batch in cases(args.resnet):
        seconds(received, reference, batch, True)  # warm-up
        timed = {True: [], False: []}
        for _ in range(args.repeats):
            for groups in (True, False):
                timed[groups].append(seconds(received, reference, batch, groups))
        a, b = statistics.median(timed[True]), statistics.median(timed[False])
        print(f"| {label} | {a:.3f} | {b:.3f} | {a / b:.2f} |", flush=True)
    if not args.wide:
        return
    print(f"\ninspect_model, wide group pairs at the batch's width / one by one at their own width (baseline), median of "
          f"{args.repeats}\n")
    print("| model | group pairs (separating) | batch width (s) | own width (s) | speed-up |\n|---|---|---|---|---|")
    for label, received, reference, batch in wide_cases():
        timed, layers = {True: [], False: []}, {}
        for _ in range(args.repeats):
            for factored in (True, False):
                t, layers[factored] = factored_seconds(received, reference, batch, factored)
                timed[factored].append(t)
        if layers[True] != layers[False]:
            raise SystemExit(f"{label}: the counts differ at the batch's width: {layers[True]} != {layers[False]}")
        layer = layers[True]["net.1"]
        a, b = statistics.median(timed[True]), statistics.median(timed[False])
        print(f"| {label} | {layer['row_groups']} groups ({layer['separating_groups']}) | {a:.2f} | {b:.2f} | "
              f"{b / a:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
