"""The sweep configuration (``guardfl sweep --config sweep.yaml``): a red-team config, the defense
settings to try (axes), and the utility task that prices each setting.

    base: default.yaml            # a red-team config (path relative to this file) or a mapping
    override: {certify: {max_updates: 8}}   # deep-merged into the base (optional)
    axes:
      - defense: {kind: gradprune}      # the template; ``param`` is filled in per point
        param: ratio                    # a dotted path into the template (``defenses.1.sigma`` in a stack)
        values: [0.5, 0.7, 0.9, 0.99]   # or range: {start: 0.5, stop: 0.99, num: 8, scale: linear}
    utility: {source: lfw-detection, train: 150, test: 50, epochs: 5}
    autotune: true                # bisect each monotone axis instead of evaluating the whole grid
    max_points: 256               # the most settings over all axes (default 256, at most 2000)

Parsed here, once, at the edge: every point's defense and red-team config is validated when the sweep
config is loaded, so an axis value outside the defense's range fails before anything runs, with the
defense's own one-line error (prefixed with the axis it came from).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_validator, model_validator

from guardfl.config import StrictModel, validate
from guardfl.defenses.registry import parse_config
from guardfl.errors import ConfigError
from guardfl.redteam import modality
from guardfl.redteam.modality import SOURCES, UTILITY_SOURCES
from guardfl.yamlio import load_yaml

if TYPE_CHECKING:
    from guardfl.redteam.config import RedTeamConfig

#: which way each known defense parameter makes the defense stronger (more private): what autotune bisects
STRONGER: dict[tuple[str, str], str] = {
    ("gradprune", "ratio"): "higher",
    ("gaussian", "sigma"): "higher",
    ("laplace", "scale"): "higher",
    ("dpsgd", "noise_multiplier"): "higher",
    ("dpsgd", "max_grad_norm"): "lower",
    ("dpsgd", "target_epsilon"): "lower",
    ("outpost", "noise"): "higher",
    ("outpost", "prune"): "higher",
    ("outpost", "phi"): "higher",
    ("soteria", "prune"): "higher",
    ("mixup", "k"): "higher",
    ("instahide", "k"): "higher",
}

#: a sweep's settings (values summed over its axes): at most ``max_points`` (default DEFAULT_MAX_POINTS,
#: never more than MAX_POINTS): checked when the sweep config is loaded, before any point is validated or run
DEFAULT_MAX_POINTS = 256
MAX_POINTS = 2000


class RangeSpec(StrictModel):
    """``num`` values from ``start`` to ``stop`` (both included), evenly spaced or log-spaced."""

    start: float
    stop: float
    num: int = Field(ge=2, le=200, json_schema_extra={"allowed": "an integer in [2, 200]"})
    scale: Literal["linear", "log"] = Field(default="linear", json_schema_extra={"allowed": "'linear' or 'log'"})

    @model_validator(mode="after")
    def _log_positive(self) -> "RangeSpec":
        if self.scale == "log" and (self.start <= 0 or self.stop <= 0):
            raise ValueError(f"a log range needs start and stop > 0 (got {self.start}, {self.stop})")
        return self

    def values(self) -> list[float]:
        if self.scale == "log":
            lo, hi = math.log(self.start), math.log(self.stop)
            return [float(f"{math.exp(lo + (hi - lo) * i / (self.num - 1)):.6g}") for i in range(self.num)]
        return [float(f"{self.start + (self.stop - self.start) * i / (self.num - 1):.6g}") for i in range(self.num)]


class AxisSection(StrictModel):
    """One series of the sweep: a defense template and the values of one of its parameters."""

    defense: dict[str, Any]
    param: str = Field(min_length=1, json_schema_extra={"allowed": "a dotted path into the defense, e.g. ratio or defenses.1.sigma"})
    values: list[int | float] | None = Field(default=None, min_length=1, max_length=200,
                                             json_schema_extra={"allowed": "1 to 200 numbers"})
    range: RangeSpec | None = None
    #: which way the parameter makes the defense stronger; null: guardfl's table (``STRONGER``), and
    #: 'none' when it is not there (no bisection: the axis's whole grid is evaluated)
    stronger: Literal["higher", "lower", "none"] | None = Field(default=None, json_schema_extra={
        "allowed": "null (from guardfl's table), 'higher', 'lower' or 'none' (not monotone)"})
    label: str | None = Field(default=None, max_length=80, json_schema_extra={"allowed": "null or up to 80 characters"})

    @model_validator(mode="after")
    def _one_grid(self) -> "AxisSection":
        if (self.values is None) == (self.range is None):
            raise ValueError("give exactly one of values (a list) or range ({start, stop, num, scale})")
        return self

    def grid(self) -> list[int | float]:
        return list(self.values) if self.values is not None else self.range.values()

    def direction(self) -> str:
        if self.stronger is not None:
            return self.stronger
        kind = self.defense.get("kind")
        return STRONGER.get((kind, self.param), "none") if kind != "stack" else _stack_direction(self.defense, self.param)

    def name(self) -> str:
        return self.label or f"{self.defense.get('kind')}.{self.param}"


def _stack_direction(template: dict, param: str) -> str:
    """A stack member's parameter (``defenses.I.name``): that member's direction."""
    parts = param.split(".")
    if len(parts) == 3 and parts[0] == "defenses" and parts[1].isdigit():
        members = template.get("defenses") or []
        i = int(parts[1])
        if i < len(members) and isinstance(members[i], dict):
            return STRONGER.get((members[i].get("kind"), parts[2]), "none")
    return "none"


class UtilitySection(StrictModel):
    """The utility task: the base config's model trained with each defense through the real client path
    (``local_update``, so ``protect``: DP-SGD with its accounting, input encodings), tested on held-out data."""

    source: str = Field(default="lfw-detection", json_schema_extra={"allowed": ", ".join(UTILITY_SOURCES)})
    root: str | None = None
    path: str | None = None
    download: bool = False
    image_size: int | None = Field(default=None, ge=4, le=1024, json_schema_extra={"allowed": "null or an integer in [4, 1024]"})
    #: text: tokens per sample (null: the base config's data.seq_len), the tokenizer (null: the base's)
    seq_len: int | None = Field(default=None, ge=2, le=4096, json_schema_extra={"allowed": "null or an integer in [2, 4096]"})
    split: Literal["train", "validation", "test"] = Field(default="train", json_schema_extra={
        "allowed": "'train', 'validation' or 'test' (wikitext / cola)"})
    #: examples to train on and held-out examples to test on (shuffled with ``seed``, disjoint)
    train: int = Field(default=150, ge=1, le=10_000_000, json_schema_extra={"allowed": "an integer in [1, 10000000]"})
    test: int = Field(default=50, ge=1, le=10_000_000, json_schema_extra={"allowed": "an integer in [1, 10000000]"})
    epochs: int = Field(default=5, ge=1, le=1000, json_schema_extra={"allowed": "an integer in [1, 1000]"})
    batch_size: int = Field(default=16, ge=1, le=65536, json_schema_extra={"allowed": "an integer in [1, 65536]"})
    lr: float = Field(default=0.05, gt=0, le=100, json_schema_extra={"allowed": "finite, in (0, 100]"})
    momentum: float = Field(default=0.9, ge=0, lt=1, json_schema_extra={"allowed": "[0, 1)"})
    seed: int = Field(default=0, ge=0, le=2**32 - 1, json_schema_extra={"allowed": "an integer in [0, 2**32 - 1]"})
    #: trainings per setting (seeds ``seed`` .. ``seed + repeats - 1``: initialisation and batch order; the
    #: split stays): accuracy is their mean, so that a small test set's noise does not pick the setting
    repeats: int = Field(default=3, ge=1, le=100, json_schema_extra={"allowed": "an integer in [1, 100]"})
    metric: Literal["accuracy"] = Field(default="accuracy", json_schema_extra={
        "allowed": "'accuracy' (held-out; a causal LM's next-token accuracy)"})

    @field_validator("source")
    @classmethod
    def _source(cls, source: str) -> str:
        if source in SOURCES and SOURCES[source].synthetic_labels:
            raise ValueError(f"{source} carries synthetic labels (i % num_classes), so accuracy on it measures nothing; "
                             f"the built-in labelled task is lfw-detection (faces vs non-faces); allowed: {', '.join(UTILITY_SOURCES)}")
        if source not in UTILITY_SOURCES:
            raise ValueError(f"unknown source {source!r}; allowed: {', '.join(UTILITY_SOURCES)}")
        return source


class SweepConfig(StrictModel):
    base: str | dict[str, Any] = Field(json_schema_extra={"allowed": "a red-team config: a path (relative to the sweep file) or a mapping"})
    override: dict[str, Any] = Field(default_factory=dict)
    axes: list[AxisSection] = Field(min_length=1, max_length=32, json_schema_extra={"allowed": "1 to 32 axes"})
    utility: UtilitySection = Field(default_factory=UtilitySection)
    #: bisect each monotone axis for its weakest certifying setting instead of evaluating the whole grid
    autotune: bool = True
    #: what a point must show to be chosen: ``certified`` (the red team's empirical verdict), ``proven`` (the
    #: certificate's proven bound below ``certify.max_leak_rate``: ``guardfl.bounds``; the bound falls
    #: monotonically with the noise, so autotune's bisection is exact for it), or ``both``
    require: Literal["certified", "proven", "both"] = Field(
        default="certified", json_schema_extra={"allowed": "'certified', 'proven' or 'both'"})
    #: also red-team the undefended client (a reference point on the plot; the utility baseline always runs)
    redteam_baseline: bool = False
    #: seeds every point's defense (unless its template has a seed): a sweep reproduces, and its
    #: results do not depend on the backend or worker count. The chosen defense YAML drops it (a deployed
    #: defense draws from OS entropy).
    seed: int = Field(default=0, ge=0, le=2**32 - 1, json_schema_extra={"allowed": "an integer in [0, 2**32 - 1]"})
    #: the most settings (values summed over the axes) the sweep may hold: each one can be a red-team run
    #: and a utility training. The default refuses a typo'd grid; raise it explicitly, up to MAX_POINTS.
    max_points: int = Field(default=DEFAULT_MAX_POINTS, ge=1, le=MAX_POINTS,
                            json_schema_extra={"allowed": f"an integer in [1, {MAX_POINTS}]"})

    @model_validator(mode="after")
    def _bounded_grid(self) -> "SweepConfig":
        total = sum(len(a.values) if a.values is not None else a.range.num for a in self.axes)
        if total > self.max_points:
            raise ValueError(f"axes: {total} settings on {len(self.axes)} axes (each a red-team run and a utility "
                             f"training); allowed: at most max_points = {self.max_points} (raise max_points explicitly, "
                             f"up to {MAX_POINTS}, or use fewer values)")
        return self


@dataclass(frozen=True)
class Point:
    """One setting to evaluate: axis ``axis``'s ``index``-th value (axes ordered weak to strong when monotone)."""

    axis: int
    index: int
    value: int | float
    #: the defense as deployed (the template with the value; no seed unless the template had one)
    defense: dict[str, Any] | None
    #: the red-team config of this point (the base with ``defense`` seeded for reproducibility), validated once
    redteam: RedTeamConfig

    @property
    def id(self) -> str:
        return "baseline" if self.axis < 0 else f"a{self.axis}-v{self.index}"


