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
#: the bounds of the red-team config's model section (``ModelSection``): what --input-shape and
#: --num-classes accept, checked before a model is built
MAX_CHANNELS, MAX_SIDE, MAX_CLASSES = 16, 1024, 100_000
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
    shape = _bounded_shape(*((input_shape, "--input-shape") if input_shape is not None else
                             (model_section.get("input_shape"), "model.input_shape")))
    classes = _bounded_classes(*((num_classes, "--num-classes") if num_classes is not None else
                                 (model_section.get("num_classes"), "model.num_classes")))
    net = _build(name, shape, classes)
    defense.check_model(net)
    untouched = untouched_layers(defense, net)
    summary += f" on {name} (input {'x'.join(map(str, shape))}, {classes} classes)"
    if defense.kind == "identity":
        return summary, [f"{name}: identity: no defense, every parameter tensor is sent as it is"]
    numel = {n: p.numel() for n, p in net.named_parameters()}
    return summary, [f"{name}: {u.name} ({_entries(numel[u.name])}) is never changed: {u.reason}" for u in untouched]


def _bounded_shape(shape, field: str) -> tuple[int, int, int]:
    """The input shape to build the model with (``DEFAULT_INPUT_SHAPE`` when None): [C, H, W] with C in
    [1, 16], H and W in [1, 1024] (the red-team config's upper bounds; a model of the user's may take
    inputs smaller than the red team's 4 x 4), else a one-line ConfigError."""
    if shape is None:
        return DEFAULT_INPUT_SHAPE
    ok = (isinstance(shape, (list, tuple)) and len(shape) == 3
          and all(isinstance(v, int) and not isinstance(v, bool) for v in shape))
    if not ok or not (1 <= shape[0] <= MAX_CHANNELS and all(1 <= v <= MAX_SIDE for v in shape[1:])):
        raise ConfigError(f"{field}: expected C H W with C in [1, {MAX_CHANNELS}], H and W in [1, {MAX_SIDE}] "
                          f"(got {list(shape) if isinstance(shape, (list, tuple)) else shape!r})")
    return tuple(shape)


def _bounded_classes(classes, field: str) -> int:
    """The classes to build the model with (``DEFAULT_NUM_CLASSES`` when None): an integer in [2,
    100000], never replaced silently (0 used to become 10)."""
    if classes is None:
        return DEFAULT_NUM_CLASSES
    if not isinstance(classes, int) or isinstance(classes, bool) or not 2 <= classes <= MAX_CLASSES:
        raise ConfigError(f"{field}: expected an integer in [2, {MAX_CLASSES}] (got {classes!r})")
    return classes


def _entries(n: int) -> str:
    return f"{n} entry" if n == 1 else f"{n} entries"


def _build(name: str, shape: tuple[int, ...], classes: int):
    from guardfl.redteam.modality.image.models import build_model

    if len(shape) != 3:
        raise ConfigError(f"model.input_shape: expected [C, H, W] (got {list(shape)})")
    try:
        return build_model(name, shape, int(classes))
    except (ValueError, GuardflError) as err:  # unknown name; a user factory's failure, already one line
        raise ConfigError(str(err)) from None
    except Exception as err:  # anything else: one line, not a traceback
        raise ConfigError(f"model.name: building {name!r} failed: {type(err).__name__}: {err}") from None
