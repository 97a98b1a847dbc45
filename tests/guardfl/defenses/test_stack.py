import pytest
import torch

from guardfl.defenses import GaussianNoise, GradPrune, Outpost, SignCompression, Stack


def test_stack_applies_members_in_order():
    g = [torch.randn(100), torch.randn(10)]
    out, stats = Stack(GradPrune(0.5), SignCompression())(g)
    expected, _ = SignCompression()(GradPrune(0.5)(g)[0])
    assert all(torch.equal(a, b) for a, b in zip(out, expected))
    assert [s.kind for s in stats.stages] == ["gradprune", "sign"]


def test_seeded_stack_reproduces_and_members_get_distinct_streams():
    g = [torch.zeros(1000)]
    a, _ = Stack(GaussianNoise(1.0), GaussianNoise(1.0), seed=5)(g)
    b, _ = Stack(GaussianNoise(1.0), GaussianNoise(1.0), seed=5)(g)
    assert torch.equal(a[0], b[0])
    s = Stack(GaussianNoise(1.0), GaussianNoise(1.0), seed=5)
    assert s.members[0]._seed != s.members[1]._seed


def test_stack_with_outpost_needs_params():
    s = Stack(GradPrune(0.5), Outpost())
    assert s.needs_params
    g, w = [torch.randn(50)], [torch.randn(50)]
    out, stats = s(g, w)
    assert [st.kind for st in stats.stages] == ["gradprune", "outpost"]


# -- one walk over a stack --------------------------------------------------------------------------------
def test_leaves_expand_nested_stacks_in_order():
    from guardfl.defenses import DPSGD, GaussianNoise, GradPrune, MixUp

    inner = Stack(GradPrune(0.5), Stack(GaussianNoise(0.1)))
    outer = Stack(MixUp(k=2), inner, DPSGD(noise_multiplier=1.0))
    assert [leaf.kind for leaf in outer.leaves()] == ["mixup", "gradprune", "gaussian", "dpsgd"]
    assert [leaf.kind for leaf in outer.config.leaves()] == ["mixup", "gradprune", "gaussian", "dpsgd"]
    assert outer.stages == {"input", "gradient", "dp"}


def test_nested_dp_stack_is_refused_at_wrap():
    import guardfl
    from guardfl.defenses import DPSGD
    from guardfl.errors import UnsupportedOptimizerError

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    with pytest.raises(UnsupportedOptimizerError, match="dpsgd"):
        guardfl.wrap(opt, Stack(Stack(DPSGD(noise_multiplier=1.0))))
