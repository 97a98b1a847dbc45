"""No update leaves a client undefended, whatever its arrays' dtypes (issue 33, item 1).

Every integration path (the update core, GuardUpdateMod, GuardedNumPyClient, local_update and the Flower
train helper) with int, bool, complex, float16, bfloat16 and float64 arrays: floating arrays are defended
by the amount the defense's parameters say; a non-floating array that training changed is refused (an
error naming it, never the undefended array); one left bit for bit as received is sent as it is.
"""

import math
import os

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from guardfl.defenses import GaussianNoise, GradPrune, Identity
from guardfl.errors import NonFiniteGradientError, UndefendedUpdateError
from guardfl.integrations.torch import local_update
from guardfl.integrations.update import UpdateDefense

RATIO = 0.9
INTEGERS = [np.int8, np.int32, np.int64, np.uint8, np.bool_, np.complex64]
FLOATS = [np.float16, np.float32, np.float64]


def pair(dtype, shape=(16, 8), seed=0):
    """(received, trained) arrays of ``dtype``: every entry changed by training."""
    rng = np.random.default_rng(seed)
    if dtype is np.bool_:
        received = rng.integers(0, 2, shape).astype(bool)
        return received, ~received
    if np.issubdtype(dtype, np.floating) or np.issubdtype(dtype, np.complexfloating):
        received = rng.normal(size=shape).astype(dtype)
        return received, (received + rng.normal(size=shape).astype(dtype) + 0.5).astype(dtype)
    received = rng.integers(-5 if np.issubdtype(dtype, np.signedinteger) else 0, 5, shape).astype(dtype)
    return received, (received + 1).astype(dtype)


def assert_pruned(received, sent, ratio=RATIO):
    delta = sent.astype(np.float64) - received.astype(np.float64)
    assert (delta == 0).sum() >= math.floor(ratio * delta.size)


# -- the update core ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", INTEGERS, ids=lambda d: np.dtype(d).name)
def test_a_changed_non_floating_array_refuses_the_update(dtype):
    w, w_new = pair(np.float32)
    q, q_new = pair(dtype)
    with pytest.raises(UndefendedUpdateError, match=rf"fc\.qweight \({np.dtype(dtype).name}\)"):
        UpdateDefense(GradPrune(RATIO))([w, q], [w_new, q_new], ["fc.weight", "fc.qweight"])


@pytest.mark.parametrize("dtype", INTEGERS, ids=lambda d: np.dtype(d).name)
def test_an_unchanged_non_floating_array_is_sent_as_received(dtype):
    w, w_new = pair(np.float32)
    q, _ = pair(dtype)
    out, stats = UpdateDefense(GradPrune(RATIO))([w, q], [w_new, q.copy()], ["fc.weight", "fc.qweight"])
    assert out[1].dtype == q.dtype and np.array_equal(out[1], q)
    assert_pruned(w, out[0])
    assert stats.defended == 1


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
def test_every_floating_precision_is_pruned_by_the_ratio(dtype):
    received, new = pair(dtype)
    out, stats = UpdateDefense(GradPrune(RATIO))([received], [new], ["w"])
    assert out[0].dtype == new.dtype
    assert_pruned(received, out[0])
    assert stats.defended == 1 and stats.zero_fraction >= RATIO - 0.01


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=lambda d: np.dtype(d).name)
def test_every_floating_precision_gets_the_configured_noise(dtype):
    received = np.zeros(100_000, dtype)
    new = np.ones(100_000, dtype)
    out, _ = UpdateDefense(GaussianNoise(sigma=0.3))([received], [new], ["w"])
    assert np.std(out[0].astype(np.float64) - 1.0) == pytest.approx(0.3, rel=0.03)


def test_float16_noise_survives_rounding_to_half_precision():
    received, new = np.zeros(100_000, np.float16), np.ones(100_000, np.float16)
    out, _ = UpdateDefense(GaussianNoise(sigma=0.3))([received], [new], ["w"])
    # float16's spacing near 1 is ~1e-3: rounding the noised value moves it by far less than sigma
    assert np.std(out[0].astype(np.float64) - 1.0) == pytest.approx(0.3, rel=0.03)


def test_float16_overflow_is_refused_not_sent_as_inf():
    received, new = np.full(64, 65000, np.float16), np.full(64, 65000, np.float16)
    new[0] = 64000
    with pytest.raises(NonFiniteGradientError, match="overflows"):
        UpdateDefense(GaussianNoise(sigma=1e5))([received], [new], ["w"])


