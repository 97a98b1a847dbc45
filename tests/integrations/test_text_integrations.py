"""The client-side adapters on text models: ``guardfl.integrations.torch.local_update`` (the plain-PyTorch
FL round), ``UpdateDefense`` and the Flower adapter (``train`` helper, ``GuardUpdateMod``) on the causal LM
``Transformer3`` (loader of ``(tokens, next_token_labels(tokens))``; also ``tied=True``) and the
``TextClassifier`` (loader of ``(tokens, class)``), small instances (vocabulary 1,000, 12 tokens)."""

import copy
import math
import os
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import guardfl
from guardfl.defenses import DPSGD, GradPrune, Identity, SignCompression
from guardfl.errors import ConfigError
from guardfl.integrations.torch import ClientState, first_batch, local_update
from guardfl.integrations.update import UpdateDefense
from guardfl.ops.selection import prune_count
from guardfl.redteam.modality.text.models import next_token_labels
from tests.textmodels import CLASSES, LENGTH, MODELS, VOCAB, AttentionClassifier, make

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

LR = 0.1
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook:UserWarning",
                                        "ignore:Secure RNG turned off:UserWarning")


def dataset(kind: str, n: int = 8, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n, LENGTH), generator=g)
    labels = torch.randint(0, CLASSES, (n,), generator=g) if kind == "classifier" else next_token_labels(tokens)
    return TensorDataset(tokens, labels)


def loader(kind: str, n: int = 8, batch_size: int = 4) -> DataLoader:
    return DataLoader(dataset(kind, n), batch_size=batch_size)


sgd = lambda lr: (lambda params: torch.optim.SGD(params, lr=lr))  # noqa: E731


def trainable(model: nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


# -- local_update ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", MODELS)
def test_local_update_identity_is_the_plain_loop_bit_for_bit(kind):
    model, ref = make(kind), make(kind)
    start = copy.deepcopy(ref.state_dict())
    result = local_update(model, loader(kind), sgd(LR), Identity(), epochs=2)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    losses = []
    for _ in range(2):
        for x, y in loader(kind):
            opt.zero_grad()
            loss = guardfl.soft_cross_entropy(ref(x), y)
            if kind != "classifier":  # the LM's loss: mean over the tokens, the last position's target skipped
                torch.testing.assert_close(loss, nn.functional.cross_entropy(ref(x)[:, :-1].flatten(0, 1), x[:, 1:].flatten()))
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    assert list(result.delta) == list(start)
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
        assert torch.equal(result.delta[k], v - start[k]), k
        assert torch.isfinite(result.delta[k]).all(), k
    if kind == "causal-lm-tied":
        assert not result.delta["token.weight"].any()  # frozen (and the output layer): not sent moving
    assert (result.steps, result.num_examples, result.state.rounds) == (4, 16, 1)
    assert result.mean_loss == pytest.approx(sum(losses) / len(losses), rel=1e-6)
    assert math.log(VOCAB if kind != "classifier" else CLASSES) / 2 < result.mean_loss < math.inf
    assert math.isinf(result.epsilon)


@pytest.mark.parametrize("kind", MODELS)
def test_local_update_sign_moves_every_weight_by_multiples_of_lr(kind):
    model = make(kind)
    result = local_update(model, loader(kind), sgd(0.05), SignCompression())
    assert result.steps == 2 and math.isfinite(result.mean_loss)
    for k in trainable(model):
        steps = result.delta[k] / 0.05
        assert torch.allclose(steps, steps.round(), atol=1e-3) and steps.abs().max() <= result.steps + 1e-3, k
    assert len(result.defense_stats) == 2 and result.defense_stats[0]["stages"][0]["kind"] == "sign"


@pytest.mark.parametrize("kind", MODELS)
def test_local_update_one_pruned_step_sends_the_documented_zeros(kind):
    model = make(kind)
    result = local_update(model, loader(kind, n=4), sgd(LR), GradPrune(0.9))
    assert result.steps == 1
    for k in trainable(model):
        v = result.delta[k]
        assert int((v == 0).sum()) >= prune_count(0.9, v.numel()), k
    layers = result.defense_stats[0]["stages"][0]["layers"]
    assert {layer["name"] for layer in layers} == trainable(model)


@pytest.mark.parametrize("kind", MODELS)
def test_local_update_with_dp_sgd_on_text_is_cumulative_and_removes_the_hooks(kind):
    model, state, eps = make(kind), ClientState(), []  # seeded: the round counter from round 0
    for _ in range(2):
        result = local_update(model, loader(kind), sgd(LR), DPSGD(noise_multiplier=1.0, seed=0), state=state)
        state = result.state
        eps.append(result.epsilon)
        assert all(torch.isfinite(v).all() for v in result.delta.values())
    assert 0 < eps[0] < eps[1] < math.inf and state.rounds == 2 and result.dp_delta == 1e-5
    assert ClientState.from_json(state.to_json()).privacy == state.privacy
    assert not any(m._forward_hooks or m._backward_hooks for m in model.modules())  # Opacus's hooks are gone
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())
    assert set(result.delta) == set(make(kind).state_dict())
    if kind == "causal-lm-tied":
        assert not result.delta["token.weight"].any()


