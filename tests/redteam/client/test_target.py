"""Certifying the user's real client: a Flower ClientApp (examples/flower) or a train_fn."""

import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from guardfl.errors import ConfigError
from guardfl.redteam.certification.run import certify
from guardfl.redteam.client.simulate import FedAvg, simulate_client
from guardfl.redteam.config import load_config
from guardfl.redteam.client.target import TargetError, load_object, observe, on_path, run_clientapp
from tests.claims import LOOSE_CLAIM

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "flower"
DLG_FAST = [{"name": "dlg", "budget": {"iterations": 150}, "threat": {"labels": "known"}}]


def example_config(**run_config):
    return {
        "target": {"clientapp": "guardfl_flower_example.client_app:app", "app_dir": str(EXAMPLE),
                   "config": {"lr": 0.02}, "run_config": {"model": "lenet", "dataset": "faces", "samples-per-client": 2,
                                                          "batch-size": 1, **run_config}},
        "model": {"name": "guardfl_flower_example.task:lenet", "state": "wide-init"},
        "client": {"protocol": "fedavg", "lr": 0.02, "batch_size": 1, "samples": 2},
        "attacks": DLG_FAST,
        "certify": {"max_ssim": 0.4, "max_updates": 2, **LOOSE_CLAIM},
    }


@pytest.fixture(scope="module")
def example_app():
    pytest.importorskip("flwr")
    with on_path(EXAMPLE):
        from guardfl_flower_example.task import lenet

        yield load_object("guardfl_flower_example.client_app:app", "target.clientapp"), lenet


def run_example(app, lenet, **run_config):
    from guardfl.redteam.modality.image.models import set_model_state

    model = set_model_state(lenet(), "wide-init", seed=0)
    base = {"model": "lenet", "dataset": "faces", "samples-per-client": 2, "batch-size": 1}
    returned, steps = run_clientapp(app, model, config={"lr": 0.02}, node_config={"partition-id": 1},
                                    run_config={**base, **run_config})
    return model, observe(model, returned, steps, FedAvg(batch_size=1, lr=0.02), None, "target.clientapp")


def test_the_red_team_attacks_exactly_what_the_client_app_sends(example_app):
    model, run = run_example(*example_app, defense="", **{"update-prune": 0.0})
    assert run.steps == 2 and run.inputs.shape == (2, 3, 16, 16) and run.labels.tolist() == [2, 3]
    # the same client simulated by guardfl on the captured private data gives the same update
    sim = simulate_client(model, run.inputs, run.labels, None, FedAvg(batch_size=1, lr=0.02))
    for name, delta in run.observation.update.items():
        assert torch.allclose(delta, sim.update[name], atol=1e-6), name


def test_the_observed_update_carries_the_apps_own_defenses(example_app):
    _, run = run_example(*example_app)  # the app's defaults: SignCompression + GradPrune(0.9) on the update
    for name, delta in run.observation.update.items():
        assert (delta == 0).float().mean() >= 0.8, name
        steps = delta[delta != 0] / 0.02
        assert torch.allclose(steps, steps.round(), atol=1e-3), name


def test_certify_the_example_app_with_and_without_its_defenses(tmp_path, example_app):
    undefended = certify(example_config(defense="", **{"update-prune": 0.0}), out=tmp_path / "a")
    assert not undefended.certified and undefended.worst[0]["worst"] > 0.9
    assert undefended.client["kind"] == "clientapp" and undefended.client["batches"]["0"]["steps"] == 2
    defended = certify({**example_config(), "defense": {"kind": "stack", "defenses": [{"kind": "sign"}, {"kind": "gradprune", "ratio": 0.9}]}},
                       out=tmp_path / "b")
    assert defended.certified, defended.checks
    assert "the user's clientapp" in (tmp_path / "b" / "report.html").read_text()