@dataclass(frozen=True)
class SweepPlan:
    config: SweepConfig
    base: dict[str, Any]  # the validated red-team base (the merged, resolved mapping)
    axes: list[list[Point]]  # per axis, its points ordered weak -> strong (grid order for 'none')
    directions: list[str]
    baseline: Point
    digest: str
    source: str | None  # the sweep file, when read from one


def deep_merge(base: dict, override: dict) -> dict:
    """``base`` with ``override`` merged in (mappings merge key by key; anything else replaces)."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def set_path(template: dict, path: str, value: Any, where: str) -> dict:
    """A copy of ``template`` with the dotted ``path`` set to ``value`` (integers index lists)."""
    out = copy.deepcopy(template)
    node: Any = out
    parts = path.split(".")
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"{where}.param: {path!r}: {'.'.join(parts[:i]) or 'the defense'} is a list of "
                                  f"{len(node)}; expected an index in [0, {len(node) - 1}] at {part!r}")
            if last:
                node[int(part)] = value
            node = node[int(part)]
        elif isinstance(node, dict):
            if last:
                node[part] = value
            else:
                if part not in node:
                    raise ConfigError(f"{where}.param: {path!r}: the template has no {'.'.join(parts[:i + 1])!r}")
                node = node[part]
        else:
            raise ConfigError(f"{where}.param: {path!r}: {'.'.join(parts[:i])!r} is a value, not a mapping or list")
    return out


def _seeded(defense: dict, seed: int) -> dict:
    """The defense with ``seed`` when its template has none (stack members derive theirs from it)."""
    return defense if defense.get("seed") is not None else {**defense, "seed": seed}


def point_seed(sweep_seed: int, axis: int, index: int) -> int:
    """A point's defense seed: from the sweep's seed and the point only (never the backend or worker)."""
    digest = hashlib.sha256(f"{sweep_seed}:{axis}:{index}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def load_sweep(source: str | Path | dict) -> SweepPlan:
    """Read and validate a sweep config; every point's defense and red-team config is validated here
    (ConfigError with one line naming the axis and the field otherwise)."""
    from guardfl.redteam.config import load_config

    data, path = _read(source)
    cfg = validate(SweepConfig, data, prefix="sweep")
    merged = deep_merge(_base_data(cfg, path), cfg.override)
    try:
        base_cfg = load_config({**merged, "defense": None})
    except ConfigError as err:
        raise ConfigError(f"sweep.base: {err}") from None
    base = base_cfg.model_dump(mode="json")
    _check_base(cfg, base)
    axes, directions = [], []
    for a, axis in enumerate(cfg.axes):
        points, direction = _axis_points(cfg, a, axis, base)
        axes.append(points)
        directions.append(direction)
    baseline = Point(-1, 0, 0, None, base_cfg)  # its defense is None
    digest = hashlib.sha256(json.dumps(
        {"sweep": cfg.model_dump(mode="json", exclude={"base", "override", "max_points"}), "base": base}, sort_keys=True,
        default=str).encode()).hexdigest()[:16]
    return SweepPlan(cfg, base, axes, directions, baseline, digest, str(path) if path else None)


def _read(source: str | Path | dict) -> tuple[dict, Path | None]:
    """The sweep config's data (a mapping) and the file it came from (None for a dict)."""
    path = None
    if isinstance(source, dict):
        data = source
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"sweep config not found: {source}")
        data = load_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError(f"sweep: expected a mapping at the top level, got {type(data).__name__}")
    return data, path


