"""A defense never silently does nothing: for zero and tiny settings of every registered defense, either the
setting is refused (one line, pointing to Identity() when it is zero-strength), or applying it changes the
gradient, or its stats say it did not. Never ``fired=True`` on a bit-identical gradient, never
``fired=False`` on a changed one, and every per-layer fraction is what was counted on the gradient."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from guardfl.defenses import REGISTRY, from_config
from guardfl.errors import ConfigError

TINY = [0.0, 5e-324, 1e-300, 1e-45, 1e-30, 1e-12, 1e-6, 1e-3]
tiny = st.sampled_from(TINY)
tiny_ratio = st.sampled_from([0.0, 5e-324, 1e-12, 1e-3, 0.01, 0.05])
seeds = st.integers(0, 2**32 - 8)  # config seeds end at 2**32 - 1; stack members get seed + i

#: zero and tiny settings of every registered kind (a new defense must add its own here)
SETTINGS = {
    "gradprune": st.fixed_dictionaries({"ratio": tiny_ratio, "scope": st.sampled_from(["layer", "global"])}),
    "gaussian": st.fixed_dictionaries({"sigma": tiny}),
    "laplace": st.fixed_dictionaries({"scale": tiny}),
    "sign": st.just({}),
    "identity": st.just({}),
    "outpost": st.fixed_dictionaries({"prune": tiny_ratio, "noise": tiny, "phi": st.sampled_from([0.0, 1e-9, 0.01, 1.0]),
                                      "beta": st.sampled_from([0.0, 0.1, 1e9])}),
    "soteria": st.fixed_dictionaries({"prune": tiny_ratio}),
    "graddefense": st.integers(1, 4).flatmap(lambda s: st.fixed_dictionaries({
        "slices": st.just(s), "perturb_slices": st.integers(1, s), "noise": tiny, "clip": st.booleans(),
        "clip_norm": st.sampled_from([None, 1e-30, 1e30]), "root_size": st.integers(1, 4)})),
    "dpsgd": st.fixed_dictionaries({"noise_multiplier": st.sampled_from([0.0, 1e-12]),
                                    "max_grad_norm": st.sampled_from([1e-12, 1e6])}),
    "mixup": st.integers(2, 4).flatmap(lambda k: st.fixed_dictionaries(
        {"k": st.just(k), "max_coeff": st.sampled_from([1.0 / k + 1e-9, 1.0])})),
    "instahide": st.integers(2, 4).flatmap(lambda k: st.fixed_dictionaries(
        {"k": st.just(k), "max_coeff": st.sampled_from([1.0 / k + 1e-9, 1.0])})),
}
GRADIENT_KINDS = ["gradprune", "gaussian", "laplace", "sign", "identity", "outpost", "soteria", "graddefense"]
MODEL_KINDS = {"soteria", "graddefense"}
stack_members = st.sampled_from([k for k in GRADIENT_KINDS]).flatmap(
    lambda kind: SETTINGS[kind].map(lambda cfg: {"kind": kind, **cfg}))
SETTINGS["stack"] = st.fixed_dictionaries({"defenses": st.lists(stack_members, min_size=1, max_size=3)})


def zero_strength(cfg: dict) -> bool:
    """The settings that can never change anything, which must be refused."""
    kind = cfg["kind"]
    if kind == "gradprune":
        return cfg["ratio"] == 0
    if kind in ("gaussian", "laplace"):
        return cfg.get("sigma", cfg.get("scale")) == 0
    if kind == "soteria":
        return cfg["prune"] == 0
    if kind == "outpost":
        return cfg["prune"] == 0 and (cfg["noise"] == 0 or cfg["phi"] == 0)
    if kind == "graddefense":
        return cfg["noise"] == 0 and not cfg["clip"]
    if kind == "stack":
        return any(m["kind"] == "identity" or zero_strength(m) for m in cfg["defenses"])
    return False


def refused_otherwise(cfg: dict) -> bool:
    """Settings refused for another reason than zero strength (clip_norm null means the noise std, 0 here)."""
    if cfg["kind"] == "stack":
        return any(refused_otherwise(m) for m in cfg["defenses"])
    return cfg["kind"] == "graddefense" and cfg["noise"] == 0 and cfg["clip"] and cfg["clip_norm"] is None


def build(cfg: dict):
    """The defense, or None when it is refused (as it must be exactly when the setting is zero-strength)."""
    try:
        defense = from_config(cfg)
    except ConfigError as err:
        msg = str(err)
        assert "\n" not in msg
        assert zero_strength(cfg) or refused_otherwise(cfg), msg
        if zero_strength(cfg) and not refused_otherwise(cfg):
            assert "Identity()" in msg, msg
        return None
    assert not zero_strength(cfg) and not refused_otherwise(cfg), f"accepted {cfg}"
    return defense


# -- gradients: drawn ones (small layers, zeros, ties, three dtypes) and a small model's real ones ----------
SHAPES = [(1,), (3,), (10,), (6, 5), (2, 3, 4)]


@st.composite
def gradients(draw):
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
    shapes = draw(st.lists(st.sampled_from(SHAPES), min_size=1, max_size=4))
    seed = draw(seeds)
    gen = torch.Generator().manual_seed(seed)
    grads, params = [], []
    for shape in shapes:
        style = draw(st.sampled_from(["randn", "zeros", "ties", "tiny", "signs"]))
        g = torch.randn(shape, generator=gen, dtype=torch.float64)
        if style == "zeros":
            g = g * (torch.rand(shape, generator=gen, dtype=torch.float64) < 0.5)
        elif style == "ties":
            g = g.sign() * 0.5
        elif style == "tiny":
            g = g * 1e-30
        elif style == "signs":
            g = torch.sign(g)
        grads.append(g.to(dtype))
        w = torch.randn(shape, generator=gen, dtype=torch.float64) if draw(st.booleans()) else torch.ones(shape)
        params.append(w.to(dtype))
    return grads, params


def small_model_gradients(seed: int):
    """A model with small layers (a one-entry PReLU weight), its gradients on a batch, and the batch."""
    torch.manual_seed(seed % 1000)
    model = nn.Sequential(nn.Linear(3, 4), nn.PReLU(), nn.Linear(4, 3))
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(5, 3, generator=gen), torch.randint(0, 3, (5,), generator=gen)
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad()
    return model, x, grads, [p.detach() for p in model.parameters()], [n for n, _ in model.named_parameters()]


# -- the invariant ----------------------------------------------------------------------------------------
def assert_stage_honest(stage, before, after):
    changed = [int((b != a).sum()) for b, a in zip(before, after)]
    assert stage.fired == any(changed), (stage, changed)
    for layer, count in zip(stage.layers, changed):
        assert round(layer.fraction_changed * layer.numel) == count, (layer, count)
        assert round(layer.fraction_zeroed * layer.numel) <= count and round(layer.fraction_noised * layer.numel) <= count
        if count == 0:
            assert layer.fraction_zeroed == layer.fraction_noised == layer.noise_std == 0.0


def with_seeds(cfg: dict, seed: int) -> dict:
    if cfg["kind"] == "stack":
        return {**cfg, "defenses": [with_seeds(m, seed + i) for i, m in enumerate(cfg["defenses"])]}
    return {**cfg, "seed": seed}


def check_gradient_defense(cfg, grads, params, iteration, model=None, inputs=None, names=None):
    defense = build(cfg)
    if defense is None:
        return
    kw = dict(iteration=iteration, model=model, inputs=inputs, names=names)
    out, stats = defense(grads, params, **kw)
    if not stats.fired:
        assert all(torch.equal(g, o) for g, o in zip(grads, out))
    members = cfg["defenses"] if cfg["kind"] == "stack" else [cfg]
    assert len(stats.stages) == len(members)
    x = grads
    for member, stage in zip(members, stats.stages):  # each stage, replayed alone on what it received
        y, alone = from_config(member)(x, params, **kw)
        assert alone.stages == (stage,)
        assert_stage_honest(stage, x, y)
        x = y
    assert all(torch.equal(a, b) for a, b in zip(x, out))


def test_every_registered_kind_has_zero_and_tiny_settings_here():
    assert set(SETTINGS) == set(REGISTRY)


@pytest.mark.parametrize("kind", [k for k in GRADIENT_KINDS if k not in MODEL_KINDS] + ["stack"])
@given(data=st.data(), seed=seeds, iteration=st.sampled_from([1, 2, 7]))
def test_gradient_defenses_never_claim_what_they_did_not_do(kind, data, seed, iteration):
    cfg = with_seeds({"kind": kind, **data.draw(SETTINGS[kind])}, seed)
    leaves = cfg["defenses"] if kind == "stack" else [cfg]
    if any(m["kind"] in MODEL_KINDS for m in leaves):
        model, x, grads, params, names = small_model_gradients(seed)
        check_gradient_defense(cfg, grads, params, iteration, model=model, inputs=x, names=names)
    else:
        grads, params = data.draw(gradients())
        check_gradient_defense(cfg, grads, params, iteration)


@pytest.mark.parametrize("kind", sorted(MODEL_KINDS))
@given(data=st.data(), seed=seeds, iteration=st.sampled_from([1, 2]))
def test_model_defenses_never_claim_what_they_did_not_do(kind, data, seed, iteration):
    cfg = with_seeds({"kind": kind, **data.draw(SETTINGS[kind])}, seed)
    model, x, grads, params, names = small_model_gradients(seed)
    check_gradient_defense(cfg, grads, params, iteration, model=model, inputs=x, names=names)


@pytest.mark.parametrize("kind", ["mixup", "instahide"])
@given(data=st.data(), seed=seeds)
def test_input_encodings_at_their_weakest_still_change_the_images(kind, data, seed):
    cfg = {"kind": kind, **data.draw(SETTINGS[kind]), "seed": seed}
    defense = build(cfg)
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.rand(6, 1, 3, 3, generator=gen), torch.randint(0, 3, (6,), generator=gen)
    encoded, _ = defense.encode(x, y, 3)
    assert not torch.equal(encoded, x)


@given(data=st.data())
def test_dpsgd_noise_0_is_clipping_only_and_never_a_silent_gradient_stage(data):
    """Decision (dpsgd.py): noise_multiplier=0 is accepted (per-sample clipping still changes the update).
    DP-SGD acts through guardfl.protect; as a plain gradient stage it refuses instead of doing nothing."""
    defense = build({"kind": "dpsgd", **data.draw(SETTINGS["dpsgd"])})
    with pytest.raises(ConfigError, match="per-sample gradients"):
        defense([torch.randn(3)])


# -- the audit's cases, by name ---------------------------------------------------------------------------
@pytest.mark.parametrize("make", [
    lambda d: d.GradPrune(0), lambda d: d.GaussianNoise(0), lambda d: d.LaplaceNoise(0),
    lambda d: d.Stack(d.GradPrune(0), d.GaussianNoise(0)), lambda d: d.Stack(d.Identity(), d.Identity()),
    lambda d: d.Soteria(prune=0), lambda d: d.Outpost(prune=0, noise=0), lambda d: d.GradDefense(noise=0, clip=False),
])
def test_the_audits_zero_strength_settings_are_refused_pointing_to_identity(make):
    import guardfl.defenses as d

    with pytest.raises(ConfigError) as info:
        make(d)
    assert "Identity()" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("make", [lambda d: d.GradPrune(0.01), lambda d: d.Outpost(prune=0.01, noise=0.0)])
def test_a_tiny_prune_reaches_every_layer_of_two_or_more_entries(make):
    import guardfl.defenses as d

    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=gen) for s in [(3,), (10,), (6, 5), (1,)]]
    params = [torch.randn(g.shape, generator=gen) for g in grads]
    out, stats = make(d)(grads, params)
    (stage,) = stats.stages
    for g, o, layer in zip(grads[:3], out[:3], stage.layers[:3]):
        assert int((o != g).sum()) == 1 and layer.fraction_zeroed == 1 / g.numel()
    assert torch.equal(out[3], grads[3]) and stage.layers[3].fraction_changed == 0.0  # one entry: never pruned
    assert stage.fired


def test_noise_too_small_for_the_dtype_is_not_reported_as_noise():
    g = [torch.ones(1000, dtype=torch.bfloat16)]
    out, stats = from_config({"kind": "gaussian", "sigma": 1e-6, "seed": 0})(g)
    assert torch.equal(out[0], g[0]) and not stats.fired
    assert stats.stages[0].layers[0].fraction_noised == 0.0 and stats.stages[0].layers[0].noise_std == 0.0
