"""``trap_weights rows: fit`` against an inspecting FC-2 client: what it costs, and what the auxiliary
images' basis cache (``trap_chain.aux_basis``) saves, as a ratio against the same fit without the cache in
the same run.

The setting of ``tests/redteam/attacks/malicious/test_trap_fit.py`` at full size: FC-2 on 3 x 32 x 32
uniform images centred to unit variance, a client batch of 32 that inspects, 512 auxiliary images (``--aux``;
4 shadow batches held out from the calibration; the SVD the cache saves grows with them). Each fit builds every size of ``FIT_SIZES`` and the whole layer,
calibrates the column noise of each against the client's shared-columns check (each level a fresh build, each
build a disguise of the trap's rows with parts the auxiliary images barely see), and inspects and queries
each on 4 shadow batches. Without the cache every disguise recomputes the auxiliary images' SVD.

    .venv/bin/python bench/bench_trap_fit.py [--repeats 2] [--threads 1] [--aux 512]

Prints the seconds of each fit (cached and uncached, interleaved so that a busy neighbour slows both) and the
ratio of their medians. Measure on a quiet machine (see the README's note on 2 busy cores).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from guardfl.redteam.attacks import Setting, get
from guardfl.redteam.attacks.malicious import trap_chain
from guardfl.redteam.auxdata import AuxData
from guardfl.redteam.client.simulate import ClientQuery, FedSGD
from guardfl.redteam.modality.image.models import FC2
from guardfl.redteam.threat import ThreatModel

SHAPE = (3, 32, 32)
RANGE = (-0.5 / 0.29, 0.5 / 0.29)


def centred(n: int, seed: int) -> torch.Tensor:
    return (torch.rand(n, *SHAPE, generator=torch.Generator().manual_seed(seed)) - 0.5) / 0.29


def fit_seconds(model, setting, threat, x, y) -> float:
    client = ClientQuery(x, y, None, FedSGD(), inspect=True, reference=model, input_range=RANGE)
    start = time.perf_counter()
    get("trap_weights", seed=0, rows="fit").interrogate(client, setting, threat)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--aux", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = FC2(SHAPE)
    aux = AuxData(centred(args.aux, 9), torch.arange(args.aux) % 10)
    setting = Setting(model, FedSGD(), 32, SHAPE, 10, RANGE, None)
    threat = ThreatModel(server="malicious", labels="known", aux=aux)
    x, y = centred(32, 0), torch.arange(32) % 10
    cached = trap_chain.aux_basis

    def uncached(images):
        trap_chain._BASIS[0] = (lambda: None, -1, None)
        return cached(images)

    times = {"cached": [], "uncached": []}
    fit_seconds(model, setting, threat, x, y)  # warm-up: imports, first allocations
    for _ in range(args.repeats):
        for label, basis in (("uncached", uncached), ("cached", cached)):
            trap_chain.aux_basis = basis
            times[label].append(fit_seconds(model, setting, threat, x, y))
            print(f"{label:9s} {times[label][-1]:6.1f} s", flush=True)
    trap_chain.aux_basis = cached
    ratio = statistics.median(times["cached"]) / statistics.median(times["uncached"])
    print(f"median fit: cached {statistics.median(times['cached']):.1f} s, uncached {statistics.median(times['uncached']):.1f} s; "
          f"ratio cached / uncached {ratio:.2f} ({args.threads} thread(s), {args.aux} auxiliary images)")


if __name__ == "__main__":
    main()
