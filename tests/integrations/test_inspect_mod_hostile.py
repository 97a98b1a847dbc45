"""Hostile and broken received models in the integrations: InspectModelMod and the Flower train helper
always answer with an error Message (never an exception, the app never called, nothing trained), and
local_update(inspect=True) refuses before training (MaliciousModelError) or names its batch (ConfigError)."""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from guardfl.errors import ConfigError, MaliciousModelError
from guardfl.integrations.torch import first_batch, inspect_received, local_update

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

NAN, INF = float("nan"), float("inf")


def net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


DATA = TensorDataset(torch.randn(32, 1, 4, 4, generator=torch.Generator().manual_seed(2)),
                     torch.randint(0, 3, (32,), generator=torch.Generator().manual_seed(2)))
sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731


def with_entry(name: str, fill: float) -> dict[str, torch.Tensor]:
    state = net(1).state_dict()
    state[name] = state[name].clone()
    state[name].view(-1)[0] = fill
    return state


def overflowing() -> dict[str, torch.Tensor]:
    """Finite weights whose forward overflows float32 to inf / NaN logits."""
    state = net(1).state_dict()
    state["1.weight"] = torch.full((8, 16), 1e30)
    state["3.weight"] = torch.full((3, 8), 1e30)
    state["3.weight"][0] = -1e30
    return state


def int_fishing_head() -> dict[str, torch.Tensor]:
    state = net(1).state_dict()
    head = torch.zeros(3, 8, dtype=torch.int64)
    head[2] = 1
    state["3.weight"] = head
    return state


def same(a, b):
    return all(torch.equal(v, b[k]) for k, v in a.items())


# -- local_update(inspect=True) ------------------------------------------------------------------------------
@pytest.mark.parametrize("name, fill", [("1.weight", NAN), ("3.bias", INF), ("3.weight", -INF)])
def test_local_update_refuses_non_finite_weights_before_training(name, fill):
    model = net()
    model.load_state_dict(with_entry(name, fill))
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(MaliciousModelError) as info:
        local_update(model, DataLoader(DATA, batch_size=8), sgd, inspect=True)
    assert any(r.startswith("non-finite:") and name in r for r in info.value.reasons)
    assert all(torch.equal(v, before[k]) or (v != v).any() for k, v in model.state_dict().items())


def test_local_update_refuses_a_forward_that_overflows():
    model = net()
    model.load_state_dict(overflowing())
    with pytest.raises(MaliciousModelError, match="non-finite: the forward pass on the batch"):
        local_update(model, DataLoader(DATA, batch_size=8), sgd, inspect=True)


def test_local_update_names_a_batch_the_model_cannot_run_on():
    wrong = TensorDataset(torch.randn(16, 5), torch.randint(0, 3, (16,)))
    with pytest.raises(ConfigError) as info:
        local_update(net(), DataLoader(wrong, batch_size=8), sgd, inspect=True)
    assert str(info.value).startswith("batch: the model cannot run on x of shape [8, 5]") and "\n" not in str(info.value)


def test_an_empty_first_batch_is_not_used_and_the_skip_is_named():
    empty_first = [(torch.zeros(0, 1, 4, 4), torch.zeros(0, dtype=torch.long)), (DATA.tensors[0][:8], DATA.tensors[1][:8])]
    assert first_batch(empty_first) is None
    result = inspect_received(net(), empty_first)
    assert result.ok and "skipped" in result.checks["batch"] and "gradient_concentration" not in result.checks


# -- Flower ---------------------------------------------------------------------------------------------------
flwr = pytest.importorskip("flwr")

from flwr.app import Array, ArrayRecord, Context, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.common.constant import ErrorCode  # noqa: E402

from guardfl.integrations import flower as gf  # noqa: E402


def context():
    return Context(run_id=1, node_id=7, node_config={"partition-id": 0}, state=RecordDict(), run_config={})


def numpy_record(state, **override) -> ArrayRecord:
    arrays = {k: v.numpy() for k, v in state.items()}
    arrays.update(override)
    return ArrayRecord({k: Array(np.asarray(v)) for k, v in arrays.items()})


