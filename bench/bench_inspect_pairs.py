"""What the isolation check's pairwise tests cost now that every nested pair of rows is examined
(``guardfl.inspect_pairs``): the screened tests (bounds from matrix products, the rest tested exactly)
against every pair tested exactly, in the same run; both find the same pairs (checked here too).

Cases: honest FC-2 on 64 LFW faces in [0, 1] (uncentred inputs: many nested supports); FC-2 with 1,024
units on 64 normalised CIFAR-10 images with 1,016 decoy rows before an 8-row trap (the construction that
filled the old cap of 200,000 pairs); and the worst case a 4,096-unit layer (``ISOLATION_MAX_UNITS``) can
hold, every row in 5 levels of decoys (6.7 million nested pairs), on batches of 64 and 256.

    .venv/bin/python bench/bench_inspect_pairs.py [--repeats 3] [--threads 2] [--no-worst]

Measure on a quiet machine (see the README's note on 2 busy cores).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from guardfl.inspect_isolation import ISOLATION_PEEL, ISOLATION_READ_ERROR, ISOLATION_TOLERANCE
from guardfl.inspect_pairs import pair_sets
from guardfl.redteam.modality.image.data import lfw_faces
from guardfl.redteam.modality.image.models import FC2

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.guardfl.test_inspect_pairs import decoys_and_chain, trap_behind_decoys  # noqa: E402 - the tests' constructions


def first_layer(model, x, y):
    """The first linear layer's coefficients (batch x units: the summed loss's gradient into its outputs)
    and its inputs, in train mode."""
    model.train()
    seen = {}

    def keep(module, inputs, out):
        out.retain_grad()
        seen.update(z=out, a=inputs[0])

    hook = model.net[1].register_forward_hook(keep)
    F.cross_entropy(model(x), y, reduction="sum").backward()
    hook.remove()
    return seen["z"].grad.double(), seen["a"].detach().double()


def cases(worst: bool):
    faces, labels = lfw_faces(10)
    torch.manual_seed(0)
    yield "honest FC-2, 64 LFW faces in [0, 1]", *first_layer(FC2((1, 25, 25), 10), faces[:64], labels[:64])
    sent, _, (x, y) = trap_behind_decoys()
    yield "FC-2 (1,024 units), 1,016 decoys + 8-row trap, 64 CIFAR-10", *first_layer(sent, x, y)
    if worst:
        for batch in (64, 256):
            g = torch.Generator().manual_seed(batch)
            yield (f"4,096 units in 5 decoy levels + 12-row chain, batch {batch}", decoys_and_chain(batch, 4084, 5, 12, 0),
                   torch.randn(batch, 3072, generator=g, dtype=torch.float64))


def run(d, a, screen: bool):
    support = d.abs() > 1e-9 * d.abs().max()
    gram = a.reshape(a.shape[0], -1) @ a.reshape(a.shape[0], -1).T
    norms = gram.diagonal().sqrt()[:, None]
    start = time.perf_counter()
    sets, info = pair_sets(d, support, gram, norms, ISOLATION_TOLERANCE, ISOLATION_READ_ERROR, ISOLATION_PEEL, screen)
    return time.perf_counter() - start, sets, info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--worst", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"pairwise tests screened / every pair exact, median of {args.repeats}, {args.threads} threads\n")
    print("| case | nested pairs | tested exactly | screened (s) | every pair (s) | ratio |\n|---|---|---|---|---|---|")
    for label, d, a in cases(args.worst):
        fast, slow = [], []
        for _ in range(args.repeats):
            t, sets, info = run(d, a, True)
            fast.append(t)
            t, every, every_info = run(d, a, False)
            slow.append(t)
            same = sorted(map(tuple, sets.int().tolist())) == sorted(map(tuple, every.int().tolist()))
            assert same and info["separating_pairs"] == every_info["separating_pairs"], label
        f, s = statistics.median(fast), statistics.median(slow)
        print(f"| {label} | {info['nested_pairs']:,} | {info['screened_pairs']:,} | {f:.3f} | {s:.3f} | {s / f:.1f}x |",
              flush=True)


if __name__ == "__main__":
    main()
