"""Files of the red team: atomic writes (a reader, or a killed run, never sees a partial file), the
output folder's verdict and run marker, and the resumable state folder.

The verdict (``certificate.json``, with ``report.html`` and its pictures) is retracted before a run does
anything, and ``run.json`` says the run is in progress: a run that fails or is killed leaves no verdict,
earlier or partial. The state folder (``OUT/state``) lists every file guardfl writes there in
``manifest.json``: a new run removes only those, a resume reads only those, and only as JSON or tensors
(``torch.load(weights_only=True)``: loading runs no code).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from guardfl.errors import ConfigError


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


def _remove_with_temps(path: Path) -> None:
    """``path`` and the temporary files an interrupted atomic write of it left (``.NAME.*``)."""
    path.unlink(missing_ok=True)
    if path.parent.is_dir():
        for tmp in path.parent.glob(f".{glob_escape(path.name)}.*"):
            if tmp.is_file():
                tmp.unlink(missing_ok=True)


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


# -- the verdict and the run marker in OUT --------------------------------------------------------------
CERTIFICATE = "certificate.json"
REPORT = "report.html"
RUN_MARKER = "run.json"
_GRID = re.compile(r"grid-batch\d+\.png")


def retract_verdict(out: Path) -> list[str]:
    """Delete an earlier verdict in ``out`` (``certificate.json``, ``report.html``, ``grid-batch<b>.png``)
    and the temporaries of interrupted writes of them; the names removed. Deleted, not renamed: a
    renamed certificate still says CERTIFIED to whatever globs the folder, and the run that wrote it can
    be repeated (or resumed) from its config."""
    if not out.is_dir():
        return []
    names = [CERTIFICATE, REPORT] + sorted(p.name for p in out.iterdir() if _GRID.fullmatch(p.name))
    removed = [n for n in names if (out / n).exists()]
    for n in names:
        _remove_with_temps(out / n)
    return removed


def mark_run(out: Path, status: str, **info: Any) -> None:
    """``out/run.json``: ``status`` ("in progress", "failed", "interrupted", "finished") and details. A
    killed run's marker stays "in progress"; only "finished" goes with a ``certificate.json``."""
    record = {"status": status, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "pid": os.getpid(), **info}
    atomic_write(out / RUN_MARKER, json.dumps(record, indent=2, default=str))