TRAIN_FNS = textwrap.dedent('''
    import math
    import torch
    import torch.nn.functional as F
    import guardfl

    def sgd(model, loader):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in loader:
            opt.zero_grad(); F.cross_entropy(model(x), y).backward(); opt.step()
        return model

    def outpost(model, loader):
        opt = guardfl.wrap(torch.optim.SGD(model.parameters(), lr=0.1), guardfl.defenses.Outpost(), model=model)
        for x, y in loader:
            opt.zero_grad(); torch.nn.CrossEntropyLoss()(model(x), y).backward(); opt.step()

    def lazy(model, loader):
        return model

    def no_step(model, loader):
        for x, y in loader:
            F.cross_entropy(model(x), y).backward()
        return model

    def diverges(model, loader):
        sgd(model, loader)
        with torch.no_grad():
            next(model.parameters()).fill_(math.nan)
        return model

    def mse(model, loader):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in loader:
            opt.zero_grad(); F.mse_loss(model(x), F.one_hot(y, 10).float()).backward(); opt.step()
        return model

    def two_epochs(model, loader):
        sgd(model, loader); return sgd(model, loader)

    def dp(model, loader):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        # seeded: its noise and Poisson sampling (the defense's own generator) one fixed draw; unseeded, 1 run
        # in 256 would sample no one (4 samples at rate 1/2 over two steps)
        dp_defense = guardfl.defenses.DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, seed=0)
        private, opt, private_loader = guardfl.protect(model, opt, loader, dp_defense)
        for x, y in private_loader:
            opt.zero_grad(); F.cross_entropy(private(x), y).backward(); opt.step()
        return private.to_standard_module()

    def not_a_model(model, loader):
        return {"weights": 1}
''')


@pytest.fixture
def train_fn_config(tmp_path):
    (tmp_path / "user_client.py").write_text(TRAIN_FNS)

    def make(fn, **over):
        cfg = {"target": {"train_fn": f"user_client:{fn}", "app_dir": str(tmp_path)},
               "model": {"name": "lenet", "state": "wide-init"}, "data": {"source": "lfw-faces", "limit": 1},
               "client": {"protocol": "fedavg", "lr": 0.1, "batch_size": 1, "samples": 1},
               "attacks": DLG_FAST, "certify": {"max_ssim": 0.4, "max_updates": 2, **LOOSE_CLAIM}}
        for key, value in over.items():
            cfg[key] = {**cfg[key], **value}
        return cfg

    yield make
    sys.modules.pop("user_client", None)


def test_train_fn_without_defense_is_not_certified_and_with_outpost_it_is(train_fn_config):
    plain = certify(train_fn_config("sgd"))
    assert not plain.certified and plain.client["batches"]["0"]["kind"] == "train_fn"
    assert certify(train_fn_config("outpost") | {"defense": {"kind": "outpost"}}).certified


def test_a_dp_sgd_client_with_poisson_batches_is_certified_by_running_its_code(train_fn_config):
    cfg = train_fn_config("dp", client={"batch_size": 2, "samples": 4}, data={"limit": 4}) | {
        "defense": {"kind": "dpsgd", "noise_multiplier": 1.0, "max_grad_norm": 1.0},
        "attacks": [{"name": "inverting_gradients", "budget": {"iterations": 100, "restarts": 1}, "threat": {"labels": "known"}}]}
    cert = certify(cfg)
    run = cert.client["batches"]["0"]
    assert run["kind"] == "train_fn" and run["steps"] == 2 and 1 <= run["samples"] <= 4
    assert cert.results[0]["metrics"]["summary"]["ssim"]["best"] < 0.4


@pytest.mark.parametrize("fn, message", [
    ("lazy", "no training step was observed"),
    ("no_step", "equal the global model"),
    ("diverges", "NaN or infinite"),
    ("mse", "cannot see the labels"),
    ("two_epochs", "client ran 2 steps"),
    ("not_a_model", "expected the trained torch.nn.Module"),
    ("missing", "has no attribute .missing."),
])
def test_a_client_that_cannot_be_observed_is_refused(train_fn_config, fn, message):
    with pytest.raises(TargetError, match=message):
        certify(train_fn_config(fn))


