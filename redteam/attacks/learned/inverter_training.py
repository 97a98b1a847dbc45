"""The training loop learned inversion runs for images and for tokens (Wu et al. 2023): standardise the
observations, then Adam over shuffled minibatches of (observation, target) pairs, the learning rate x0.1
at ``lr_drop_at`` of the epochs, the training observations redrawn every ``refresh_every`` epochs when
the defense is random (fresh defense draws: the defense as augmentation)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from guardfl.redteam.attacks.compute import progress_bar


def holdout_split(n: int, holdout: float, batch: int, gen: torch.Generator, what: str) -> tuple[Tensor, Tensor]:
    """(validation, training) indices of ``n`` auxiliary samples in a random order from ``gen``: a
    ``holdout`` share held out, rounded down to whole batches of ``batch``; ValueError when the rest
    cannot fill one training batch."""
    order = torch.randperm(n, generator=gen)
    n_val = int(round(holdout * n))
    n_val = n_val - n_val % batch
    if n - n_val < batch:
        raise ValueError(f"aux: {n} auxiliary {what} cannot fill one training batch of {batch} after the holdout")
    return order[:n_val], order[n_val:]


def standardiser(feats: Tensor, enabled: bool) -> tuple[Tensor, Tensor]:
    """(mean, std) per coordinate of the first training draw (std 1 where a coordinate is constant), or
    (0, 1) when standardisation is off."""
    if not enabled:
        return torch.zeros(feats.shape[1], device=feats.device), torch.ones(feats.shape[1], device=feats.device)
    mu, sd = feats.mean(0), feats.std(0)
    return mu, torch.where(sd > 1e-12, sd, torch.ones_like(sd))


def _fused_ok(net: nn.Module) -> bool:
    """Whether the fused Adam kernel serves ``net``'s parameters (float CPU or CUDA tensors)."""
    return all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in net.parameters())


def train_inverter(net: nn.Module, feats: Tensor, targets: Tensor, loss_fn: Callable[[Tensor, Tensor], Tensor],
                   redraw: Callable[[], tuple[Tensor, Tensor]] | None, *, mu: Tensor, sd: Tensor, epochs: int,
                   batch: int, lr: float, lr_drop_at: float, refresh_every: int, gen: torch.Generator,
                   progress: bool, name: str, metric: str) -> tuple[list[float], int]:
    """Train ``net`` on ``(feats - mu) / sd -> targets``; ``redraw`` (None: a deterministic defense) gives a
    fresh training draw. Returns the mean training loss per epoch and the number of draws used."""
    # fused: one pass over each parameter per step (the inverter's first layer holds millions of weights: the
    # per-tensor loop spent 44% of the default config's preparation in Adam; fused 7.6x faster, same maths up
    # to float32 rounding, bench/bench_lti.py)
    opt = torch.optim.Adam(net.parameters(), lr=lr, fused=_fused_ok(net))
    drop = max(1, int(round(lr_drop_at * epochs)))
    bar = progress_bar(progress, epochs, f"{name}: training")
    losses, draws = [], 1
    for epoch in range(epochs):
        if epoch and redraw is not None and epoch % refresh_every == 0:
            feats, targets = redraw()
            draws += 1
        if epoch == drop:
            for group in opt.param_groups:
                group["lr"] = lr * 0.1
        perm = torch.randperm(len(feats), generator=gen).to(feats.device)
        total = torch.zeros((), device=feats.device)  # summed on the device: no host sync per minibatch
        for lo in range(0, len(perm), batch):
            i = perm[lo : lo + batch]
            loss = loss_fn(net((feats[i] - mu) / sd), targets[i])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.detach() * len(i)
        losses.append(float(total) / len(perm))
        if bar:
            bar.update(1)
            bar.set_postfix({metric: f"{losses[-1]:.4f}"})
    if bar:
        bar.close()
    return losses, draws
