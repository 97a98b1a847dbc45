"""A client's state on disk (its round count, its DP accountant): written atomically, locked, and never lost
silently (issue 66).

``GuardedTrainer(state_path=)`` and ``GuardUpdateFilter(budget_path=)`` keep what bounds a server's looks at
the client's data in a file. A file that is lost, cut short or rolled back must not read as "round 0":
that would reset the round budget and the DP accountant. So:

- **atomic writes** (``atomic_write``): the bytes go to a temporary file in the same folder, which is
  flushed and ``fsync``-ed, then renamed over the old one (``os.replace``), and the folder is ``fsync``-ed:
  a kill or a power cut leaves the old file or the new one, never half of one;
- **a lock** (``locked``): ``<path>.lock``, an exclusive ``fcntl.flock`` held while the state is read,
  the round trained and the state written. A second process on the same file (two site processes, a
  relaunch while the old one still runs) is refused at once with the holder's pid, not left to race;
- **a first launch told from a lost state** (``load``): the first successful write leaves a marker beside
  the file, ``<path>.created`` (when and by which pid). A missing state file whose marker exists is a lost
  state (deleted, moved, a workspace restored without it): refused, naming both files. No file and no
  marker is a first launch. Deleting the marker as well is the deliberate way to start a new budget;
- **unreadable, truncated or foreign content** (a file that is not JSON, lacks a field, holds a count that
  is no integer >= 0, was written by another format version or by a client with another configuration):
  refused, naming the file and what is wrong, with the recovery (restore the file, or move it and its
  marker aside to start anew). Never read as zero.

What it cannot tell: a whole workspace wiped, marker included, is a first launch. Keep ``state_path`` on
storage that outlives the job's scratch space (``examples/nvflare`` keeps it beside the site's script).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from guardfl.errors import StateFileError


def marker_of(path: Path) -> Path:
    """``<path>.created``: written beside the state file on its first write (see the module docstring)."""
    return path.with_name(path.name + ".created")


def lock_of(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems cannot open a directory for fsync
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write(path: str | Path, data: bytes | str) -> None:
    """Write ``data`` to ``path`` atomically and durably: a temporary file beside it, flushed and fsync-ed,
    renamed over ``path``, the folder fsync-ed. A crash leaves the old content or the new, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)


@contextlib.contextmanager
def locked(path: str | Path, what: str) -> Iterator[None]:
    """Hold ``<path>.lock`` exclusively (``fcntl.flock``) for the block; another holder (another process, or
    another open of it in this one) is a ``StateFileError`` naming the file and its pid, at once."""
    import fcntl

    path = Path(path)
    lock = lock_of(path)
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            raise StateFileError(f"{what} {path}: in use by another process (pid {holder}, lock {lock.name}); two writers "
                                 "would each count from the same rounds: run one client per state file") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # closing releases the flock


def load(path: str | Path, what: str, parse: Callable[[Any], Any]) -> Any | None:
    """The parsed content of the state file at ``path`` (``parse(json)``, which raises ``ValueError`` /
    ``KeyError`` / ``TypeError`` on content it refuses), or None on a first launch (no file, no marker).
    A lost file (the marker without it), an unreadable or truncated one, or content ``parse`` refuses is a
    ``StateFileError`` naming the file, never None."""
    path = Path(path)
    marker = marker_of(path)
    if not path.exists():
        if marker.exists():
            when = _read_marker(marker)
            raise StateFileError(f"{what} {path}: missing, but {marker.name} beside it says it was created{when}: the "
                                 "state was lost (deleted or moved), which would reset the round count and the privacy "
                                 f"accountant; restore the file, or delete {marker.name} too to start a new budget on purpose")
        return None
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise StateFileError(f"{what} {path}: cannot be read ({type(err).__name__}: {err}); refusing rather than "
                             "counting from 0") from None
    try:
        return parse(json.loads(text))
    except StateFileError:
        raise
    except (ValueError, KeyError, TypeError) as err:
        short = "empty" if not text.strip() else f"{len(text)} bytes"
        raise StateFileError(f"{what} {path}: not a readable guardfl state ({short}; {type(err).__name__}: "
                             f"{str(err)[:160]}); refusing rather than counting from 0: restore it from a backup, or "
                             f"move it and {marker.name} aside to start a new budget on purpose") from None


def save(path: str | Path, data: str) -> None:
    """Write the state atomically, then (first time) the marker beside it."""
    path = Path(path)
    atomic_write(path, data)
    marker = marker_of(path)
    if not marker.exists():
        atomic_write(marker, json.dumps({"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "pid": os.getpid(),
                                         "state": path.name}))


def _read_marker(marker: Path) -> str:
    try:
        return f" on {json.loads(marker.read_text())['created']}"
    except (OSError, ValueError, KeyError, TypeError):
        return ""


__all__ = ["atomic_write", "load", "lock_of", "locked", "marker_of", "save"]
