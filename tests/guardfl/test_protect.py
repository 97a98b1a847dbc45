import warnings

import pytest
import torch
import torch.nn.functional as F
from opacus.accountants import RDPAccountant
from torch.utils.data import DataLoader, TensorDataset

import guardfl
from guardfl.defenses import DPSGD, GradPrune, InstaHide, MixUp, Outpost, SignCompression, Stack
from guardfl.errors import ConfigError, UnsupportedOptimizerError
from guardfl.integrations.torch import round_defense

N, BATCH = 64, 16


def _setup(seed=0, bn=False):
    torch.manual_seed(seed)
    layers = [torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU()]
    if bn:
        layers.insert(1, torch.nn.BatchNorm2d(4))
    model = torch.nn.Sequential(*layers, torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 3))
    g = torch.Generator().manual_seed(seed)
    data = TensorDataset(torch.randn(N, 1, 8, 8, generator=g), torch.randint(0, 3, (N,), generator=g))
    return model, torch.optim.SGD(model.parameters(), lr=0.05), DataLoader(data, batch_size=BATCH, shuffle=True)


def _epoch(model, opt, loader, loss=F.cross_entropy):
    steps = 0
    for x, y in loader:
        if len(x) == 0:
            continue
        opt.zero_grad()
        loss(model(x), y).backward()
        opt.step()
        steps += 1
    return steps


def test_gradient_defense_only_wraps_the_optimizer():
    model, opt, loader = _setup()
    m2, o2, l2 = guardfl.protect(model, opt, loader, GradPrune(0.5))
    assert m2 is model and l2 is loader and isinstance(o2, guardfl.GuardedOptimizer)
    assert o2.epsilon(1e-5) == float("inf")


def test_dpsgd_epsilon_equals_opacus_accountant():
    model, opt, loader = _setup()
    model, opt, loader = guardfl.protect(model, opt, loader, DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, seed=0))
    assert isinstance(opt, guardfl.PrivateOptimizer)
    steps = _epoch(model, opt, loader) + _epoch(model, opt, loader)
    reference = RDPAccountant()
    for _ in range(2 * len(loader)):
        reference.step(noise_multiplier=1.0, sample_rate=BATCH / N)
    assert opt.epsilon(1e-5) == pytest.approx(reference.get_epsilon(1e-5))
    assert steps <= 2 * len(loader)


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_epsilon_is_cumulative_across_rounds(accountant):
    def run(rounds, epochs_per_round):
        state = None
        for r in range(rounds):
            model, opt, loader = _setup(seed=r)
            model, opt, loader = guardfl.protect(
                model, opt, loader, round_defense(DPSGD(noise_multiplier=1.1, accountant=accountant, seed=0), r),
                privacy_state=state)
            for _ in range(epochs_per_round):
                _epoch(model, opt, loader)
            state = opt.privacy_state()
        return opt.epsilon(1e-5)

    two_rounds = run(2, 1)
    one_run = run(1, 2)
    assert two_rounds == pytest.approx(one_run, rel=1e-6)
    assert two_rounds > run(1, 1)  # and it grows with steps


def test_a_seeded_dpsgd_in_a_later_round_needs_a_per_round_seed():
    """``privacy_state`` says this is a later round: a seeded DP-SGD not built for it by ``round_defense``
    would draw round 0's noise again (a server differencing two rounds cancels it). One line; the
    round's own defense trains, and unseeded DP-SGD needs nothing."""
    model, opt, loader = _setup()
    model, opt, loader = guardfl.protect(model, opt, loader, DPSGD(noise_multiplier=1.0, seed=3))
    _epoch(model, opt, loader)
    state = opt.privacy_state()
    with pytest.raises(ConfigError, match=r"^defense.seed: a seeded dpsgd with privacy_state") as err:
        guardfl.protect(*_setup(), DPSGD(noise_multiplier=1.0, seed=3), privacy_state=state)
    assert "\n" not in str(err.value) and "round_defense" in str(err.value)
    guardfl.protect(*_setup(), round_defense(DPSGD(noise_multiplier=1.0, seed=3), 1), privacy_state=state)
    guardfl.protect(*_setup(), DPSGD(noise_multiplier=1.0), privacy_state=state)


