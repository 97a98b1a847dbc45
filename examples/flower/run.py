"""Run the example in Flower's simulation engine (Ray), without ``flwr run``:

    python examples/flower/run.py --rounds 3 --clients 4 --out flower-out

Writes ``OUT/results.json`` (central accuracy per round, client metrics, the audit of every update that
left a client) and ``OUT/global_model.pt``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--samples", type=int, default=128, help="samples per client")
    p.add_argument("--defense", default="kind: sign", help="optimizer-level defense: a kind, YAML text or a .yaml path ('' = none)")
    p.add_argument("--update-prune", type=float, default=0.9, help="GradPrune ratio on the update (0 = off)")
    p.add_argument("--model", default="cnn", choices=["cnn", "lenet"])
    p.add_argument("--dataset", default="synthetic", choices=["synthetic", "faces", "cifar10"])
    p.add_argument("--download", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpus", type=int, default=min(2, os.cpu_count() or 1), help="CPUs Ray may use")
    p.add_argument("--out", default="flower-out")
    args = p.parse_args(argv)

    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    # Ray renices its workers (the ClientApps) to 15. On a 2-core host with any other busy process at nice 0
    # they got ~3% of a core: round 1 never finished in 10 minutes (26 s otherwise). The clients are the work.
    os.environ.setdefault("RAY_worker_niceness", "0")
    # Ray's worker processes import the apps by module name
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH", "")]))
    sys.path.insert(0, str(HERE))
    from flwr.simulation import run_simulation

    from guardfl_flower_example.client_app import make_client_app
    from guardfl_flower_example.server_app import make_server_app
    from guardfl_flower_example.task import Settings

    settings = Settings(num_server_rounds=args.rounds, local_epochs=args.epochs, lr=args.lr,
                        samples_per_client=args.samples, num_partitions=args.clients, defense=args.defense,
                        update_prune=args.update_prune, model=args.model, dataset=args.dataset, download=args.download,
                        seed=args.seed, out_dir=str(Path(args.out).resolve()))
    run_simulation(
        server_app=make_server_app(settings),
        client_app=make_client_app(settings),
        num_supernodes=args.clients,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                        "init_args": {"num_cpus": args.cpus, "include_dashboard": False}},
    )
    results = Path(args.out) / "results.json"
    if not results.is_file():
        print("error: the simulation did not finish (no results.json); see the log above", file=sys.stderr)
        return 1
    print(f"results: {results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
