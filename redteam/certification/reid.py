"""Re-identification: does a reconstruction name its private sample among candidates?

A pixel threshold says how close a reconstruction is to its private image; it does not say whether an
attacker learns *whose* image it was. Re-identification asks that question, as an attacker with a gallery
would: the candidates are the population the claim is about (every sample a client of the deployment may
hold) and the attacker's own auxiliary images. Every reconstruction an attack made of an update names the
candidate nearest to it under each of two similarities:

- SSIM (the structural similarity the pixel threshold uses), and
- eigenfaces (Turk and Pentland 1991): the cosine of the candidates' and the reconstruction's coordinates
  on the leading principal components of the attacker's own auxiliary images (in-distribution ones, else
  its OOD ones; ``EIGEN_COMPONENTS`` at most), a feature distance fitted on data the attacker holds, never
  on the private samples.

The attacker's identification of an update of ``B`` samples is the ``B`` candidates named most often (ties:
the one with the higher eigenface cosine, then SSIM, to any of the reconstructions): one answer per
private sample, chosen without the ground truth. A private sample is re-identified when it is among them.
A guess that knows nothing (a grey image, noise) names the right one of ``N`` candidates with probability
``B / N`` per sample: the certificate gives this chance rate beside the claim.

Beside the attacker's answer, per attack and similarity, the rank of the true sample among the candidates
(1: nearest) for each private sample (for ``B > 1`` the best rank over the attack's reconstructions, a
diagnostic that uses the truth, labelled as such in the report).

Images only: a text client's certificate says re-identification is not measured (``available: False``).
Pure functions on tensors; ``run`` builds the gallery once and applies ``identify`` to each update.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from guardfl.redteam.modality.image import metrics

#: the most principal components of the eigenface basis
EIGEN_COMPONENTS = 24


@dataclass(frozen=True)
class Gallery:
    """The candidates (the population first, then the attacker's auxiliary images), their eigenface
    coordinates (unit rows; None without auxiliary images to fit them on), and where they come from."""

    images: torch.Tensor
    population: int
    data_range: tuple[float, float]
    mean: torch.Tensor | None
    basis: torch.Tensor | None
    coords: torch.Tensor | None
    source: str

    @property
    def size(self) -> int:
        return int(self.images.shape[0])

    def chance(self, per_update: int) -> float:
        """The rate at which a guess that knows nothing names a sample (``per_update`` names among ``size``)."""
        return min(1.0, per_update / self.size)

    def describe(self) -> dict[str, Any]:
        return {"candidates": self.size, "population": self.population, "auxiliary": self.size - self.population,
                "similarities": ["ssim"] + (["eigenfaces"] if self.basis is not None else []),
                "eigen_components": None if self.basis is None else int(self.basis.shape[0]),
                "eigen_fitted_on": self.source if self.basis is not None else None}


def gallery(population: torch.Tensor, aux_images: torch.Tensor | None, aux_ood: torch.Tensor | None,
            data_range: tuple[float, float]) -> Gallery:
    """The gallery of a run: ``population`` then the attacker's in-distribution auxiliary images; the
    eigenface basis fitted on those auxiliary images (their OOD images when it has none in-distribution)."""
    aux = aux_images if aux_images is not None and aux_images.is_floating_point() and len(aux_images) else None
    images = torch.cat([population.float(), aux.float()]) if aux is not None else population.float()
    fit, source = (aux, "the attacker's auxiliary images") if aux is not None and len(aux) >= 3 else (
        (aux_ood, "the attacker's OOD images") if aux_ood is not None and len(aux_ood) >= 3 else (None, ""))
    mean = basis = coords = None
    if fit is not None:
        flat = fit.flatten(1).double()
        mean = flat.mean(0)
        k = min(EIGEN_COMPONENTS, flat.shape[0] - 1, flat.shape[1])
        _, _, v = torch.linalg.svd(flat - mean, full_matrices=False)
        basis = v[:k]
        coords = _unit((images.flatten(1).double() - mean) @ basis.T)
    return Gallery(images, int(population.shape[0]), tuple(data_range), mean, basis, coords, source)


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=1, keepdim=True).clamp_min(1e-12)


def similarities(g: Gallery, recon: torch.Tensor) -> dict[str, np.ndarray]:
    """Similarity name -> ``(reconstructions, candidates)`` array (higher: nearer)."""
    lo, hi = g.data_range
    recon = recon.detach().float().cpu().clamp(lo, hi)
    out = {"ssim": metrics.ssim_matrix(recon, g.images, hi - lo).T}
    if g.basis is not None:
        e = _unit((recon.flatten(1).double() - g.mean) @ g.basis.T)
        out["eigenfaces"] = (e @ g.coords.T).numpy()
    return out


def identify(g: Gallery, recons: dict[str, torch.Tensor], truth: list[int]) -> dict[str, Any]:
    """One update: ``recons`` (attack -> its reconstructions of the update), ``truth`` (the update's
    private samples, as indices into the population). The attacker's named candidates, the samples
    re-identified, and per attack and similarity the rank of each true sample (diagnostic)."""
    votes = np.zeros(g.size)
    best = {name: np.full(g.size, -np.inf) for name in ("eigenfaces", "ssim")}
    ranks: dict[str, dict[str, list[int]]] = {}
    for attack, recon in recons.items():
        sims = similarities(g, recon)
        ranks[attack] = {}
        for name, s in sims.items():
            for row in s:
                votes[int(np.argmax(row))] += 1
            best[name] = np.maximum(best[name], s.max(0))
            # rank of the true sample: 1 + the candidates strictly nearer, best over the reconstructions
            ranks[attack][name] = [int(min(1 + np.sum(row > row[t]) for row in s)) for t in truth]
    order = np.lexsort((-best["ssim"], -best["eigenfaces"], -votes))  # most votes, then the nearer
    named = [int(i) for i in order[: len(truth)]]
    hit = [t in named for t in truth]
    return {"named": named, "reidentified": hit, "fraction": float(np.mean(hit)) if hit else 0.0, "ranks": ranks}