def test_epsilon_grows_monotonically():
    model, opt, loader = _setup()
    model, opt, loader = guardfl.protect(model, opt, loader, DPSGD(noise_multiplier=1.0, seed=0))
    eps = []
    for x, y in loader:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        eps.append(opt.epsilon(1e-5))
    assert all(b > a for a, b in zip(eps, eps[1:]))


def test_per_sample_gradients_are_clipped_before_noise():
    model, opt, _ = _setup()
    x = 5 * torch.randn(8, 1, 8, 8)
    with torch.no_grad():
        wrong = model(x).argmin(1)  # the least likely class: a large gradient to clip
    data = TensorDataset(x, wrong)
    loader = DataLoader(data, batch_size=1)
    model, opt, loader = guardfl.protect(
        model, opt, loader, DPSGD(noise_multiplier=0.0, max_grad_norm=0.5, poisson_sampling=False, seed=0)
    )
    for x, y in loader:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        raw = torch.cat([p.grad_sample.reshape(-1) for p in model.parameters()]).norm()
        opt.step()
        clipped = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm()
        assert float(clipped) <= 0.5 + 1e-5 and float(raw) > 0.5  # clipping was active


def _poisson_batches(seed):
    model, opt, loader = _setup()
    model, opt, loader = guardfl.protect(model, opt, loader, DPSGD(noise_multiplier=1.0, seed=seed))
    torch.manual_seed(0)  # what most training scripts do: Opacus's sampler would draw from this generator
    return [tuple(x.flatten()[:1].tolist()) + (len(x),) for x, _ in loader]


def test_poisson_sampling_is_the_defenses_randomness_not_torchs_global_generator():
    """Which samples form each batch is secret (amplification by subsampling rests on it): unseeded, two
    clients after the same ``torch.manual_seed`` sample differently; seeded, reproducibly."""
    assert _poisson_batches(None) != _poisson_batches(None)
    assert _poisson_batches(3) == _poisson_batches(3) != _poisson_batches(4)


def test_gradient_defense_acts_inside_dp_after_clipping_and_noise():
    model, opt, loader = _setup()
    defense = Stack(DPSGD(noise_multiplier=1.0, seed=0), SignCompression())
    model, opt, loader = guardfl.protect(model, opt, loader, defense)
    _epoch(model, opt, loader)
    for p in model.parameters():
        assert set(p.grad.unique().tolist()) <= {-1.0, 0.0, 1.0}  # signed AFTER Opacus noised
    assert 0 < opt.epsilon(1e-5) < float("inf")
    assert opt.last_stats.stages[0].kind == "sign"


def test_dp_with_outpost_keeps_per_round_counter():
    model, opt, loader = _setup()
    model, opt, loader = guardfl.protect(model, opt, loader, Stack(DPSGD(noise_multiplier=1.0, seed=0), Outpost(seed=0)))
    _epoch(model, opt, loader)
    assert opt.guarded.iteration > 1
    opt.new_round()
    assert opt.guarded.iteration == 0


def test_batchnorm_is_fixed_and_keys_stay_plain():
    model, opt, loader = _setup(bn=True)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        model, opt, loader = guardfl.protect(model, opt, loader, DPSGD(noise_multiplier=1.0, seed=0))
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    _epoch(model, opt, loader)
    keys = set(guardfl.plain_state_dict(model))
    assert keys and not any(k.startswith("_module.") for k in keys)
    guardfl.load_plain_state_dict(model, guardfl.plain_state_dict(model))


