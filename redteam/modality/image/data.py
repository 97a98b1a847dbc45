"""Private data for the red team: the built-in LFW faces (no download) and common datasets.

Every source yields float images in [0, 1], shape ``(N, C, H, W)``, and integer labels.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from guardfl.data import DataError, from_array  # noqa: F401  (re-exported)
from guardfl.redteam.modality.sources import SOURCES

#: the largest single tensor a red-team run builds from its inputs (the population at ``image_size``, an
#: npz's decoded array, Robbing the Fed's imprint block): at most this, and at most half the RAM
MAX_TENSOR_BYTES = 8 << 30


def memory_bound(cap: int = MAX_TENSOR_BYTES) -> int:
    """``cap``, or half the physical memory when that is less."""
    import os

    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return cap
    return min(cap, physical // 2)


def gib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def _check_bytes(need: int, what: str, field: str, hint: str) -> None:
    bound = memory_bound()
    if need > bound:
        raise DataError(f"{field}: {what} needs about {gib(need)}, past the bound of {gib(bound)} (half the memory, "
                        f"at most {gib(MAX_TENSOR_BYTES)}); {hint}")


def _npz_shape(path: str, name: str) -> tuple[tuple[int, ...], int] | None:
    """(shape, itemsize) of array ``name`` in the npz at ``path`` from its header alone, None when that
    cannot be read (``np.load`` then reports what is wrong)."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as z, z.open(f"{name}.npy") as fh:
            version = np.lib.format.read_magic(fh)
            shape, _, dtype = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                               else np.lib.format.read_array_header_2_0)(fh)
            return tuple(shape), dtype.itemsize
    except Exception:
        return None


def _lfw_subset(rows: slice, num_classes: int) -> tuple[Tensor, Tensor]:
    """Rows ``rows`` of ``skimage.data.lfw_subset()`` (25x25 grey) as ``(N, 1, 25, 25)`` floats, with synthetic
    labels ``i % num_classes``."""
    import skimage.data

    images = skimage.data.lfw_subset()[rows]
    x = torch.from_numpy(np.ascontiguousarray(images)).float().unsqueeze(1)
    return x, torch.arange(len(x)) % num_classes


def lfw_faces(num_classes: int = 10) -> tuple[Tensor, Tensor]:
    """The 100 face images of ``skimage.data.lfw_subset()`` (25x25 grey, shipped with scikit-image).
    The subset carries no identities, so labels are synthetic class ids ``i % num_classes``: the
    attacker still has to recover (or is granted) them like any label."""
    return _lfw_subset(slice(0, 100), num_classes)


def lfw_nonfaces(num_classes: int = 10) -> tuple[Tensor, Tensor]:
    """The 100 NON-face images of ``skimage.data.lfw_subset()`` (25x25 grey patches of LFW backgrounds):
    out-of-distribution data for an attacker targeting faces. Labels are synthetic (``i % num_classes``)."""
    return _lfw_subset(slice(100, 200), num_classes)


def _torchvision(source: str, root: str | None, download: bool) -> tuple[Tensor, Tensor]:
    """A ``torchvision.datasets`` training set (the class the source table names) under ``root``."""
    import torchvision

    cls = getattr(torchvision.datasets, SOURCES[source].torchvision)
    root = str(Path(root).expanduser()) if root else str(Path.home() / ".cache" / "guardfl" / "data")
    try:
        ds = cls(root=root, train=True, download=download)
    except RuntimeError as err:
        hint = "set download: true (needs internet)" if not download else "check the network or point root at a copy"
        raise DataError(f"data: {source} not available at {root} ({err}); {hint}") from None
    except Exception as err:  # offline download
        raise DataError(f"data: could not download {source} to {root}: {err}") from None
    return from_array(np.asarray(ds.data), np.asarray(ds.targets))


