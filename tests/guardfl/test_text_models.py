"""Every gradient defense, the input encodings and DP-SGD (Opacus 1.6) through ``guardfl.protect`` /
``guardfl.wrap`` on text models: the causal LM ``Transformer3`` (own output layer, and ``tied=True``: frozen
token embedding as the output layer) and the bidirectional ``TextClassifier`` (small instances: vocabulary
1,000, 12-token sequences, batches of 4).

What holds (each claim is a test below):

- sign, gradprune (layer and global), gaussian, laplace, outpost, identity and a stack train on both
  models, and the update that leaves the client (the SGD step, ``-lr`` times the defended gradient) is
  the undefended gradient of the same batch changed exactly as documented.
- soteria and graddefense REFUSE token ids, at the first ``step()``, with one ConfigError line naming the
  defense (``soteria: the model's inputs are torch.int64, not floating point; ...``), the weights untouched:
  both differentiate with respect to the model's inputs (Soteria's ``dr/dx``, GradDefense's sensitivity
  ``d/dx dL/dtheta``), and integer token ids have no input gradient. (Soteria would also refuse the
  transformers' first ``nn.Linear``, whose input is ``(N, L, D)``, not ``(batch, features)``.)
- mixup and instahide REFUSE a token-id loader at ``protect`` time with one line naming ``defense``: a
  weighted mix of token ids is no input (before this was refused, MixUp cast its coefficients to int64
  and the classifier silently trained on all-zero token sequences; InstaHide crashed in the embedding).
- DP-SGD: Opacus 1.6's per-sample gradient samplers (``GradSampleModule.GRAD_SAMPLERS``) cover
  ``Conv1d/2d/3d``, ``Embedding``, ``EmbeddingBag``, ``GroupNorm``, ``InstanceNorm1d/2d/3d``, ``LayerNorm``,
  ``Linear``, ``RMSNorm`` and Opacus's own ``RNNLinear`` and ``SequenceBias`` (the parts of its DPLSTM /
  DPMultiheadAttention). The text models use only ``Embedding`` (tokens; learned positions looked up with
  ``(N, L)`` ids), ``Linear`` on ``(N, L, D)`` inputs and ``LayerNorm`` (attention is written out), so every
  trainable parameter gets a per-sample gradient from Opacus's hooks, equal to ``torch.func``'s
  ``vmap(grad)`` to float32 rounding, and clipping bounds each sample's contribution. The tied model's
  frozen embedding (used by ``F.linear`` outside a module) needs none and stays unchanged.
- ``nn.MultiheadAttention`` has no grad sampler: Opacus's validator asks for its ``DPMultiheadAttention``.
  ``protect`` with DP-SGD fixes it automatically (``ModuleValidator.fix``, as for BatchNorm): it warns
  naming the swap, returns a NEW model (the caller's stays as it was) whose attention parameters are
  ``qlinear/klinear/vlinear`` instead of ``in_proj_weight`` (so the state-dict keys change; an FL client
  must build the global model with ``guardfl.dp_compatible`` everywhere, and ``local_update`` refuses
  otherwise), and it trains.
"""

import copy
import math
import warnings

import pytest
import torch
from opacus.grad_sample import GradSampleModule
from opacus.layers import DPMultiheadAttention
from opacus.validators import ModuleValidator
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils.data import DataLoader, TensorDataset

import guardfl
from guardfl.defenses import (REGISTRY, DPSGD, GaussianNoise, GradDefense, GradPrune, Identity, InstaHide, LaplaceNoise,
                              MixUp, Outpost, SignCompression, Soteria, Stack)
from guardfl.defenses.outpost import layer_risk
from guardfl.errors import ConfigError
from guardfl.ops.selection import cover_count, largest_k_mask, prune_count, smallest_k_mask
from guardfl.redteam.modality.text.models import next_token_labels
from tests.textmodels import CLASSES, LENGTH, MODELS, VOCAB, AttentionClassifier, make

BATCH, LR = 4, 0.1
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook:UserWarning",
                                        "ignore:Secure RNG turned off:UserWarning")