def test_a_floating_array_returned_as_integers_is_refused():
    received, new = pair(np.float32)
    with pytest.raises(UndefendedUpdateError, match=r"w \(float32->int32\)"):
        UpdateDefense(GradPrune(RATIO))([received], [np.round(new).astype(np.int32)], ["w"])


def test_skip_is_the_deliberate_way_to_send_an_integer_array_as_trained():
    q, q_new = pair(np.int8)
    out, stats = UpdateDefense(GradPrune(RATIO), skip=("qweight",))([q], [q_new], ["fc.qweight"])
    assert np.array_equal(out[0], q_new) and stats.sent_as_trained == ("fc.qweight",)


def test_unnamed_arrays_refuse_a_changed_counter_until_names_are_given():
    names = ["w", "bn.num_batches_tracked"]
    received = [np.zeros(8, np.float32), np.array(3)]
    new = [np.ones(8, np.float32), np.array(4)]
    with pytest.raises(UndefendedUpdateError, match=r"array1 \(int64\)"):
        UpdateDefense(GradPrune(RATIO))(received, new)
    out, stats = UpdateDefense(GradPrune(RATIO))(received, new, names)
    assert stats.sent_as_trained == ("bn.num_batches_tracked",)


# -- Flower: GuardUpdateMod and GuardedNumPyClient ------------------------------------------------------
@pytest.fixture(scope="module")
def flower():
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    pytest.importorskip("flwr")
    from guardfl.integrations import flower as gf

    return gf


def mod_app(gf, arrays_out):
    """A ClientApp behind GuardUpdateMod(GradPrune(0.9)) whose reply carries ``arrays_out``."""
    from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    app = ClientApp(mods=[gf.GuardUpdateMod(GradPrune(RATIO))])

    @app.train()
    def train(msg, ctx):
        return Message(RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in arrays_out.items()}),
                                   "metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)

    return app


def flower_context():
    from flwr.app import Context, RecordDict

    return Context(run_id=1, node_id=7, node_config={}, state=RecordDict(), run_config={})


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.int8, np.bool_], ids=lambda d: np.dtype(d).name)
def test_mod_replies_with_an_error_for_changed_integer_arrays(flower, dtype):
    """The audit's case: an app returning quantised weights got them through untouched under GradPrune(0.9)."""
    from flwr.common.constant import ErrorCode

    w, w_new = pair(np.float32)
    q, q_new = pair(dtype)
    msg = flower.train_message({"fc.weight": torch.from_numpy(w), "fc.qweight": torch.from_numpy(q)})
    reply = mod_app(flower, {"fc.weight": w_new, "fc.qweight": q_new})(msg, flower_context())
    assert reply.has_error() and reply.error.code == ErrorCode.MOD_FAILED_PRECONDITION
    assert "fc.qweight" in reply.error.reason and "not floating point" in reply.error.reason


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
def test_mod_defends_every_floating_precision(flower, dtype):
    w, w_new = pair(dtype)
    q, _ = pair(np.int64)
    msg = flower.train_message({"fc.weight": torch.from_numpy(w), "fc.step": torch.from_numpy(q)})
    reply = mod_app(flower, {"fc.weight": w_new, "fc.step": q})(msg, flower_context())
    assert not reply.has_error()
    sent = reply.content["arrays"].to_numpy_ndarrays()
    assert sent[0].dtype == dtype
    assert_pruned(w, sent[0])
    assert np.array_equal(sent[1], q)


def test_mod_answers_an_array_it_cannot_read_with_an_error_message(flower):
    """Object arrays (or anything the core cannot convert) end as an error reply, not an exception."""
    w, w_new = pair(np.float32)
    msg = flower.train_message({"w": torch.from_numpy(w)})
    reply = mod_app(flower, {"w": w_new.astype(np.complex64)})(msg, flower_context())
    assert reply.has_error() and "w (float32->complex64)" in reply.error.reason


@pytest.mark.parametrize("dtype", [np.int32, np.float16, np.float64], ids=lambda d: np.dtype(d).name)
def test_numpy_client_never_returns_an_undefended_array(flower, dtype):
    from flwr.compat.client.numpy_client import NumPyClient

    w, w_new = pair(np.float32)
    q, q_new = pair(dtype)

    class Quantised(NumPyClient):
        def fit(self, parameters, config):
            return [w_new, q_new], 4, {}

    client = flower.GuardedNumPyClient(Quantised(), GradPrune(RATIO), names=["fc.weight", "fc.q"])
    if not np.issubdtype(dtype, np.floating):
        with pytest.raises(UndefendedUpdateError, match=r"fc\.q \(int32\)"):
            client.fit([w, q], {})
        return
    out, _, metrics = client.fit([w, q], {})
    assert out[1].dtype == dtype
    assert_pruned(w, out[0])
    assert_pruned(q, out[1])


