"""Which private samples a certification attacks: seeded random draws from the stated population.

A certificate's claim is about a population (the configured data: source, offset, size) and the client
that trains on it. Each attacked client update is its own draw: ``n`` distinct samples taken uniformly at
random from the whole population, independently of every other update (so a sample may come back in a
later update, with the client's fresh randomness, as in a deployment where it is sent every round). The
updates are then independent and identically distributed, which is what the sequential rule
(``sequential``) needs; update ``b``'s draw depends on the config's ``seed`` and ``b`` only, so the same
config draws the same samples (resume, workers, reruns, a larger budget), another seed draws others, and
the certificate records every update's indices. Taking the first images instead would certify whatever
order the dataset happens to be stored in (often sorted by class or by source).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Population:
    """The images a certificate speaks for: ``size`` images of ``source`` from ``offset`` (of its stored
    order, or of its order shuffled by the seed ``shuffle``); ``index``: their indices in the source (None:
    ``offset`` onwards)."""

    source: str
    offset: int
    size: int
    path: str | None = None
    shuffle: int | None = None
    index: tuple[int, ...] | None = field(default=None, repr=False)

    def draw_update(self, b: int, count: int, seed: int) -> list[int]:
        """Update ``b``'s ``count`` distinct indices into the population (0-based; :meth:`describe` gives the
        source's), uniformly at random, independent of the other updates' draws, reproducible under
        (``seed``, ``b``)."""
        if count > self.size:
            raise ValueError(f"cannot draw {count} distinct samples from a population of {self.size}")
        gen = torch.Generator().manual_seed(_update_seed(seed, b))
        return torch.randperm(self.size, generator=gen)[:count].tolist()

    def describe(self, updates: dict[int, list[int]], seed: int) -> dict:
        """The certificate's ``population`` entry: what the claim is about, and which samples each attacked
        update drew (``indices``: the source's indices, update by update)."""
        source = [[self.index[i] if self.index is not None else self.offset + i for i in rows]
                  for _, rows in sorted(updates.items())]
        return {
            "source": self.source, "path": self.path, "offset": self.offset, "size": self.size, "seed": seed,
            "shuffle": self.shuffle, "drawn": sum(len(rows) for rows in source), "updates": len(source),
            "distinct": len({i for rows in source for i in rows}),
            "indices": [i for rows in source for i in rows], "per_update": source,
            "sampling": ("each update: distinct samples drawn uniformly at random from the whole population "
                         "(torch.randperm, seeded by the config's seed and the update's number), independently of "
                         "the other updates"),
        }


def _update_seed(seed: int, b: int) -> int:
    """A 63-bit seed for update ``b`` of a run seeded ``seed`` (distinct for distinct pairs)."""
    import hashlib

    digest = hashlib.sha256(f"guardfl-update:{seed}:{b}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
