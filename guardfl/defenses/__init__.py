"""Gradient defenses. Each is one class with a pydantic config (``.config``) and a registry entry.

>>> import torch
>>> from guardfl.defenses import GradPrune, Outpost, Stack, from_config, untouched_layers
>>> d = from_config({"kind": "gradprune", "ratio": 0.9})
>>> d
GradPrune(ratio=0.9)
>>> Stack(GradPrune(0.9), Outpost()).config.kind
'stack'
>>> [u.name for u in untouched_layers(d, torch.nn.Linear(4, 1))]   # the tensors this setting never changes
['bias']
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