# -- the torch loop and the Flower train helper -------------------------------------------------------
DATA = TensorDataset(torch.randn(16, 12, generator=torch.Generator().manual_seed(1)),
                     torch.randint(0, 3, (16,), generator=torch.Generator().manual_seed(1)))


def model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)).to(dtype)


def loader(dtype=torch.float32):
    x, y = DATA.tensors
    return DataLoader(TensorDataset(x.to(dtype), y), batch_size=16)


def loss(out, y):
    return torch.nn.functional.cross_entropy(out.float(), y)


def sgd(p):
    return torch.optim.SGD(p, lr=0.5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_local_update_prunes_every_floating_precision(dtype):
    m = model(dtype)
    result = local_update(m, loader(dtype), sgd, GradPrune(RATIO), loss_fn=loss)
    for name, d in result.delta.items():
        assert d.dtype == dtype
        assert int((d == 0).sum()) >= math.floor(RATIO * d.numel()), name  # one SGD step: delta = -lr * pruned grad


class Recorder(torch.nn.Module):
    """A model whose forward writes its input's mean into a buffer: data-derived state no gradient
    defense reaches."""

    def __init__(self):
        super().__init__()
        self.net = model()
        self.register_buffer("last_mean", torch.zeros(12))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        if self.training:
            self.last_mean.copy_(x.detach().mean(0))
            self.calls += 1
        return self.net(x)


def test_local_update_refuses_a_changed_buffer_no_defense_reaches():
    with pytest.raises(UndefendedUpdateError, match=r"last_mean \(torch.float32\), calls \(torch.int64\)"):
        local_update(Recorder(), loader(), sgd, GradPrune(RATIO), loss_fn=loss)


def test_local_update_without_a_defense_sends_every_change():
    result = local_update(Recorder(), loader(), sgd, Identity(), loss_fn=loss)
    assert torch.allclose(result.delta["last_mean"], DATA.tensors[0].mean(0))


def test_local_update_sends_batchnorm_buffers_as_documented():
    m = torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))
    result = local_update(m, loader(), sgd, GradPrune(RATIO), loss_fn=loss)
    assert int(result.delta["1.num_batches_tracked"]) == 1


def test_local_update_refuses_a_parameter_changed_outside_the_optimizer():
    m = model()

    def only_last(params):
        return torch.optim.SGD(list(m[2].parameters()), lr=0.5)

    class Drift(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = m

        def forward(self, x):
            with torch.no_grad():
                self.m[0].bias.add_(x.mean())  # data-dependent, outside the optimizer
            return self.m(x)

    with pytest.raises(UndefendedUpdateError, match=r"m\.0\.bias"):
        local_update(Drift(), loader(), only_last, GradPrune(RATIO), loss_fn=loss)


def flower_train_reply(gf, net, dtype=torch.float32):
    from flwr.clientapp import ClientApp

    app = ClientApp()

    @app.train()
    def train(msg, ctx):
        return gf.train(msg, ctx, net, loader(dtype), sgd, GradPrune(RATIO), loss_fn=loss)

    # the server sends float32 where Flower cannot carry the model's dtype (bfloat16)
    state = {k: v.float() if v.dtype == torch.bfloat16 else v for k, v in net.state_dict().items()}
    return app(gf.train_message(state), flower_context()), state


def test_flower_train_defends_float64_models(flower):
    net = model(torch.float64)
    reply, sent = flower_train_reply(flower, net, torch.float64)
    assert not reply.has_error()
    new = reply.content["arrays"].to_torch_state_dict()
    for k, v in sent.items():
        assert new[k].dtype == torch.float64
        assert int((new[k] - v == 0).sum()) >= math.floor(RATIO * v.numel())


def test_flower_train_replies_with_an_error_for_an_undefended_buffer(flower):
    reply, _ = flower_train_reply(flower, Recorder())
    assert reply.has_error() and "last_mean" in reply.error.reason


def test_flower_train_replies_with_an_error_for_bfloat16_it_cannot_carry(flower):
    reply, _ = flower_train_reply(flower, model(torch.bfloat16), torch.bfloat16)
    assert reply.has_error() and "bfloat16" in reply.error.reason
