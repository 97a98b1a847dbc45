"""The defense as the attacker builds it from the configuration it knows (its leaves, stages, partners).

The attacker knows a client's defense configuration, never its randomness nor its files: it builds the
defense from the configuration (seeds removed by the caller, ``threat.unseeded``), and an Inter-InstaHide
leaf mixes with the attacker's own partner images instead of the client's ``public`` file.
"""

from __future__ import annotations

from torch import Tensor

from guardfl.defenses import REGISTRY, Defense, Stack, from_config, parse_config
from guardfl.defenses.encoding import InstaHide
from guardfl.errors import ConfigError


def defense_leaves(config: dict | None) -> list[type[Defense]]:
    """The classes of the leaf defenses of a configuration (a stack expanded at every depth); nothing is
    built, so no randomness is drawn and no public data loaded."""
    return [REGISTRY[leaf.kind] for leaf in parse_config(config).leaves()] if config else []


def config_stages(config: dict | None) -> set[str]:
    """The stages ("gradient", "dp", "input") a defense configuration acts at (empty for none)."""
    return {leaf.stage for leaf in defense_leaves(config)}


def _inter_instahide(config: dict) -> bool:
    if config.get("kind") == "stack":
        return any(_inter_instahide(m) for m in config.get("defenses", []))
    return config.get("kind") == "instahide" and config.get("mode") == "inter"


def attacker_defense(config: dict, public: Tensor | None) -> Defense:
    """The defense of ``config`` as the attacker builds it: from the configuration, except that an
    Inter-InstaHide leaf mixes with ``public`` (the attacker's partners) instead of loading the client's
    ``public`` file. ConfigError when such a leaf has no ``public``."""
    if not _inter_instahide(config):
        return from_config(config)
    if config.get("kind") == "stack":
        extra = {k: v for k, v in config.items() if k in ("nonfinite", "seed")}
        return Stack(*[attacker_defense(m, public) for m in config["defenses"]], **extra)
    if public is None:
        raise ConfigError("instahide.public: mode 'inter' mixes with a public set the attacker does not hold; pass "
                          "public= (the attacker's stand-in partners, e.g. its auxiliary images, or the client's set "
                          "when the attacker holds it)")
    return InstaHide(public=public, **{k: v for k, v in config.items() if k not in ("kind", "public")})
