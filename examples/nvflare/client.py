"""A site's training script (NVFlare Client API): guardfl's defense on the optimizer through
``GuardedTrainer``; the update filter (``GuardUpdateFilter``) is configured in the job, not here."""

from __future__ import annotations

import argparse

import nvflare.client as flare
import torch

from guardfl.integrations.nvflare import GuardedTrainer
from task import Net, accuracy, site_index, site_loader, test_data


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--defense", default="sign", help="guardfl defense on the optimizer: a kind, a .yaml path, or none")
    p.add_argument("--inspect", action="store_true", help="check the received model with guardfl.inspect_model")
    args = p.parse_args()
    defense = None if args.defense == "none" else args.defense  # GuardedTrainer takes a kind or a .yaml path

    flare.init()
    site = flare.get_site_name()
    loader = site_loader(site_index(site), args.samples)
    x_test, y_test = test_data()
    model = Net()
    trainer = GuardedTrainer(model, lambda params: torch.optim.SGD(params, lr=args.lr), defense,
                             epochs=args.epochs, inspect=args.inspect)
    while flare.is_running():
        input_model = flare.receive()
        if input_model is None:
            break
        model.load_state_dict({k: torch.as_tensor(v) for k, v in input_model.params.items()})
        global_acc = accuracy(model, x_test, y_test)  # the received global model, on held-out data
        if flare.is_train():
            out = trainer.train(input_model, loader)
            out.metrics = {**(out.metrics or {}), "accuracy": global_acc}
            print(f"{site} round {input_model.current_round}: global accuracy {global_acc:.3f}, "
                  f"train loss {out.metrics['train_loss']:.3f}")
            flare.send(out)
        elif flare.is_evaluate():
            flare.send(flare.FLModel(metrics={"accuracy": global_acc}))


if __name__ == "__main__":
    main()
