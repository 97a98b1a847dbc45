"""Defense randomness from OS entropy fills the CPU generator's whole mt19937 state: torch keeps only 32
bits of a seed, so a seeded-from-entropy stream would be one of 2**32 an attacker could try."""

import torch

from guardfl.defenses import GaussianNoise, GradPrune, Stack
from guardfl.defenses.base import make_generator


def _mt_words(gen: torch.Generator) -> list[int]:
    words = torch.frombuffer(bytearray(gen.get_state().numpy().tobytes()), dtype=torch.int64)
    return [int(w) for w in words[3 : 3 + 624]]


def _seeded_by_32_bits(words: list[int]) -> bool:
    """mt19937's init_genrand: word i+1 is a function of word i alone."""
    return all(words[i + 1] == (1812433253 * (words[i] ^ (words[i] >> 30)) + i + 1) & 0xFFFFFFFF for i in range(3))


def test_a_seeded_generator_is_mt19937_init_and_an_entropy_one_is_not():
    assert _seeded_by_32_bits(_mt_words(make_generator("cpu", 123)))
    assert not _seeded_by_32_bits(_mt_words(make_generator("cpu", None)))
    a, b = make_generator("cpu", None), make_generator("cpu", None)
    assert not torch.equal(torch.randn(8, generator=a), torch.randn(8, generator=b))
    assert torch.equal(torch.randn(8, generator=make_generator("cpu", 5)), torch.randn(8, generator=make_generator("cpu", 5)))


def test_defenses_and_stack_members_without_a_seed_use_the_full_state():
    noise = GaussianNoise(0.1)
    assert not _seeded_by_32_bits(_mt_words(noise.generator("cpu")))
    stack = Stack(GradPrune(0.5), GaussianNoise(0.1))
    assert not _seeded_by_32_bits(_mt_words(stack.members[1].generator("cpu")))
    seeded = Stack(GradPrune(0.5), GaussianNoise(0.1), seed=7)
    assert _seeded_by_32_bits(_mt_words(seeded.members[1].generator("cpu")))  # reproducible on request
    noise.reseed(None)
    assert not _seeded_by_32_bits(_mt_words(noise.generator("cpu")))
    noise.reseed(11)
    assert _seeded_by_32_bits(_mt_words(noise.generator("cpu")))
