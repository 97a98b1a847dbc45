"""guardfl.inspect_model on broken and hostile input (issue 33 item 3, issue 34): every case is either a
refused model (``ok=False`` with a one-line reason; ``MaliciousModelError`` with ``strict=True``) or a
one-line ``ConfigError`` naming the argument - never a raw torch error and never a silent pass.

Small real models on random data, no CIFAR sample needed: each case runs in milliseconds."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

import guardfl
from guardfl import inspect as I
from guardfl.errors import ConfigError, MaliciousModelError

NAN, INF = float("nan"), float("inf")


def net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))


def bn_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3))


X = torch.randn(12, 1, 4, 4, generator=torch.Generator().manual_seed(1))
Y = torch.arange(12) % 3
BATCH = (X, Y)


def refused(result: guardfl.Inspection, prefix: str) -> None:
    assert isinstance(result, guardfl.Inspection) and not result.ok, result
    assert result.reasons and all(isinstance(r, str) and "\n" not in r for r in result.reasons)
    assert any(r.startswith(prefix) for r in result.reasons), result.reasons


def one_line_config_error(call, field: str) -> str:
    with pytest.raises(ConfigError) as info:
        call()
    msg = str(info.value)
    assert msg.startswith(f"{field}:") and "\n" not in msg, msg
    return msg


def edited(model: nn.Module, name: str, fill) -> nn.Module:
    """A copy of ``model`` with entry 0 of tensor ``name`` (a parameter or buffer) set to ``fill``."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        model.state_dict()[name].view(-1)[0] = fill
    return model


# -- non-finite tensors: refused, naming them; no LinAlgError ----------------------------------------------
NON_FINITE = [
    ("nan in a hidden linear weight", net, "1.weight", NAN),
    ("inf in the classifier weight", net, "3.weight", INF),
    ("-inf in the classifier weight", net, "3.weight", -INF),
    ("nan in a bias", net, "1.bias", NAN),
    ("nan in a conv weight", bn_net, "0.weight", NAN),
    ("inf in a batchnorm buffer", bn_net, "1.running_var", INF),
]


@pytest.mark.parametrize("case, make, name, fill", NON_FINITE, ids=[c[0] for c in NON_FINITE])
@pytest.mark.parametrize("as_state_dict", [False, True])
def test_non_finite_tensors_are_refused_and_named(case, make, name, fill, as_state_dict):
    model = edited(make(), name, fill)
    received = model.state_dict() if as_state_dict else model
    for result in (guardfl.inspect_model(received), guardfl.inspect_model(received, make(), batch=BATCH)):
        refused(result, "non-finite:")
        assert name in result.reasons[-1] and result.checks["tensors"]["non_finite"] == [name]
    assert result.checks["batch"] == {"skipped": "the model's tensors were refused (see reasons): it is not run"}
    with pytest.raises(MaliciousModelError) as info:
        guardfl.inspect_model(received, strict=True)
    assert "non-finite:" in str(info.value) and "\n" not in str(info.value)


def test_a_fully_nan_imprint_sized_layer_is_refused_without_linalg():
    model = net()
    big = nn.Sequential(nn.Flatten(), nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 3))
    with torch.no_grad():
        big[1].weight.fill_(NAN)
    refused(guardfl.inspect_model(big.state_dict()), "non-finite:")
    assert guardfl.inspect_model(model).ok


# -- a forward that overflows or produces NaN: refused -------------------------------------------------------
def overflowing() -> nn.Module:
    """Finite weights, but the hidden activations overflow float32 (1e30 * 1e30) and the logits are NaN."""
    model = net()
    with torch.no_grad():
        model[1].weight.fill_(1e30)
        model[3].weight.fill_(1e30)
        model[3].weight[0] = -1e30
    return model


class NanHead(nn.Module):
    """A real model whose forward takes the log of negative pre-activations (NaN logits)."""

    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(16, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.log(self.body(x.flatten(1)) - 10.0))


@pytest.mark.parametrize("make", [overflowing, NanHead], ids=["overflow", "log of negatives"])
def test_a_forward_with_non_finite_activations_is_refused(make):
    model = make()
    result = guardfl.inspect_model(model, batch=BATCH)
    refused(result, "non-finite: the forward pass on the batch gives NaN or infinite activations")
    assert "non_finite_in" in result.checks["batch"]
    with pytest.raises(MaliciousModelError):
        guardfl.inspect_model(model, batch=BATCH, strict=True)