def batch(kind: str, n: int = BATCH, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and their targets: next tokens (-100 last) for the LM, classes for the classifier."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n, LENGTH), generator=g)
    if kind == "classifier":
        return tokens, torch.randint(0, CLASSES, (n,), generator=g)
    return tokens, next_token_labels(tokens)


def loader(kind: str, n: int = BATCH, batch_size: int = BATCH) -> DataLoader:
    return DataLoader(TensorDataset(*batch(kind, n)), batch_size=batch_size)


def loss(model, x, y):
    return guardfl.soft_cross_entropy(model(x), y)


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def defended_step(kind: str, defense, entry: str = "protect"):
    """One SGD step of ``defense`` on one batch; returns (undefended gradients of a copy on the same batch,
    the defended gradients, the weights before, the model, the optimizer), by parameter name."""
    model = make(kind)
    ref = copy.deepcopy(model)
    x, y = batch(kind)
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    if entry == "protect":
        model, opt, data = guardfl.protect(model, sgd, DataLoader(TensorDataset(x, y), batch_size=BATCH), defense)
    else:
        opt, data = guardfl.wrap(sgd, defense, model=model), [(x, y)]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for xb, yb in data:
        opt.zero_grad()
        loss(model, xb, yb).backward()
        opt.step()
    loss(ref, x, y).backward()
    undefended = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    sent = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(sent) == set(undefended) == {n for n, p in model.named_parameters() if p.requires_grad}
    for n, p in model.named_parameters():  # the update that leaves the client is -lr x the defended gradient
        expected = before[n].add(sent[n], alpha=-LR) if n in sent else before[n]
        assert torch.equal(p.detach(), expected), n
        assert torch.isfinite(p).all(), n
    return undefended, sent, before, model, opt


# -- 1. every gradient defense ---------------------------------------------------------------------------
TESTED_GRADIENT_KINDS = {"sign", "gradprune", "gaussian", "laplace", "outpost", "soteria", "graddefense", "identity", "stack"}


def test_every_registered_gradient_defense_is_covered_here():
    assert {k for k, cls in REGISTRY.items() if cls.stage == "gradient"} == TESTED_GRADIENT_KINDS


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("entry", ["protect", "wrap"])
def test_identity_is_bit_identical_to_plain_sgd(kind, entry):
    undefended, sent, before, model, _ = defended_step(kind, Identity(), entry)
    plain = make(kind)
    opt = torch.optim.SGD(plain.parameters(), lr=LR)
    loss(plain, *batch(kind)).backward()
    opt.step()
    for (n, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), n
    for n in sent:
        assert torch.equal(sent[n], undefended[n]), n


@pytest.mark.parametrize("kind", MODELS)
def test_sign_sends_the_sign_of_every_gradient_entry(kind):
    undefended, sent, before, model, opt = defended_step(kind, SignCompression())
    for n, g in sent.items():
        assert set(g.unique().tolist()) <= {-1.0, 0.0, 1.0}, n
        assert torch.equal(g, undefended[n].sign()), n
    for n, p in model.named_parameters():  # so every weight moved by -lr, 0 or +lr
        if n in sent:
            steps = (p.detach() - before[n]) / LR
            assert torch.allclose(steps, steps.round(), atol=1e-3) and steps.abs().max() <= 1 + 1e-3, n
    if kind == "causal-lm":  # the token embedding's gradient is zero outside the batch's tokens: sign keeps that
        present = torch.zeros(VOCAB, dtype=torch.bool)  # (the last position's token reaches no loss: causal, no target)
        present[batch(kind)[0][:, :-1].unique()] = True
        assert torch.equal(sent["token.weight"].abs().sum(1) > 0, present)


def _check_pruned(defended: torch.Tensor, g: torch.Tensor, ratio: float, where: str):
    """``defended`` is ``g`` with its ``ceil(ratio * (n - 1))`` smallest-|g| entries zeroed (the documented rule)."""
    k = prune_count(ratio, g.numel())
    assert int((defended == 0).sum()) == max(k, int((g == 0).sum())), where
    kept = defended != 0
    assert torch.equal(defended[kept], g[kept]), where
    if kept.any() and (~kept & (g != 0)).any():
        assert g[kept].abs().min() >= g[~kept].abs().max(), where
    torch.testing.assert_close(defended, g.masked_fill(smallest_k_mask(g.abs(), k), 0.0), rtol=0, atol=0)


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("ratio", [0.5, 0.9])
def test_gradprune_layerwise_zeroes_the_documented_count_of_every_tensor(kind, ratio):
    undefended, sent, *_ = defended_step(kind, GradPrune(ratio))
    for n, g in sent.items():
        _check_pruned(g.reshape(-1), undefended[n].reshape(-1), ratio, n)


@pytest.mark.parametrize("kind", MODELS)
def test_gradprune_global_zeroes_the_documented_count_over_the_model(kind):
    undefended, sent, *_ = defended_step(kind, GradPrune(0.9, scope="global"))
    names = list(sent)
    _check_pruned(flat(sent[n] for n in names), flat(undefended[n] for n in names), 0.9, "global")


@pytest.mark.parametrize("kind", ["causal-lm", "classifier"])
@pytest.mark.parametrize("make_noise, std, mean_abs", [
    (lambda: GaussianNoise(0.01, seed=3), 0.01, 0.01 * math.sqrt(2 / math.pi)),
    (lambda: LaplaceNoise(0.01, seed=3), 0.01 * math.sqrt(2), 0.01),
])
def test_additive_noise_has_the_configured_scale(kind, make_noise, std, mean_abs):
    undefended, sent, *_ = defended_step(kind, make_noise())
    diff = flat(sent[n] - undefended[n] for n in sent).double()
    n = diff.numel()
    assert (diff != 0).float().mean() > 0.999  # every entry noised
    assert abs(float(diff.mean())) < 6 * std / math.sqrt(n)
    assert float(diff.std()) == pytest.approx(std, rel=8 / math.sqrt(n))  # Laplace: se(std)/std ~ 1.1/sqrt(n)
    assert float(diff.abs().mean()) == pytest.approx(mean_abs, rel=8 / math.sqrt(n))  # tells the two apart


@pytest.mark.parametrize("kind", MODELS)
def test_outpost_prunes_and_noises_each_layer_per_algorithm_1(kind):
    d = Outpost(seed=5)  # iteration 1: always perturbs; prune 80%, noise the top 40% by |g| with std 0.8 Var(w)
    undefended, sent, before, _, opt = defended_step(kind, d)
    c = d.config
    checked_std = 0
    for n, g in sent.items():
        ref, out = undefended[n].reshape(-1), g.reshape(-1)
        base = ref.masked_fill(smallest_k_mask(ref.abs(), prune_count(c.prune, ref.numel())), 0.0)
        std = c.noise * layer_risk(before[n])
        if std == 0:  # LayerNorm weights (all 1) and biases (all 0) at init: risk 0, pruned only
            assert torch.equal(out, base), n
            continue
        top = largest_k_mask(ref.abs(), cover_count(c.phi, ref.numel()))
        assert torch.equal(out[~top], base[~top]) and not (out[~top] != 0).any(), n  # 1 - phi < prune: all zero
        assert int((out == 0).sum()) == ref.numel() - int(top.sum()), n
        noise = (out - base)[top].double()
        if noise.numel() >= 500:
            assert float(noise.std()) == pytest.approx(std, rel=6 / math.sqrt(2 * noise.numel())), n
            checked_std += 1
    assert checked_std >= 3
    assert opt.last_stats.stages[0].kind == "outpost" and opt.last_stats.stages[0].fired


@pytest.mark.parametrize("kind", MODELS)
def test_a_stack_applies_its_members_in_order(kind):
    undefended, sent, _, _, opt = defended_step(kind, Stack(GradPrune(0.9), SignCompression()))
    for n, g in sent.items():
        ref = undefended[n]
        pruned = ref.masked_fill(smallest_k_mask(ref.abs().reshape(-1), prune_count(0.9, ref.numel())).view_as(ref), 0.0)
        assert torch.equal(g, pruned.sign()), n
    assert [s.kind for s in opt.last_stats.stages] == ["gradprune", "sign"]


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("defense", [Soteria, GradDefense, lambda: Stack(GradPrune(0.5), Soteria())],
                         ids=["soteria", "graddefense", "stack-with-soteria"])
@pytest.mark.parametrize("entry", ["protect", "wrap"])
def test_input_gradient_defenses_refuse_token_ids_with_one_line(kind, defense, entry):
    d = defense()
    name = "soteria" if d.kind == "stack" else d.kind
    model = make(kind)
    before = copy.deepcopy(model.state_dict())
    x, y = batch(kind)
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    opt = guardfl.protect(model, sgd, loader(kind), d)[1] if entry == "protect" else guardfl.wrap(sgd, d, model=model)
    opt.zero_grad()
    loss(model, x, y).backward()
    with pytest.raises(ConfigError) as err:
        opt.step()
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{name}: the model's inputs are torch.int64, not floating point")
    assert "differentiates with respect to the inputs" in message
    for k, v in model.state_dict().items():  # fail closed: nothing moved
        assert torch.equal(v, before[k]), k


# -- 2. input encodings ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("encoding", [lambda: MixUp(k=2, seed=0), lambda: InstaHide(k=2, seed=0),
                                      lambda: Stack(MixUp(k=2, seed=0), DPSGD(noise_multiplier=1.0, seed=0))],
                         ids=["mixup", "instahide", "mixup+dpsgd"])
