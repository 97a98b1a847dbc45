"""inspect_model in the integrations: local_update(inspect=), the Flower train helper, InspectModelMod."""

import copy
import os

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from guardfl.defenses import GradPrune
from guardfl.errors import ConfigError, MaliciousModelError
from guardfl.inspect_history import LeakHistory
from guardfl.integrations.torch import ClientState, local_update
from tests import malicious as M

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")


def net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


DATA = TensorDataset(torch.randn(32, 1, 4, 4, generator=torch.Generator().manual_seed(2)),
                     torch.randint(0, 3, (32,), generator=torch.Generator().manual_seed(2)))
sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731


def same(a, b):
    return all(torch.equal(v, b[k]) for k, v in a.items())


# -- local_update --------------------------------------------------------------------------------------------
def test_local_update_refuses_a_fished_model_before_training():
    model = M.class_fishing(net(), target=1)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(MaliciousModelError) as info:
        local_update(model, DataLoader(DATA, batch_size=8), sgd, GradPrune(0.5), inspect=True)
    assert any("class fishing" in r for r in info.value.reasons)
    assert same(before, model.state_dict())


@pytest.mark.parametrize("inspect", [True, "strict"])
def test_local_update_trains_a_benign_model_and_reports_the_inspection(inspect):
    result = local_update(net(), DataLoader(DATA, batch_size=8), sgd, GradPrune(0.5), inspect=inspect)
    assert result.inspection is not None and result.inspection.ok and result.steps == 4
    assert "gradient_concentration" in result.inspection.checks  # the loader's first batch was checked
    assert local_update(net(), DataLoader(DATA, batch_size=8), sgd).inspection is None


def test_a_one_shot_loader_is_not_drawn_from_for_the_inspection():
    batches = iter(DataLoader(DATA, batch_size=8))
    result = local_update(net(), batches, sgd, inspect=True)
    assert result.steps == 4 and "gradient_concentration" not in result.inspection.checks


def test_local_update_judges_isolation_against_a_fresh_initialisation_of_the_clients_architecture():
    """The received state is loaded into the client's model before local_update inspects it: no other
    reference. Until 2026-11-27 the isolation counts were then reported and never judged, and trap weights
    whose rows carry a disguise and whose columns carry noise (passing the weight and shared-columns checks)
    were trained on; the baseline is now the architecture re-initialised, so the count is judged."""
    from guardfl.redteam.modality.image.models import FC2
    from tests.guardfl.test_inspect_isolation import centred, trapped

    torch.manual_seed(0)
    model = trapped(FC2(), column_noise=0.1)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(MaliciousModelError) as info:
        local_update(model, DataLoader(TensorDataset(*centred()), batch_size=32), sgd, inspect=True)
    assert [r.split(":")[0] for r in info.value.reasons] == ["isolation"] and same(before, model.state_dict())


def test_local_update_inspect_must_be_a_known_mode():
    with pytest.raises(ConfigError, match=r"^inspect: expected False, True or 'strict'"):
        local_update(net(), DataLoader(DATA, batch_size=8), sgd, inspect="warn")


def dsnr_only(seed=0):
    """Disguised class fishing on label 1, the one sample of label 1 in the loader's first batch: it passes
    every default check and only SEER's D-SNR (62 > 2) refuses it."""
    from guardfl.redteam.attacks.malicious.fishing import fishing_model

    return fishing_model(net(seed), 3, 1, 50.0, disguise=True)


def test_local_update_inspect_disaggregation_adds_the_dsnr_check():
    result = local_update(dsnr_only(), DataLoader(DATA, batch_size=8), sgd, inspect=True)
    assert result.inspection.ok and "disaggregation" not in result.inspection.checks  # off by default: trained
    model = dsnr_only()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(MaliciousModelError) as info:
        local_update(model, DataLoader(DATA, batch_size=8), sgd, inspect=True, inspect_disaggregation=True)
    assert [r.split(":")[0] for r in info.value.reasons] == ["disaggregation"] and same(before, model.state_dict())
    benign = local_update(net(), DataLoader(DATA, batch_size=8), sgd, inspect="strict", inspect_disaggregation=True)
    assert benign.inspection.checks["disaggregation"]["judged"] and benign.inspection.checks["disaggregation"]["max"] < 2


