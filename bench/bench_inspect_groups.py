"""What the isolation check's group test (``guardfl.inspect_groups``) costs ``inspect_model``: a ratio against
the same inspection without it (pairs of rows only) in the same run.

Models: FC-2 on 64 LFW faces in [0, 1] (honest, where units firing for every face form a large group, and
with the whole-layer trap of 3 rows per cut, ``trap_weights columns: 3``), FC-2 on a batch of 32 normalised
CIFAR-10 images (honest), and ResNet-18 on that batch (honest, no reference: the torch adapter's call).
Each inspection is timed with and without the group test, interleaved, ``--repeats`` times; medians.

    .venv/bin/python bench/bench_inspect_groups.py [--repeats 3] [--threads 2] [--no-resnet]

Measure on a quiet machine (see the README's note on 2 busy cores).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--resnet", action=argparse.BooleanOptionalAction, default=True)
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


if __name__ == "__main__":
    main()
