"""guardfl.inspect_model: detection rate on malicious-server models, false-positive rate on benign ones.

Malicious (tests/malicious.py, from the papers' descriptions): Robbing the Fed's imprint block in front
of the small CNN, LeNet and ResNet-18 (64 to 512 bins); class fishing (breaching's cls_attack, and with
the trained target row kept) and feature fishing on the last layer of the small CNN, LeNet, ResNet-18
(CIFAR stem) and torchvision's ResNet-18, untrained and trained, every target class. Benign: PyTorch
default initialisations (small CNN, LeNet, ResNet-18, a linear model, FC-2) and DLG's wide
initialisation over many seeds, checkpoints trained 1-5 epochs on
CIFAR-10 images, and FedAvg global models over rounds (4 IID clients, and 4 non-IID clients of 2-3
classes each; FC-2 with BatchNorm IID, with LayerNorm non-IID), fine-tuned checkpoints, and FC-2 with dead
hidden units (a quarter pruned, or never firing). Every model is inspected with and
without the client's first batch (32 CIFAR-10 images it was not trained on) and, for benign ones, a
non-IID batch (mostly one class), also against a fresh initialisation of the same architecture as the client's own model.
Inputs in [0, 1] (no normalising transform, the isolation check's hard case: an honest MLP's units fire
for the brightest few samples): FC-2 and its BatchNorm / LayerNorm / GroupNorm forms at default inits and
over FedAvg rounds, CIFAR-10 and LFW faces, each against the model before it (as a Flower client has it)
and alone; FC-2 with 1,024, 4,096 and 8,192 units on batches of 8, 12 and 16 (wide layers on small batches, whose
units firing for all but a few samples form many groups of rows).
Adaptive (issue 34, a server that has read guardfl/inspect.py): trap weights in FC-2's own first layer
(two chains, one chain, and 8 rows adapted to the isolation check), the same through BatchNorm (FC-2 with
BatchNorm1d: the cut-offs in its affine parameters; whole layer, 8 and 3 rows), through GroupNorm (FC-2 as
dp_compatible makes it), through LayerNorm (spread constants, one LayerNorm weight per chain) and class fishing without the
zero-row / bias-gap fingerprints (rows scaled, routed through dead units), FC-2 untrained and trained; against
the near-parallel-rows check, the small traps with each row's unseen part (``disguise``) and traps of single
rows (one row per measurement, no two rows alike); against the shared-columns check, the disguised small
traps with noise on each row's share of the chain's classifier column.
The opt-in disaggregation check (SEER's D-SNR, ``inspect_model(..., disaggregation=True)``) is run too and
counted apart: flagged by it, and flagged by it alone.

    .venv/bin/python bench/bench_inspect.py [--seeds 20] [--images 1024] [--targets 10] [--no-resnet] [--no-disaggregation]

Prints a table and the largest benign value of each measured statistic next to its threshold.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
import torchvision

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from guardfl import inspect as I  # noqa: E402
from guardfl import inspect_columns as C  # noqa: E402
from guardfl import inspect_model  # noqa: E402
from guardfl.redteam.attacks.malicious.trap_chain import auto_rho, disguise  # noqa: E402
from guardfl.redteam.attacks.malicious.trap_weights import craft, trap_layers  # noqa: E402
from guardfl.redteam.modality.image.models import FC2, FC2BN, FC2GN, FC2LN  # noqa: E402
from tests import malicious as M  # noqa: E402


def non_iid(x, y, clients=4, classes_per_client=3):
    shards = []
    for c in range(clients):
        keep = torch.isin(y, torch.tensor([(c * 2 + k) % 10 for k in range(classes_per_client)]))
        shards.append((x[keep], y[keep]))
    return shards


def fedavg_non_iid(model, x, y, rounds):
    import copy

    current, history = copy.deepcopy(model), []
    for rnd in range(rounds):
        states = [M.train(copy.deepcopy(current), xs, ys, epochs=1, seed=rnd * 10 + c).state_dict()
                  for c, (xs, ys) in enumerate(non_iid(x, y))]
        current.load_state_dict({k: torch.stack([s[k].double() for s in states]).mean(0).to(v.dtype) if v.is_floating_point()
                                 else states[0][k] for k, v in current.state_dict().items()})
        history.append(copy.deepcopy(current))
    return history


def fresh_init(model, seed: int = 1234):
    """A copy of ``model`` with every layer re-initialised (PyTorch's defaults): the client's own model of
    the same architecture, the reference of the isolation check."""
    own = copy.deepcopy(model)
    torch.manual_seed(seed)
    for m in own.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    return own


def trap(base, aux, chains=2, rows=None, seed=0, disguised=False, noise=0.0, per_cut=1):
    """Trap weights (the red team's construction, guardfl.redteam.attacks.malicious.trap_weights) in ``base``;
    ``disguised``: each row with a near-multiple gets a part images barely see (``trap_chain.disguise``, as
    ``disguise: auto`` does for a small trap), adapted to the near-parallel-rows check; ``noise``: relative
    noise on each row's share of its chain's classifier column (``column_noise``; ``auto`` picks 0.02-0.05
    for these small traps), adapted to the shared-columns check; ``per_cut``: rows per cut, each with its own
    classifier column (``trap_weights columns``, ``trap_groups``), adapted to the shared-columns check and
    the pairwise isolation tests."""
    layers = trap_layers(base, (3, 32, 32))
    gen = torch.Generator().manual_seed(seed)
    made = craft(base, layers, (3, 32, 32), aux, chains, noise, (float(aux.min()), float(aux.max())), gen, rows, 32,
                 per_cut=per_cut)
    if disguised:
        disguise(made.rows(), auto_rho(), (3, 32, 32), aux, gen)
    return made.sent


def dead_units(model, seed):
    """Two benign models with dead hidden units from a trained FC-2: a quarter of the units pruned (rows,
    biases and their classifier columns zeroed, as magnitude pruning of units leaves them) and a quarter
    whose biases sit far below any input's pre-activation (they never fire, as units killed in training)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for kind in ("pruned", "never fire"):
        dead = copy.deepcopy(model)
        units = torch.randperm(dead.net[1].out_features, generator=g)[: dead.net[1].out_features // 4]
        with torch.no_grad():
            if kind == "pruned":
                dead.net[1].weight[units] = 0.0
                dead.net[1].bias[units] = 0.0
                dead.net[3].weight[:, units] = 0.0
            else:
                dead.net[1].bias[units] = -100.0
        out.append(dead)
    return out


def uncentred_data():
    """Inputs in [0, 1] (no normalising transform): (training images, labels, the client's first batch,
    input shape) for CIFAR-10 and for LFW faces (scikit-image's subset of 200: trained on faces 64-199,
    the batch faces 0-63, labels person-agnostic ``index % 10``)."""
    import numpy as np
    import skimage

    x, y = M.cifar(512)
    bx, by = M.cifar(32, offset=4000)
    un = lambda t: (t * M.CIFAR_STD + M.CIFAR_MEAN).clamp(0, 1)  # noqa: E731
    faces = torch.from_numpy(np.load(Path(skimage.__file__).parent / "data" / "lfw_subset.npy")).float()[:, None]
    labels = torch.arange(len(faces)) % 10
    return {"CIFAR-10": (un(x), y, (un(bx), by), (3, 32, 32)),
            "LFW": (faces[64:], labels[64:], (faces[:64], labels[:64]), (1, 25, 25))}


def uncentred_benign(seeds: int) -> dict[str, list]:
    """Benign MLPs on inputs in [0, 1], where an MLP's units fire for the few brightest samples and the
    honest architecture isolates much of a batch by itself (the isolation check's hard case): FC-2 and
    FC-2 with BatchNorm, LayerNorm, GroupNorm at default inits (another init as the reference) and FedAvg
    rounds (the previous round as the reference, as a Flower client has it): (model, reference, batch)."""
    out: dict[str, list] = {}
    for data, (x, y, batch, shape) in uncentred_data().items():
        for cls in (FC2, FC2BN, FC2LN, FC2GN):
            for s in range(seeds):
                torch.manual_seed(s)
                first, second = cls(in_shape=shape), cls(in_shape=shape)
                out.setdefault(f"inputs in [0, 1], {data}: {cls.__name__} default inits", []).append((second, first, batch))
            for s in range(2):
                torch.manual_seed(s)
                history = [cls(in_shape=shape)]
                history += M.fedavg(history[0], x, y, clients=4, rounds=4, lr=0.01)
                out.setdefault(f"inputs in [0, 1], {data}: {cls.__name__} FedAvg rounds", []).extend(
                    (m, prev, batch) for m, prev in zip(history[1:], history[:-1]))
        for units in (1024, 4096, 8192):  # wide layers on small batches: many groups of rows (2026-11-27)
            for s in range(min(seeds, 2)):
                torch.manual_seed(s)
                first, second = FC2(in_shape=shape, hidden=units), FC2(in_shape=shape, hidden=units)
                out.setdefault(f"inputs in [0, 1], {data}: FC-2 with {units} units, batches of 8, 12, 16", []).extend(
                    (second, first, (batch[0][:b], batch[1][:b])) for b in (8, 12, 16))
    return out


def fish_scaled(model, target, scale=3e-3, gap=20.0):
    """Class fishing without the zero-row / bias-gap fingerprints: the other rows scaled by ``scale``
    (above the zero-row threshold), the biases ``gap`` logits apart (at the bias-gap threshold)."""
    fished = copy.deepcopy(model)
    head = M.last_linear(fished)
    with torch.no_grad():
        keep = torch.arange(head.out_features) != target
        head.weight[keep] *= scale
        head.bias.fill_(gap / 2)
        head.bias[target] = -gap / 2
    return fished


def fish_routed(model, target, dead=200, gap=20.0):
    """FC-2 class fishing routed through hidden units that never fire: the other classes read only the
    ``dead`` units (biased far below zero), the target only the live ones."""
    fished = copy.deepcopy(model)
    first, head = fished.net[1], fished.net[3]
    with torch.no_grad():
        first.bias[:dead] = -50.0
        first.weight[:dead] *= 0.01
        keep = torch.arange(head.out_features) != target
        head.weight[keep, dead:] = 0.0
        head.weight[target, :dead] = 0.0
        head.bias.fill_(gap / 2)
        head.bias[target] = -gap / 2
    return fished


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=20, help="seeds per default / wide initialisation")
    ap.add_argument("--images", type=int, default=1024, help="training images for the checkpoints")
    ap.add_argument("--targets", type=int, default=10, help="fishing target classes per base model (1-10)")
    ap.add_argument("--disaggregation", action=argparse.BooleanOptionalAction, default=True,
                    help="run the opt-in disaggregation check (SEER's D-SNR) too, and count what it adds")
    ap.add_argument("--resnet", action=argparse.BooleanOptionalAction, default=True,
                    help="include the ResNet-18 models (--no-resnet: minutes instead of an hour on 2 cores: the "
                         "disaggregation check differentiates each sample's loss alone under batch norm)")
    args = ap.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    start = time.time()
    x, y = M.cifar(args.images)
    batch = M.cifar(32, offset=4000)
    xb, yb = M.cifar(32, offset=4100)
    skewed = (xb, torch.where(torch.arange(32) < 28, torch.tensor(3), yb))  # a non-IID client: 28 of 32 one label

    benign: dict[str, list] = {}
    for s in range(args.seeds):
        benign.setdefault("default init: small CNN", []).append(M.small_cnn(s))
        benign.setdefault("default init: LeNet", []).append(M.lenet(s))
        benign.setdefault("wide init: LeNet", []).append(M.lenet(s, wide=True))
        benign.setdefault("default init: linear", []).append(M.linear_model(s))
        torch.manual_seed(s)
        benign.setdefault("default init: FC-2 (3072-256-10)", []).append(FC2())
        torch.manual_seed(s)
        benign.setdefault("default init: FC-2 with BatchNorm1d", []).append(FC2BN())
        torch.manual_seed(s)
        benign.setdefault("default init: FC-2 with GroupNorm", []).append(FC2GN())
        torch.manual_seed(s)
        benign.setdefault("default init: FC-2 with LayerNorm", []).append(FC2LN())
    for s in range(max(2, args.seeds // 5) if args.resnet else 0):
        benign.setdefault("default init: ResNet-18", []).append(M.resnet18(s))
        torch.manual_seed(s)
        benign.setdefault("default init: torchvision ResNet-18", []).append(torchvision.models.resnet18(num_classes=10))
    for s in range(3):
        for epochs in (1, 3, 5):
            benign.setdefault("trained: small CNN", []).append(M.train(M.small_cnn(s), x, y, epochs=epochs, seed=s))
            benign.setdefault("trained: LeNet", []).append(M.train(M.lenet(s), x, y, epochs=epochs, lr=0.1, seed=s))
            benign.setdefault("trained: LeNet wide init", []).append(M.train(M.lenet(s, wide=True), x, y, epochs=epochs, lr=0.01, seed=s))
            benign.setdefault("trained: linear", []).append(M.train(M.linear_model(s), x, y, epochs=epochs, lr=0.01, seed=s))
            torch.manual_seed(s)
            benign.setdefault("trained: FC-2", []).append(M.train(FC2(), x, y, epochs=epochs, lr=0.01, seed=s))
            torch.manual_seed(s)
            benign.setdefault("trained: FC-2 with BatchNorm1d", []).append(M.train(FC2BN(), x, y, epochs=epochs, seed=s))
            torch.manual_seed(s)
            benign.setdefault("trained: FC-2 with GroupNorm", []).append(M.train(FC2GN(), x, y, epochs=epochs, seed=s))
            torch.manual_seed(s)
            benign.setdefault("trained: FC-2 with LayerNorm", []).append(M.train(FC2LN(), x, y, epochs=epochs, seed=s))
        torch.manual_seed(s)
        benign.setdefault("dead ReLUs: FC-2 trained, a quarter of its units pruned or never firing", []).extend(
            dead_units(M.train(FC2(), x, y, epochs=3, lr=0.01, seed=s), s))
        benign.setdefault("fine-tuned: small CNN (3 epochs, then 2 on other images at lr 0.01)", []).append(
            M.train(M.train(M.small_cnn(s), x, y, epochs=3, seed=s), *M.cifar(256, offset=3000), epochs=2, lr=0.01, seed=s))
    if args.resnet:
        benign["trained: ResNet-18 (1 epoch)"] = [M.train(M.resnet18(0), x[:512], y[:512], epochs=1, lr=0.05)]
    for s in range(2):
        benign.setdefault("FedAvg IID rounds: small CNN", []).extend(M.fedavg(M.small_cnn(s), x, y, clients=4, rounds=5))
        benign.setdefault("FedAvg IID rounds: LeNet", []).extend(M.fedavg(M.lenet(s), x, y, clients=4, rounds=5, lr=0.1))
        benign.setdefault("FedAvg non-IID rounds: small CNN", []).extend(fedavg_non_iid(M.small_cnn(s), x, y, rounds=5))
        torch.manual_seed(s)
        benign.setdefault("FedAvg IID rounds: FC-2 with BatchNorm1d", []).extend(M.fedavg(FC2BN(), x, y, clients=4, rounds=5))
        torch.manual_seed(s)
        benign.setdefault("FedAvg non-IID rounds: FC-2 with LayerNorm", []).extend(fedavg_non_iid(FC2LN(), x, y, rounds=5))

    trained_cnn = benign["trained: small CNN"][1]
    trained_lenet = benign["trained: LeNet"][1]
    tv = torchvision.models.resnet18(num_classes=10)
    bases = {"small CNN": M.small_cnn(0), "small CNN trained": trained_cnn, "LeNet": M.lenet(0),
             "LeNet trained": trained_lenet, "ResNet-18": M.resnet18(0), "torchvision ResNet-18": tv}
    if not args.resnet:
        del bases["ResNet-18"], bases["torchvision ResNet-18"]
    malicious: dict[str, list] = {}
    for bins in (64, 128, 512):
        for name in [b for b in ("small CNN", "small CNN trained", "LeNet", "ResNet-18") if b in bases]:
            malicious.setdefault("Robbing the Fed imprint", []).append((M.with_imprint(bases[name], bins=bins, seed=bins), bases[name]))
    for name, base in bases.items():
        for t in range(args.targets):
            malicious.setdefault("class fishing (cls_attack)", []).append((M.class_fishing(base, t), base))
            malicious.setdefault("class fishing, target row kept", []).append((M.class_fishing(base, t, keep_target_row=True), base))
            malicious.setdefault("feature fishing", []).append((M.feature_fishing(base, t, feature=3 * t), base))

    # the adaptive constructions (issue 34): built by a server that has read guardfl/inspect.py
    aux = M.cifar(1024, offset=2048)[0]
    trained_fc2 = benign["trained: FC-2"][1]
    for name, base in (("FC-2", FC2()), ("FC-2 trained", trained_fc2)):
        for seed in range(5):
            malicious.setdefault("trap weights, whole layer (2 chains)", []).append((trap(base, aux, seed=seed), base))
            malicious.setdefault("trap weights, whole layer (1 chain)", []).append((trap(base, aux, chains=1, seed=seed), base))
            malicious.setdefault("trap weights, 8 rows (adapted to isolation)", []).append((trap(base, aux, chains=1, rows=8, seed=seed), base))
            malicious.setdefault("trap weights, 8 rows disguised (adapted to parallel rows)", []).append(
                (trap(base, aux, chains=1, rows=8, seed=seed, disguised=True), base))
            malicious.setdefault("trap weights, 8 single rows (8 chains of 1)", []).append((trap(base, aux, chains=8, rows=1, seed=seed), base))
            malicious.setdefault("trap weights, 8 rows disguised, column noise 0.05 (adapted to shared columns)", []).append(
                (trap(base, aux, chains=1, rows=8, seed=seed, disguised=True, noise=0.05), base))
            malicious.setdefault("trap weights, whole layer, 2 rows per cut with their own columns, disguised (columns: 2)",
                                 []).append((trap(base, aux, seed=seed, disguised=True, per_cut=2), base))
            malicious.setdefault("trap weights, 4 x 4 cuts of 2 rows with their own columns, disguised (columns: 2)", []).append(
                (trap(base, aux, chains=4, rows=4, seed=seed, disguised=True, per_cut=2), base))
        for t in range(args.targets):
            malicious.setdefault("class fishing, rows scaled 3e-3, gap 20 (adaptive)", []).append((fish_scaled(base, t), base))
            malicious.setdefault("class fishing, routed through dead units (adaptive)", []).append((fish_routed(base, t), base))
    # through a normalisation: BatchNorm (the cut-offs in its affine parameters, trap_norm), GroupNorm (one
    # measuring channel per group) and LayerNorm (spread constants, one LayerNorm weight per chain; trap_per_sample)
    sizes = (("whole layer", {}), ("8 rows", {"chains": 1, "rows": 8}), ("3 rows", {"chains": 1, "rows": 3}),
             ("3 rows disguised", {"chains": 1, "rows": 3, "disguised": True}), ("6 single rows", {"chains": 6, "rows": 1}),
             ("3 rows disguised, column noise 0.05", {"chains": 1, "rows": 3, "disguised": True, "noise": 0.05}))
    for norm, trained_set, cls in (("BatchNorm", "BatchNorm1d", FC2BN), ("GroupNorm", "GroupNorm", FC2GN),
                                   ("LayerNorm", "LayerNorm", FC2LN)):
        trained = benign[f"trained: FC-2 with {trained_set}"][1]
        torch.manual_seed(0)
        for base in (cls(), trained):
            for seed in range(5):
                for size, kw in sizes:
                    malicious.setdefault(f"trap weights through {norm}, {size}", []).append((trap(base, aux, seed=seed, **kw), base))

    stats = {"class rank ratio (min)": [], "bias gap (max)": [], "mean top probability, unanimous (max)": [],
             "sample gradient share (max)": [], "label gradient share (max)": [], "imprint rank ratio (min)": [],
             "layer sample share (max)": [], "layer label share (max)": [], "isolated samples, no reference (max)": [],
             "isolation excess over own init (max)": [], "D-SNR, train mode (max)": [],
             "parallel rows, largest abs cosine in a hidden layer (max)": [],
             "shared columns, largest abs cosine of two units' coefficients over the batch (max)": []}
    rows = []
    for group, models in benign.items():
        flagged = flagged_dsnr = 0
        for model in models:
            own = fresh_init(model)  # the client's own model: the same architecture, its own initialisation
            results = [inspect_model(model, batch=b, disaggregation=args.disaggregation) for b in (None, batch, skewed)]
            results += [inspect_model(model.state_dict(), model)]
            results += [inspect_model(model.state_dict(), own, batch=b, disaggregation=args.disaggregation) for b in (batch, skewed)]
            flagged += any(not r.ok for r in results)
            flagged_dsnr += any(reason.startswith("disaggregation") for r in results for reason in r.reasons)
            for r in results[1:3] + results[-2:]:
                if "max" in r.checks.get("disaggregation", {}):
                    stats["D-SNR, train mode (max)"].append(r.checks["disaggregation"]["max"])
            for r in results[-2:]:
                iso = r.checks["isolation"]
                if "layers" in iso:
                    judged = [v[count] - iso[key].get(k, 0) for k, v in iso["layers"].items() if v.get("judged", True)
                              for count, key in (("isolated", "baseline"), ("by_pairs", "baseline_by_pairs"))]
                    stats["isolation excess over own init (max)"].append(max(judged, default=0))
            for r in results[1:3]:
                layers = r.checks["gradient_concentration"].get("layers", {})
                stats["layer sample share (max)"].append(max((v["sample_share"] for v in layers.values()), default=0.0))
                stats["layer label share (max)"].append(max((v["class_share"] for v in layers.values()), default=0.0))
                stats["isolated samples, no reference (max)"].append(r.checks["isolation"].get("max_isolated", 0))
                c = r.checks
                stats["class rank ratio (min)"].append(c["class_fishing"]["rank_ratio"])
                stats["bias gap (max)"].append(c["class_fishing"]["bias_gap"])
                if c["output_collapse"]["unanimous"]:
                    stats["mean top probability, unanimous (max)"].append(c["output_collapse"]["mean_probability"])
                stats["sample gradient share (max)"].append(c["gradient_concentration"]["sample_share"])
                stats["label gradient share (max)"].append(c["gradient_concentration"]["class_share"])
                stats["parallel rows, largest abs cosine in a hidden layer (max)"].append(c["parallel_rows"]["max_cos"])
                if "max_cos" in c.get("shared_columns", {}):
                    stats["shared columns, largest abs cosine of two units' coefficients over the batch (max)"].append(
                        c["shared_columns"]["max_cos"])
                if c["imprint"]["min_rank_ratio"] is not None:
                    stats["imprint rank ratio (min)"].append(c["imprint"]["min_rank_ratio"])
        rows.append(("benign", group, len(models), flagged, flagged / len(models), flagged_dsnr))
    over = []
    for group, pairs in uncentred_benign(args.seeds).items():
        flagged = 0
        for model, previous, b in pairs:
            results = (inspect_model(model.state_dict(), previous, batch=b), inspect_model(model, batch=b))
            flagged += any(not r.ok for r in results)
            for r in results:
                iso = r.checks["isolation"]
                n = b[1].numel()
                for count, key in (("isolated", "baseline"), ("by_pairs", "baseline_by_pairs")):
                    over += [v[count] - I.isolation_limit(n, iso[key].get(k, 0))
                             for k, v in iso.get("layers", {}).items()
                             if v.get("judged", True) and iso[key].get(k, 0) >= I.isolation_threshold(n)]
        rows.append(("benign", group, len(pairs), flagged, flagged / len(pairs), 0))
    stats["isolation, benign count minus its limit where the fresh init leaks, inputs in [0, 1] (max)"] = over
    dsnr: dict[str, list[float]] = {}
    for group, models in malicious.items():
        caught = caught_weights = caught_batch = caught_dsnr = only_dsnr = 0
        for model, expected in models:
            weights_only = inspect_model(model)
            with_ref = inspect_model(model, expected, batch=batch, disaggregation=args.disaggregation)
            caught_weights += not weights_only.ok
            caught_batch += any(r.startswith(("gradient concentration", "isolation", "shared columns")) for r in with_ref.reasons)
            by_dsnr = any(r.startswith("disaggregation") for r in with_ref.reasons)
            caught_dsnr += by_dsnr
            only_dsnr += by_dsnr and weights_only.ok and all(r.startswith("disaggregation") for r in with_ref.reasons)
            caught += not (weights_only.ok and with_ref.ok)
            if "max" in with_ref.checks.get("disaggregation", {}):
                dsnr.setdefault(group, []).append(with_ref.checks["disaggregation"]["max"])
        rows.append(("malicious", group, len(models), caught, caught / len(models), caught_weights, caught_batch,
                     caught_dsnr, only_dsnr))

    print(f"inspect_model: {sum(r[2] for r in rows if r[0] == 'benign')} benign and "
          f"{sum(r[2] for r in rows if r[0] == 'malicious')} malicious models, {time.time() - start:.0f} s\n")
    print("| set | models | flagged | rate | by weights alone | by the batch checks | by D-SNR (only by D-SNR) | D-SNR median |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r[0] == "benign":
            print(f"| {r[1]} | {r[2]} | {r[3]} | FP {r[4]:.0%} | | | {r[5]} | |")
        else:
            med = float(torch.tensor(dsnr[r[1]]).median()) if dsnr.get(r[1]) else float("nan")
            print(f"| {r[1]} | {r[2]} | {r[3]} | detection {r[4]:.0%} | {r[5]} | {r[6]} | {r[7]} ({r[8]}) | {med:.3g} |")
    fp = sum(r[3] for r in rows if r[0] == "benign")
    n = sum(r[2] for r in rows if r[0] == "benign")
    det = sum(r[3] for r in rows if r[0] == "malicious")
    m = sum(r[2] for r in rows if r[0] == "malicious")
    print(f"\ndetection {det}/{m} = {det / m:.1%}; false positives {fp}/{n} = {fp / n:.1%}\n")
    thresholds = {"class rank ratio (min)": f"< {I.RANK_ONE_RATIO:g}", "imprint rank ratio (min)": f"< {I.RANK_ONE_RATIO:g}",
                  "bias gap (max)": f"> {I.BIAS_GAP_LOGITS:g}", "mean top probability, unanimous (max)": "(reported only)",
                  "sample gradient share (max)": f"> {I.CONCENTRATION_SHARE}", "label gradient share (max)": f"> {I.CONCENTRATION_SHARE}",
                  "layer sample share (max)": f"> {I.CONCENTRATION_SHARE}", "layer label share (max)": f"> {I.CONCENTRATION_SHARE}",
                  "isolated samples, no reference (max)": "(reported only)",
                  "isolation excess over own init (max)": "(reported only: judged against the fixed fresh init)",
                  "isolation, benign count minus its limit where the fresh init leaks, inputs in [0, 1] (max)": ">= 0 (I.isolation_limit)",
                  "D-SNR, train mode (max)": f"> {I.DSNR_THRESHOLD:g}",
                  "parallel rows, largest abs cosine in a hidden layer (max)": f">= {I.PARALLEL_COS:g} (layers of {I.PARALLEL_MIN_COLS}+ inputs)",
                  "shared columns, largest abs cosine of two units' coefficients over the batch (max)":
                      f">= {C.COLUMN_COS:g} (where the error spans {C.COLUMN_MIN_DIMENSIONS:g}+ dimensions)"}
    print("| benign statistic | worst benign value | flagged when |")
    print("|---|---|---|")
    for k, v in stats.items():
        worst = (min(v) if "(min)" in k else max(v)) if v else float("nan")
        print(f"| {k} | {worst:.3g} | {thresholds[k]} |")


if __name__ == "__main__":
    main()
