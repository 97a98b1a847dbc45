"""guardfl + NVIDIA FLARE: FedAvg over a few simulated sites, each site's update defended twice.

    python examples/nvflare/job.py --rounds 3 --sites 3 --out nvflare-out

Runs NVFlare's simulator (one machine, offline, CPU) and writes ``OUT/results.json``: the accuracy of the
global model per round, the audit of every update that arrived at the server, and the run's time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sites", type=int, default=3)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--samples", type=int, default=128, help="samples per site")
    p.add_argument("--defense", default="sign", help="guardfl defense on the sites' optimizer: a kind, a .yaml path, or none")
    p.add_argument("--update-prune", type=float, default=0.9, help="GradPrune ratio of the update filter (0 = no filter)")
    p.add_argument("--no-inspect", action="store_true", help="no InspectModelFilter on the sites' train tasks")
    p.add_argument("--transfer", default="DIFF", choices=["DIFF", "FULL"], help="send weight differences or full weights")
    p.add_argument("--out", default="nvflare-out")
    args = p.parse_args(argv)

    sys.path.insert(0, str(HERE))  # task.py, audit.py
    # each site's script runs in a process of its own, and finds task.py there
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH", "")]))
    import torch
    from nvflare.app_opt.pt.recipes.fedavg import FedAvgRecipe
    from nvflare.client.config import TransferType
    from nvflare.recipe import SimEnv

    from audit import UpdateAudit
    from guardfl.integrations.nvflare import GuardUpdateFilter, InspectModelFilter, add_inspect_filter, add_update_filter
    from task import Net, accuracy, test_data

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    audit_path = out / "audit.jsonl"
    audit_path.unlink(missing_ok=True)
    train_args = f"--lr {args.lr} --epochs {args.epochs} --samples {args.samples} --defense {args.defense}"
    recipe = FedAvgRecipe(name="guardfl_nvflare", model=Net(), min_clients=args.sites, num_rounds=args.rounds,
                          train_script=str(HERE / "client.py"), train_args=train_args,
                          # a process per site: the simulator runs its sites as threads of one process, and the
                          # in-process Client API is one context per process (flare.init() of the second site
                          # returned the first's): in two CI runs both sites trained as one site on its data
                          launch_external_process=True, command=f"{sys.executable} -u",
                          params_transfer_type=TransferType.DIFF if args.transfer == "DIFF" else TransferType.FULL)
    if args.update_prune > 0:
        add_update_filter(recipe, GuardUpdateFilter({"kind": "gradprune", "ratio": args.update_prune}), tasks=["train"])
    if not args.no_inspect:  # refuse a malicious global model before the site's script sees it
        add_inspect_filter(recipe, InspectModelFilter(reference="task:Net"), tasks=["train"])
    recipe.add_server_input_filter(UpdateAudit(str(audit_path), lr=args.lr), tasks=["train"])

    start = time.perf_counter()
    env = SimEnv(num_clients=args.sites, num_threads=1, workspace_root=str(out / "workspace"))
    try:
        workspace = Path(recipe.run(env).get_result())
    except RuntimeError as err:  # a site refused a round (see its log), or the run failed
        print(f"error: {err}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - start

    audit = [json.loads(line) for line in audit_path.read_text().splitlines()] if audit_path.is_file() else []
    per_round: dict[int, list[float]] = {}
    for a in audit:
        if a.get("global_accuracy") is not None:
            per_round.setdefault(int(a["round"]), []).append(a["global_accuracy"])
    accuracy_per_round = [round(sum(v) / len(v), 4) for _, v in sorted(per_round.items())]
    final = None
    models = sorted(workspace.rglob("FL_global_model.pt"))
    if models:
        model = Net()
        saved = torch.load(models[0], map_location="cpu", weights_only=False)
        model.load_state_dict({k: torch.as_tensor(v) for k, v in saved.get("model", saved).items()})
        final = accuracy(model, *test_data())
        accuracy_per_round.append(round(final, 4))
    results = {"rounds": args.rounds, "sites": args.sites, "seconds": round(seconds, 1),
               # entry r: the global model at the start of round r (as the sites measured it), the last
               # entry: the final global model (measured here)
               "accuracy_per_round": accuracy_per_round, "final_accuracy": final, "audit": audit,
               "workspace": str(workspace)}
    (out / "results.json").write_text(json.dumps(results, indent=2))
    refused = [a for a in audit if a["return_code"] != "OK"]
    print(f"accuracy per round: {accuracy_per_round}; {len(audit)} updates audited, {len(refused)} refused; {seconds:.0f} s")
    print(f"results: {out / 'results.json'}")
    if final is None or len(audit) != args.rounds * args.sites or refused:
        print("error: the federation did not finish as expected; see the logs under", workspace, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