def test_input_encodings_refuse_a_token_loader_at_protect(kind, encoding):
    model = make(kind)
    with pytest.raises(ConfigError) as err:
        guardfl.protect(model, torch.optim.SGD(model.parameters(), lr=LR), loader(kind), encoding(), num_classes=CLASSES)
    message = str(err.value)
    assert "\n" not in message and message.startswith("defense: ") and "torch.int64" in message
    assert "mixes images" in message


def test_a_token_loader_of_batch_size_one_hears_about_the_dtype_first():
    """Both are wrong (token ids, and a batch of 1 for k = 2): the dtype is the refusal that helps."""
    model = make("classifier")
    with pytest.raises(ConfigError, match="^defense: mixup mixes images"):
        guardfl.protect(model, torch.optim.SGD(model.parameters(), lr=LR), loader("classifier", batch_size=1), MixUp(k=2, seed=0))


def test_input_encodings_refuse_token_batches_of_a_loader_without_a_dataset():
    model = make("classifier")
    data = [batch("classifier")]  # a plain list of batches: nothing to probe at protect time
    model, opt, encoded = guardfl.protect(model, torch.optim.SGD(model.parameters(), lr=LR), data, MixUp(k=2, seed=0))
    with pytest.raises(ConfigError, match="^defense: mixup mixes images"):
        next(iter(encoded))


