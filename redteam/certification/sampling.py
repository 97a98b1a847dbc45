"""Which private samples a certification attacks: a seeded random draw from the stated population.

A certificate's claim is about a population (the configured data: source, offset, size). The samples it
rests on are drawn from that population uniformly at random without replacement, with a generator seeded
by the config's ``seed``: the same config draws the same samples (resume, workers, reruns), another seed
draws others, and the certificate records the drawn indices. Taking the first ``n`` images instead would
certify whatever order the dataset happens to be stored in (often sorted by class or by source).
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

    def draw(self, count: int, seed: int) -> list[int]:
        """``count`` distinct indices into the population (0-based; :meth:`describe` gives the source's),
        uniformly at random, reproducible under ``seed``."""
        if count > self.size:
            raise ValueError(f"cannot draw {count} samples from a population of {self.size}")
        gen = torch.Generator().manual_seed(seed)
        return torch.randperm(self.size, generator=gen)[:count].tolist()

    def describe(self, drawn: list[int], seed: int) -> dict:
        """The certificate's ``population`` entry: what the claim is about, and which samples were drawn."""
        return {
            "source": self.source, "path": self.path, "offset": self.offset, "size": self.size, "seed": seed,
            "shuffle": self.shuffle, "drawn": len(drawn),
            "indices": [self.index[i] if self.index is not None else self.offset + i for i in drawn],
            "sampling": "uniform without replacement (torch.randperm, seeded by the config's seed)",
        }