@pytest.mark.parametrize("inspect, flag, match", [
    (False, True, r"^inspect_disaggregation: True adds a check to the inspection, but inspect is False"),
    (True, "yes", r"^inspect_disaggregation: expected False or True"),
])
def test_local_update_inspect_disaggregation_needs_inspection_and_a_bool(inspect, flag, match):
    with pytest.raises(ConfigError, match=match) as info:
        local_update(net(), DataLoader(DATA, batch_size=8), sgd, inspect=inspect, inspect_disaggregation=flag)
    assert len(str(info.value).splitlines()) == 1


def test_local_update_inspect_leak_limit_refuses_the_honest_models_own_leak():
    """The honest net singles out 2 of the loader's first 8 samples by itself: every default check passes
    it (it is the client's own architecture), a leak limit of 1 refuses it before training, 2 trains it."""
    model = net()
    before = copy.deepcopy(model.state_dict())
    assert local_update(copy.deepcopy(model), DataLoader(DATA, batch_size=8), sgd, inspect=True).inspection.ok
    with pytest.raises(MaliciousModelError) as info:
        local_update(model, DataLoader(DATA, batch_size=8), sgd, inspect=True, inspect_leak_limit=1)
    assert info.value.reasons[0].startswith("leak limit: a server reads 2 of the batch's 8 samples")
    assert same(before, model.state_dict())
    result = local_update(model, DataLoader(DATA, batch_size=8), sgd, inspect=True, inspect_leak_limit=2)
    assert result.steps == 4 and result.inspection.checks["leak_limit"]["read"] == 2


@pytest.mark.parametrize("inspect, limit, loader, match", [
    (False, 0, None, r"^inspect_leak_limit: a limit adds a check to the inspection, but inspect is False"),
    (True, -1, None, r"^inspect_leak_limit: expected None or an integer >= 0"),
    (True, 2.0, None, r"^inspect_leak_limit: expected None or an integer >= 0"),
    (True, 2, "one-shot", r"^inspect_leak_limit: needs the loader's first batch"),
])
def test_local_update_inspect_leak_limit_bad_input_is_one_line(inspect, limit, loader, match):
    batches = iter(DataLoader(DATA, batch_size=8)) if loader == "one-shot" else DataLoader(DATA, batch_size=8)
    model = net()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ConfigError, match=match) as info:
        local_update(model, batches, sgd, inspect=inspect, inspect_leak_limit=limit)
    assert len(str(info.value).splitlines()) == 1 and same(before, model.state_dict())


def test_the_leak_history_limits_are_set_in_the_integrations_and_raised_mid_training():
    """``inspect_leak_history={"max_rounds": n, "max_batches": m}``: the history with those limits; a batch
    answered ``max_rounds`` times is refused (fail closed), and the same mapping with a higher value on the
    next round raises it on the history kept so far. Bad keys and values: one line naming the field."""
    loader = DataLoader(DATA, batch_size=8)
    first = local_update(net(0), loader, sgd, inspect=True, inspect_leak_limit=8, state=ClientState(),
                         inspect_leak_history={"max_rounds": 1, "max_batches": 4})
    history = first.state.leak_history
    assert (history.max_rounds, history.max_batches) == (1, 4)
    with pytest.raises(MaliciousModelError, match="answered 1 times, all its history remembers"):
        local_update(net(0), loader, sgd, inspect=True, inspect_leak_limit=8, state=first.state,
                     inspect_leak_history={"max_rounds": 1})
    again = local_update(net(0), loader, sgd, inspect=True, inspect_leak_limit=8, state=first.state,
                         inspect_leak_history={"max_rounds": 5})
    assert again.inspection.ok and again.state.leak_history is history and history.max_rounds == 5
    for bad, line in (({"rounds": 3}, r"^inspect_leak_history: unknown key\(s\) \['rounds'\]"),
                      ({"max_rounds": 0}, r"^inspect_leak_history.max_rounds: must be an integer in \[1, 100000\], got 0$"),
                      ({"max_batches": True}, r"^inspect_leak_history.max_batches: must be an integer")):
        with pytest.raises(ConfigError, match=line):
            local_update(net(0), loader, sgd, inspect=True, inspect_leak_limit=8, inspect_leak_history=bad)


