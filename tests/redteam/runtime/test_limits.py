"""The shared sizes live in runtime.limits; the modules that run jobs re-export them."""

from __future__ import annotations

from guardfl.redteam.runtime import allocator, limits, workers


def test_the_runtime_re_exports_the_shared_sizes():
    assert workers.LARGE_MODEL == limits.LARGE_MODEL == 2_000_000
    assert allocator.MMAP_THRESHOLD == limits.MMAP_THRESHOLD == 32 << 20