# -- integer / bool weights are examined, not skipped -----------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool])
def test_an_integer_classifier_with_zeroed_rows_is_examined(dtype):
    state = net().state_dict()
    head = torch.zeros(3, 8, dtype=dtype)
    head[1] = 1
    state["3.weight"], state["3.bias"] = head, torch.zeros(3, dtype=dtype)
    result = guardfl.inspect_model(state, net())
    refused(result, "class fishing:")
    assert "2 of 3 rows zeroed" in result.reasons[0] and result.checks["tensors"]["examined_as_float64"] == ["3.weight"]


def test_an_integer_imprint_layer_is_examined():
    state = {"0.weight": torch.arange(1, 17)[:, None] * torch.randint(1, 5, (1, 16)), "0.bias": -torch.arange(16),
             "1.weight": torch.randn(3, 16)}
    refused(guardfl.inspect_model(state), "imprint:")


def test_benign_integer_head_passes():
    state = net().state_dict()
    state["3.weight"] = torch.randint(-5, 6, (3, 8), generator=torch.Generator().manual_seed(0))
    assert guardfl.inspect_model(state, net()).ok


# -- the batch checks' classifier never ran ---------------------------------------------------------------------
class Bypass(nn.Module):
    """Has nn.Linear layers (which the weight checks examine) but computes its output without them."""

    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(16, 8), nn.Linear(8, 3)

    def forward(self, x):
        return x.flatten(1)[:, :3]


class Decoy(nn.Module):
    """The state dict's last linear layer (a benign decoy) never runs; the head that does is fished."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.head, self.decoy = nn.Linear(16, 3), nn.Linear(3, 3)
        with torch.no_grad():
            self.head.weight[1:] = 0.0
            self.head.bias[1:] = 1000.0

    def forward(self, x):
        return self.head(x.flatten(1))


def test_a_model_whose_linear_layers_never_run_is_refused():
    result = guardfl.inspect_model(Bypass(), batch=BATCH)
    refused(result, "batch: none of the model's 2 nn.Linear layer(s) ran on the batch")
    assert guardfl.inspect_model(Bypass()).ok  # weights alone: nothing to say


def test_the_head_that_ran_is_checked_when_the_last_linear_is_a_decoy():
    result = guardfl.inspect_model(Decoy(), batch=BATCH)
    refused(result, "class fishing: classification layer 'head'")
    assert result.checks["batch"]["classifier"] == "head" and result.checks["batch"]["not_run"] == ["decoy"]


# -- bad batches: one ConfigError line naming batch -------------------------------------------------------------
BAD_BATCHES = {
    "wrong feature shape": (torch.randn(12, 5), Y),
    "wrong dtype": (X.double(), Y),
    "empty": (torch.randn(0, 1, 4, 4), torch.zeros(0, dtype=torch.long)),
    "fewer labels than samples": (X, Y[:5]),
    "label out of range": (X, Y + 3),
    "negative label": (X, Y - 1),
    "float labels": (X, Y.float()),
    "bool labels": (X, Y > 0),
    "2-d labels": (X, Y[:, None]),
    "scalar x": (torch.tensor(1.0), Y[:1]),
    "meta x": (X.to("meta"), Y),
    "three tensors": (X, Y, Y),
    "not tensors": ([[0.0] * 16], [0]),
}


@pytest.mark.parametrize("case", list(BAD_BATCHES))
@pytest.mark.parametrize("as_state_dict", [False, True])
def test_a_bad_batch_is_one_config_error_naming_batch(case, as_state_dict):
    received, reference = (net().state_dict(), net()) if as_state_dict else (net(), None)
    one_line_config_error(lambda: guardfl.inspect_model(received, reference, batch=BAD_BATCHES[case]), "batch")
    one_line_config_error(lambda: guardfl.inspect_model(received, reference, batch=BAD_BATCHES[case], strict=True), "batch")


def test_a_model_that_cannot_run_quotes_the_first_line_of_the_error():
    msg = one_line_config_error(lambda: guardfl.inspect_model(net(), batch=(torch.randn(4, 5), Y[:4])), "batch")
    assert "shape [4, 5]" in msg and "RuntimeError: mat1 and mat2 shapes cannot be multiplied" in msg


def test_the_batch_checks_leave_the_model_as_it_was_after_a_failed_forward():
    model = net().train()
    with pytest.raises(ConfigError):
        guardfl.inspect_model(model, batch=(torch.randn(4, 5), Y[:4]))
    assert model.training and not model[1]._forward_hooks and not model[3]._forward_hooks


# -- meta tensors, non-tensors, shapes that differ from the reference -----------------------------------------
def meta_net() -> nn.Module:
    with torch.device("meta"):
        return net()


def test_a_meta_device_model_is_refused_as_unusable():
    for received in (meta_net(), meta_net().state_dict()):
        result = guardfl.inspect_model(received, net(), batch=BATCH if isinstance(received, nn.Module) else None)
        refused(result, "unusable:")
        assert "meta device" in result.reasons[0] and len(result.checks["tensors"]["not_examined"]) == 4
    state = net().state_dict()
    state["1.weight"] = state["1.weight"].to("meta")
    refused(guardfl.inspect_model(state), "unusable:")


def test_a_meta_reference_to_run_the_batch_on_is_a_config_error():
    one_line_config_error(lambda: guardfl.inspect_model(net().state_dict(), meta_net(), batch=BATCH), "reference")
    assert guardfl.inspect_model(net().state_dict(), meta_net()).ok  # names and shapes only: fine


class Locked(nn.Sequential):
    """The client's model holding something that cannot be copied (a lock)."""

    def __init__(self):
        super().__init__(*net())
        self.lock = threading.Lock()