def _base_data(cfg: SweepConfig, path: Path | None) -> dict:
    """The base red-team config as data: given inline, or read from ``sweep.base`` (a path relative to the
    sweep config's folder)."""
    if not isinstance(cfg.base, str):
        return cfg.base
    base_path = Path(cfg.base)
    if not base_path.is_absolute() and path is not None:
        base_path = path.parent / base_path
    if not base_path.is_file():
        raise ConfigError(f"sweep.base: red-team config not found: {cfg.base} (looked at {base_path})")
    base_data = load_yaml(base_path)
    if not isinstance(base_data, dict):
        raise ConfigError(f"sweep.base: {base_path} is not a mapping")
    return base_data


def _check_base(cfg: SweepConfig, base: dict) -> None:
    """Refuse a base the sweep cannot run: an unknown model, utility data of the other kind than the
    base's (text or images), a text file too large, or a target (the user's own client code)."""
    _known_model(base["model"]["name"])
    kind_base, kind_task = modality.of(base), modality.for_source(cfg.utility.source)
    if kind_base is not kind_task:
        raise ConfigError(f"sweep.utility.source: {cfg.utility.source!r} is {kind_task.noun} but the "
                          f"base's data ({base['data']['source']!r}) is {kind_base.noun}; the utility "
                          "task trains the base's model, so it needs data of the same kind")
    if cfg.utility.path is not None:
        kind_task.check_path(cfg.utility.path, "sweep.utility.path")  # read whole by every point's training
    if base.get("target") is not None:
        raise ConfigError("sweep.base: a target (the user's own client code) cannot be swept: guardfl cannot change "
                          "the defense inside it; describe the client instead (model, data, client sections)")


