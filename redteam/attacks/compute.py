"""Where and how an attack computes: its device, exact float32 on CUDA, random initial guesses, a progress bar."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import Tensor


@contextlib.contextmanager
def exact_float32() -> Iterator[None]:
    """float32 that is float32 on CUDA while an attack runs: PyTorch lets cuDNN convolutions (and, where
    enabled, matrix products) use TF32, a 10-bit mantissa, by default. That changes the attack's objective
    by ~1e-3 relative, as much as the flat float32 norm whose error once tilted the input gradient, and a
    weaker attack on a GPU than on a CPU could certify what the CPU run would not. No effect on a CPU; the
    caller's settings are restored afterwards."""
    conv, matmul = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = conv, matmul


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r}: CUDA is not available here; use 'auto' or 'cpu'")
    return device


def random_inputs(shape: tuple[int, ...], bounds: tuple[float, float], gen: torch.Generator, device: torch.device) -> Tensor:
    lo, hi = bounds
    return (lo + (hi - lo) * torch.rand(shape, generator=gen)).to(device)



def progress_bar(enabled: bool, total: int, name: str):
    """A tqdm bar for an attack's inner loop, or None when progress is off."""
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=name, leave=False)