def test_local_update_keeps_the_leak_limit_across_rounds_in_its_state():
    """Round 0's honest model reads samples 1 and 5 of the first batch (limit 2: accepted); round 1's model
    reads sample 7 alone, within the limit per update, but 3 with what round 0 gave away: refused. The
    history lives in the ``ClientState``; a state restored from JSON has lost it and is refused in one line
    (fail closed) unless the client limits each update alone (``inspect_leak_history=False``)."""
    loader = DataLoader(DATA, batch_size=8)
    first = local_update(net(0), loader, sgd, inspect=True, inspect_leak_limit=2, state=ClientState())
    assert first.state.leak_history is not None and first.inspection.checks["leak_limit"]["samples"] == [1, 5]
    model = net(1)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(MaliciousModelError) as info:
        local_update(model, loader, sgd, inspect=True, inspect_leak_limit=2, state=first.state)
    assert "reads 3 of the batch's 8 samples with this update and the 1 this client sent before" in info.value.reasons[0]
    assert "2 given away before" in info.value.reasons[0] and same(before, model.state_dict())
    restored = ClientState.from_json(first.state.to_json())
    with pytest.raises(ConfigError, match=r"^inspect_leak_history: this client's state has done 1 rounds but holds no leak history"):
        local_update(net(1), loader, sgd, inspect=True, inspect_leak_limit=2, state=restored)
    alone = local_update(net(1), loader, sgd, inspect=True, inspect_leak_limit=2, state=restored, inspect_leak_history=False)
    assert alone.inspection.ok and "history" not in alone.inspection.checks["leak_limit"]
    with pytest.raises(ConfigError, match="^inspect_leak_history: must be true or false"):
        local_update(net(1), loader, sgd, inspect=True, inspect_leak_limit=2, inspect_leak_history="yes")
    saved = LeakHistory.from_bytes(first.state.leak_history.to_bytes())
    assert saved.rounds(*next(iter(loader))) == 1
    with pytest.raises(ConfigError, match="^leak history: not a saved guardfl LeakHistory"):
        LeakHistory.from_bytes(b"not a history")


# -- Flower ----------------------------------------------------------------------------------------------------
flwr = pytest.importorskip("flwr")

from flwr.app import ArrayRecord, Context, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.common.constant import ErrorCode  # noqa: E402

from guardfl.integrations import flower as gf  # noqa: E402


def context():
    return Context(run_id=1, node_id=7, node_config={"partition-id": 0}, state=RecordDict(), run_config={})


def inspected_app(model, mods=(), inspect=True, **kw):
    app = ClientApp(mods=list(mods))
    calls = []

    @app.train()
    def train(msg, ctx):
        calls.append(1)
        return gf.train(msg, ctx, model, DataLoader(DATA, batch_size=8), sgd, GradPrune(0.5), inspect=inspect, **kw)

    return app, calls


def test_train_helper_replies_with_an_error_naming_the_reasons_and_trains_nothing():
    model, ctx = net(1), context()
    before = copy.deepcopy(model.state_dict())
    app, _ = inspected_app(model)
    reply = app(gf.train_message(M.class_fishing(net(), target=2).state_dict()), ctx)
    assert reply.has_error() and reply.error.code == ErrorCode.MOD_FAILED_PRECONDITION
    assert "class fishing" in reply.error.reason and "'3'" in reply.error.reason
    assert same(before, model.state_dict()) and gf.STATE_KEY not in ctx.state.config_records


def test_train_helper_names_an_inserted_module_instead_of_failing_to_load():
    app, _ = inspected_app(net())
    imprinted = M.with_imprint(net(), in_shape=(1, 4, 4), bins=16)
    reply = app(gf.train_message(imprinted.state_dict()), context())
    assert reply.has_error() and "architecture:" in reply.error.reason and "imprint:" in reply.error.reason


def test_train_helper_inspect_disaggregation_refuses_what_only_dsnr_sees():
    received = dsnr_only().state_dict()
    app, _ = inspected_app(net())
    assert not app(gf.train_message(received), context()).has_error()  # D-SNR off: trained and sent
    model, ctx = net(), context()
    before = copy.deepcopy(model.state_dict())
    app, _ = inspected_app(model, inspect_disaggregation=True)
    reply = app(gf.train_message(received), ctx)
    assert reply.has_error() and "disaggregation: sample" in reply.error.reason and "D-SNR > 2" in reply.error.reason
    assert same(before, model.state_dict()) and gf.STATE_KEY not in ctx.state.config_records


