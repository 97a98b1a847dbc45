"""What differs between images and text (data, models, metrics): the modality registry and the source table.

``for_source(name)``, ``of(cfg)`` and ``get(name)`` give a :class:`Modality`; :data:`SOURCES` is the one
table of data sources. Importing the package registers ``image`` and ``text``.
"""

from guardfl.redteam.modality.registry import DEFAULT, MODALITIES, Modality, for_model, for_source, get, of, register
from guardfl.redteam.modality.sources import DATA_SOURCES, SOURCES, UTILITY_SOURCES, Source
from guardfl.redteam.modality import image, text  # noqa: E402,F401  (each registers itself)

__all__ = ["DATA_SOURCES", "DEFAULT", "MODALITIES", "Modality", "SOURCES", "Source", "UTILITY_SOURCES",
           "for_model", "for_source", "get", "image", "of", "register", "text"]
