"""The red team's house: subpackages are layers, imports only go down, no cycle (lazy imports included),
small modules. The layers, lowest first:

1. ``runtime`` (files, limits, workers, Ray, allocator, user references): runs anything, knows no attack;
2. ``modality`` (image and text data, models, metrics);
3. the shared vocabulary at the root (``threat``, ``auxdata``) and ``client`` (what leaves the client);
4. ``attacks``;
5. ``config`` and ``config_sections`` (the typed config, parsed at the edge) and ``certification`` (plan,
   batches, runner, judge, the certificate);
6. ``sweep`` (its config, utility training, autotune, backends);
7. ``reports`` (pages of certificates and sweeps: they read results, they run nothing);
8. the entry points that run and then write a page: ``certification.run`` and ``sweep.run``;
9. ``cli``; 10. the package's public namespace.

A name may be given a layer of its own (``certification.run``): the longest matching prefix wins.
"""

from __future__ import annotations

import ast
from pathlib import Path

import guardfl.redteam

ROOT = Path(guardfl.redteam.__file__).parent
PACKAGE = "guardfl.redteam"

#: layer of each top-level name under guardfl.redteam (a subpackage or a root module)
LAYERS = {
    "runtime": 1,
    "modality": 2,
    "threat": 3, "auxdata": 3, "client": 3,
    "attacks": 4,
    "config": 5, "config_sections": 5, "certification": 5,
    "sweep": 6,
    "reports": 7,
    "certification.run": 8, "sweep.run": 8,
    "cli": 9,
    "__init__": 10,
}

#: debts of the restructuring (issue 38), each to be paid and removed; nothing may be added here
KNOWN_UP: set[str] = set()
KNOWN_CYCLES: list[list[str]] = []
KNOWN_BIG: set[str] = set()

#: the most lines a module may have (the issue's "~400")
MAX_LINES = 420


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join([PACKAGE, *parts]) if parts != ["__init__"] else PACKAGE] = path
    return out


def imports(path: Path, names: set[str]) -> set[str]:
    """The red-team modules ``path`` imports anywhere in its body (lazy imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGE):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in names else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith(PACKAGE)}
    return {n for n in found if n in names}


def graph() -> dict[str, set[str]]:
    mods = modules()
    names = set(mods)
    return {m: imports(p, names) - {m} for m, p in mods.items()}


def layer(module: str) -> int:
    if module == PACKAGE:
        return LAYERS["__init__"]
    parts = module[len(PACKAGE) + 1 :].split(".")
    return next(LAYERS[".".join(parts[:k])] for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in LAYERS)


def test_every_module_has_a_layer():
    missing = {m for m in modules() if m != PACKAGE and m[len(PACKAGE) + 1 :].split(".")[0] not in LAYERS}
    assert missing == set()


def test_imports_only_go_down_the_layers():
    g = graph()
    up = {f"{m} -> {d}" for m, deps in g.items() for d in deps if layer(d) > layer(m)}
    assert sorted(up - KNOWN_UP) == []
    assert sorted(KNOWN_UP - up) == [], "paid: remove from KNOWN_UP"


def test_no_import_cycle_lazy_or_not():
    g = graph()
    # a package's __init__ importing its own modules is how a registry fills; modules reach siblings directly
    for m in g:
        g[m] = {d for d in g[m] if not m.startswith(d + ".")}
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    assert sorted(c for c in cycles if c not in KNOWN_CYCLES) == []
    assert sorted(c for c in KNOWN_CYCLES if c not in cycles) == [], "paid: remove from KNOWN_CYCLES"


def test_no_attack_imports_the_runtime_that_runs_it():
    """Attacks need the shared sizes (``runtime.limits``) and the state files, never the workers or Ray."""
    g = graph()
    running = {f"{PACKAGE}.runtime.{m}" for m in ("workers", "ray_backend", "allocator")}
    reached = sorted(f"{m}: {d}" for m, deps in g.items() if m.startswith(f"{PACKAGE}.attacks") for d in deps & running)
    assert reached == []


def test_modules_are_small():
    big = {m for m, p in modules().items() if len(p.read_text().splitlines()) > MAX_LINES}
    assert sorted(big - KNOWN_BIG) == []
    assert sorted(KNOWN_BIG - big) == [], "paid: remove from KNOWN_BIG"


def test_every_module_states_its_purpose():
    missing = sorted(m for m, p in modules().items() if not ast.get_docstring(ast.parse(p.read_text())))
    assert missing == []


#: the most lines a function may have (the issue's "~60")
MAX_FUNCTION_LINES = 60
KNOWN_LONG: set[str] = set()


def test_functions_are_short():
    long = set()
    for m, p in modules().items():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= MAX_FUNCTION_LINES:
                long.add(f"{m}:{node.name}")
    assert sorted(long - KNOWN_LONG) == []
    assert sorted(KNOWN_LONG - long) == [], "paid: remove from KNOWN_LONG"


#: the modality names, and the per-modality lists of sources or models a branch would test membership in
#: (``source in TEXT_SOURCES``); a registry keyed by the modality's name (``TEXT_MATHS[setting.modality]``) is
#: a lookup, not a branch
MODALITY_NAMES = {"image", "text"}
MODALITY_LISTS = (("TEXT_", "IMAGE_"), ("SOURCES", "MODELS"))


def modality_branches(tree: ast.AST) -> list[str]:
    """Comparisons that branch on a modality's name: a string ``'image'`` / ``'text'`` against anything that
    names a modality (``cfg.modality == "text"``), or membership in a per-modality list of sources or models
    (``name not in TEXT_MODELS``)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        named = any(isinstance(s, ast.Constant) and s.value in MODALITY_NAMES for s in sides)
        if named and any("modality" in ast.unparse(s).lower() for s in sides if not isinstance(s, ast.Constant)):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        for op, right in zip(node.ops, node.comparators):
            if isinstance(op, (ast.In, ast.NotIn)) and isinstance(right, (ast.Name, ast.Attribute)):
                last = right.id if isinstance(right, ast.Name) else right.attr
                if last.upper().startswith(MODALITY_LISTS[0]) and last.upper().endswith(MODALITY_LISTS[1]):
                    found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_modality_name_is_compared_outside_modality():
    """What differs between images and text is asked of the ``Modality`` registry (its fields and hooks),
    never decided by comparing its name: only ``modality/`` may."""
    inside = f"{PACKAGE}.modality"
    found = sorted(f"{m}:{hit}" for m, p in modules().items() if m != inside and not m.startswith(inside + ".")
                   for hit in modality_branches(ast.parse(p.read_text())))
    assert found == []


def test_the_modality_check_sees_a_branch():
    code = ('if cfg.modality == "text": pass\nif "image" != modality.of(cfg).name: pass\n'
            'if source in TEXT_SOURCES: pass\nif name not in IMAGE_MODELS: pass\n'
            'if m.tokenized and name == "text-classifier": pass\nif setting.modality in TEXT_MATHS: pass\n')
    assert [hit.split(":")[0] for hit in modality_branches(ast.parse(code))] == ["1", "2", "3", "4"]
