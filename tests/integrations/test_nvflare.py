"""guardfl.integrations.nvflare: the task-result filter on real NVFlare objects (DXO, Shareable, FLContext,
the events the client runner fires), the Client API helper on real FLModels, and the example job on
NVFlare's simulator."""

import copy
import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("nvflare")

from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable  # noqa: E402
from nvflare.apis.event_type import EventType  # noqa: E402
from nvflare.apis.fl_constant import FLContextKey, ReturnCode  # noqa: E402
from nvflare.apis.fl_context import FLContext  # noqa: E402
from nvflare.apis.shareable import Shareable  # noqa: E402
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType  # noqa: E402

from guardfl.defenses import GradPrune  # noqa: E402
from guardfl.errors import ConfigError, MaliciousModelError  # noqa: E402
from guardfl.integrations import nvflare as gn  # noqa: E402
from tests import malicious as M  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PRUNE = {"kind": "gradprune", "ratio": 0.5}


def net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                               torch.nn.Linear(8, 3))


DATA = TensorDataset(torch.randn(32, 1, 4, 4, generator=torch.Generator().manual_seed(2)),
                     torch.randint(0, 3, (32,), generator=torch.Generator().manual_seed(2)))


def arrays(model):
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def trained(model, steps=2, lr=0.1):
    model = copy.deepcopy(model).train()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in list(DataLoader(DATA, batch_size=8))[:steps]:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model


def task_context(received, task_id="t1", task="train"):
    """An FLContext as the client runner leaves it around a task: task id/name, and the task data while the
    executor runs (the filter keeps the received model on BEFORE_TASK_EXECUTION)."""
    ctx = FLContext()
    ctx.set_prop(FLContextKey.TASK_ID, task_id, private=True, sticky=False)
    ctx.set_prop(FLContextKey.TASK_NAME, task, private=True, sticky=False)
    if received is not None:
        ctx.set_prop(FLContextKey.TASK_DATA, DXO(DataKind.WEIGHTS, received).to_shareable(), private=True, sticky=False)
    return ctx


def run_task(flt, received, result, **kw):
    ctx = task_context(received, **kw)
    flt.handle_event(EventType.BEFORE_TASK_EXECUTION, ctx)
    return flt.process(result, ctx)


# -- the filter ------------------------------------------------------------------------------------------------
def test_filter_defends_a_weights_result_against_the_received_model():
    model = net()
    received, new = arrays(model), arrays(trained(model))
    reply = run_task(gn.GuardUpdateFilter({"kind": "gradprune", "ratio": 0.9}), received,
                     DXO(DataKind.WEIGHTS, new, meta={MetaKey.NUM_STEPS_CURRENT_ROUND: 2}).to_shareable())
    assert reply.get_return_code() == ReturnCode.OK
    dxo = from_shareable(reply)
    assert list(dxo.data) == list(received) and dxo.get_meta_prop(MetaKey.NUM_STEPS_CURRENT_ROUND) == 2
    for k in ("1.weight", "4.weight"):  # the pruned delta is added back to the received weights
        delta = dxo.data[k] - received[k]
        assert (delta == 0).mean() >= 0.85 and not np.array_equal(dxo.data[k], new[k])
    for k in ("2.running_mean", "2.running_var", "2.num_batches_tracked"):  # BatchNorm buffers: sent as trained
        assert np.array_equal(dxo.data[k], new[k])
    stats = dxo.get_meta_prop(gn.META_KEY)
    assert stats["round"] == 0 and stats["defended"] == 6 and stats["zero_fraction"] >= 0.85
    assert json.loads(stats["defense"]) == {"kind": "gradprune", "ratio": 0.9}
    assert set(stats["sent_as_trained"]) == {"2.running_mean", "2.running_var", "2.num_batches_tracked"}
    assert "GuardUpdateFilter" in dxo.get_filter_history()


