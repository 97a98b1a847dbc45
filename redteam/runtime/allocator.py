"""The C allocator of red-team processes: glibc's malloc, told to keep the memory it reuses every iteration.

An attack allocates and frees the same tensors every iteration: for transformer3 (GPT-2's 50,257-token
vocabulary) the token embedding's gradient alone is 19 MB, and the learned inversion's simulator produces
tens of MB per auxiliary batch. glibc serves blocks above its mmap threshold with fresh ``mmap`` pages and
gives the top of its heap back to the kernel past its trim threshold (twice the mmap threshold, which
adapts upwards only as far as the largest block freed so far); either way the next iteration touches new
pages and pays a page fault per 4 KiB. Measured on 2 cores (``configs/text-default.yaml``, TAG only,
2 jobs): 20.7 million page faults, 35 s of kernel time, 60 s wall; with the thresholds below, 1.0 million,
3 s and 41 s, peak memory +6%. The thresholds: blocks up to 32 MiB (glibc's largest mmap threshold) come
from the heap, and up to 256 MiB of free heap top is kept for the next iteration. ``mallopt`` with
``M_MMAP_THRESHOLD`` set also fixes the threshold (no dynamic adjustment), so behaviour does not depend on
the history of the process.

Applied by the ``guardfl redteam`` / ``guardfl sweep`` commands in their own process and in every
worker process they spawn, never on import (a library must not retune its host's allocator). A user
who set glibc's own variables (``MALLOC_*_``, ``GLIBC_TUNABLES``) keeps them; other C libraries
(musl, macOS, Windows) are left alone. ``GUARDFL_MALLOC=default`` turns it off.
"""

from __future__ import annotations

import ctypes
import os
import platform

from guardfl.redteam.runtime.limits import MMAP_THRESHOLD  # noqa: F401  (re-exported: glibc's largest mmap threshold)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
TRIM_THRESHOLD = 256 << 20

_USER_VARIABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_",
                   "GLIBC_TUNABLES")
_state = "untouched"


def tune_malloc() -> str:
    """Set the thresholds once per process (idempotent); returns the state, as ``state()``."""
    global _state
    if _state == "untouched":
        _state = _tune()
    return _state


def _tune() -> str:
    if os.environ.get("GUARDFL_MALLOC", "").lower() == "default":
        return "default (GUARDFL_MALLOC=default)"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "default (not glibc)"
    named = [v for v in _USER_VARIABLES if v in os.environ]
    if named:
        return f"the user's ({', '.join(named)})"
    try:
        libc = ctypes.CDLL(None)
        ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    except (OSError, AttributeError):
        ok = False
    if not ok:
        return "default (mallopt refused)"
    return f"glibc: mmap threshold {MMAP_THRESHOLD >> 20} MiB, trim threshold {TRIM_THRESHOLD >> 20} MiB"


def state() -> str:
    """What this process's allocator runs with (for the certificate's environment)."""
    return _state