@pytest.mark.parametrize("kind", MODELS)
def test_inspect_on_a_text_model(kind):
    batch = first_batch(loader(kind))  # (tokens, classes) for the classifier; none for the LM's (N, L) targets
    assert (batch is None) == (kind != "classifier")
    result = local_update(make(kind), loader(kind), sgd(LR), Identity(), inspect=True)
    assert result.inspection is not None and result.inspection.ok



def test_local_update_refuses_dp_on_multihead_attention_naming_the_swap():
    with pytest.raises(ConfigError) as err:  # the swap changes the parameter names the server sent
        local_update(AttentionClassifier(), loader("classifier"), sgd(LR), DPSGD(noise_multiplier=1.0))
    message = str(err.value)
    assert "\n" not in message and message.startswith("defense: DP-SGD cannot train this model")
    assert "nn.MultiheadAttention -> DPMultiheadAttention" in message and "dp_compatible" in message
    fixed = guardfl.dp_compatible(AttentionClassifier())  # what the message asks for: then it trains
    result = local_update(fixed, loader("classifier"), sgd(LR), DPSGD(noise_multiplier=1.0, seed=0), state=ClientState())
    assert 0 < result.epsilon < math.inf and "encoder.self_attn.qlinear.weight" in result.delta


def test_dp_on_a_model_opacus_cannot_copy_is_one_line():
    class Local(AttentionClassifier):  # a class defined in a function: Opacus's fix copies by pickling
        pass

    model = Local()
    with pytest.raises(ConfigError) as err:
        guardfl.protect(model, torch.optim.SGD(model.parameters(), lr=LR), loader("classifier"), DPSGD(noise_multiplier=1.0))
    message = str(err.value)
    assert "\n" not in message and message.startswith("dpsgd: Opacus must replace layers of this model")
    assert "Can't pickle local object" in message


@pytest.mark.parametrize("kind", ["causal-lm", "classifier"])
def test_update_defense_prunes_a_text_model_delta(kind):
    model = make(kind)
    received = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    local_update(model, loader(kind), sgd(LR), Identity())
    new = {k: v.numpy() for k, v in model.state_dict().items()}
    out, stats = UpdateDefense(GradPrune(0.9))(received, new)
    for (k, a), b in zip(received.items(), out):
        assert b.dtype == a.dtype and b.shape == a.shape
        assert int(((b - a) == 0).sum()) >= prune_count(0.9, a.size), k
    assert stats.defended == len(received) and stats.zero_fraction >= 0.9


