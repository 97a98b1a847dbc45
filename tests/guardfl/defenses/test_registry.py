import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from guardfl.defenses import REGISTRY, from_config, parse_config
from guardfl.errors import ConfigError

valid_configs = st.one_of(
    st.builds(lambda r, s: {"kind": "gradprune", "ratio": r, "scope": s}, st.floats(0, 0.999, exclude_min=True), st.sampled_from(["layer", "global"])),
    st.just({"kind": "sign"}),
    st.just({"kind": "identity"}),
    st.builds(lambda s: {"kind": "gaussian", "sigma": s}, st.floats(0, 10, exclude_min=True)),
    st.builds(lambda s: {"kind": "laplace", "scale": s}, st.floats(0, 10, exclude_min=True)),
    st.builds(
        lambda b, p, r, n: {"kind": "outpost", "beta": b, "phi": p, "prune": r, "noise": n},
        st.floats(0, 10), st.floats(0.01, 1), st.floats(0.01, 0.99), st.floats(0, 5),
    ),
)


members = valid_configs.filter(lambda c: c["kind"] != "identity")  # identity is refused in a stack


@given(cfg=st.one_of(valid_configs, st.lists(members, min_size=1, max_size=3).map(lambda d: {"kind": "stack", "defenses": d})),
       seed=st.one_of(st.none(), st.integers(0, 2**32 - 1)))
def test_config_round_trips(cfg, seed):
    cfg = {**cfg, "seed": seed}
    d = from_config(cfg)
    assert type(d) is REGISTRY[cfg["kind"]]
    dumped = d.config.model_dump()
    assert from_config(dumped).config == d.config
    assert from_config(yaml.safe_dump(d.config.model_dump(mode="json"))).config == d.config


def test_from_yaml_file(tmp_path):
    p = tmp_path / "d.yaml"
    p.write_text("defense:\n  kind: stack\n  defenses:\n    - {kind: gradprune, ratio: 0.9}\n    - {kind: sign}\n")
    d = from_config(p)
    assert [m.kind for m in d.members] == ["gradprune", "sign"]
    assert from_config(str(p)).config == d.config


@pytest.mark.parametrize(
    "cfg, field, allowed",
    [
        ({"kind": "gradprune", "ratio": 1.0}, "gradprune.ratio", "(0, 1)"),
        ({"kind": "gradprune", "ratio": -0.1}, "gradprune.ratio", "(0, 1)"),
        ({"kind": "gradprune", "ratio": 0.5, "scope": "net"}, "gradprune.scope", "'layer' or 'global'"),
        ({"kind": "gaussian", "sigma": -1}, "gaussian.sigma", "finite, in (0, 1e6]"),
        ({"kind": "gaussian", "sigma": float("inf")}, "gaussian.sigma", "finite, in (0, 1e6]"),
        ({"kind": "laplace", "scale": -2}, "laplace.scale", "finite, in (0, 1e6]"),
        ({"kind": "outpost", "beta": -0.1}, "outpost.beta", ">= 0"),
        ({"kind": "outpost", "prune": 1.0}, "outpost.prune", "[0, 1)"),
        ({"kind": "sign", "nonfinite": "ignore"}, "sign.nonfinite", "'raise' or 'zero'"),
        ({"kind": "sign", "seed": -3}, "sign.seed", "[0, 2**32 - 1]"),
        ({"kind": "gradprune"}, "gradprune.ratio", None),
        ({"kind": "gradprune", "ratio": 0.5, "rato": 1}, "gradprune.rato", "ratio"),
        ({"kind": "telepathy"}, "defense.kind", "gaussian"),
        ({"kind": "stack", "defenses": []}, "stack.defenses", None),
        ({"kind": "stack", "defenses": [{"kind": "sign"}, {"kind": "gaussian", "sigma": -1}]}, "[1] gaussian.sigma", "(0, 1e6]"),
    ],
)
def test_bad_configs_name_the_field_and_range(cfg, field, allowed):
    with pytest.raises(ConfigError) as info:
        from_config(cfg)
    msg = str(info.value)
    assert field in msg and "\n" not in msg
    if allowed:
        assert allowed in msg


@given(ratio=st.one_of(st.floats(max_value=-1e-9), st.floats(min_value=1.0)).filter(lambda x: x == x))
def test_any_out_of_range_ratio_is_refused(ratio):
    with pytest.raises(ConfigError, match="gradprune.ratio"):
        from_config({"kind": "gradprune", "ratio": ratio})


def test_non_mapping_and_bad_yaml():
    with pytest.raises(ConfigError, match="expected a mapping"):
        parse_config("[1, 2]")
    with pytest.raises(ConfigError, match="not valid YAML"):
        parse_config("kind: [unclosed\n")
    with pytest.raises(ConfigError, match="not found"):
        parse_config("missing.yaml")


def test_configs_are_frozen():
    d = from_config({"kind": "gradprune", "ratio": 0.9})
    with pytest.raises(Exception):
        d.config.ratio = 0.1


@pytest.mark.parametrize("config, random", [
    ({"kind": "identity"}, False), ({"kind": "gradprune", "ratio": 0.5}, False), ({"kind": "sign"}, False),
    ({"kind": "gaussian", "sigma": 0.1}, True), ({"kind": "laplace", "scale": 0.1}, True), ({"kind": "outpost"}, True),
    ({"kind": "stack", "defenses": [{"kind": "gradprune", "ratio": 0.5}, {"kind": "sign"}]}, False),
    ({"kind": "stack", "defenses": [{"kind": "gradprune", "ratio": 0.5}, {"kind": "gaussian", "sigma": 0.1}]}, True),
])
def test_randomized_declares_whether_two_applications_can_differ(config, random):
    """The red team's learned attacks redraw randomised defenses only: the flag must tell the truth."""
    import torch

    defense = from_config(config)
    assert defense.randomized is random
    g = [torch.randn(30, 20, generator=torch.Generator().manual_seed(0)), torch.randn(20)]
    p = [torch.randn(30, 20), torch.randn(20)]
    a, _ = defense(g, p)
    b, _ = defense(g, p)
    assert (not all(torch.equal(u, v) for u, v in zip(a, b))) is random