# -- plain data: what a state file may hold --------------------------------------------------------------
def plain(obj: Any, where: str = "state") -> Any:
    """``obj`` as tensors and plain data only (dicts with string keys, lists, tuples, str, int, float,
    bool, None), which ``torch.load(weights_only=True)`` reads back without running code; numpy scalars
    and arrays become Python numbers and tensors. Anything else is a TypeError naming where it sits."""
    if obj is None or isinstance(obj, (str, bool, int, float, torch.Tensor)):
        return obj
    if isinstance(obj, dict):
        if not all(isinstance(k, (str, int)) for k in obj):
            raise TypeError(f"{where}: keys must be strings or integers")
        return {k: plain(v, f"{where}.{k}") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [plain(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        return tuple(items) if isinstance(obj, tuple) else items
    try:
        import numpy as np

        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, np.ndarray):
            return torch.from_numpy(obj.copy())
    except ImportError:  # pragma: no cover
        pass
    raise TypeError(f"{where}: {type(obj).__name__} is not plain data (tensors, numbers, strings, lists, dicts)")


# -- the resumable state folder -----------------------------------------------------------------------
class StateFolder:
    """``OUT/state``: the files of a resumable run, every one listed in ``manifest.json`` (with the run's
    ``meta``: its resume key) BEFORE it is written. Only listed files are read or removed."""

    MANIFEST = "manifest.json"
    FORMAT = "guardfl-redteam-state/1"

    def __init__(self, root: Path, meta: dict[str, Any], files: list[str]) -> None:
        self.root, self.meta, self.files = root, meta, list(files)
        self._listed = set(files)

    # -- opening ---------------------------------------------------------------------------------------
    @classmethod
    def read_manifest(cls, root: Path) -> dict[str, Any] | None:
        """The manifest of a guardfl state folder; None when there is none (or it is not guardfl's)."""
        path = root / cls.MANIFEST
        if not path.is_file():
            return None
        try:
            manifest = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        if not (isinstance(manifest, dict) and manifest.get("format") == cls.FORMAT
                and isinstance(manifest.get("files"), list) and all(_safe_name(f) for f in manifest["files"])):
            return None
        return manifest

    @classmethod
    def reopen(cls, root: Path, manifest: dict[str, Any]) -> "StateFolder":
        return cls(root, manifest.get("meta", {}), manifest["files"])

    @classmethod
    def fresh(cls, root: Path, meta: dict[str, Any]) -> "StateFolder":
        """A new, empty state for a run: the files an earlier guardfl run listed are removed, nothing else.
        A folder that holds files without a guardfl manifest is refused (ConfigError): they are not ours
        to delete, and a run must not mix with them."""
        manifest = cls.read_manifest(root)
        if manifest is not None:
            inside = root.resolve()
            for name in [*manifest["files"], cls.MANIFEST]:
                if (root / name).parent.resolve().is_relative_to(inside):  # never through a linked folder
                    _remove_with_temps(root / name)
            for sub in sorted({(root / n).parent for n in manifest["files"]}, key=lambda p: -len(p.parts)):
                if sub != root and sub.is_dir() and not any(sub.iterdir()):
                    sub.rmdir()
        elif root.exists():
            if not root.is_dir():
                raise ConfigError(f"--out: {root} exists and is not a folder; choose another --out")
            if any(root.iterdir()):
                raise ConfigError(f"--out: {root} holds files guardfl did not write (no {cls.MANIFEST}: another "
                                  "program's, or an older guardfl's state); move them away or choose another --out")
        root.mkdir(parents=True, exist_ok=True)
        state = cls(root, meta, [])
        state._write_manifest()
        return state

    def _write_manifest(self) -> None:
        atomic_write(self.root / self.MANIFEST,
                     json.dumps({"format": self.FORMAT, "meta": self.meta, "files": self.files}, indent=1))

    # -- files -----------------------------------------------------------------------------------------
    def path(self, name: str) -> Path:
        """Where to write ``name`` (relative, '/'-separated): listed in the manifest first."""
        if not _safe_name(name):
            raise ValueError(f"state file name {name!r}: expected a relative path without '..'")
        if name not in self._listed:
            self._listed.add(name)
            self.files.append(name)
            self._write_manifest()
        return self.root / name

    def existing(self, name: str) -> Path | None:
        """``name``'s path when guardfl listed it and it is there (a planted file is never read)."""
        path = self.root / name
        return path if name in self._listed and path.is_file() else None

    def save_json(self, name: str, obj: Any) -> None:
        atomic_write(self.path(name), json.dumps(obj, default=str))

    def load_json(self, name: str) -> Any | None:
        path = self.existing(name)
        return None if path is None else json.loads(path.read_text())

    def save_tensors(self, name: str, obj: Any) -> None:
        """Tensors and plain data (``plain``), read back by ``load_tensors`` without unpickling objects."""
        atomic_torch_save(plain(obj, name), self.path(name))

    def load_tensors(self, name: str) -> Any | None:
        path = self.existing(name)
        if path is None:
            return None
        try:
            with warnings.catch_warnings():  # a foreign pickle's protocol warning: it is refused below anyway
                warnings.simplefilter("ignore", UserWarning)
                return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # a file that holds objects (or is not ours): refused, never executed
            raise ConfigError(f"--resume: {path} is not a tensor file guardfl wrote ({type(err).__name__}); "
                              "drop --resume to start over") from None


def _safe_name(name: Any) -> bool:
    return (isinstance(name, str) and bool(name) and not name.startswith("/") and "\\" not in name
            and all(part not in ("", ".", "..") for part in name.split("/")))