# -- Flower ------------------------------------------------------------------------------------------------
try:
    from flwr.app import Context, RecordDict
    from flwr.clientapp import ClientApp

    from guardfl.integrations import flower as gf
except ImportError:  # pragma: no cover - flwr is an extra: the local_update tests above still run
    gf = None

needs_flower = pytest.mark.skipif(gf is None, reason="needs pip install 'guardfl[flower]'")


def context():
    return Context(run_id=1, node_id=7, node_config={"partition-id": 0}, state=RecordDict(), run_config={})


def text_app(kind, defense, mods=()):
    app = ClientApp(mods=list(mods))

    @app.train()
    def train(msg, ctx):
        return gf.train(msg, ctx, make(kind), loader(kind), sgd(LR), defense)

    return app


@needs_flower
@pytest.mark.parametrize("kind", MODELS)
def test_flower_round_trips_the_arrays_and_sends_the_signed_update(kind):
    global_state = make(kind).state_dict()
    reply = text_app(kind, SignCompression())(gf.train_message(global_state), context())
    assert not reply.has_error(), reply.error
    arrays = reply.content["arrays"]
    assert list(arrays.keys()) == list(global_state)
    new = arrays.to_torch_state_dict()
    for k, v in global_state.items():
        assert new[k].shape == v.shape and new[k].dtype == v.dtype, k
        steps = (new[k] - v) / LR
        assert torch.allclose(steps, steps.round(), atol=1e-3) and steps.abs().max() <= 2 + 1e-3, k
    if kind == "causal-lm-tied":
        assert torch.equal(new["token.weight"], global_state["token.weight"])
    else:
        assert not torch.equal(new["token.weight"], global_state["token.weight"])
    metrics = reply.content["metrics"]
    assert metrics["num-examples"] == 8 and metrics["guardfl-round"] == 1
    assert 0 < metrics["train_loss"] < math.inf and "guardfl-epsilon" not in metrics


@needs_flower
@pytest.mark.parametrize("kind", ["causal-lm", "classifier"])
def test_flower_dp_rounds_on_text_accumulate_epsilon(kind):
    ctx, global_state, eps = context(), make(kind).state_dict(), []
    for rnd in (1, 2):
        reply = text_app(kind, DPSGD(noise_multiplier=1.0, seed=0))(gf.train_message(global_state, server_round=rnd), ctx)
        assert not reply.has_error(), reply.error
        eps.append(reply.content["metrics"]["guardfl-epsilon"])
        assert list(reply.content["arrays"].keys()) == list(global_state)
        assert all(np.isfinite(v.numpy()).all() for v in reply.content["arrays"].values())
    assert 0 < eps[0] < eps[1] < math.inf and gf.client_state(ctx).rounds == 2


@needs_flower
@pytest.mark.parametrize("kind", ["causal-lm", "classifier"])
def test_guard_update_mod_prunes_a_trained_text_update(kind):
    global_state = make(kind).state_dict()
    reply = text_app(kind, Identity(), mods=[gf.GuardUpdateMod(GradPrune(0.9))])(gf.train_message(global_state), context())
    assert not reply.has_error(), reply.error
    new = reply.content["arrays"].to_torch_state_dict()
    assert list(new) == list(global_state)
    for k, v in global_state.items():
        assert int(((new[k] - v) == 0).sum()) >= prune_count(0.9, v.numel()), k
    metrics = reply.content["metrics"]
    assert metrics["guardfl-update-zero-fraction"] >= 0.9 and metrics["guardfl-update-clip-factor"] == 1.0
    assert metrics["num-examples"] == 8 and math.isfinite(metrics["train_loss"])


@needs_flower
def test_guarded_flower_app_refuses_mixup_on_tokens_as_one_line():
    from guardfl.defenses import MixUp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ConfigError, match="^defense: mixup mixes images"):
            gf.train(gf.train_message(make("classifier").state_dict()), context(), make("classifier"),
                     loader("classifier"), sgd(LR), MixUp(k=2, seed=0))
