"""untouched_layers: the parameter tensors a setting never changes, before training."""

import pytest
import torch
from torch import nn

from guardfl.defenses import (
    DPSGD,
    GaussianNoise,
    GradDefense,
    GradPrune,
    Identity,
    MixUp,
    Outpost,
    SignCompression,
    Soteria,
    Stack,
    Untouched,
    untouched_layers,
)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.PReLU(), nn.Flatten(), nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 3))


NAMES = ["0.weight", "0.bias", "1.weight", "3.weight", "3.bias", "5.weight", "5.bias"]


def test_one_entry_tensors_are_never_pruned_nor_given_outpost_noise():
    for defense in (GradPrune(0.5), GradPrune(0.999), Outpost(), Outpost(prune=0.01, noise=0.0)):
        (u,) = untouched_layers(defense, _model())
        assert u.name == "1.weight" and defense.kind in u.reason
    grads = [p.detach().clone().normal_() for p in _model().parameters()]
    out, stats = Outpost(seed=0)(grads, [p.detach() for p in _model().parameters()])
    assert torch.equal(out[2], grads[2]) and stats.stages[0].layers[2].fraction_changed == 0.0  # as predicted


def test_noise_sign_graddefense_dpsgd_and_encodings_leave_no_tensor_certainly_untouched():
    for defense in (GaussianNoise(0.1), SignCompression(), GradDefense(), DPSGD(noise_multiplier=1.0), MixUp(),
                    GradPrune(0.5, scope="global"), Stack(GradPrune(0.9), GaussianNoise(0.1))):
        assert untouched_layers(defense, _model()) == []


def test_soteria_touches_only_its_layers_weight():
    assert [u.name for u in untouched_layers(Soteria(), _model())] == [n for n in NAMES if n != "3.weight"]
    assert [u.name for u in untouched_layers(Soteria(layer="5"), _model())] == [n for n in NAMES if n != "5.weight"]
    # from shapes alone and layer=None, which 2-D weight is the first nn.Linear's is unknown: not listed
    shapes = [(n, p.shape) for n, p in _model().named_parameters()]
    assert [u.name for u in untouched_layers(Soteria(), shapes)] == ["0.weight", "0.bias", "1.weight", "3.bias", "5.bias"]
    one_feature = nn.Sequential(nn.Linear(1, 3))
    assert [u.name for u in untouched_layers(Soteria(prune=0.9), one_feature)] == ["0.weight", "0.bias"]


def test_a_stack_leaves_untouched_what_every_member_leaves_untouched():
    (u,) = untouched_layers(Stack(GradPrune(0.5), Outpost()), _model())
    assert u.name == "1.weight" and "gradprune" in u.reason and "outpost" in u.reason
    assert untouched_layers(Stack(GradPrune(0.5), GaussianNoise(0.1)), _model()) == []
    assert [u.name for u in untouched_layers(Stack(Soteria(), GradPrune(0.5)), _model())] == ["1.weight"]


def test_identity_none_configs_and_shape_forms():
    assert [u.name for u in untouched_layers(Identity(), _model())] == NAMES
    assert [u.reason for u in untouched_layers(None, {"w": (2, 2)})] == ["no defense"]
    expected = [Untouched("b", untouched_layers(GradPrune(0.3), {"b": (1,)})[0].reason)]
    assert untouched_layers({"kind": "gradprune", "ratio": 0.3}, {"a": (4,), "b": torch.zeros(1), "e": (0, 3)}) == expected
    assert str(expected[0]).startswith("b: gradprune")
    assert untouched_layers("kind: gradprune\nratio: 0.3\n", [("a", (1,))])[0].name == "a"


def test_predictions_hold_on_the_gradient():
    """Every tensor listed is unchanged by the defense, for many draws."""
    model = _model()
    params = [p.detach() for p in model.parameters()]
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        for defense in (GradPrune(0.01, seed=seed), Outpost(seed=seed), Outpost(prune=0.0, seed=seed)):
            listed = {u.name for u in untouched_layers(defense, model)}
            out, _ = defense(grads, params, names=NAMES)
            for name, g, o in zip(NAMES, grads, out):
                if name in listed:
                    assert torch.equal(g, o)


@pytest.mark.parametrize("bad", [{"kind": "gradprune", "ratio": 0}, {"kind": "stack", "defenses": [{"kind": "identity"}]}])
def test_zero_strength_configs_are_refused_here_too(bad):
    from guardfl.errors import ConfigError

    with pytest.raises(ConfigError, match="Identity"):
        untouched_layers(bad, {"a": (3,)})
