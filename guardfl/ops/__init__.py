"""Pure tensor functions behind the defenses (no configuration, no state): easy to property-test."""

from guardfl.ops.finite import nonfinite_counts
from guardfl.ops.noise import gaussian_like, laplace_like
from guardfl.ops.selection import cover_count, kth_smallest, prune_count, smallest_k_mask

__all__ = [
    "cover_count",
    "gaussian_like",
    "kth_smallest",
    "laplace_like",
    "nonfinite_counts",
    "prune_count",
    "smallest_k_mask",
]
