"""Sizes that the runtime and the attacks share: the attacks import them from here, never from the runtime.

``workers`` (threads per job) and ``allocator`` (glibc's thresholds) sit above the attacks and re-export
these; an attack (``attacks/optimisation/engine.py``, ``attacks/learned/learned_inversion_text.py``) reads
them here, so that no attack imports the runtime that runs it.
"""

from __future__ import annotations

#: parameters from which a model's operators are large enough to use several intra-op threads (ResNet-18,
#: not LeNet): ``workers.job_threads`` splits the cores then, and an attack vectorises differently
LARGE_MODEL = 2_000_000

#: glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit, the largest mmap threshold it accepts: ``allocator`` sets it,
#: and a blocked computation keeps its blocks under it (served from the heap, no page faults)
MMAP_THRESHOLD = 32 << 20
