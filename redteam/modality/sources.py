"""The one table of data sources: each source's modality and what it serves (red-team data, a utility task).

Every list of sources elsewhere (the config's allowed ``data.source``, a sweep's utility sources, the
torchvision classes, a text source's model task) is read from :data:`SOURCES`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Source:
    """One data source: its name, its modality (``image`` or ``text``) and what it serves."""

    name: str
    modality: str
    #: a red-team data source (the config's ``data`` / ``aux`` / ``aux.ood`` sections)
    data: bool = True
    #: a labelled source a sweep's utility task can train on
    utility: bool = True
    #: labels ``i % num_classes``: accuracy on them measures nothing (refused as a utility source)
    synthetic_labels: bool = False
    #: the ``torchvision.datasets`` class, and its folder under ``root``
    torchvision: str | None = None
    folder: str | None = None
    #: a text source: the model task its samples feed (``causal-lm``: plain text; ``classification``)
    task: str | None = None


#: every source, in the order the messages list them: the image sources, then ``text`` (a plain-text file
#: or folder, or the built-in text: windows of ``seq_len`` tokens for a causal LM), ``labelled-text`` (a
#: TSV of labelled sentences, or built-in sentences with synthetic labels, for a classifier), ``wikitext``
#: / ``cola`` (the ``datasets`` names, when cached locally); ``lfw-detection`` (built in: LFW's 100 faces
#: vs its 100 non-face patches, real labels) is a utility task only
SOURCES: dict[str, Source] = {s.name: s for s in (
    Source("lfw-detection", "image", data=False),
    Source("lfw-faces", "image", utility=False, synthetic_labels=True),
    Source("lfw-nonfaces", "image", utility=False, synthetic_labels=True),
    Source("cifar10", "image", torchvision="CIFAR10", folder="cifar-10-batches-py"),
    Source("cifar100", "image", torchvision="CIFAR100", folder="cifar-100-python"),
    Source("mnist", "image", torchvision="MNIST", folder="MNIST"),
    Source("fashion-mnist", "image", torchvision="FashionMNIST", folder="FashionMNIST"),
    Source("imagefolder", "image"),
    Source("npz", "image"),
    Source("text", "text", task="causal-lm"),
    Source("labelled-text", "text", task="classification"),
    Source("wikitext", "text", task="causal-lm"),
    Source("cola", "text", task="classification"),
)}

#: the sources a red-team config's data sections take, and those a sweep's utility task takes
DATA_SOURCES = tuple(name for name, s in SOURCES.items() if s.data)
UTILITY_SOURCES = tuple(name for name, s in SOURCES.items() if s.utility)