def test_dp_sgd_trains_a_torchvision_resnet():
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=3)  # BatchNorm, ReLU(inplace=True), `out += identity`
    loader = DataLoader(TensorDataset(torch.rand(8, 3, 32, 32), torch.arange(8) % 3), batch_size=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        private, opt, loader = guardfl.protect(model, opt, loader, DPSGD(noise_multiplier=1.0, seed=0))
    before = [p.detach().clone() for p in private.parameters()]
    _epoch(private, opt, loader)  # Opacus's hooks refused the in-place add: trained with expanded weights
    assert any(not torch.equal(a, p) for a, p in zip(before, private.parameters()))
    assert not any(k.startswith("_module.") for k in guardfl.plain_state_dict(private))


def test_the_expanded_weights_fallback_clips_the_same_per_sample_gradients():
    import copy

    from opacus import PrivacyEngine

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.GroupNorm(2, 8), torch.nn.ReLU(),
                               torch.nn.Flatten(), torch.nn.Linear(8 * 8 * 8, 3))
    x, y = torch.rand(6, 3, 8, 8), torch.arange(6) % 3
    grads = []
    for mode in ("hooks", "ew"):
        model = copy.deepcopy(base)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            private, opt, _ = PrivacyEngine().make_private(
                module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                data_loader=DataLoader(TensorDataset(x, y), batch_size=6), noise_multiplier=0.0, max_grad_norm=0.5,
                poisson_sampling=False, grad_sample_mode=mode)
        opt.zero_grad()
        F.cross_entropy(private(x), y).backward()
        opt.pre_step()  # per-sample clipping and the sum, no noise
        grads.append([p.grad.clone() for p in private.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-5)


def test_input_encodings_wrap_the_loader_with_soft_labels():
    model, opt, loader = _setup()
    model, opt, enc_loader = guardfl.protect(model, opt, loader, Stack(InstaHide(k=4, seed=0), GradPrune(0.9)))
    x, y = next(iter(enc_loader))
    assert x.shape == (BATCH, 1, 8, 8) and y.shape == (BATCH, 3)
    assert len(enc_loader) == len(loader) and enc_loader.dataset is loader.dataset
    _epoch(model, opt, enc_loader, loss=guardfl.soft_cross_entropy)
    assert opt.last_stats.stages[0].kind == "gradprune"


def test_mixup_with_dp():
    model, opt, loader = _setup()
    model, opt, loader = guardfl.protect(model, opt, loader, Stack(MixUp(seed=0), DPSGD(noise_multiplier=1.0, seed=0)))
    _epoch(model, opt, loader, loss=guardfl.soft_cross_entropy)
    assert opt.epsilon(1e-5) > 0


def test_bad_input():
    model, opt, loader = _setup()
    with pytest.raises(ConfigError, match="dpsgd.delta"):
        guardfl.protect(model, opt, loader, {"kind": "dpsgd", "noise_multiplier": 1.0, "delta": 1.5})
    with pytest.raises(ConfigError, match="exactly one"):
        DPSGD(noise_multiplier=1.0, target_epsilon=3.0, epochs=1)
    with pytest.raises(ConfigError, match="at most one dpsgd"):
        guardfl.protect(model, opt, loader, Stack(DPSGD(noise_multiplier=1.0), DPSGD(noise_multiplier=2.0)))
    with pytest.raises(UnsupportedOptimizerError, match="guardfl.protect"):
        guardfl.wrap(opt, Stack(GradPrune(0.5), MixUp()))



class OddLayer(torch.nn.Linear):
    """A layer a user declared unsupported to Opacus (a registered validator and no fixer)."""


def test_a_model_opacus_cannot_handle_names_the_layer(monkeypatch):
    from opacus.validators import ModuleValidator
    from opacus.validators.errors import UnsupportedModuleError

    monkeypatch.setitem(ModuleValidator.VALIDATORS, OddLayer, lambda m: [UnsupportedModuleError("OddLayer is not supported")])
    _, _, loader = _setup()
    model = torch.nn.Sequential(torch.nn.Flatten(), OddLayer(64, 3))
    with pytest.raises(ConfigError, match="dpsgd: Opacus cannot train this model: OddLayer"):
        guardfl.protect(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, DPSGD(noise_multiplier=1.0))


def test_target_epsilon_is_met():
    model, opt, loader = _setup()
    model, opt, loader = guardfl.protect(model, opt, loader, DPSGD(target_epsilon=3.0, epochs=2, seed=0))
    _epoch(model, opt, loader)
    _epoch(model, opt, loader)
    assert opt.epsilon(1e-5) <= 3.0 + 1e-3