def test_a_reference_that_cannot_be_copied_is_a_config_error_not_a_raw_one():
    message = one_line_config_error(lambda: guardfl.inspect_model(net().state_dict(), Locked(), batch=BATCH), "reference")
    assert "cannot be copied" in message and "_thread.lock" in message
    assert guardfl.inspect_model(Locked(), net(), batch=BATCH).ok  # received as a module: nothing to copy into


class WithExtraState(nn.Linear):
    def get_extra_state(self):
        return {"note": "not a tensor"}

    def set_extra_state(self, state):
        pass


@pytest.mark.parametrize("received, field", [
    ({"1.weight": torch.randn(8, 16), "1.bias": [0.0] * 8}, "received"),
    ({"1.weight": torch.randn(8, 16).numpy()}, "received"),
    ({"1.weight": None}, "received"),
    (WithExtraState(4, 2), "received"),
    ("model.pt", "received"),
])
def test_non_tensor_state_is_a_config_error(received, field):
    one_line_config_error(lambda: guardfl.inspect_model(received), field)


@pytest.mark.parametrize("reference", [{"1.weight": (8, -1)}, {"1.weight": (8.0, 16)}, {"1.weight": "8x16"}])
def test_a_bad_reference_shape_is_a_config_error(reference):
    one_line_config_error(lambda: guardfl.inspect_model(net(), reference), "reference")


@pytest.mark.parametrize("change", ["transposed", "wider", "extra", "missing"])
def test_shapes_that_differ_from_the_reference_are_refused_and_the_batch_not_run(change):
    state = net().state_dict()
    if change == "transposed":
        state["1.weight"] = state["1.weight"].T.contiguous()
    elif change == "wider":
        state["3.weight"] = torch.randn(5, 8)
    elif change == "extra":
        state["4.weight"] = torch.randn(3, 3)
    else:
        del state["3.bias"]
    result = guardfl.inspect_model(state, net(), batch=BATCH)
    refused(result, "architecture:")
    assert result.checks["batch"] == {"skipped": "the received architecture differs from the reference"}


# -- tensors that cannot be examined, huge layers ---------------------------------------------------------------
@pytest.mark.parametrize("case", ["complex", "sparse", "too large (zero-stride)"])
def test_tensors_that_cannot_be_examined_are_refused(case):
    state = net().state_dict()
    if case == "complex":
        state["1.weight"] = torch.randn(8, 16, dtype=torch.complex64)
    elif case == "sparse":
        state["1.weight"] = state["1.weight"].to_sparse()
    else:  # 2e10 elements in a few bytes, as a hostile checkpoint can hold it
        state["1.weight"] = torch.zeros(1).expand(200_000, 100_000)
    result = guardfl.inspect_model(state, batch=None)
    refused(result, "unusable:")
    assert result.checks["tensors"]["not_examined"] == ["1.weight"]


def test_a_huge_zero_stride_layer_is_refused_in_bounded_time_and_memory():
    import time

    start = time.perf_counter()
    result = guardfl.inspect_model({"0.weight": torch.ones(1).expand(10**6, 10**6), "1.weight": torch.randn(3, 8)})
    refused(result, "unusable:")
    assert f"> {I.MAX_TENSOR_ELEMENTS}" in result.reasons[0] and time.perf_counter() - start < 1.0


@pytest.fixture
def small_bounds(monkeypatch):
    """The randomized-SVD and chunked paths on small layers (the bounds are module constants)."""
    monkeypatch.setattr(I, "EXACT_SVD_COST", 1000)
    monkeypatch.setattr(I, "CHUNK_ELEMENTS", 512)