def test_cli_reports_an_unobservable_client_in_one_line(train_fn_config, tmp_path, capsys):
    import yaml

    from guardfl.cli import main

    path = tmp_path / "lazy.yaml"
    path.write_text(yaml.safe_dump(train_fn_config("lazy")))
    assert main(["redteam", "--config", str(path), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: target.train_fn: no training step was observed")


def test_client_app_bad_replies_are_refused(tmp_path):
    pytest.importorskip("flwr")
    (tmp_path / "bad_apps.py").write_text(textwrap.dedent('''
        import numpy as np
        from flwr.app import Array, ArrayRecord, Error, Message, RecordDict
        from flwr.clientapp import ClientApp

        def app_returning(transform):
            app = ClientApp()
            @app.train()
            def train(msg, ctx):
                rec = next(iter(msg.content.array_records.values()))
                return transform(msg, rec)
            return app

        keys = app_returning(lambda m, r: Message(RecordDict({"arrays": ArrayRecord({k: v for k, v in list(r.items())[:-1]})}), reply_to=m))
        shape = app_returning(lambda m, r: Message(RecordDict({"arrays": ArrayRecord({k: Array(v.numpy().reshape(-1)) for k, v in r.items()})}), reply_to=m))
        error = app_returning(lambda m, r: Message(Error(code=2, reason="out of memory"), reply_to=m))
        not_an_app = object()
    '''))
    base = {"model": {"name": "lenet", "input_shape": [1, 16, 16]}, "client": {"protocol": "fedavg"}, "attacks": DLG_FAST}
    try:
        for name, message in [("keys", "keys differ"), ("shape", "came back with shape"), ("error", "out of memory"),
                              ("not_an_app", "expected a flwr ClientApp")]:
            with pytest.raises(TargetError, match=message):
                certify({**base, "target": {"clientapp": f"bad_apps:{name}", "app_dir": str(tmp_path)}})
    finally:
        sys.modules.pop("bad_apps", None)


def test_declared_samples_must_match_what_the_client_trained_on(example_app):
    cfg = example_config()
    cfg["client"] = {**cfg["client"], "samples": 3}
    with pytest.raises(TargetError, match="client.samples: declares 3"):
        certify(cfg)


def test_unknown_run_config_keys_of_a_flower_app_are_refused(tmp_path, example_app):
    cfg = example_config(**{"no-such-setting": 1})
    with pytest.raises(TargetError, match="no-such-setting"):
        certify(cfg)


def test_target_config_errors_name_the_field():
    for bad, field in [
        ({"target": {"clientapp": "a:b", "train_fn": "c:d"}, "client": {"protocol": "fedavg"}}, "exactly one"),
        ({"target": {"train_fn": "a:b"}}, "client.protocol"),
        ({"target": {"clientapp": "a:b"}, "client": {"protocol": "fedavg"}, "data": {"source": "mnist"}}, "data"),
        ({"target": {"clientapp": "no-colon"}, "client": {"protocol": "fedavg"}}, "module:attribute"),
    ]:
        with pytest.raises(ConfigError, match=field):
            load_config(bad)
    with pytest.raises(ConfigError, match="input_shape"):
        certify({"target": {"clientapp": "a:b"}, "client": {"protocol": "fedavg"}, "model": {"name": "lenet"}})


def test_shipped_flower_example_configs_validate():
    for name in ("flower-example.yaml", "flower-example-no-defense.yaml"):
        cfg = load_config(ROOT / "configs" / name)
        assert cfg.target is not None and cfg.target.clientapp.endswith(":app")


def test_a_malicious_server_attack_on_a_target_is_refused_in_one_line(train_fn_config):
    from guardfl.errors import ConfigError

    cfg = train_fn_config("sgd") | {"attacks": [{"name": "robbing_the_fed", "threat": {"server": "malicious"}}]}
    with pytest.raises(ConfigError, match="robbing_the_fed: not applicable.*simulated client"):
        certify(cfg)