def test_filter_defends_a_weight_diff_and_keeps_torch_tensors():
    model = net()
    diff = {k: torch.as_tensor(v) for k, v in arrays(trained(model)).items()}
    diff = {k: (v - model.state_dict()[k]) for k, v in diff.items()}
    flt = gn.GuardUpdateFilter({"kind": "gradprune", "ratio": 0.5})
    reply = run_task(flt, None, DXO(DataKind.WEIGHT_DIFF, diff).to_shareable())
    dxo = from_shareable(reply)
    assert all(isinstance(v, torch.Tensor) for v in dxo.data.values())
    w = dxo.data["1.weight"]
    assert 0.45 <= float((w == 0).float().mean()) <= 0.55
    kept = w != 0
    assert torch.equal(w[kept], diff["1.weight"][kept])  # GradPrune keeps the largest entries as they are


def test_a_seeded_filter_never_reuses_a_rounds_noise():
    flt = gn.GuardUpdateFilter({"kind": "gaussian", "sigma": 0.1, "seed": 7})
    diff = {"w": np.zeros((4, 4), np.float32)}
    rounds = [from_shareable(run_task(flt, None, DXO(DataKind.WEIGHT_DIFF, copy.deepcopy(diff)).to_shareable(),
                                      task_id=f"t{i}")).data["w"] for i in range(2)]
    assert not np.array_equal(rounds[0], rounds[1])
    again = gn.GuardUpdateFilter({"kind": "gaussian", "sigma": 0.1, "seed": 7})  # reproducible per (seed, round)
    first = from_shareable(run_task(again, None, DXO(DataKind.WEIGHT_DIFF, copy.deepcopy(diff)).to_shareable())).data["w"]
    assert np.array_equal(first, rounds[0])


def _non_dxo():
    s = Shareable()
    s["weights"] = {"w": np.ones(3)}
    return s


