"""What a certification reads, by content: the key a resumed run must match.

A config names files (private data, a checkpoint, auxiliary data, LPIPS weights) and code (a
``module:callable`` model factory, a target's ``train_fn`` / ``clientapp`` and its ``app_dir``). The
config's own hash does not see those files change, so a resume could mix batches of two datasets, or of
two versions of the client code. ``fingerprint`` hashes the bytes of every one of them (folders: every
file in them, by relative path); ``resume_key`` combines that with the config's hash. Code is located
without being imported (``importlib.machinery.PathFinder``): computing the key runs nothing of the user's.

Files that do not exist are recorded as ``"missing"`` (the run itself reports them with a clear error);
built-in modules as ``"built-in"``. Nothing here raises on a bad path.
"""

from __future__ import annotations

import hashlib
import os
import sys
from importlib.machinery import PathFinder
from pathlib import Path
from typing import Any

from guardfl.redteam.modality.sources import SOURCES

_SKIP_DIRS = {"__pycache__", "node_modules", "site-packages"}
_CHUNK = 1 << 20


def _hash_file(path: Path, h: Any) -> None:
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)


def _folder_files(folder: Path, suffixes: tuple[str, ...] | None) -> list[Path]:
    """Regular files under ``folder`` (sorted, symlinked folders not followed; code folders skip hidden
    folders, caches and virtual environments)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(folder):
        if suffixes is not None:
            dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in _SKIP_DIRS
                           and not (Path(dirpath) / d / "pyvenv.cfg").exists()]
        for name in filenames:
            p = Path(dirpath) / name
            if (suffixes is None or p.suffix in suffixes) and p.is_file():
                found.append(p)
    return sorted(found, key=lambda p: p.relative_to(folder).as_posix())


def content_digest(path: str | Path, suffixes: tuple[str, ...] | None = None) -> str:
    """sha256 of a file's bytes, or of a folder's files (relative path and bytes of each, in sorted order;
    ``suffixes`` keeps only those file types); ``"missing"`` when there is nothing at ``path``."""
    p = Path(path).expanduser()
    try:
        if p.is_file():
            h = hashlib.sha256(b"file\0")
            _hash_file(p, h)
            return h.hexdigest()
        if p.is_dir():
            h = hashlib.sha256(b"folder\0")
            for f in _folder_files(p, suffixes):
                rel = f.relative_to(p).as_posix().encode()
                inner = hashlib.sha256()
                _hash_file(f, inner)
                h.update(len(rel).to_bytes(8, "little") + rel + inner.digest())
            return h.hexdigest()
    except OSError as err:
        return f"unreadable: {type(err).__name__}"
    return "missing"


def module_origin(module: str, app_dir: str | Path | None = None) -> str | None:
    """The source file of ``module`` (dotted), found as ``import`` would find it with ``app_dir`` first on
    the path, WITHOUT importing it or its parent packages; "built-in" for a built-in module; None when it
    cannot be found."""
    if not module or any(not part.isidentifier() for part in module.split(".")):
        return None
    search: list[str] = ([str(Path(app_dir).resolve())] if app_dir is not None else []) + list(sys.path)
    parts = module.split(".")
    spec = None
    path: list[str] | None = search
    for i in range(len(parts)):
        if path is None:  # a parent that is a module, not a package
            return None
        try:
            spec = PathFinder.find_spec(".".join(parts[: i + 1]), path)
        except (ImportError, ValueError, OSError):
            spec = None
        if spec is None:
            break
        path = list(spec.submodule_search_locations) if spec.submodule_search_locations is not None else None
    if spec is None:
        if len(parts) == 1 and (module in sys.builtin_module_names or module in sys.modules
                                and getattr(sys.modules[module], "__file__", None) is None):
            return "built-in"
        return None
    if spec.origin is None or not spec.has_location:
        return None  # a namespace package: no file of its own
    return spec.origin


def _source_entries(prefix: str, section: Any) -> dict[str, str]:
    """The files a data / aux / ood section reads."""
    if section is None or section.source is None:
        return {}
    src = section.source
    if src in ("npz", "imagefolder"):
        return {f"{prefix}.path": section.path or ""}
    folder = SOURCES[src].folder if src in SOURCES else None  # the folder torchvision reads under ``root``
    if folder is not None:
        root = Path(section.root).expanduser() if section.root else Path.home() / ".cache" / "guardfl" / "data"
        return {f"{prefix}.root": str(root / folder)}
    if src in ("lfw-faces", "lfw-nonfaces"):  # scikit-image's shipped file (no import to find it)
        origin = module_origin("skimage")
        if origin and origin != "built-in":
            return {f"{prefix}.source": str(Path(origin).parent / "data" / "lfw_subset.npy")}
    return {}


def run_inputs(cfg: Any) -> dict[str, tuple[str, tuple[str, ...] | None]]:
    """Every file or folder ``cfg`` (a ``RedTeamConfig``) makes the run read: ``{field: (path, suffixes)}``
    (``suffixes``: for a code folder, the file types hashed; None: every file)."""
    found: dict[str, tuple[str, tuple[str, ...] | None]] = {}
    target = cfg.target
    app_dir = target.app_dir if target is not None else None
    clientapp = target is not None and target.clientapp is not None
    own_data = clientapp or (target is not None and target.nvflare is not None)
    if not own_data:  # a ClientApp / NVFlare site loads its own data; the data section is not read
        found.update({k: (v, None) for k, v in _source_entries("data", cfg.data).items()})
    if cfg.model.state not in ("default", "wide-init"):
        found["model.state"] = (cfg.model.state, None)
    refs = [("model.name", cfg.model.name)]
    if target is not None:
        refs.append(("target.clientapp", target.clientapp) if clientapp else ("target.nvflare", target.nvflare)
                    if target.nvflare is not None else ("target.train_fn", target.train_fn))
        if target.job is not None:
            found["target.job"] = (str(target.job), None)
    for name, ref in refs:
        if ref and ":" in ref:
            origin = module_origin(ref.split(":", 1)[0], app_dir)
            found[f"{name} module"] = (origin or "", None)
    if app_dir is not None:  # the user's project: its code and its run config
        found["target.app_dir"] = (str(app_dir), (".py", ".toml"))
    if cfg.aux is not None:
        found.update({k: (v, None) for k, v in _source_entries("aux", cfg.aux).items()})
        found.update({k: (v, None) for k, v in _source_entries("aux.ood", cfg.aux.ood).items()})
    if cfg.certify.lpips_weights:
        found["certify.lpips_weights"] = (cfg.certify.lpips_weights, None)
    from guardfl.redteam.threat import inter_instahide

    inter = inter_instahide(cfg.defense)
    if inter is not None and inter.public:  # the client mixes with it; an attacker may hold it
        found["defense.public"] = (str(inter.public), None)
    return found


def fingerprint(cfg: Any) -> dict[str, str]:
    """``{field: sha256 of what it reads}`` (or "missing", "built-in", "unresolved") for every input of
    the run described by ``cfg``, in a stable order."""
    out: dict[str, str] = {}
    for name, (path, suffixes) in sorted(run_inputs(cfg).items()):
        if path == "built-in":
            out[name] = "built-in"
        elif not path:
            out[name] = "unresolved"
        else:
            out[name] = content_digest(path, suffixes)
    return out


def resume_key(config_hash: str, inputs: dict[str, str]) -> str:
    """The key a resume must match: the config's hash and the content of every input."""
    h = hashlib.sha256(config_hash.encode())
    for name, digest in sorted(inputs.items()):
        h.update(f"\0{name}\0{digest}".encode())
    return h.hexdigest()[:16]


def changed_inputs(before: dict[str, str], now: dict[str, str]) -> list[str]:
    """The fields whose content differs (or that appeared or disappeared) between two fingerprints."""
    return sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
