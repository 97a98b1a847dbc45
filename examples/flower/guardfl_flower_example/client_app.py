"""The ClientApp: local training with a guardfl defense on the optimizer (``guardfl_flower.train``) and,
optionally, GradPrune on the returned update (``GuardUpdateMod``)."""

from __future__ import annotations

import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from guardfl.defenses import GradPrune, from_config
from guardfl.integrations import flower as guardfl_flower

from guardfl_flower_example.task import Settings, client_loader, evaluate, make_model


def make_client_app(base: Settings | None = None) -> ClientApp:
    base = base or Settings()

    def update_prune_mod(msg: Message, context: Context, call_next) -> Message:
        # the mod's ratio comes from the run config, so it is built per message
        ratio = Settings.from_run_config(context.run_config, base).update_prune
        if ratio <= 0:
            return call_next(msg, context)
        return guardfl_flower.GuardUpdateMod(GradPrune(ratio))(msg, context, call_next)

    app = ClientApp(mods=[update_prune_mod])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        settings = Settings.from_run_config(context.run_config, base)
        config = msg.content["config"]
        lr = float(config.get("lr", settings.lr))
        defense = from_config(settings.defense_config()) if settings.defense_config() else None
        return guardfl_flower.train(
            msg, context, make_model(settings), client_loader(settings, int(context.node_config["partition-id"])),
            lambda params: torch.optim.SGD(params, lr=lr), defense,
            epochs=int(config.get("local-epochs", settings.local_epochs)),
        )

    @app.evaluate()
    def evaluate_fn(msg: Message, context: Context) -> Message:
        settings = Settings.from_run_config(context.run_config, base)
        model = make_model(settings)
        _, record = guardfl_flower.received_arrays(msg)
        model.load_state_dict(record.to_torch_state_dict())
        data = client_loader(settings, int(context.node_config["partition-id"])).dataset.tensors
        loss, acc = evaluate(model, *data)
        metrics = MetricRecord({"eval_loss": loss, "eval_acc": acc, "num-examples": len(data[0])})
        return Message(RecordDict({"metrics": metrics}), reply_to=msg)

    return app


#: for ``flwr run`` (settings from pyproject.toml's [tool.flwr.app.config])
app = make_client_app()