REFUSED = {
    "metrics DXO": (lambda r, n: DXO(DataKind.METRICS, {"accuracy": 0.5}).to_shareable(), "METRICS DXO"),
    "collection DXO": (lambda r, n: DXO(DataKind.COLLECTION, {"a": DXO(DataKind.WEIGHTS, n)}).to_shareable(), "COLLECTION DXO"),
    "not a DXO": (lambda r, n: _non_dxo(), "is not a DXO"),
    "no weights": (lambda r, n: DXO(DataKind.WEIGHTS, {}).to_shareable(), "holds no weights"),
    "other keys": (lambda r, n: DXO(DataKind.WEIGHTS, {k + "x": v for k, v in n.items()}).to_shareable(), "not those received"),
    "other shape": (lambda r, n: DXO(DataKind.WEIGHTS, {**n, "1.bias": np.zeros(3, np.float32)}).to_shareable(), "shape"),
    "changed integer array": (lambda r, n: DXO(DataKind.WEIGHTS, {**n, "q": np.array([1, 2], np.int8)}).to_shareable(), "not floating point"),
    "non-finite": (lambda r, n: DXO(DataKind.WEIGHTS, {**n, "1.bias": np.full(8, np.nan, np.float32)}).to_shareable(), "non-finite"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_filter_fails_closed_with_one_error_line(case, caplog):
    make, reason = REFUSED[case]
    received = {**arrays(net()), "q": np.array([0, 0], np.int8)}
    new = {**arrays(trained(net())), "q": np.array([0, 0], np.int8)}
    with caplog.at_level(logging.ERROR):
        reply = run_task(gn.GuardUpdateFilter(PRUNE), received, make(received, new))
    assert reply.get_return_code() == ReturnCode.TASK_RESULT_FILTER_ERROR
    with pytest.raises(ValueError):
        from_shareable(reply)  # nothing of the update in the reply
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and reason in errors[0] and "the result was not sent" in errors[0], errors


def test_a_weights_result_without_a_received_model_on_record_is_refused(caplog):
    flt = gn.GuardUpdateFilter(PRUNE)
    new = arrays(net())
    run_task(flt, arrays(net()), Shareable(), task_id="other")  # another task's model does not count
    with caplog.at_level(logging.ERROR):
        reply = flt.process(DXO(DataKind.WEIGHTS, new).to_shareable(), task_context(None, task_id="t9"))
    assert reply.get_return_code() == ReturnCode.TASK_RESULT_FILTER_ERROR
    assert "did not see" in caplog.text


def test_error_replies_pass_through_untouched():
    from nvflare.apis.shareable import make_reply

    reply = run_task(gn.GuardUpdateFilter(PRUNE), None, make_reply(ReturnCode.EXECUTION_EXCEPTION))
    assert reply.get_return_code() == ReturnCode.EXECUTION_EXCEPTION


@pytest.mark.parametrize("config, field", [
    ({"kind": "gradprunee"}, "unknown kind"),
    ("sign", "cannot act on a model update"),
    ({"kind": "outpost"}, "cannot act on a model update"),
    ({"kind": "dpsgd", "noise_multiplier": 1.0}, "cannot act on a model update"),
])
def test_filter_construction_refuses_what_cannot_act_on_an_update(config, field):
    with pytest.raises(ConfigError, match=field):
        gn.GuardUpdateFilter(config)


def test_filter_construction_refuses_other_data_kinds_and_bad_clip_norm():
    with pytest.raises(ConfigError, match="data_kinds"):
        gn.GuardUpdateFilter(PRUNE, data_kinds=["METRICS"])
    with pytest.raises(ConfigError, match="clip_norm"):
        gn.GuardUpdateFilter(PRUNE, clip_norm=-1)


def test_job_config_round_trips_and_add_update_filter_writes_the_sites_config(tmp_path, monkeypatch):
    flt = gn.GuardUpdateFilter(GradPrune(0.8), clip_norm=2.0, skip=["running_var"], data_kinds=["WEIGHT_DIFF"])
    entry = flt.job_config()
    assert entry["path"] == "guardfl.integrations.nvflare.GuardUpdateFilter"
    rebuilt = gn.GuardUpdateFilter(**json.loads(json.dumps(entry["args"])))  # what NVFlare builds from the JSON
    assert rebuilt.job_config() == entry and rebuilt.clip_norm == 2.0 and rebuilt.skip == ["running_var"]

    from nvflare.app_opt.pt.recipes.fedavg import FedAvgRecipe

    script = tmp_path / "client.py"
    script.write_text("print('train')\n")
    # the model's class from a small local module: NVFlare's Job API copies a model class's module (and what
    # it imports) into the job, which for torch.nn.Sequential itself would be torch's whole source
    (tmp_path / "nvf_test_model.py").write_text("import torch\n\nclass Net(torch.nn.Linear):\n"
                                                "    def __init__(self):\n        super().__init__(2, 2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from nvf_test_model import Net

    recipe = FedAvgRecipe(name="j", model=Net(), min_clients=1, num_rounds=1, train_script=str(script))
    gn.add_update_filter(recipe, flt)
    recipe.export(job_dir=str(tmp_path / "jobs"))
    (config,) = (tmp_path / "jobs").rglob("config_fed_client.json")
    assert json.loads(config.read_text())["task_result_filters"] == [{"tasks": ["train"], "filters": [entry]}]
    with pytest.raises(ConfigError, match="tasks"):
        gn.add_update_filter(recipe, flt, tasks="train")


# -- the Client API helper ---------------------------------------------------------------------------------------
def fl_model(model, tensors=False, rnd=0):
    params = {k: (v.clone() if tensors else v.numpy().copy()) for k, v in model.state_dict().items()}
    return FLModel(params_type=ParamsType.FULL, params=params, current_round=rnd, total_rounds=3)


@pytest.mark.parametrize("tensors", [False, True])
def test_trainer_returns_the_trained_weights_in_the_received_format(tensors):
    global_model = net()
    trainer = gn.GuardedTrainer(net(5), lambda p: torch.optim.SGD(p, lr=0.1), "sign")
    out = trainer.train(fl_model(global_model, tensors), DataLoader(DATA, batch_size=8))
    assert out.params_type == ParamsType.FULL and list(out.params) == list(global_model.state_dict())
    assert all(isinstance(v, torch.Tensor if tensors else np.ndarray) for v in out.params.values())
    assert out.meta[MetaKey.NUM_STEPS_CURRENT_ROUND] == 4 and out.current_round == 0
    delta = np.asarray(out.params["1.weight"]) - global_model.state_dict()["1.weight"].numpy()
    steps = delta / 0.1  # SignCompression with plain SGD: every entry moved by an integer number of +-lr
    assert np.abs(steps - np.round(steps)).max() < 1e-4 and np.abs(delta).max() > 0
    assert "train_loss" in out.metrics and "guardfl_epsilon" not in out.metrics


def test_trainer_keeps_dp_epsilon_cumulative_across_rounds_and_launches(tmp_path):
    from guardfl.protect import dp_compatible

    def make():
        torch.manual_seed(0)
        return dp_compatible(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 3)))

    path = tmp_path / "state.json"
    dp = {"kind": "dpsgd", "noise_multiplier": 1.0, "max_grad_norm": 1.0}
    trainer = gn.GuardedTrainer(make(), lambda p: torch.optim.SGD(p, lr=0.1), dp, state_path=path)
    eps = [trainer.train(fl_model(make(), rnd=r), DataLoader(DATA, batch_size=8)).metrics["guardfl_epsilon"] for r in range(2)]
    relaunched = gn.GuardedTrainer(make(), lambda p: torch.optim.SGD(p, lr=0.1), dp, state_path=path)  # a new process
    eps.append(relaunched.train(fl_model(make(), rnd=2), DataLoader(DATA, batch_size=8)).metrics["guardfl_epsilon"])
    assert eps[0] < eps[1] < eps[2] and relaunched.state.rounds == 3


def test_trainer_refuses_a_malicious_model_before_training():
    model = net(1)
    before = copy.deepcopy(model.state_dict())
    trainer = gn.GuardedTrainer(model, lambda p: torch.optim.SGD(p, lr=0.1), PRUNE, inspect=True)
    with pytest.raises(MaliciousModelError, match="class fishing"):
        trainer.train(fl_model(M.class_fishing(net(), target=2)), DataLoader(DATA, batch_size=8))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()) and trainer.state.rounds == 0