def test_large_layers_are_checked_by_the_bounded_paths(small_bounds):
    g = torch.Generator().manual_seed(0)
    v = torch.randn(128, generator=g)
    imprint = torch.arange(1.0, 65.0)[:, None] * v  # 64 x 128, rank one
    benign = torch.randn(64, 128, generator=g)
    assert I.rank_ratio(imprint) < 1e-5 and I.rank_ratio(benign) > 0.1
    assert I.threshold_monotone_share(imprint, -torch.arange(64.0) * torch.arange(1.0, 65.0)) == 1.0
    repeated = benign.clone()
    repeated[32:] = benign[0]
    assert I.duplicate_row_share(repeated) == pytest.approx(33 / 64) and I.duplicate_row_share(benign) == 0.0
    assert I.zero_row_share(torch.cat([torch.zeros(48, 128), benign[:16]])) == 0.75
    state = {"0.weight": imprint, "0.bias": -torch.arange(64.0), "1.weight": benign[:10, :64]}
    refused(guardfl.inspect_model(state), "imprint:")
    assert guardfl.inspect_model({"0.weight": benign, "1.weight": torch.randn(10, 64, generator=g)}).ok


def test_the_randomized_svd_leaves_the_global_rng_alone(small_bounds):
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    I.rank_ratio(torch.randn(64, 128, generator=torch.Generator().manual_seed(0)))
    assert torch.equal(torch.rand(3), expected)


def test_hostile_names_keep_the_reasons_on_one_line():
    state = net().state_dict()
    state["x\nimprint: fake line.weight"] = torch.full((2, 2), NAN)
    result = guardfl.inspect_model(state, net())
    refused(result, "architecture:")
    with pytest.raises(MaliciousModelError) as info:
        guardfl.inspect_model(state, net(), strict=True)
    assert "\n" not in str(info.value)


# -- the fixes do not flag benign models --------------------------------------------------------------------
@pytest.mark.parametrize("make", [net, bn_net])
def test_benign_small_models_pass_with_every_check(make):
    model = make()
    result = guardfl.inspect_model(model, make(), batch=BATCH)
    assert result.ok, result.reasons
    assert result.checks["tensors"] == {"non_finite": [], "not_examined": [], "examined_as_float64": []}
    assert "gradient_concentration" in result.checks and result.checks["batch"]["classifier"] in {"3", "4"}


def test_a_refused_classifier_is_named_as_skipped_not_replaced_by_a_hidden_layer():
    result = guardfl.inspect_model(edited(net(), "3.weight", NAN))
    assert result.checks["class_fishing"] == {"skipped": "the classification layer '3' was refused unexamined (see reasons)"}
    assert result.reasons == ["non-finite: 1 tensor(s) hold NaN or infinite values (3.weight (1 NaN)): "
                              "the model cannot be trained on or examined"]


# -- extreme but finite scales: the checks are scale-free, no float overflow or underflow ---------------------
@pytest.mark.parametrize("scale", [1e300, 1e-300, 1e30, 1e-30])
def test_attacks_are_found_at_any_finite_scale(scale):
    g = torch.Generator().manual_seed(0)
    v = torch.randn(32, generator=g, dtype=torch.float64)
    imprint = torch.arange(1.0, 17.0, dtype=torch.float64)[:, None] * v * scale
    state = {"0.weight": imprint, "0.bias": -torch.arange(16.0, dtype=torch.float64) * scale,
             "1.weight": torch.randn(3, 16, generator=g, dtype=torch.float64) * scale}
    refused(guardfl.inspect_model(state), "imprint:")
    fishing = torch.cat([torch.zeros(9, 16, dtype=torch.float64), torch.randn(1, 16, generator=g, dtype=torch.float64)]) * scale
    refused(guardfl.inspect_model({"1.weight": fishing}), "class fishing:")
    benign = {"0.weight": torch.randn(16, 32, generator=g, dtype=torch.float64) * scale,
              "1.weight": torch.randn(10, 16, generator=g, dtype=torch.float64) * scale}
    assert guardfl.inspect_model(benign).ok


@pytest.mark.parametrize("call, field", [
    (lambda: guardfl.inspect_model({0: torch.randn(2, 2)}), "received"),
    (lambda: guardfl.inspect_model({("a", "weight"): torch.randn(2, 2)}), "received"),
    (lambda: guardfl.inspect_model(net(), {1: (8, 16)}), "reference"),
])
def test_non_string_names_are_a_config_error(call, field):
    one_line_config_error(call, field)


def test_a_batch_without_a_module_to_run_is_a_config_error_even_for_a_refused_state():
    for state in (net().state_dict(), edited(net(), "1.weight", NAN).state_dict()):
        one_line_config_error(lambda: guardfl.inspect_model(state, batch=BATCH), "batch")