def _axis_points(cfg: SweepConfig, a: int, axis: AxisSection, base: dict) -> tuple[list[Point], str]:
    """Axis ``a``'s points, weak to strong (each with its deployed defense and its validated red-team
    config, seeded from the sweep's seed and the point), and its direction."""
    from guardfl.redteam.config import load_config

    where = f"sweep.axes.{a}"
    direction = axis.direction()
    grid = axis.grid()
    if len(set(grid)) != len(grid):
        field = "values" if axis.values is not None else "range"
        why = "" if axis.values is not None else " (the range's values, rounded to 6 significant digits)"
        raise ConfigError(f"{where}.{field}: repeated values {grid}{why}; allowed: distinct values")
    if direction != "none":
        grid = sorted(grid, reverse=direction == "lower")  # weak -> strong
    points = []
    for i, value in enumerate(grid):
        defense = set_path(axis.defense, axis.param, value, where)
        try:
            defense = parse_config(defense).model_dump(mode="json", exclude_unset=False)
        except ConfigError as err:
            raise ConfigError(f"{where} ({axis.param} = {value}): {err}") from None
        deployed = _strip_defaults(defense, axis.defense)
        red = {**base, "defense": _seeded(defense, point_seed(cfg.seed, a, i))}
        try:
            red = load_config(red)
        except ConfigError as err:
            raise ConfigError(f"{where} ({axis.param} = {value}): {err}") from None
        points.append(Point(a, i, value, deployed, red))
    return points, direction


def _known_model(name: str) -> None:
    """A built-in model name must exist (a 'module:callable' is imported when a point runs)."""
    known = {known for m in modality.MODALITIES.values() for known in m.models}
    if ":" not in name and name not in known:
        raise ConfigError(f"sweep.base: model.name: unknown model {name!r}; allowed: "
                          f"{', '.join(sorted(known))} or 'module:callable'")


def _strip_defaults(defense: dict, template: dict) -> dict:
    """The deployed defense: the validated config, without the seed the sweep adds (unless the template
    had one: then it is the user's)."""
    out = dict(defense)
    if template.get("seed") is None:
        out.pop("seed", None)
    return out