def test_input_encodings_still_mix_float_inputs():
    data = DataLoader(TensorDataset(torch.rand(8, 1, 4, 4), torch.arange(8) % 3), batch_size=4)
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 3))
    _, _, encoded = guardfl.protect(model, torch.optim.SGD(model.parameters(), lr=LR), data, MixUp(k=2, seed=0))
    x, y = next(iter(encoded))
    assert x.dtype == torch.float32 and y.shape == (4, 3)


# -- 3. DP-SGD (Opacus) ------------------------------------------------------------------------------------
def test_opacus_grad_samplers_cover_every_trainable_layer_of_the_text_models():
    samplers = {cls.__name__ for cls in GradSampleModule.GRAD_SAMPLERS}
    assert {"Embedding", "Linear", "LayerNorm"} <= samplers and "MultiheadAttention" not in samplers
    for kind in MODELS:
        trainable = {type(m) for m in make(kind).modules() if any(p.requires_grad for p in m.parameters(recurse=False))}
        assert trainable == {nn.Embedding, nn.Linear, nn.LayerNorm}, kind  # tied: the position embedding still trains
        assert trainable <= set(GradSampleModule.GRAD_SAMPLERS), kind
        assert ModuleValidator.validate(make(kind), strict=False) == [], kind


def _dp(kind: str, **config):
    model = make(kind)
    plain = copy.deepcopy(model)
    data = loader(kind, n=config.pop("n", 8), batch_size=BATCH)
    private, opt, data = guardfl.protect(model, torch.optim.SGD(model.parameters(), lr=LR), data,
                                         DPSGD(seed=0, **config))
    return plain, private, opt, data


@pytest.mark.parametrize("kind", MODELS)
def test_dpsgd_trains_text_models_with_per_sample_gradients_for_every_trainable_parameter(kind):
    plain, private, opt, data = _dp(kind, noise_multiplier=1.0, n=16)
    assert isinstance(opt, guardfl.PrivateOptimizer) and isinstance(private, GradSampleModule)
    trainable = {n for n, p in private.named_parameters() if p.requires_grad}
    steps = 0
    for x, y in data:  # Poisson-sampled batches
        if len(x) == 0:
            continue
        opt.zero_grad()
        loss(private, x, y).backward()
        with_samples = {n for n, p in private.named_parameters() if getattr(p, "grad_sample", None) is not None}
        assert with_samples == trainable
        for n, p in private.named_parameters():
            if p.requires_grad:
                assert p.grad_sample.shape == (len(x), *p.shape), n
        opt.step()
        steps += 1
    assert steps >= 1
    assert 0 < opt.epsilon(1e-5) < math.inf
    after = guardfl.plain_state_dict(private)
    assert list(after) == list(plain.state_dict())
    for n, p in plain.named_parameters():
        assert torch.isfinite(after[n]).all(), n
        assert torch.equal(after[n], p) != p.requires_grad, n  # trainable ones moved, the frozen tied embedding did not
    if kind == "causal-lm-tied":
        assert "token.weight" not in trainable and private._module.token.weight.grad is None