def _npz(path: str | None, limit: int | None) -> tuple[Tensor, Tensor]:
    """Arrays ``x`` (images) and ``y`` (labels) of the npz at ``path``, bounded by its header first."""
    if not path or not Path(path).is_file():
        raise DataError(f"data.path: npz file not found: {path!r}")
    header = _npz_shape(path, "x")
    if header is not None:  # np.load decodes the whole array, whatever the limit
        shape, itemsize = header
        _check_bytes(int(np.prod(shape, dtype=np.float64)) * max(itemsize, 4), f"its array 'x' {list(shape)} (as float32)",
                     "data.path", "give a smaller file (the red team reads it whole)")
    try:
        with np.load(path, allow_pickle=False) as d:
            if "x" not in d or "y" not in d:
                raise DataError(f"data.path: {path} must hold arrays 'x' (images) and 'y' (labels); has {list(d.keys())}")
            xa, ya = d["x"], d["y"]
    except DataError:
        raise
    except Exception as err:  # object arrays (would need pickle), not a zip, truncated
        raise DataError(f"data.path: {path} is not an npz of numeric arrays ({str(err).splitlines()[0][:160]})") from None
    if xa.dtype.kind not in "biuf" or ya.dtype.kind not in "biu":
        raise DataError(f"data.path: {path}: 'x' must be numeric and 'y' integer (got {xa.dtype}, {ya.dtype})")
    return from_array(xa[:limit] if limit else xa, ya[:limit] if limit else ya)


def _imagefolder(path: str | None, image_size: int | None, limit: int | None) -> tuple[Tensor, Tensor]:
    """A ``torchvision.datasets.ImageFolder`` at ``path`` (a class per subfolder), resized while read."""
    import torchvision

    if not path or not Path(path).is_dir():
        raise DataError(f"data.path: image folder not found: {path!r}")
    tf = [torchvision.transforms.ToTensor()]
    if image_size:
        tf.insert(0, torchvision.transforms.Resize((image_size, image_size)))
    ds = torchvision.datasets.ImageFolder(path, transform=torchvision.transforms.Compose(tf))
    n = min(len(ds), limit or len(ds))
    if image_size:
        _check_bytes(n * 3 * image_size * image_size * 4, f"{n} images at {image_size}x{image_size}", "data.image_size",
                     "set data.limit or a smaller image_size")
    items = [ds[i] for i in range(n)]
    return torch.stack([a for a, _ in items]), torch.tensor([b for _, b in items])


def load(source: str, *, root: str | None = None, path: str | None = None, download: bool = False,
         image_size: int | None = None, num_classes: int = 10, limit: int | None = None) -> tuple[Tensor, Tensor]:
    """Load ``source``: lfw-faces, lfw-nonfaces, cifar10, cifar100, mnist, fashion-mnist, imagefolder or npz."""
    if source == "lfw-faces":
        x, y = lfw_faces(num_classes)
    elif source == "lfw-nonfaces":
        x, y = lfw_nonfaces(num_classes)
    elif source in SOURCES and SOURCES[source].torchvision:
        x, y = _torchvision(source, root, download)
    elif source == "npz":
        x, y = _npz(path, limit)
    elif source == "imagefolder":
        x, y = _imagefolder(path, image_size, limit)
    else:
        raise DataError(f"data.source: unknown source {source!r}")
    if limit:
        x, y = x[:limit], y[:limit]
    if image_size and x.shape[-1] != image_size:
        _check_bytes(x.shape[0] * x.shape[1] * image_size * image_size * 4,
                     f"{x.shape[0]} images of {x.shape[1]} channel(s) at {image_size}x{image_size}", "data.image_size",
                     "set data.limit or a smaller image_size")
        x = torch.nn.functional.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)
    return x, y


def load_section(section, *, num_classes: int, limit: int | None = None, image_size: int | None = None,
                 **_text: object) -> tuple[Tensor, Tensor]:
    """:func:`load` of a source section (``source``, ``root``, ``path``, ``download``, ``image_size``);
    ``image_size``: the size when the section gives none; the text options are not an image's."""
    return load(section.source, root=section.root, path=section.path, download=section.download,
                image_size=section.image_size or image_size, num_classes=num_classes, limit=limit)

