"""Gradient defenses. Each is one class with a pydantic config (``.config``) and a registry entry.

>>> from guardfl.defenses import GradPrune, Outpost, Stack, from_config
>>> d = from_config({"kind": "gradprune", "ratio": 0.9})
>>> untouched_layers(d, model)   # the parameter tensors this setting never changes, with the reason
"""

from guardfl.defenses.base import REGISTRY, Defense, DefenseConfig, StepContext, register
from guardfl.defenses.coverage import Untouched, untouched_layers
from guardfl.defenses.dpsgd import DPSGD
from guardfl.defenses.encoding import InstaHide, MixUp
from guardfl.defenses.graddefense import GradDefense
from guardfl.defenses.identity import Identity
from guardfl.defenses.noise import GaussianNoise, LaplaceNoise
from guardfl.defenses.outpost import Outpost
from guardfl.defenses.prune import GradPrune
from guardfl.defenses.registry import available, from_config, parse_config
from guardfl.defenses.sign import SignCompression
from guardfl.defenses.soteria import Soteria
from guardfl.defenses.stack import Stack

__all__ = [
    "REGISTRY",
    "DPSGD",
    "Defense",
    "DefenseConfig",
    "GaussianNoise",
    "GradDefense",
    "GradPrune",
    "Identity",
    "InstaHide",
    "LaplaceNoise",
    "MixUp",
    "Outpost",
    "SignCompression",
    "Soteria",
    "Stack",
    "StepContext",
    "Untouched",
    "available",
    "from_config",
    "parse_config",
    "register",
    "untouched_layers",
]
