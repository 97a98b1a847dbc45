"""The shared sizes live below the attacks: no attack imports the runtime that runs it."""

from __future__ import annotations

import ast
from pathlib import Path

from guardfl.redteam import allocator, limits, workers

ATTACKS = Path(limits.__file__).parent / "attacks"
#: the runtime and the orchestration above the attacks
ABOVE = {"workers", "allocator", "ray_backend", "certify", "cli", "sweep", "sweep_backends", "sweep_cli", "report"}


def _imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return names


def test_no_attack_imports_the_runtime_above_it():
    above = {f"guardfl.redteam.{m}" for m in ABOVE}
    reached = {f"{p.name}: {name}" for p in sorted(ATTACKS.glob("*.py")) for name in _imported(p) if name in above}
    assert reached == set()


def test_the_runtime_re_exports_the_shared_sizes():
    assert workers.LARGE_MODEL == limits.LARGE_MODEL == 2_000_000
    assert allocator.MMAP_THRESHOLD == limits.MMAP_THRESHOLD == 32 << 20
