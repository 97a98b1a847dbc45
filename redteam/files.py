"""Atomic files for the red team's outputs and resumable state: a reader (or a killed run) never sees a
partial file."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch


def atomic_write(path: Path, data: bytes | str) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder, fsynced, then renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as fh:
        fh.write(data.encode() if isinstance(data, str) else data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def atomic_torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` to ``path`` through a temporary file, then renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    torch.save(obj, tmp)
    os.replace(tmp, path)
