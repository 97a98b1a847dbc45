"""What an attacker who knows the defense's configuration builds into its objective: one table keyed by
defense kind.

``known_defense(config)`` walks the leaves of the configuration (a stack at any depth) and merges what each
kind's rule says into one ``KnownDefense``; the engines read its fields, never defense names. A new defense
is one new entry in ``RULES`` (a kind without an entry adds nothing: the attack treats that stage as
unknown perturbation, which the scale-free cosine distance tolerates).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from guardfl.defenses import DefenseConfig
from guardfl.redteam.threat import defense_kinds


@dataclass(frozen=True)
class KnownDefense:
    #: the update is sign-compressed: hinge loss on signs (one sample) or a tanh surrogate in each step
    signed: bool = False
    #: entries are zeroed: compare only where the observed update is non-zero (Wu et al. 2023)
    pruned: bool = False
    #: input sign flips (InstaHide): total variation on |x| (Huang et al. 2021, Sec. 4)
    abs_tv: bool = False
    #: per-entry variance of known i.i.d. additive noise per local step (Gaussian sigma^2, Laplace 2 b^2)
    noise_var: float = 0.0
    #: DP-SGD: per-sample clipping norm C (the replica clips each sample's gradient to C)
    clip_norm: float | None = None
    #: DP-SGD noise multiplier (noise std = multiplier * C on the summed gradient)
    noise_multiplier: float | None = None
    #: an input encoding's config (MixUp / InstaHide): attacks reconstruct encodings, then demix
    encoding: DefenseConfig | None = None


def _outpost(c: DefenseConfig) -> dict:
    return {"pruned": c.prune > 0}


def _dpsgd(c: DefenseConfig) -> dict:
    return {"clip_norm": float(c.max_grad_norm), "noise_multiplier": c.noise_multiplier}


#: kind -> the fields its (parsed) configuration sets (noise variances add up across stages)
RULES: dict[str, Callable[[DefenseConfig], dict]] = {
    "sign": lambda c: {"signed": True},
    "gradprune": lambda c: {"pruned": True},
    "soteria": lambda c: {"pruned": True},  # zeroed columns of one layer: compare the kept coordinates
    "outpost": _outpost,
    "gaussian": lambda c: {"noise_var": float(c.sigma) ** 2},
    "laplace": lambda c: {"noise_var": 2 * float(c.scale) ** 2},
    "dpsgd": _dpsgd,
    "mixup": lambda c: {"encoding": c},
    "instahide": lambda c: {"encoding": c, "abs_tv": True},
}


def known_defense(config: DefenseConfig | dict | None) -> KnownDefense:
    """What the known configuration ``config`` (None: unknown or no defense) tells the attacker."""
    known = KnownDefense()
    for leaf in defense_kinds(config):
        rule = RULES.get(leaf.kind)
        if rule is None:
            continue
        fields = rule(leaf)
        if "noise_var" in fields:
            fields["noise_var"] += known.noise_var
        known = replace(known, **fields)
    return known
