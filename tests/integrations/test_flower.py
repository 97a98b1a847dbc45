"""guardfl.integrations.flower: the train helper, GuardUpdateMod's contract, the NumPyClient wrapper."""

import math
import os

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
flwr = pytest.importorskip("flwr")

from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.clientapp.mod import LocalDpMod  # noqa: E402
from flwr.common.constant import ErrorCode  # noqa: E402
from flwr.compat.client.numpy_client import NumPyClient  # noqa: E402

from guardfl.defenses import DPSGD, GradPrune, SignCompression  # noqa: E402
from guardfl.errors import ConfigError, RoundBudgetError  # noqa: E402
from guardfl.integrations import flower as gf  # noqa: E402


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


DATA = TensorDataset(torch.randn(32, 1, 4, 4, generator=torch.Generator().manual_seed(2)),
                     torch.randint(0, 3, (32,), generator=torch.Generator().manual_seed(2)))


def context():
    return Context(run_id=1, node_id=7, node_config={"partition-id": 0}, state=RecordDict(), run_config={})


def guarded_app(defense, mods=()):
    app = ClientApp(mods=list(mods))

    @app.train()
    def train(msg, ctx):
        return gf.train(msg, ctx, net(), DataLoader(DATA, batch_size=8), lambda p: torch.optim.SGD(p, lr=0.1), defense)

    return app


def test_train_helper_keeps_dp_state_across_rebuilt_client_apps():
    ctx, global_state = context(), net().state_dict()
    eps = []
    for rnd in range(1, 4):
        app = guarded_app(DPSGD(noise_multiplier=1.0))  # Flower rebuilds the ClientApp every round
        reply = app(gf.train_message(global_state, server_round=rnd), ctx)
        assert not reply.has_error(), reply.error
        eps.append(reply.content["metrics"]["guardfl-epsilon"])
        assert list(reply.content["arrays"].keys()) == list(global_state)
    assert eps[0] < eps[1] < eps[2]
    assert gf.client_state(ctx).rounds == 3


def test_train_helper_reply_carries_the_defended_update():
    g = net().state_dict()
    reply = guarded_app(SignCompression())(gf.train_message(g), context())
    new = reply.content["arrays"].to_torch_state_dict()
    for k, v in g.items():
        steps = (new[k] - v) / 0.1
        assert torch.allclose(steps, steps.round(), atol=1e-4)
    assert reply.content["metrics"]["num-examples"] == 32


def echo_app(transform):
    """A ClientApp whose reply is ``transform(received arrays)``: to probe the mod's contract."""
    app = ClientApp(mods=[gf.GuardUpdateMod(GradPrune(0.9))])

    @app.train()
    def train(msg, ctx):
        _, rec = gf.received_arrays(msg)
        return Message(transform(rec), reply_to=msg)

    return app


def perturbed(rec):
    return RecordDict({"arrays": ArrayRecord({k: Array(v.numpy() + 1.0) for k, v in rec.items()}),
                       "metrics": MetricRecord({"num-examples": 1})})


def test_mod_prunes_the_update_and_reports_it():
    g = net().state_dict()
    reply = echo_app(perturbed)(gf.train_message(g), context())
    assert not reply.has_error()
    new = reply.content["arrays"].to_torch_state_dict()
    for k, v in g.items():
        assert ((new[k] - v) == 0).sum() >= math.floor(0.9 * v.numel())
    assert reply.content["metrics"]["guardfl-update-zero-fraction"] >= 0.85


@pytest.mark.parametrize("transform, reason", [
    (lambda rec: RecordDict({"a": rec, "b": rec}), "exactly one ArrayRecord in the reply"),
    (lambda rec: RecordDict({"arrays": ArrayRecord({k: v for k, v in list(rec.items())[1:]})}), "keys"),
    (lambda rec: RecordDict({"arrays": ArrayRecord({k: Array(v.numpy()[..., :1]) for k, v in rec.items()})}), "shape"),
    (lambda rec: RecordDict({"arrays": ArrayRecord({k: Array(v.numpy() * np.nan) for k, v in rec.items()})}), "non-finite"),
])
def test_mod_returns_error_messages_not_exceptions(transform, reason):
    reply = echo_app(transform)(gf.train_message(net().state_dict()), context())
    assert reply.has_error() and reply.error.code == ErrorCode.MOD_FAILED_PRECONDITION
    assert reason in reply.error.reason


def test_mod_refuses_a_message_with_two_array_records_and_passes_evaluate_through():
    app = echo_app(perturbed)
    msg = gf.train_message(net().state_dict())
    msg.content["other"] = ArrayRecord(net().state_dict())
    assert "exactly one ArrayRecord" in app(msg, context()).error.reason
    evaluate = ClientApp(mods=[gf.GuardUpdateMod(GradPrune(0.9))])

    @evaluate.evaluate()
    def ev(msg, ctx):
        return Message(RecordDict({"metrics": MetricRecord({"acc": 1.0})}), reply_to=msg)

    eval_msg = gf.train_message(net().state_dict())
    eval_msg.metadata.message_type = "evaluate"
    assert evaluate(eval_msg, context()).content["metrics"]["acc"] == 1.0


def test_mod_composes_with_local_dp_mod_in_the_documented_order():
    app = ClientApp(mods=[LocalDpMod(clipping_norm=1.0, sensitivity=1.0, epsilon=1.0, delta=1e-5),
                          gf.GuardUpdateMod(GradPrune(0.9))])

    @app.train()
    def train(msg, ctx):
        _, rec = gf.received_arrays(msg)
        return Message(perturbed(rec), reply_to=msg)

    reply = app(gf.train_message(net().state_dict()), context())
    assert not reply.has_error() and list(reply.content["arrays"].keys()) == list(net().state_dict())


