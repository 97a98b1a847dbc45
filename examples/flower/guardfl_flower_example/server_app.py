"""The ServerApp: FedAvg over all clients, central evaluation on held-out data, and an audit of every
update that arrives (what the defenses should have left on it), written to ``results.json``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from guardfl_flower_example.task import Settings, evaluate, make_model, test_data


def audit_update(sent: ArrayRecord, reply: ArrayRecord, lr: float) -> dict:
    """Per array: the fraction of delta entries that are exactly zero, and how far the non-zero ones are
    from an integer multiple of ``lr`` (0 for a sign-compressed SGD update without momentum)."""
    rows = {}
    for key in sent.keys():
        a, b = sent[key].numpy(), reply[key].numpy()
        if not np.issubdtype(a.dtype, np.floating):
            continue
        delta = b.astype(np.float64) - a.astype(np.float64)
        steps = delta[delta != 0] / lr
        rows[key] = {
            "size": int(delta.size),
            "zero_fraction": float((delta == 0).mean()),
            "sign_residual": float(np.abs(steps - np.round(steps)).max()) if steps.size else 0.0,
        }
    return rows


class AuditedFedAvg(FedAvg):
    """FedAvg that records, for every reply, what the defenses left on the update."""

    def __init__(self, lr: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.lr = lr
        self.audit: list[dict] = []
        self._sent: ArrayRecord | None = None

    def configure_train(self, server_round, arrays, config, grid):
        self._sent = arrays
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round, replies):
        replies = list(replies)
        for reply in replies:
            if reply.has_error():
                self.audit.append({"round": server_round, "node": reply.metadata.src_node_id, "error": reply.error.reason})
                continue
            record = next(iter(reply.content.array_records.values()))
            self.audit.append({"round": server_round, "node": reply.metadata.src_node_id,
                               "arrays": audit_update(self._sent, record, self.lr)})
        return super().aggregate_train(server_round, replies)


def plot(accuracy: dict[int, float], audit: list[dict], settings: Settings, path: Path) -> None:
    """Global accuracy per round, and the zero fraction of every update that arrived (GradPrune's mark)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.2))
    rounds = sorted(accuracy)
    a.plot(rounds, [accuracy[r] for r in rounds], marker="o")
    a.set(xlabel="round", ylabel="global accuracy", ylim=(0, 1), xticks=rounds, title=f"defense: {settings.defense or 'none'}")
    zeros = [(e["round"], sum(r["zero_fraction"] * r["size"] for r in e["arrays"].values()) / sum(r["size"] for r in e["arrays"].values()))
             for e in audit if "arrays" in e]
    b.scatter([r for r, _ in zeros], [z for _, z in zeros], alpha=0.6)
    b.axhline(settings.update_prune, color="grey", linestyle="--", label=f"update-prune {settings.update_prune}")
    b.set(xlabel="round", ylabel="zero fraction of the update", ylim=(0, 1), xticks=rounds[1:], title="every update that arrived")
    b.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def make_server_app(base: Settings | None = None) -> ServerApp:
    base = base or Settings()
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        settings = Settings.from_run_config(context.run_config, base)
        torch.manual_seed(settings.seed)
        x_test, y_test = test_data(settings)

        def central_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
            model = make_model(settings)
            model.load_state_dict(arrays.to_torch_state_dict())
            loss, acc = evaluate(model, x_test, y_test)
            return MetricRecord({"loss": loss, "accuracy": acc})

        n = settings.num_partitions
        strategy = AuditedFedAvg(lr=settings.lr, fraction_train=1.0, fraction_evaluate=0.0,
                                 min_train_nodes=n, min_available_nodes=n)
        result = strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(make_model(settings).state_dict()),
            num_rounds=settings.num_server_rounds,
            train_config=ConfigRecord({"lr": settings.lr, "local-epochs": settings.local_epochs}),
            evaluate_fn=central_evaluate,
        )
        if settings.out_dir:
            out = Path(settings.out_dir)
            out.mkdir(parents=True, exist_ok=True)
            accuracy = {int(r): float(m["accuracy"]) for r, m in result.evaluate_metrics_serverapp.items()}
            train = {int(r): dict(m) for r, m in result.train_metrics_clientapp.items()}
            (out / "results.json").write_text(json.dumps(
                {"settings": settings.__dict__, "accuracy": accuracy, "train_metrics": train, "audit": strategy.audit},
                indent=2, default=str))
            torch.save(result.arrays.to_torch_state_dict(), out / "global_model.pt")
            plot(accuracy, strategy.audit, settings, out / "rounds.png")

    return app


#: for ``flwr run``
app = make_server_app()