@pytest.mark.parametrize("kind", MODELS)
def test_opacus_per_sample_gradients_equal_torch_func_and_are_clipped(kind):
    max_norm = 0.05  # well below the per-sample gradient norms: clipping is active for every sample
    plain, private, opt, data = _dp(kind, noise_multiplier=0.0, max_grad_norm=max_norm, poisson_sampling=False)
    x, y = next(iter(data))
    assert len(x) == BATCH
    opt.zero_grad()
    loss(private, x, y).backward()
    names = [n for n, p in plain.named_parameters() if p.requires_grad]
    opacus = {n.removeprefix("_module."): p.grad_sample.clone() for n, p in private.named_parameters() if p.requires_grad}
    opt.step()
    clipped_sum = {n.removeprefix("_module."): p.grad.clone() for n, p in private.named_parameters() if p.requires_grad}

    params = {n: p.detach() for n, p in plain.named_parameters() if p.requires_grad}
    frozen = {n: p.detach() for n, p in plain.named_parameters() if not p.requires_grad}

    def sample_loss(ps, xi, yi):
        return loss(lambda t: functional_call(plain, {**ps, **frozen}, (t,)), xi[None], yi[None])

    reference = vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, x, y)
    assert set(opacus) == set(reference) == set(names)
    assert {"position.weight", "blocks.0.attn.qkv.weight", "blocks.0.norm1.weight"} <= set(names)  # (N, L) ids, (N, L, D) inputs
    assert ("token.weight" in names) == (kind != "causal-lm-tied")
    for n in names:
        torch.testing.assert_close(opacus[n], reference[n], rtol=1e-4, atol=1e-6, msg=n)

    norms = torch.stack([reference[n].reshape(BATCH, -1).norm(dim=1) for n in names]).norm(dim=0)
    assert (norms > max_norm).all()  # clipping was active
    factor = (max_norm / (norms + 1e-6)).clamp(max=1.0)  # Opacus's rule
    for n in names:  # noise 0: the step's gradient is the mean of the clipped per-sample gradients
        expected = torch.einsum("i,i...->...", factor, reference[n]) / BATCH
        torch.testing.assert_close(clipped_sum[n], expected, rtol=1e-4, atol=1e-7, msg=n)
    total = float(flat(clipped_sum[n] for n in names).norm())
    assert total <= max_norm * (1 + 1e-5)  # a mean of vectors of norm <= C


def test_multihead_attention_is_swapped_for_opacus_dp_multihead_attention_and_trains():
    torch.manual_seed(0)
    model = AttentionClassifier()
    errors = ModuleValidator.validate(model, strict=False)
    assert len(errors) == 1 and "DPMultiheadAttention" in str(errors[0])
    original = copy.deepcopy(model.state_dict())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        private, opt, data = guardfl.protect(model, torch.optim.SGD(model.parameters(), lr=LR), loader("classifier", n=8),
                                             DPSGD(noise_multiplier=1.0, seed=0))
    swap = [str(w.message) for w in caught if str(w.message).startswith("dpsgd:")]
    assert swap == ["dpsgd: layers replaced for Opacus (MultiheadAttention -> DPMultiheadAttention): a new model, whose "
                    "state-dict keys may differ; the optimizer was rebuilt for the new parameters"]
    assert private._module is not model and isinstance(private._module.encoder.self_attn, DPMultiheadAttention)
    assert isinstance(model.encoder.self_attn, nn.MultiheadAttention)  # the caller's model is left as it was
    keys = list(guardfl.plain_state_dict(private))
    assert "encoder.self_attn.qlinear.weight" in keys and "encoder.self_attn.in_proj_weight" not in keys
    torch.testing.assert_close(  # the swap kept the weights: q, k, v are the rows of in_proj_weight
        torch.cat([guardfl.plain_state_dict(private)[f"encoder.self_attn.{q}linear.weight"] for q in "qkv"]),
        original["encoder.self_attn.in_proj_weight"])
    before = [p.detach().clone() for p in private.parameters()]
    for x, y in data:
        if len(x):
            opt.zero_grad()
            loss(private, x, y).backward()
            assert all(p.grad_sample is not None for p in private.parameters() if p.requires_grad)
            opt.step()
    assert any(not torch.equal(a, p) for a, p in zip(before, private.parameters()))
    assert all(torch.isfinite(p).all() for p in private.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, original[k]), k
