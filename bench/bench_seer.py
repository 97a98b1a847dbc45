"""SEER (``seer``, Garov et al. 2024) at CPU scale: what the learned, disguised server reads through each
client defense, and what guardfl's inspection says of its model (issue 34).

    python bench/bench_seer.py [--batch 8] [--steps 1500] [--clients 10] [--defenses none sign ...] [--seed 0]
                               [--repeats auto|1|16]

FC-2 with BatchNorm (``fc2bn``, 3072-256-10) at PyTorch's default initialisation (seed 0); the attacker's
auxiliary images are 4,000 of the CIFAR-10 sample in ``../shared/data`` (benchmarks only; a seeded
permutation, since the sample is ordered by class), the clients' batches are drawn from the other 1,000. One preparation (the joint training of the model and
the secret decoder, ``--steps`` of Adam), then per defense ``--clients`` client batches, each client
inspecting the model it receives with every check guardfl ships (``inspect=True``, D-SNR on), the defense
on its update, FedSGD, train mode. Prints the preparation's held-out measure (the gate), then per defense:
models refused, the SSIM of the decoded image to the batch's brightest image (the one SEER targets), the
share past SSIM 0.5, and the batch's mean image as the guess (the baseline a decoder must beat). A batch the
training did not reach (the gate failing, as at 64 here) is printed as such: the attack fails the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import numpy as np
import torch

from guardfl.redteam.attacks import AttackFailed, Setting, get
from guardfl.redteam.auxdata import AuxData
from guardfl.redteam.client.simulate import ClientQuery, FedSGD
from guardfl.redteam.modality.image import metrics
from guardfl.redteam.modality.image.models import FC2BN
from guardfl.redteam.threat import ThreatModel
from malicious_defenses import DEFENSES as ALL_DEFENSES  # bench/, beside this script

ROOT = Path(__file__).resolve().parents[1]
#: the shared table but DP-SGD, which rules seer out (below)
DEFENSES = {name: d for name, d in ALL_DEFENSES.items() if not name.startswith("dpsgd")}
#: DP-SGD trains a BatchNorm model only as ``guardfl.dp_compatible`` makes it (GroupNorm in BatchNorm's
#: place): no batch statistics, so no "brightest of the batch" to train for; ``seer`` refuses ``fc2gn``
DPSGD_NOTE = ("dpsgd: not run; a DP-SGD client trains fc2bn only as dp_compatible makes it (fc2gn: GroupNorm, "
              "no batch statistics), which seer refuses: SEER's max property needs BatchNorm")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--defenses", nargs="*", default=list(DEFENSES), choices=list(DEFENSES))
    ap.add_argument("--adapt-steps", type=int, default=None,
                    help="steps fitting the decoder to each defense (seer's adapt_steps; 0: the clean decoder reads it)")
    ap.add_argument("--through", action="store_true", help="train through each pruning / sign / clipped-noise defense (seer's through: true)")
    ap.add_argument("--seed", type=int, default=0, help="the attack's seed: its training stream and its draws (run-to-run spread)")
    ap.add_argument("--repeats", default=None, help="seer's repeats ('auto', the default: 16 against fresh noise; 1: one round)")
    ap.add_argument("--disjoint", action="store_true", help="aux: the first 4,000 (classes 0-7), clients: the last 1,000 (8-9)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    d = np.load(ROOT.parent / "shared/data/cifar10-train-5k.npz")
    x_all = torch.tensor(d["x"]).permute(0, 3, 1, 2).float() / 255
    y_all = torch.tensor(d["y"]).long()
    # the sample is ordered by class (its last 1,000 images are ships and trucks): the split is a seeded
    # permutation, so that the attacker's images and the clients' hold the same classes (before 2026-11-28
    # 19:50 the first 4,000 were the aux: no ship or truck; ``--disjoint`` keeps that split)
    order = torch.arange(5000) if args.disjoint else torch.randperm(5000, generator=torch.Generator().manual_seed(0))
    x_all, y_all = x_all[order], y_all[order]
    threat = ThreatModel(server="malicious", labels="known", aux=AuxData(x_all[:4000], y_all[:4000]))
    torch.manual_seed(0)
    model = FC2BN()
    attack = get("seer", seed=args.seed, steps=args.steps, through=args.through,
                 **({} if args.adapt_steps is None else {"adapt_steps": args.adapt_steps}),
                 **({} if args.repeats is None else {"repeats": args.repeats if args.repeats == "auto" else int(args.repeats)}))
    t0 = time.perf_counter()
    setting = Setting(model, FedSGD(), args.batch, (3, 32, 32), 10, (0.0, 1.0), None)
    try:
        state = attack.prepare(setting, threat)
    except AttackFailed as err:
        print(f"B = {args.batch}, {args.steps} steps, {time.perf_counter() - t0:.0f} s: the gate fails the run: {err}")
        return
    h = state["held_out"]
    print(f"B = {args.batch}, {args.steps} steps, prepared in {time.perf_counter() - t0:.0f} s; held-out aux: SSIM "
          f"{h['ssim']:.3f} (alone {h['ssim_alone']:.3f}, batch mean {h['ssim_batch_mean']:.3f}), past 0.5 {h['share_past_0.5']:.2f}")
    print(f"{'defense':15s} | refused | SSIM to the brightest (mean) | past 0.5 | batch mean's SSIM | s")
    for name in args.defenses:
        defense, got, guess, refused, t1 = DEFENSES[name], [], [], 0, time.perf_counter()
        own = attack.prepare(dataclasses.replace(setting, defense_config=defense), threat)
        if own is not state:  # trained through this defense: its own preparation
            h = own["held_out"]
            print(f"   trained through {own['through']} ({time.perf_counter() - t1:.0f} s): held-out aux (clean gradient) "
                  f"SSIM {h['ssim']:.3f} (batch mean {h['ssim_batch_mean']:.3f})")
        for s in range(args.clients):
            pick = 4000 + torch.randperm(1000, generator=torch.Generator().manual_seed(s))[:args.batch]
            x, y = x_all[pick], y_all[pick]
            client = ClientQuery(x, y, defense, FedSGD(), inspect=True, reference=model, disaggregation=True)
            # the one preparation (seer's joint training reads no defense); the decoder is fitted to each
            rec = attack.interrogate(client, dataclasses.replace(setting, defense_config=defense), threat)
            refused += client.refused
            brightest = int(x.mean((1, 2, 3)).argmax())
            got.append(metrics.ssim(rec.inputs[0], x[brightest], 1.0))
            guess.append(metrics.ssim(x.mean(0), x[brightest], 1.0))
        print(f"   sent: {rec.info.get('evasion')}")
        print(f"   boost: {rec.info.get('boost')}")
        adapted = rec.info.get("defense_adapted")
        if isinstance(adapted, dict):
            b, a = adapted["held_out_before"], adapted["held_out_after"]
            print(f"   decoder fitted to the defense ({adapted['steps']} steps): held-out aux through it {b['ssim']:.3f} "
                  f"-> {a['ssim']:.3f} (batch mean {a['ssim_batch_mean']:.3f}), past 0.5 {a['share_past_0.5']:.2f}; "
                  f"kept: {adapted['kept']}")
        print(f"{name:15s} | {refused:7d} | {np.mean(got):28.3f} | {np.mean(np.array(got) > 0.5):8.2f} | "
              f"{np.mean(guess):17.3f} | {time.perf_counter() - t1:.0f}")
    print(DPSGD_NOTE)


if __name__ == "__main__":
    main()
