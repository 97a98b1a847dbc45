"""A site's training script (NVFlare Client API): guardfl's defense on the optimizer through
``GuardedTrainer``; the update filter (``GuardUpdateFilter``) is configured in the job, not here.

``train(input_model, site=...)`` is one round of one site, the function the loop below calls: the red
team certifies it as deployed (``configs/nvflare-example.yaml``, ``target.nvflare: client:train``)."""

from __future__ import annotations

import argparse
import os

import torch

from guardfl.integrations.nvflare import GuardedTrainer
from task import accuracy, make_model, site_index, site_loader, test_data


class Site:
    """One site's model, private data and guarded trainer (its DP accountant / round counter live here)."""

    def __init__(self, site: str, *, lr: float = 0.02, epochs: int = 1, samples: int = 128, batch_size: int = 16,
                 defense: str = "sign", inspect: bool = False, model: str = "cnn", dataset: str = "synthetic",
                 state_path: str | None = None) -> None:
        self.name = site
        self.loader = site_loader(site_index(site), samples, batch_size, dataset=dataset)
        self.model = make_model(model)
        self.trainer = GuardedTrainer(self.model, lambda params: torch.optim.SGD(params, lr=lr),
                                      None if defense == "none" else defense,  # a guardfl kind or a .yaml path
                                      epochs=epochs, inspect=inspect, state_path=state_path)

    def train(self, input_model):
        return self.trainer.train(input_model, self.loader)


def train(input_model, site: str = "site-1", **settings):
    """One training round of a fresh ``site`` on ``input_model`` (an FLModel); returns the FLModel to send."""
    return Site(site, **settings).train(input_model)


def main() -> None:
    import nvflare.client as flare

    p = argparse.ArgumentParser()
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--defense", default="sign", help="guardfl defense on the optimizer: a kind, a .yaml path, or none")
    p.add_argument("--inspect", action="store_true", help="check the received model with guardfl.inspect_model")
    args = p.parse_args()

    flare.init()
    name = flare.get_site_name()
    # the simulator starts this script anew every round (job.py): the site's ClientState (round counter, DP
    # accountant, round budget) lives in a file in its workspace, not in the process
    site = Site(name, lr=args.lr, epochs=args.epochs, samples=args.samples, defense=args.defense,
                inspect=args.inspect, state_path=os.path.abspath(f"guardfl-state-{name}.json"))
    x_test, y_test = test_data()
    while flare.is_running():
        input_model = flare.receive()
        if input_model is None:
            break
        site.model.load_state_dict({k: torch.as_tensor(v) for k, v in input_model.params.items()})
        global_acc = accuracy(site.model, x_test, y_test)  # the received global model, on held-out data
        if flare.is_train():
            out = site.train(input_model)
            out.metrics = {**(out.metrics or {}), "accuracy": global_acc}
            out.meta = {**(out.meta or {}), "site": site.name}  # for the server's audit (audit.py: who sent it)
            print(f"{site.name} round {input_model.current_round}: global accuracy {global_acc:.3f}, "
                  f"train loss {out.metrics['train_loss']:.3f}")
            flare.send(out)
        elif flare.is_evaluate():
            flare.send(flare.FLModel(metrics={"accuracy": global_acc}))


if __name__ == "__main__":
    main()
