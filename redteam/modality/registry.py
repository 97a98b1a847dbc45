"""The modality registry: what differs between images and text, looked up by name, source or config.

Each modality (``modality/image``, ``modality/text``) registers one frozen :class:`Modality` when the
package is imported; code outside ``modality/`` asks it (``for_source(name)``, ``of(cfg)``, ``get(name)``)
instead of branching on the modality's name. Registering a name twice is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from guardfl.errors import ConfigError
from guardfl.redteam.modality.sources import SOURCES

#: the modality of a config or observation that names none (the red team's first modality)
DEFAULT = "image"


@dataclass(frozen=True)
class Recovery:
    """How a certificate counts the private samples that came back: past the main threshold, and exactly."""

    #: the main per-sample metric, and its ``certify`` config field (``above_max_<metric>`` counts those past it)
    metric: str
    threshold: str
    #: a sample came back exactly when ``exact_metric`` is at least ``exact_at``
    exact_metric: str
    exact_at: float


@dataclass(frozen=True, eq=False, repr=False)
class Modality:
    """One modality: its sample unit, its per-sample thresholds, and the hooks the red team calls."""

    name: str
    #: one sample and several, in messages and reports ("image" / "images", "sequence" / "sequences")
    unit: str
    units: str
    #: the data, in messages ("images" / "text")
    noun: str
    #: a model of it, in messages ("an image model" / "a text model")
    model_kind: str
    #: per-sample thresholds: metric -> (``certify`` config field, "max" when a larger value leaks more),
    #: in order of preference (the sweep plots the first the base config thresholds)
    thresholds: Mapping[str, tuple[str, str]]
    #: the built-in model names of this modality (``model.name``)
    models: frozenset[str]
    #: inputs are token ids (a tokenizer, sequences), not float tensors
    tokenized: bool
    #: (section, num_classes=, limit=, field=, image_size=, seq_len=, tokenizer=, task=) -> (inputs, targets)
    loader: Callable[..., Any]
    #: the model's inputs for the attacker's variables: x -> (args, kwargs) of the forward call
    model_inputs: Callable[[Any], tuple[tuple, dict]]
    #: the client's training loss on the model's logits and (possibly soft) targets
    loss: Callable[[Any, Any], Any]
    #: the tokenizer's vocabulary size a built-in model is made for (``data.tokenizer`` -> int; images: None)
    vocab_size: Callable[[str], Any]
    #: (path, field) -> None, or a one-line ConfigError when the file at ``path`` is too large to read whole
    check_path: Callable[[Any, str], None]
    #: (reconstruction, inputs, labels, input_range=, lpips_weights=, tokenizer=) -> {"per_image", "summary"}:
    #: the per-sample metrics of a reconstruction (a ``Reconstruction`` or a tensor) against the private batch
    evaluate: Callable[..., dict]
    #: the certificate's count of recovered samples (``certification.measure.recovered``)
    recovery: Recovery
    #: (name, num_classes, tokenizer=, seq_len=) -> the client's model when it is built before its data and
    #: its task picks the samples (text); None when the data's shape builds it (images)
    client_model: Callable[..., Any]
    #: model -> True when the client's targets are its private inputs (a causal LM's next tokens): granting
    #: the attacker the labels would grant it the answer
    targets_are_inputs: Callable[[Any], bool]
    #: the targets are class labels the red team checks against ``model.num_classes`` (text: the loader
    #: checks a classifier's, and a causal LM's are tokens)
    class_labels: bool = True
    #: what only images support: OOD pseudo-data (LTI-OOD's DCT images), the user's own client code as a
    #: target, the client's inspection of the model, input encodings (convex combinations of inputs)
    ood: bool = True
    targets: bool = True
    inspection: bool = True
    encodings: bool = True

    def __repr__(self) -> str:
        return f"Modality({self.name!r})"

    @property
    def plot_metrics(self) -> list[tuple[str, str]]:
        """(metric, certify field) in order of preference: the sweep's plot shows the first thresholded."""
        return [(metric, config_field) for metric, (config_field, _) in self.thresholds.items()]

    def load(self, section: Any, **options: Any) -> tuple[Any, Any]:
        """The tensors of a source section (``data``, ``aux``, ``sweep.utility``): :attr:`loader`."""
        return self.loader(section, **options)


MODALITIES: dict[str, Modality] = {}


def register(modality: Modality) -> Modality:
    """Add ``modality`` to the registry; a name registered twice is refused (ValueError)."""
    if modality.name in MODALITIES:
        raise ValueError(f"modality {modality.name!r} is already registered")
    MODALITIES[modality.name] = modality
    return modality


def get(name: str) -> Modality:
    """The modality called ``name``; a one-line ConfigError for an unknown one."""
    try:
        return MODALITIES[name]
    except KeyError:
        raise ConfigError(f"modality: unknown modality {name!r}; allowed: {', '.join(MODALITIES)}") from None


def for_source(name: str) -> Modality:
    """The modality of the data source ``name`` (:data:`~guardfl.redteam.modality.sources.SOURCES`)."""
    source = SOURCES.get(name)
    if source is None:
        raise ConfigError(f"data.source: unknown source {name!r}; allowed: {', '.join(SOURCES)}")
    return get(source.modality)


def for_model(name: str) -> Modality:
    """The modality of the built-in model ``name`` (an unknown name or ``module:callable``: the default)."""
    return next((m for m in MODALITIES.values() if name in m.models), get(DEFAULT))


def of(thing: Any) -> Modality:
    """The modality of an object that names one (``.modality``: an Observation, a Setting, a config) or of a
    config as a mapping (its ``data.source``; none: the default)."""
    name = getattr(thing, "modality", None)
    if isinstance(name, str):
        return get(name)
    if isinstance(thing, Mapping):
        source = (thing.get("data") or {}).get("source")
        return for_source(source) if source is not None else get(DEFAULT)
    raise TypeError(f"no modality for {type(thing).__name__}")
