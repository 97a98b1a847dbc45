"""MkDocs hooks (``hooks:`` in mkdocs.yml): before anything else of the build, lay out the package tree that
mkdocstrings reads (``paths: [build/docs-api]``). It must exist when the plugins read their configuration, so
this runs at the highest priority of ``on_config``, ahead of mkdocstrings; a clean checkout has none."""

from __future__ import annotations

import shutil
from pathlib import Path

from mkdocs.plugins import event_priority

HERE = Path(__file__).resolve().parent


def source_tree() -> Path:
    """``build/docs-api/guardfl``: the package as it installs, for mkdocstrings' static analysis (its ``paths``).

    ``guardfl.integrations`` and ``guardfl.redteam`` live in ``integrations/`` and ``redteam/`` (setuptools'
    ``package-dir``), where a source-tree search for ``guardfl`` does not look; this tree copies ``guardfl/``
    and puts those two folders in their installed places, anew at every build (symlinks would not do: the
    analysis resolves them back to the source folders)."""
    root = HERE.parents[1]
    tree = root / "build" / "docs-api" / "guardfl"
    if tree.parent.exists():
        shutil.rmtree(tree.parent)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(root / "guardfl", tree, ignore=skip)
    for name in ("integrations", "redteam"):
        shutil.copytree(root / name, tree / name, ignore=skip)
    return tree


@event_priority(100)
def on_config(config):
    source_tree()
    return config
