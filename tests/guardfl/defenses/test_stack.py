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


def test_map_leaves_replaces_leaves_and_keeps_the_structure():
    from guardfl.defenses import parse_config

    cfg = parse_config({"kind": "stack", "seed": 3, "defenses": [
        {"kind": "gradprune", "ratio": 0.5}, {"kind": "stack", "defenses": [{"kind": "gaussian", "sigma": 0.1}]}]})
    mapped = cfg.map_leaves(lambda leaf: leaf.model_copy(update={"seed": 7}) if leaf.kind == "gaussian" else leaf)
    assert [(leaf.kind, leaf.seed) for leaf in mapped.leaves()] == [("gradprune", None), ("gaussian", 7)]
    assert mapped.seed == 3 and mapped.defenses[0] is cfg.defenses[0]
    assert [leaf.seed for leaf in cfg.leaves()] == [None, None]  # the original is unchanged (frozen)
    leaf = parse_config({"kind": "gradprune", "ratio": 0.5})
    assert leaf.map_leaves(lambda x: x) is leaf


def test_nested_dp_stack_is_refused_at_wrap():
    import guardfl
    from guardfl.defenses import DPSGD
    from guardfl.errors import UnsupportedOptimizerError

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    with pytest.raises(UnsupportedOptimizerError, match="dpsgd"):
        guardfl.wrap(opt, Stack(Stack(DPSGD(noise_multiplier=1.0))))


# -- members are the instances given (issue 13) ------------------------------------------------------------
class _ZeroAll(GradPrune):
    """A user subclass: zeroes every entry (its config still says ratio 0.5)."""

    def _apply_(self, grads, ctx):
        from guardfl.stats import LayerStats, StageStats

        for g in grads:
            g.zero_()
        return StageStats.from_layers(self.kind, tuple(
            LayerStats.counted(ctx.name(i), g.numel(), changed=g.numel()) for i, g in enumerate(grads)))


def test_a_subclass_member_keeps_its_behaviour():
    """The audit's case: the member was rebuilt from its config as a GradPrune, which kept half the entries."""
    member = _ZeroAll(0.5)
    stack = Stack(member, GaussianNoise(0.1, seed=0))
    assert stack.members[0] is member and type(stack.members[0]) is _ZeroAll
    out, stats = Stack(member)([torch.randn(100), torch.randn(10)])
    assert all(bool((o == 0).all()) for o in out)
    assert stats.stages[0].kind == "gradprune"


def test_given_instances_are_kept_and_their_configs_reported():
    a, b = GradPrune(0.9), GaussianNoise(0.2, seed=3)
    stack = Stack(a, b, seed=1)
    assert stack.members[0] is a and stack.members[1] is b
    assert stack.config.defenses[0] == a.config and stack.config.defenses[1] == b.config
    assert stack.leaves() == [a, b]
    dumped = stack.config.model_dump(mode="json")
    assert dumped["defenses"] == [a.config.model_dump(mode="json"), b.config.model_dump(mode="json")]
    assert b._seed == 3  # a member with its own seed keeps it


def test_nested_stack_instances_are_kept():
    member = _ZeroAll(0.5)
    inner = Stack(member)
    outer = Stack(GaussianNoise(0.1), inner)
    assert outer.members[1] is inner and outer.leaves()[1] is member


def test_a_stack_from_a_config_builds_its_members():
    from guardfl.defenses import from_config

    s = from_config({"kind": "stack", "defenses": [{"kind": "gradprune", "ratio": 0.5}]})
    assert type(s.members[0]) is GradPrune


def test_seeded_stack_with_instances_reproduces():
    g = [torch.zeros(1000)]
    a, _ = Stack(GaussianNoise(1.0), GradPrune(0.5), seed=5)(g)
    b, _ = Stack(GaussianNoise(1.0), GradPrune(0.5), seed=5)(g)
    assert torch.equal(a[0], b[0])


def test_protect_regroups_the_same_gradient_instances_without_reseeding():
    import guardfl
    from guardfl.defenses import DPSGD

    member = _ZeroAll(0.5)
    noise = GaussianNoise(0.1)
    seed_before = noise._seed
    model = torch.nn.Linear(4, 2)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,))),
                                         batch_size=4)
    outer = Stack(DPSGD(noise_multiplier=1.0, seed=0), member, noise, seed=7)
    seed_in_stack = noise._seed
    _, opt, _ = guardfl.protect(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, outer)
    assert opt.guarded.defense.members == [member, noise]
    assert noise._seed == seed_in_stack != seed_before  # reseeded once by the seeded stack, not again by protect


def test_stream_seed_is_the_seed_of_the_streams_or_none_for_os_entropy():
    assert GaussianNoise(0.1, seed=5).stream_seed == 5
    assert GaussianNoise(0.1).stream_seed is None
    noise = GaussianNoise(0.1)
    noise.reseed(9)
    assert noise.stream_seed == 9
    stack = Stack(GradPrune(0.5), GaussianNoise(0.1), seed=7)
    assert stack.stream_seed == 7 and stack.members[1].stream_seed is not None  # derived from the stack's


def test_regroup_keeps_the_members_and_their_streams():
    member, noise = GradPrune(0.5), GaussianNoise(0.1, seed=3)
    noise.generator("cpu")
    before = noise.generator("cpu").get_state()
    grouped = Stack.regroup([member, noise])
    assert grouped.members == [member, noise] and noise.stream_seed == 3
    assert torch.equal(noise.generator("cpu").get_state(), before)  # not reseeded