def plain_net(seed=0):
    """``net`` without its BatchNorm."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def test_trainer_inspect_disaggregation_refuses_what_only_dsnr_sees():
    from guardfl.redteam.attacks.malicious.fishing import fishing_model

    fished = fishing_model(plain_net(), 3, 1, 50.0, disguise=True)  # label 1 has one sample in the first batch
    plain = gn.GuardedTrainer(plain_net(), lambda p: torch.optim.SGD(p, lr=0.1), PRUNE, inspect=True)
    plain.train(fl_model(fished), DataLoader(DATA, batch_size=8))  # D-SNR off: every default check passes
    trainer = gn.GuardedTrainer(plain_net(), lambda p: torch.optim.SGD(p, lr=0.1), PRUNE, inspect=True, inspect_disaggregation=True)
    with pytest.raises(MaliciousModelError, match="disaggregation: sample"):
        trainer.train(fl_model(fished), DataLoader(DATA, batch_size=8))
    assert trainer.state.rounds == 0
    # with BatchNorm the same fishing is refused by default: the isolation check at BatchNorm's output
    bn = gn.GuardedTrainer(net(), lambda p: torch.optim.SGD(p, lr=0.1), PRUNE, inspect=True)
    with pytest.raises(MaliciousModelError, match="isolation: layer '1 -> 2'"):
        bn.train(fl_model(fishing_model(net(), 3, 1, 50.0, disguise=True)), DataLoader(DATA, batch_size=8))
    with pytest.raises(ConfigError, match="^inspect_disaggregation: True adds a check"):
        gn.GuardedTrainer(net(), lambda p: torch.optim.SGD(p, lr=0.1), PRUNE, inspect_disaggregation=True)


def test_trainer_inspect_leak_limit_refuses_the_honest_models_own_leak():
    """plain_net singles out 2 of the first 8 samples by itself: a limit of 1 refuses it, nothing trained."""
    trainer = gn.GuardedTrainer(plain_net(), lambda p: torch.optim.SGD(p, lr=0.1), PRUNE, inspect=True, inspect_leak_limit=1)
    with pytest.raises(MaliciousModelError, match="leak limit: a server reads 2 of the batch's 8 samples"):
        trainer.train(fl_model(plain_net()), DataLoader(DATA, batch_size=8))
    assert trainer.state.rounds == 0
    with pytest.raises(ConfigError, match="^inspect_leak_limit: a limit adds a check"):
        gn.GuardedTrainer(plain_net(), lambda p: torch.optim.SGD(p, lr=0.1), PRUNE, inspect_leak_limit=0)


def test_trainer_keeps_the_leak_history_across_rounds_and_launches(tmp_path):
    """The leak limit across rounds: round 0's honest model gives 2 samples away (limit 2: accepted), and
    after a relaunch (the history read back from beside the state file) round 1's model, within the limit
    alone, is refused for what round 0 gave away."""
    path = tmp_path / "state.json"
    sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    trainer = gn.GuardedTrainer(plain_net(), sgd, PRUNE, inspect=True, inspect_leak_limit=2, state_path=path)
    trainer.train(fl_model(plain_net(0)), DataLoader(DATA, batch_size=8))
    assert (tmp_path / "state.json.leak-history").is_file()
    relaunched = gn.GuardedTrainer(plain_net(), sgd, PRUNE, inspect=True, inspect_leak_limit=2, state_path=path)
    assert relaunched.state.leak_history is not None and relaunched.last is None
    with pytest.raises(MaliciousModelError, match="given away before"):
        relaunched.train(fl_model(plain_net(1)), DataLoader(DATA, batch_size=8))
    assert relaunched.state.rounds == 1
    with pytest.raises(ConfigError, match="^inspect_leak_history: must be true or false"):
        gn.GuardedTrainer(plain_net(), sgd, PRUNE, inspect=True, inspect_leak_limit=2, inspect_leak_history=None)


def test_trainer_refuses_bad_input_at_construction_and_diff_models():
    with pytest.raises(ConfigError, match="unknown kind"):
        gn.GuardedTrainer(net(), lambda p: torch.optim.SGD(p, lr=0.1), "nope")
    trainer = gn.GuardedTrainer(net(), lambda p: torch.optim.SGD(p, lr=0.1), "sign")
    diff = FLModel(params_type=ParamsType.DIFF, params=fl_model(net()).params)
    with pytest.raises(ValueError, match="params_type"):
        trainer.train(diff, DataLoader(DATA, batch_size=8))


# -- the example on the simulator -----------------------------------------------------------------------------
def test_example_job_on_the_simulator(tmp_path):
    """examples/nvflare: 2 sites, 2 rounds; every update that reached the server is GradPrune(0.9)-sparse
    (the filter) and a lattice of +-lr steps (SignCompression through GuardedTrainer), and the model learns."""
    proc = subprocess.run([sys.executable, str(ROOT / "examples/nvflare/job.py"), "--rounds", "2", "--sites", "2",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    audit = results["audit"]
    assert len(audit) == 4 and {a["site"] for a in audit} == {"site-1", "site-2"}
    # two sites, two data partitions: each round's two updates differ (in one process both sites trained as
    # site-1 on its data, the Client API being one context per process)
    for r in (0, 1):
        assert len({a["guardfl"]["norm_before"] for a in audit if a["round"] == r}) == 2, audit
    for a in audit:
        assert a["return_code"] == "OK" and a["kind"] == "WEIGHT_DIFF"
        assert a["zero_fraction"] >= 0.89 and a["lr_multiple_fraction"] == 1.0
        assert a["guardfl"]["defended"] == 6
    acc = results["accuracy_per_round"]
    assert len(acc) == 3 and acc[-1] > acc[0] + 0.1, acc
    site_log = (Path(results["workspace"]) / "site-1" / "log.txt").read_text()
    assert site_log.count("the received model passed guardfl.inspect_model") == 2  # InspectModelFilter, every round


# -- the inspection filter --------------------------------------------------------------------------------------
def test_inspect_filter_refuses_a_fished_model_and_passes_a_benign_one(caplog, tmp_path, monkeypatch):
    (tmp_path / "nvf_inspect_model.py").write_text(
        "import torch\n\ndef net():\n    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 8), "
        "torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    flt = gn.InspectModelFilter(reference="nvf_inspect_model:net")
    ok = DXO(DataKind.WEIGHTS, arrays(net())).to_shareable()
    assert flt.process(ok, task_context(None)) is ok
    fished = DXO(DataKind.WEIGHTS, arrays(M.class_fishing(net(), target=2))).to_shareable()
    with caplog.at_level(logging.ERROR), pytest.raises(MaliciousModelError, match="class fishing"):
        flt.process(fished, task_context(None))
    assert len([r for r in caplog.records if r.levelno >= logging.ERROR]) == 1
    imprinted = DXO(DataKind.WEIGHTS, arrays(M.with_imprint(net(), in_shape=(1, 4, 4), bins=16))).to_shareable()
    with pytest.raises(MaliciousModelError, match="architecture"):
        flt.process(imprinted, task_context(None))
    metrics = DXO(DataKind.METRICS, {"a": 1.0}).to_shareable()
    assert flt.process(metrics, task_context(None)) is metrics
    with pytest.raises(ConfigError, match="reference"):
        gn.InspectModelFilter(reference="no-colon")


def test_trainer_runs_input_encodings_and_stacks():
    """MixUp trains on mixed inputs and soft labels through guardfl.protect; a stack with Outpost too."""
    for defense in ({"kind": "mixup", "k": 2, "max_coeff": 0.7},
                    {"kind": "stack", "defenses": [{"kind": "outpost"}, {"kind": "gradprune", "ratio": 0.5}]}):
        trainer = gn.GuardedTrainer(net(), lambda p: torch.optim.SGD(p, lr=0.1), defense, num_classes=3)
        out = trainer.train(fl_model(net()), DataLoader(DATA, batch_size=8, drop_last=True))
        assert out.meta[MetaKey.NUM_STEPS_CURRENT_ROUND] == 4 and np.isfinite(out.metrics["train_loss"])
        assert not np.array_equal(out.params["1.weight"], net().state_dict()["1.weight"].numpy())


def test_trainer_keeps_its_round_budget_across_launches(tmp_path):
    from guardfl.errors import RoundBudgetError
    path, noise = tmp_path / "state.json", {"kind": "gaussian", "sigma": 0.01}
    trainer = gn.GuardedTrainer(net(), lambda p: torch.optim.SGD(p, lr=0.1), noise, max_rounds=2, state_path=path)
    for r in range(2):
        trainer.train(fl_model(net(), rnd=r), DataLoader(DATA, batch_size=8))
    relaunched = gn.GuardedTrainer(net(), lambda p: torch.optim.SGD(p, lr=0.1), noise, max_rounds=2, state_path=path)
    with pytest.raises(RoundBudgetError, match="budget of 2"):
        relaunched.train(fl_model(net(), rnd=2), DataLoader(DATA, batch_size=8))
    with pytest.raises(ConfigError, match="^max_rounds: expected"):
        gn.GuardedTrainer(net(), lambda p: torch.optim.SGD(p, lr=0.1), noise, max_rounds=0)


def test_the_update_filter_keeps_a_round_budget_across_site_restarts(tmp_path, caplog):
    path, diff = tmp_path / "budget.json", {"w": np.zeros((4, 4), np.float32)}

    def send(flt, i):
        return run_task(flt, None, DXO(DataKind.WEIGHT_DIFF, copy.deepcopy(diff)).to_shareable(), task_id=f"t{i}")

    flt = gn.GuardUpdateFilter({"kind": "gaussian", "sigma": 0.1}, max_rounds=2, budget_path=str(path))
    assert [send(flt, i).get_return_code() for i in range(3)] == [ReturnCode.OK, ReturnCode.OK,
                                                                  ReturnCode.TASK_RESULT_FILTER_ERROR]
    restarted = gn.GuardUpdateFilter(**json.loads(json.dumps(flt.job_config()["args"])))  # the site's JSON config
    with caplog.at_level(logging.ERROR):
        assert send(restarted, 3).get_return_code() == ReturnCode.TASK_RESULT_FILTER_ERROR
    assert "budget of 2" in caplog.text
    in_memory = gn.GuardUpdateFilter("identity", max_rounds=1)
    assert [send(in_memory, i).get_return_code() for i in range(2)] == [ReturnCode.OK, ReturnCode.TASK_RESULT_FILTER_ERROR]
    with pytest.raises(ConfigError, match="^budget_path: keeps a round budget's count, but max_rounds is null"):
        gn.GuardUpdateFilter("identity", budget_path=str(path))
    with pytest.raises(ConfigError, match="^max_rounds: expected"):
        gn.GuardUpdateFilter("identity", max_rounds=0)
