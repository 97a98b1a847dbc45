"""The attacker's view of a known defense configuration: one table keyed by kind, every leaf of a stack."""

from guardfl.defenses import DPSGD, GaussianNoise, GradPrune, InstaHide, LaplaceNoise, Outpost, SignCompression, Stack
from guardfl.redteam.attacks.known_defense import RULES, KnownDefense, known_defense


def dump(defense):
    return defense.config


def test_none_is_nothing_known():
    assert known_defense(None) == KnownDefense()


def test_nested_stack_merges_every_leaf():
    k = known_defense(dump(Stack(Stack(GradPrune(0.9), GaussianNoise(0.1)), LaplaceNoise(0.2), SignCompression())))
    assert k.pruned and k.signed and not k.abs_tv
    assert abs(k.noise_var - (0.01 + 2 * 0.04)) < 1e-12
    assert known_defense(dump(Stack(GradPrune(0.9), GaussianNoise(0.1))).model_dump(mode="json")).pruned  # a dict is parsed


def test_outpost_without_pruning_is_not_pruned():
    assert not known_defense(dump(Outpost(prune=0.0))).pruned
    assert known_defense(dump(Outpost(prune=0.5))).pruned


def test_dpsgd_and_encoding_fields():
    k = known_defense(dump(Stack(InstaHide(k=4), DPSGD(noise_multiplier=0.5, max_grad_norm=2.0))))
    assert k.clip_norm == 2.0 and k.noise_multiplier == 0.5
    assert k.abs_tv and k.encoding.kind == "instahide" and k.encoding.k == 4


def test_every_rule_names_a_registered_defense():
    from guardfl.defenses import available

    assert set(RULES) <= set(available())