HOSTILE = {
    "nan hidden weight": lambda: with_entry("1.weight", NAN),
    "inf classifier bias": lambda: with_entry("3.bias", INF),
    "int64 head with zeroed rows": int_fishing_head,
    "complex weight": lambda: numpy_record(net().state_dict(), **{"1.weight": np.ones((8, 16), np.complex64)}),
    "uint16 head with zeroed rows": lambda: numpy_record(net().state_dict(), **{"3.weight": (np.eye(3, 8) * [[0], [0], [1]]).astype(np.uint16)}),
    "shape differs": lambda: {**net().state_dict(), "1.weight": torch.randn(8, 5)},
    "extra layer": lambda: {**net().state_dict(), "4.weight": torch.randn(3, 3)},
    "missing layer": lambda: {k: v for k, v in net().state_dict().items() if k != "3.bias"},
    "string array": lambda: numpy_record(net().state_dict(), **{"1.bias": np.array(["a"] * 8)}),
    "newline in a name": lambda: {**net().state_dict(), "x\ny.weight": torch.randn(2, 2)},
    "not a numpy stype": lambda: ArrayRecord({**numpy_record(net().state_dict()),
                                              "1.bias": Array(dtype="float32", shape=(8,), stype="pickle", data=b"\0" * 32)}),
    "truncated bytes": lambda: ArrayRecord({**numpy_record(net().state_dict()),
                                            "1.bias": Array(dtype="float32", shape=(8,), stype="numpy.ndarray", data=b"\x93NUM")}),
}


def app_with(mods, inspect):
    app = ClientApp(mods=list(mods))
    calls = []

    @app.train()
    def train(msg, ctx):
        calls.append(1)
        return gf.train(msg, ctx, model, DataLoader(DATA, batch_size=8), sgd, inspect=inspect)

    model = net()
    return app, calls, model


def message(case):
    arrays = HOSTILE[case]()
    return gf.train_message(arrays)


def assert_error_reply(reply, *expected):
    assert reply.has_error() and reply.error.code == ErrorCode.MOD_FAILED_PRECONDITION
    assert "\n" not in reply.error.reason and any(e in reply.error.reason for e in expected), reply.error.reason


@pytest.mark.parametrize("case", list(HOSTILE))
def test_inspect_model_mod_answers_every_hostile_model_with_an_error_message(case):
    app, calls, _ = app_with([gf.InspectModelMod(reference=net())], inspect=False)
    reply = app(message(case), context())
    assert_error_reply(reply, "InspectModelMod: ")
    assert calls == []


@pytest.mark.parametrize("case", ["nan hidden weight", "inf classifier bias", "complex weight", "string array"])
def test_inspect_model_mod_without_a_reference_still_answers(case):
    app, calls, _ = app_with([gf.InspectModelMod()], inspect=False)
    assert_error_reply(app(message(case), context()), "InspectModelMod: ")
    assert calls == []


@pytest.mark.parametrize("case", ["nan hidden weight", "inf classifier bias", "int64 head with zeroed rows", "shape differs",
                                  "complex weight", "string array", "truncated bytes"])
def test_train_helper_answers_a_hostile_model_with_an_error_message(case):
    app, calls, model = app_with([], inspect=True)
    before = copy.deepcopy(model.state_dict())
    ctx = context()
    reply = app(message(case), ctx)
    assert_error_reply(reply, "guardfl inspect_model: ")
    assert calls == [1] and same(before, model.state_dict()) and gf.STATE_KEY not in ctx.state.config_records


def test_train_helper_answers_an_overflowing_forward_with_an_error_message():
    app, _, _ = app_with([], inspect=True)
    reply = app(gf.train_message(overflowing()), context())
    assert_error_reply(reply, "non-finite: the forward pass on the batch")


def test_train_helper_answers_a_batch_the_model_cannot_run_on_with_an_error_message():
    app = ClientApp()
    wrong = TensorDataset(torch.randn(16, 5), torch.randint(0, 3, (16,)))

    @app.train()
    def train(msg, ctx):
        return gf.train(msg, ctx, net(), DataLoader(wrong, batch_size=8), sgd, inspect=True)

    reply = app(gf.train_message(net(1).state_dict()), context())
    assert_error_reply(reply, "guardfl inspect_model: batch: the model cannot run on x of shape [8, 5]")
