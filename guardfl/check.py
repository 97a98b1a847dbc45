"""``guardfl check``: validate a defense config and, given a model, name the layers it never changes.

The config is a defense YAML file, or a red-team config whose ``defense`` section is checked (against its
``model`` when that is a built-in model: a ``module:callable`` model is code and is only built when named
with ``--model``). Zero-strength settings fail to parse (one line, pointing to ``Identity()``); with a
model, every parameter tensor the setting can never change is a warning
(``guardfl.defenses.untouched_layers``).
"""

from __future__ import annotations

from pathlib import Path

from guardfl.defenses import from_config, untouched_layers
from guardfl.errors import ConfigError, GuardflError
from guardfl.yamlio import load_yaml

#: the input shape and classes a model is built with when neither the config nor the caller gives them
DEFAULT_INPUT_SHAPE = (3, 32, 32)
DEFAULT_NUM_CLASSES = 10
#: top-level sections of a red-team config (``guardfl.redteam.config.RedTeamConfig``)
_REDTEAM_SECTIONS = {"model", "data", "client", "defense", "target", "attacks", "certify", "aux", "strength", "seed", "device"}


def check_config(
    path: str | Path,
    *,
    model: str | None = None,
    input_shape: tuple[int, int, int] | list[int] | None = None,
    num_classes: int | None = None,
) -> tuple[str, list[str]]:
    """``(summary, warnings)`` for the config in ``path``; ConfigError (one line) when it is invalid."""
    data = load_yaml(path)  # strict: duplicate keys, alias bombs, non-UTF-8, empty files are errors
    model_section: dict = {}
    if isinstance(data, dict) and "kind" not in data and set(data) & _REDTEAM_SECTIONS:  # a red-team config
        model_section = data.get("model") if isinstance(data.get("model"), dict) else {}
        if data.get("defense") is None:
            state = "defense: null" if "defense" in data else "no defense section"
            return f"no defense ({state})", ["no defense: every parameter tensor is sent as it is"]
        data = data["defense"]
    defense = from_config(data)
    summary = repr(defense)
    name = model
    if name is None:
        name = model_section.get("name")
        if isinstance(name, str) and ":" in name:
            return f"{summary} (model {name!r} is code and was not built: pass --model to check its layers)", []
    if not isinstance(name, str):
        return summary, []
    shape = tuple(input_shape or model_section.get("input_shape") or DEFAULT_INPUT_SHAPE)
    classes = num_classes or model_section.get("num_classes") or DEFAULT_NUM_CLASSES
    net = _build(name, shape, classes)
    defense.check_model(net)
    untouched = untouched_layers(defense, net)
    summary += f" on {name} (input {'x'.join(map(str, shape))}, {classes} classes)"
    if defense.kind == "identity":
        return summary, [f"{name}: identity: no defense, every parameter tensor is sent as it is"]
    numel = {n: p.numel() for n, p in net.named_parameters()}
    return summary, [f"{name}: {u.name} ({_entries(numel[u.name])}) is never changed: {u.reason}" for u in untouched]


def _entries(n: int) -> str:
    return f"{n} entry" if n == 1 else f"{n} entries"


def _build(name: str, shape: tuple[int, ...], classes: int):
    from guardfl.redteam.models import build_model

    if len(shape) != 3:
        raise ConfigError(f"model.input_shape: expected [C, H, W] (got {list(shape)})")
    try:
        return build_model(name, shape, int(classes))
    except (ValueError, GuardflError) as err:  # unknown name; a user factory's failure, already one line
        raise ConfigError(str(err)) from None
    except Exception as err:  # anything else: one line, not a traceback
        raise ConfigError(f"model.name: building {name!r} failed: {type(err).__name__}: {err}") from None
