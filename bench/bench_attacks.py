"""Attack strength against the defenses, at paper settings (GPU) or a reduced budget (CPU).

    python bench/bench_attacks.py outpost [--images 4] [--iterations 300]
    python bench/bench_attacks.py huang   [--images 1] [--iterations 200] [--batches 1,16]
    python bench/bench_attacks.py redteam [--rows dp,soteria] [--batches 2]
    python bench/bench_attacks.py redteam-summary   # the table of the certificates the last redteam run wrote

``outpost``: the direction of Wang et al. 2024, Table III, scenario 1 (FedAvg, E=1, n=1, B=1): the LeNet of
Zhu et al. on CIFAR-10 images, DLG and csDLG (Inverting Gradients) matching the model delta, no defense vs
gradient compression (GradPrune 0.8), Gaussian perturbation, Soteria, GradDefense and Outpost (defaults), the
baselines at the paper's settings (Sec. V): Soteria prunes 50% of the FC layer's gradient (LeNet's only
nn.Linear); GradDefense with clipping on and the settings of its source code (10 slices, 5 perturbed) at
noise 0.01. Reported for PyTorch's default initialisation (the realistic case) and for the wide
U(-0.5, 0.5) init (worst case).

``huang``: the direction of Huang et al. 2021, Table 2: ResNet-18 (CIFAR stem) in train mode, FedSGD,
the strongest attacker (labels known, BN_exact; GradInversion: IG + BN prior), no defense vs GradPrune 0.9
and 0.99, batch 1 and 16. InstaHide rows need the data-side defenses (issue 3) and are marked n/a.

``redteam``: the privacy half of the privacy-utility table. Each defense row of ``bench_utility.py`` (Soteria,
GradDefense, DP-SGD at noise 0.5 and 1.0, InstaHide k=4 + GradPrune 0.9, and no defense) is certified by the
full red team (``guardfl.redteam.certification.run.certify``: every applicable attack at the device's strength, defense-aware
objectives, demixing for encodings), and the row reports the verdict and the worst-case SSIM over attacks,
batches and images (the certificate's own number, no oracle). The client is LeNet (Zhu) in its wide-init
worst case on the CIFAR-10 sample, FedSGD; batch 1 for the gradient defenses and DP-SGD (the easiest case
for the attacker), batch 8 for InstaHide (k=4 mixes need 4 distinct images of the batch), with an undefended
row at each batch size. DP-SGD rows state epsilon for a client holding 4,000 images over 5 epochs (the
utility run's data size; at batch 1 the sample rate is 1/4000, so epsilon differs from the utility run's
batch-64 figure, both are printed). When ``bench/results/utility*.json`` exist, the joined table is printed.

Data: the CIFAR-10 sample in ``../shared/data`` (benchmarks only). Metrics after Hungarian matching;
LPIPS when AlexNet weights are available. Writes JSON and PNG grids to ``bench/results/``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from guardfl.defenses import GaussianNoise, GradDefense, GradPrune, Outpost, Soteria
from guardfl.redteam import FedAvg, FedSGD, ThreatModel, attacks, simulate_client
from guardfl.redteam.modality.image import metrics
from guardfl.redteam.attacks.compute import resolve_device
from guardfl.redteam.modality.image.models import LeNetZhu, resnet18_cifar, wide_init_

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "cifar10-train-5k.npz"
OUT = ROOT / "bench" / "results"


def cifar(n: int, offset: int = 0):
    d = np.load(DATA)
    x = torch.from_numpy(d["x"][offset : offset + n]).permute(0, 3, 1, 2).float() / 255.0
    return x, torch.from_numpy(d["y"][offset : offset + n])


def save_grid(rows: dict[str, torch.Tensor], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    n = max(len(v) for v in rows.values())
    fig, axes = plt.subplots(len(names), n, figsize=(1.4 * n, 1.5 * len(names)), squeeze=False)
    for i, name in enumerate(names):
        for j in range(n):
            ax = axes[i][j]
            ax.axis("off")
            if j < len(rows[name]):
                img = rows[name][j].detach().cpu().clamp(0, 1).permute(1, 2, 0).numpy()
                ax.imshow(img.squeeze(), cmap="gray" if img.shape[-1] == 1 else None)
        axes[i][0].set_title(name, fontsize=7, loc="left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summarize(m: dict) -> dict:
    s = m["summary"]
    pick = lambda k: None if s.get(k) is None else {"mean": s[k]["mean"], "best": s[k]["best"]}  # noqa: E731
    return {"ssim": pick("ssim"), "psnr": pick("psnr"), "lpips": pick("lpips"), "label_acc": s.get("label_acc")}


def run_outpost(args, device) -> dict:
    x_all, y_all = cifar(args.images)
    defenses = {
        "none": None,
        "GC (prune 0.8)": GradPrune(0.8),
        "DP (gauss 1e-3)": GaussianNoise(1e-3),
        "Soteria (FC 50%)": Soteria(prune=0.5),
        "GD (clip, 0.01)": GradDefense(slices=10, perturb_slices=5, noise=0.01, clip=True),
        "Outpost": Outpost(),
    }
    results, grids = [], {}
    for init in ("pytorch-default", "wide-init (worst case)"):
        for dname, defense in defenses.items():
            for aname, budget in (("dlg", {"iterations": args.iterations}),
                                  ("inverting_gradients", {"iterations": args.iterations, "restarts": 2})):
                recs = []
                t0 = time.time()
                for i in range(args.images):
                    torch.manual_seed(i)
                    model = LeNetZhu((3, 32, 32), 10)
                    if init.startswith("wide"):
                        wide_init_(model)
                    x, y = x_all[i : i + 1], y_all[i : i + 1]
                    obs = simulate_client(model, x, y, defense, FedAvg(epochs=1, batch_size=1, lr=0.01))
                    rec = attacks.get(aname, seed=i, device=str(device), **budget).reconstruct(obs, ThreatModel(labels="known"))
                    recs.append(rec.inputs.cpu())
                rec_all = torch.cat(recs)
                m = metrics.evaluate(rec_all, x_all[: args.images], data_range=(0, 1))
                row = {"init": init, "defense": dname, "attack": aname, "seconds": time.time() - t0, **summarize(m)}
                results.append(row)
                print(f"{init:24s} {dname:16s} {aname:20s} SSIM mean {row['ssim']['mean']:.3f} best {row['ssim']['best']:.3f}  "
                      f"PSNR mean {row['psnr']['mean']:6.2f}  ({row['seconds']:.0f}s)", flush=True)
                grids[f"{'default' if init.startswith('pytorch') else 'wide'} {dname} {aname}"] = rec_all
    grids = {"original": x_all[: args.images], **grids}
    save_grid(grids, OUT / "outpost_table3.png")
    return {"scenario": "FedAvg E=1 n=1 B=1 lr=0.01, LeNet (Zhu), CIFAR-10 sample", "rows": results}


def run_huang(args, device) -> dict:
    defenses = {"none": None, "GradPrune 0.9": GradPrune(0.9), "GradPrune 0.99": GradPrune(0.99)}
    results, grids = [], {}
    for batch in [int(b) for b in args.batches.split(",")]:
        x, y = cifar(batch * args.images, offset=100)
        grids[f"B={batch} original"] = x[: min(batch, 8)]
        for dname, defense in defenses.items():
            t0 = time.time()
            recs = []
            for i in range(args.images):
                torch.manual_seed(i)
                model = resnet18_cifar((3, 32, 32), 10)
                xb, yb = x[i * batch : (i + 1) * batch], y[i * batch : (i + 1) * batch]
                obs = simulate_client(model, xb, yb, defense, FedSGD())
                attack = attacks.get("gradinversion", iterations=args.iterations, restarts=2, group_every=max(1, args.iterations // 10),
                                     seed=i, device=str(device), progress=False)
                recs.append(attack.reconstruct(obs, ThreatModel(labels="known", bn="exact")).inputs.cpu())
            rec_all = torch.cat(recs)
            m = metrics.evaluate(rec_all, x, data_range=(0, 1))
            row = {"batch": batch, "defense": dname, "attack": "gradinversion (labels known, BN exact)",
                   "seconds": time.time() - t0, **summarize(m)}
            results.append(row)
            print(f"B={batch:<3d} {dname:16s} SSIM mean {row['ssim']['mean']:.3f} best {row['ssim']['best']:.3f}  "
                  f"PSNR mean {row['psnr']['mean']:6.2f}  ({row['seconds']:.0f}s)", flush=True)
            grids[f"B={batch} {dname}"] = rec_all[: min(batch, 8)]
        for dname in ("InstaHide k=4", "InstaHide k=4 + GradPrune 0.9"):
            results.append({"batch": batch, "defense": dname, "attack": "n/a: data-side defenses land with issue 3"})
    save_grid(grids, OUT / "huang_table2.png")
    return {"scenario": "FedSGD, ResNet-18 (CIFAR stem, train mode), CIFAR-10 sample", "rows": results}


REDTEAM_ROWS = {
    # name: (batch, defense config)
    "none (B=1)": (1, None),
    "Soteria (prune 0.5 of the FC layer)": (1, {"kind": "soteria", "prune": 0.5}),
    "GradDefense (10 slices, 5 noised, 0.01, clip)": (1, {"kind": "graddefense"}),
    "DP-SGD (sigma 0.5, C 1.0)": (1, {"kind": "dpsgd", "noise_multiplier": 0.5, "max_grad_norm": 1.0, "epochs": 5}),
    "DP-SGD (sigma 1.0, C 1.0)": (1, {"kind": "dpsgd", "noise_multiplier": 1.0, "max_grad_norm": 1.0, "epochs": 5}),
    "none (B=8)": (8, None),
    "InstaHide k=4 + GradPrune 0.9": (8, {"kind": "stack", "defenses": [{"kind": "instahide", "k": 4},
                                                                       {"kind": "gradprune", "ratio": 0.9}]}),
}


def redteam_config(batch: int, defense: dict | None, batches: int, device: str) -> dict:
    """The row's certificate config. The attacker holds auxiliary CIFAR-10 images (400 per class) disjoint
    from the private population (the last 50 per class): the per-class split of ``bench_every_defense.py``,
    so learned inversion runs in every row (issue 35; before it, these rows had no aux and no LTI)."""
    from bench_every_defense import split_data

    aux, population = split_data()
    return {
        "model": {"name": "lenet", "num_classes": 10, "state": "wide-init"},
        "data": {"source": "npz", "path": str(population)},
        "aux": {"source": "npz", "path": str(aux)},
        "client": {"protocol": "fedsgd", "batch_size": batch, "dataset_size": 4000},
        "defense": defense,
        "attacks": "all",
        "strength": "auto",
        "device": device,
        "certify": {"max_ssim": 0.4, "max_updates": batches},
        "seed": 0,
    }


def run_redteam(args, device) -> dict:
    from guardfl.redteam.certification.run import certify

    keys = [k.strip().lower() for k in args.rows.split(",")] if args.rows else None
    rows = []
    for name, (batch, defense) in REDTEAM_ROWS.items():
        if keys is not None and not any(k in name.lower() for k in keys):
            continue
        slug = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
        t0 = time.time()
        cert = certify(redteam_config(batch, defense, args.batches, str(device)), out=OUT / "redteam" / slug)
        ssim = next((w for w in cert.worst if w["metric"] == "ssim"), {})
        where = ssim.get("where") or {}
        recovered = [r["recovered"] for r in cert.results if r.get("recovered")]
        row = {
            "defense": name, "batch": batch, "verdict": cert.verdict, "worst_ssim": ssim.get("worst"),
            "leaked": cert.evidence["leak_rate"]["leaked"], "samples": cert.evidence["leak_rate"]["samples"],
            "leak_rate_upper_bound": cert.evidence["leak_rate"]["upper_bound"],
            "worst_attack": where.get("attack"), "strength": cert.strength,
            "attacks_ran": sorted({r["attack"] for r in cert.results if r.get("metrics")}),
            "epsilon": (cert.privacy or {}).get("epsilon"),
            "recovered_max": max((r["above_max_ssim"] / max(r["of"], 1) for r in recovered), default=None),
            "seconds": time.time() - t0,
        }
        rows.append(row)
        eps = "" if row["epsilon"] is None else f"  eps {row['epsilon']:.2f}"
        print(f"{name:46s} B={batch}  {row['verdict']:13s} worst SSIM {_f(row['worst_ssim'])} ({row['worst_attack']}){eps}  "
              f"({row['seconds']:.0f}s)", flush=True)
    joined = join_utility(rows)
    return {"scenario": "red team (certify), LeNet wide-init, CIFAR-10 sample, FedSGD", "rows": rows, "joined": joined}


def learned_inversion_share(cert: dict) -> dict:
    """What learned inversion adds to a row's certificate (issue 35: before it, these rows had no LTI): the
    samples leaked by any attack, those leaked by another attack too (the row without LTI's records; the
    other attacks' jobs do not depend on it), LTI's own leaks and its worst SSIM."""
    leaked = cert["evidence"]["leak_rate"]
    samples = cert["evidence"].get("leaked_samples", [])
    others = sum(any(b["attack"] != "learned_inversion" for b in s["by"]) for s in samples)
    lti = [r for r in cert["results"] if r["attack"] == "learned_inversion" and r.get("metrics")]
    worst = max((im["ssim"] for r in lti for im in r["metrics"]["per_image"]), default=None)
    return {"leaked": leaked["leaked"], "samples": leaked["samples"], "leaked_without_lti": others,
            "lti_leaked": cert["evidence"]["per_attack"].get("learned_inversion", {}).get("leaked"),
            "lti_worst_ssim": worst, "lti_ran": bool(lti), "verdict": cert["verdict"]}


def summarise_redteam() -> None:
    """The table of the certificates a ``redteam`` run wrote (``bench/results/redteam/*/certificate.json``)."""
    print(f"{'row':48s} {'verdict':22s} {'leaked':>7s} {'w/o LTI':>8s} {'LTI leaks':>9s} {'LTI worst SSIM':>14s} {'worst (attack)':>24s}")
    for path in sorted((OUT / "redteam").glob("*/certificate.json")):
        cert = json.loads(path.read_text())
        row = learned_inversion_share(cert)
        w = next((w for w in cert["worst"] if w["metric"] == "ssim"), {})
        print(f"{path.parent.name:48s} {row['verdict']:22s} {row['leaked']:>3d}/{row['samples']:<3d} {row['leaked_without_lti']:>8d} "
              f"{row['lti_leaked'] if row['lti_ran'] else 'n/a':>9} {_f(row['lti_worst_ssim']):>14s} "
              f"{_f(w.get('worst'))} ({(w.get('where') or {}).get('attack')})")


def _f(v) -> str:
    return "  n/a" if v is None else f"{v:.3f}"


def join_utility(rows: list[dict]) -> list[dict]:
    """The privacy-utility table: each red-team row beside its utility row (accuracy, time ratio, epsilon of
    the utility run) from the latest ``bench/results/utility*.json`` that has it."""
    utility = {}
    for path in sorted(OUT.glob("utility*.json"), key=lambda p: p.stat().st_mtime):
        for r in json.loads(path.read_text()).get("rows", []):
            utility[r["defense"]] = {**r, "source": path.name}
    joined = []
    print(f"\n{'defense':46s} {'B':>2s} {'verdict':13s} {'SSIM':>6s} {'acc':>6s} {'time x':>7s} {'eps(utility)':>12s}")
    for r in rows:
        u = utility.get(r["defense"]) or (utility.get("none") if r["defense"].startswith("none") else None) or {}
        j = {**r, "test_acc": u.get("test_acc"), "time_ratio": u.get("time_ratio"),
             "epsilon_utility_run": u.get("epsilon@1e-5"), "utility_source": u.get("source")}
        joined.append(j)
        eps = j["epsilon_utility_run"]
        print(f"{r['defense']:46s} {r['batch']:2d} {r['verdict']:13s} {_f(r['worst_ssim']):>6s} {_f(j['test_acc']):>6s} "
              f"{'' if j['time_ratio'] is None else format(j['time_ratio'], '.2f'):>7s} "
              f"{'' if eps is None else format(eps, '.1f'):>12s}  {j['utility_source'] or ''}")
    return joined


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("table", choices=["outpost", "huang", "redteam", "redteam-summary"],
                    help="redteam-summary: the table of the certificates an earlier redteam run wrote")
    ap.add_argument("--rows", default=None, help="redteam: comma-separated substrings of row names")
    ap.add_argument("--images", type=int, default=None, help="images (outpost) or batches (huang) per setting")
    ap.add_argument("--iterations", type=int, default=None)
    ap.add_argument("--batches", default=None, help="huang: batch sizes (default 1,16); redteam: batches certified per row (default 2)")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args(argv)
    if args.table == "redteam-summary":
        return summarise_redteam()
    device = resolve_device(args.device)
    gpu = device.type == "cuda"
    if args.table == "redteam":
        args.batches = int(args.batches or 2)
    elif args.table == "outpost":
        args.images = args.images or (8 if gpu else 4)
        args.iterations = args.iterations or (2000 if gpu else 300)
    else:
        args.batches = args.batches or "1,16"
        args.images = args.images or (4 if gpu else 1)
        args.iterations = args.iterations or (10_000 if gpu else 200)
    if not DATA.is_file():
        raise SystemExit(f"benchmark data not found: {DATA}")
    OUT.mkdir(parents=True, exist_ok=True)
    if args.table == "redteam":
        print(f"device {device}, {args.batches} client batch(es) per row, every applicable attack", flush=True)
    else:
        print(f"device {device}, {args.images} image(s)/batch(es) per setting, {args.iterations} iterations", flush=True)
    run = {"outpost": run_outpost, "huang": run_huang, "redteam": run_redteam}[args.table]
    result = run(args, device)
    result.update({"device": str(device), "iterations": args.iterations, "images": args.images,
                   "lpips": metrics.lpips_status().__dict__})
    path = OUT / f"{args.table}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}" + ("" if args.table == "redteam" else " and the PNG grid beside it")
          + (f" (certificates and reports under {OUT / 'redteam'})" if args.table == "redteam" else ""))


if __name__ == "__main__":
    main()
