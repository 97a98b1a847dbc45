"""Prepared attack states (the once-per-setting ``Attack.prepare`` results) cached by key, in memory and on disk."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from guardfl.redteam.runtime.files import atomic_torch_save


class PreparedCache:
    """Prepared attack states by key (``NAME-KEY``): in memory, and stored on disk under ``folder`` when
    given (atomic files). Another store (the red team's state folder) overrides the two storage hooks,
    ``read`` and ``write``; the memory stays here."""

    def __init__(self, folder: str | Path | None = None) -> None:
        self.folder = Path(folder) if folder is not None else None
        self._memory: dict[str, Any] = {}

    def read(self, entry: str) -> Any | None:
        """Storage hook: the stored state of ``entry`` (``NAME-KEY``), None when none is stored."""
        if self.folder is None or not (self.folder / f"{entry}.pt").is_file():
            return None
        return torch.load(self.folder / f"{entry}.pt", map_location="cpu", weights_only=True)  # tensors and plain data only: loading runs no code

    def write(self, entry: str, state: Any) -> None:
        """Storage hook: store the state of ``entry`` (``NAME-KEY``); nothing without a folder."""
        if self.folder is not None:
            atomic_torch_save(state, self.folder / f"{entry}.pt")

    def load(self, name: str, key: str) -> Any | None:
        entry = f"{name}-{key}"
        if entry in self._memory:
            return self._memory[entry]
        state = self.read(entry)
        if state is not None:
            self._memory[entry] = state
        return state

    def entries(self) -> dict[str, Any]:
        """The states held in memory, by ``NAME-KEY`` (to hand to another process)."""
        return dict(self._memory)

    def adopt(self, entries: dict[str, Any]) -> None:
        """Take states another process prepared (``entries()`` there)."""
        self._memory.update(entries)

    def save(self, name: str, key: str, state: Any) -> None:
        self._memory[f"{name}-{key}"] = state
        self.write(f"{name}-{key}", state)