def test_train_helper_inspect_leak_limit_replies_with_an_error_and_trains_nothing():
    model, ctx = net(), context()
    before = copy.deepcopy(model.state_dict())
    app, _ = inspected_app(model, inspect_leak_limit=1)
    reply = app(gf.train_message(net().state_dict()), ctx)  # the honest global model
    assert reply.has_error() and reply.error.code == ErrorCode.MOD_FAILED_PRECONDITION
    assert "leak limit: a server reads 2 of the batch's 8 samples" in reply.error.reason
    assert same(before, model.state_dict()) and gf.STATE_KEY not in ctx.state.config_records
    app, _ = inspected_app(net(), inspect_leak_limit=2)
    assert not app(gf.train_message(net().state_dict()), context()).has_error()


def test_train_helper_keeps_the_leak_history_in_context_state_between_rounds():
    """The Flower client is built anew every round; its leak history travels in ``context.state`` with the
    client state (``LeakHistory.to_bytes``), so round 1's model is refused for what round 0 gave away."""
    ctx = context()
    app, _ = inspected_app(net(), inspect_leak_limit=2)
    assert not app(gf.train_message(net(0).state_dict()), ctx).has_error()
    assert "leak-history" in ctx.state.config_records[gf.STATE_KEY]
    assert gf.client_state(ctx).leak_history.rounds(DATA.tensors[0][:8], DATA.tensors[1][:8]) == 1
    reply = app(gf.train_message(net(1).state_dict()), ctx)
    assert reply.has_error() and "given away before" in reply.error.reason
    app, _ = inspected_app(net(), inspect_leak_limit=2, inspect_leak_history=False)
    assert not app(gf.train_message(net(1).state_dict()), ctx).has_error()  # per update only: within the limit


def test_train_helper_takes_the_leak_history_limits_and_raises_them_on_the_saved_history():
    """A Flower client refused at ``max_rounds`` on one batch raises the limit in its app's call: the history
    restored from ``context.state`` takes it (and keeps it in the bytes it saves)."""
    ctx = context()
    app, _ = inspected_app(net(), inspect_leak_limit=8, inspect_leak_history={"max_rounds": 1})
    assert not app(gf.train_message(net(0).state_dict()), ctx).has_error()
    reply = app(gf.train_message(net(0).state_dict()), ctx)
    assert reply.has_error() and "answered 1 times" in reply.error.reason and "max_rounds = 1" in reply.error.reason
    app, _ = inspected_app(net(), inspect_leak_limit=8, inspect_leak_history={"max_rounds": 3})
    assert not app(gf.train_message(net(0).state_dict()), ctx).has_error()
    assert gf.client_state(ctx).leak_history.max_rounds == 3


def test_train_helper_trains_a_benign_model_with_inspection_on():
    g = net(3).state_dict()
    app, _ = inspected_app(net())
    reply = app(gf.train_message(g), context())
    assert not reply.has_error(), reply.error
    assert list(reply.content["arrays"].keys()) == list(g)


def test_inspect_model_mod_refuses_without_calling_the_app():
    app, calls = inspected_app(net(), mods=[gf.InspectModelMod(reference=net())], inspect=False)
    reply = app(gf.train_message(M.feature_fishing(net(), target=0, feature=3).state_dict()), context())
    assert reply.has_error() and reply.error.code == ErrorCode.MOD_FAILED_PRECONDITION
    assert reply.error.reason.startswith("InspectModelMod: the received model was refused: class fishing")
    assert calls == []
    reply = app(gf.train_message(M.with_imprint(net(), (1, 4, 4), bins=16).state_dict()), context())
    assert reply.has_error() and "architecture:" in reply.error.reason and calls == []


def test_inspect_model_mod_passes_benign_models_and_other_messages():
    app, calls = inspected_app(net(), mods=[gf.InspectModelMod()], inspect=False)
    reply = app(gf.train_message(net(4).state_dict()), context())
    assert not reply.has_error() and calls == [1]


def test_inspect_model_mod_needs_exactly_one_array_record():
    app, calls = inspected_app(net(), mods=[gf.InspectModelMod()], inspect=False)
    msg = gf.train_message(net().state_dict())
    msg.content["extra"] = ArrayRecord(net().state_dict())
    reply = app(msg, context())
    assert reply.has_error() and "exactly one ArrayRecord" in reply.error.reason and calls == []


def test_inspect_model_mod_reference_must_be_a_model_or_state_dict():
    with pytest.raises(ConfigError, match="^reference: "):
        gf.InspectModelMod(reference="resnet18")