def test_mod_construction_refuses_optimizer_only_defenses():
    with pytest.raises(ConfigError, match="sign"):
        gf.GuardUpdateMod(SignCompression())


class PlainClient(NumPyClient):
    def __init__(self):
        self.model = net()

    def get_parameters(self, config):
        return [v.numpy() for v in self.model.state_dict().values()]

    def fit(self, parameters, config):
        return [p + 0.5 for p in parameters], 10, {"loss": 1.0}


def test_numpy_client_with_a_seeded_defense_needs_the_context():
    """A client_fn builds the client again every round: without the context's round counter a seeded
    defense would send its first noise every round. One line naming ``context``."""
    with pytest.raises(ConfigError, match=r"^context: required with a defense seeded explicitly \(gaussian\)"):
        gf.GuardedNumPyClient(PlainClient(), {"kind": "gaussian", "sigma": 0.1, "seed": 4})
    ctx = context()
    sent = [gf.GuardedNumPyClient(PlainClient(), {"kind": "gaussian", "sigma": 0.1, "seed": 4}, context=ctx).fit(
        PlainClient().get_parameters({}), {})[0][0] for _ in range(2)]  # rebuilt each round, one context
    assert not np.array_equal(sent[0], sent[1])
    gf.GuardedNumPyClient(PlainClient(), GradPrune(0.9, seed=1))  # deterministic: no counter needed


def test_numpy_client_wrapper_defends_fit():
    client = gf.GuardedNumPyClient(PlainClient(), GradPrune(0.9), context=context())
    params = client.get_parameters({})
    out, n, metrics = client.fit(params, {})
    assert n == 10 and metrics["loss"] == 1.0 and metrics["guardfl-update-zero-fraction"] >= 0.85
    for a, b in zip(params, out):
        assert ((b - a) == 0).sum() >= math.floor(0.9 * a.size)
    assert client.to_client() is not None


# -- the round budget -----------------------------------------------------------------------------------
def test_train_helper_keeps_its_round_budget_across_rebuilt_client_apps():
    ctx, global_state = context(), net().state_dict()

    def app():
        a = ClientApp()

        @a.train()
        def train(msg, c):
            return gf.train(msg, c, net(), DataLoader(DATA, batch_size=8), lambda p: torch.optim.SGD(p, lr=0.1),
                            {"kind": "gaussian", "sigma": 0.01, "clip": 1.0}, max_rounds=2)
        return a

    replies = [app()(gf.train_message(global_state, server_round=r), ctx) for r in range(1, 4)]
    assert [r.has_error() for r in replies] == [False, False, True]
    assert replies[2].error.code == ErrorCode.MOD_FAILED_PRECONDITION and "budget of 2" in replies[2].error.reason
    assert gf.client_state(ctx).rounds == 2


def test_round_budget_mod_refuses_before_the_app_and_counts_only_sent_rounds():
    calls = []

    def app(fail=False):
        a = ClientApp(mods=[gf.RoundBudgetMod(2)])

        @a.train()
        def train(msg, c):
            calls.append(1)
            if fail:  # a round that sent nothing (an inspection's refusal, a failed round) spends nothing
                return Message(gf.Error(code=ErrorCode.MOD_FAILED_PRECONDITION, reason="refused"), reply_to=msg)
            return Message(RecordDict({"arrays": gf.received_arrays(msg)[1]}), reply_to=msg)
        return a

    ctx, g = context(), net().state_dict()
    assert app(fail=True)(gf.train_message(g), ctx).has_error()
    assert not app()(gf.train_message(g), ctx).has_error()
    assert not app()(gf.train_message(g), ctx).has_error()
    refused = app()(gf.train_message(g), ctx)
    assert refused.has_error() and refused.error.reason.startswith("RoundBudgetMod: max_rounds: this client has answered 2")
    assert len(calls) == 3  # the spent budget never called the app


@pytest.mark.parametrize("bad", [None, 0, 2.5, True])
def test_round_budget_mod_refuses_a_bad_budget_in_one_line(bad):
    with pytest.raises(ConfigError, match=r"^max_rounds: expected"):
        gf.RoundBudgetMod(bad)


def test_numpy_client_keeps_a_round_budget_in_the_context():
    ctx, noise = context(), {"kind": "gaussian", "sigma": 0.1}
    for _ in range(2):  # rebuilt each round, one context
        gf.GuardedNumPyClient(PlainClient(), noise, context=ctx, max_rounds=2).fit(PlainClient().get_parameters({}), {})
    with pytest.raises(RoundBudgetError, match="budget of 2"):
        gf.GuardedNumPyClient(PlainClient(), noise, context=ctx, max_rounds=2).fit(PlainClient().get_parameters({}), {})
    with pytest.raises(ConfigError, match="^context: required with max_rounds"):
        gf.GuardedNumPyClient(PlainClient(), noise, max_rounds=2)


def test_round_budget_mod_with_a_file_keeps_its_count_across_restarts_and_fails_closed(tmp_path):
    path = tmp_path / "budget.json"

    def app():
        a = ClientApp(mods=[gf.RoundBudgetMod(2, path=path)])

        @a.train()
        def train(msg, c):
            return Message(RecordDict({"arrays": gf.received_arrays(msg)[1]}), reply_to=msg)
        return a

    g = net().state_dict()
    assert not app()(gf.train_message(g), context()).has_error()
    assert not app()(gf.train_message(g), context()).has_error()  # a restarted node: a fresh context.state
    spent = app()(gf.train_message(g), context())
    assert spent.has_error() and "budget of 2" in spent.error.reason
    path.write_text("{not json")
    broken = app()(gf.train_message(g), context())
    assert broken.has_error() and "refusing rather than counting from 0" in broken.error.reason
