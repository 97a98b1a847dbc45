"""mkdocs-gen-files script: writes the generated pages into the build (never into docs/ on disk).

- reference/{config,defense-config,sweep-config,cli,defenses,attacks,configs,verdicts}.md: ``reference.py``;
- reference/api/*.md: mkdocstrings directives for the public surface, each module's ``__all__``;
- (``hooks.py`` wrote ``build/docs-api/`` first: the package tree mkdocstrings reads)
- how-to/choose-a-defense.md: the hand-written page with its ``<!-- decision-table -->`` marker replaced by
  the table generated from ``docs/data/verdicts.json``.

Any error here fails the build (``mkdocs build --strict``) with the page and the reason.
"""

from __future__ import annotations

import sys
from pathlib import Path

import mkdocs_gen_files

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import reference  # noqa: E402

PAGES = {
    "reference/config.md": reference.config_page,
    "reference/defense-config.md": reference.defense_config_page,
    "reference/sweep-config.md": reference.sweep_config_page,
    "reference/cli.md": reference.cli_page,
    "reference/defenses.md": reference.defenses_page,
    "reference/attacks.md": reference.attacks_page,
    "reference/configs.md": reference.configs_page,
    "reference/verdicts.md": reference.verdicts_page,
}

#: page -> (title, intro, [(module, members or None for the module's __all__)])
API = {
    "reference/api/guardfl.md": ("guardfl", "The defenses' entry points: wrap an optimizer, protect a model, "
                                 "optimizer and loader, inspect a received model; the errors.", [("guardfl", None)]),
    "reference/api/defenses.md": ("guardfl.defenses", "Every defense class, its registry and `from_config`.",
                                  [("guardfl.defenses", None)]),
    "reference/api/bounds.md": ("guardfl.bounds", "Proven bounds on reconstruction (ReRo) and calibration.",
                                [("guardfl.bounds", None)]),
    "reference/api/integrations.md": (
        "guardfl.integrations", "Framework adapters: plain PyTorch loops, Flower and NVIDIA FLARE.",
        [("guardfl.integrations.torch", None), ("guardfl.integrations.flower", None),
         ("guardfl.integrations.nvflare", None), ("guardfl.integrations.round", ["client_round", "RoundResult"]),
         ("guardfl.integrations.update", ["UpdateDefense", "UpdateStats"])]),
    "reference/api/redteam.md": ("guardfl.redteam", "The red team's public entry points: `certify` and its "
                                 "`Certificate`, the client simulation, the threat model; the CLI commands are on "
                                 "[Command line](../cli.md).", [("guardfl.redteam", None), ("guardfl.cli", ["main"])]),
}


def public(module: str) -> list[str]:
    """A module's ``__all__``, without submodules and dunders (the API pages document objects)."""
    import importlib
    import types

    mod = importlib.import_module(module)
    names = getattr(mod, "__all__", None) or [n for n in vars(mod) if not n.startswith("_")]
    return [n for n in names if not n.startswith("__") and not isinstance(getattr(mod, n, None), types.ModuleType)]


def api_page(title: str, intro: str, modules: list[tuple[str, list[str] | None]]) -> str:
    out = [reference.GENERATED.format(script="pages.py", source="the docstrings (mkdocstrings)"), f"# {title}\n",
           intro + "\n"]
    for module, members in modules:
        names = members if members is not None else public(module)
        out.append(f"::: {module}\n    options:\n      show_root_heading: true\n      members:")
        out += [f"        - {n}" for n in names]
        out.append("")
    return "\n".join(out)


for path, make in PAGES.items():
    with mkdocs_gen_files.open(path, "w") as f:
        f.write(make())

for path, spec in API.items():
    with mkdocs_gen_files.open(path, "w") as f:
        f.write(api_page(*spec))

MARKER = "<!-- decision-table -->"
source = (HERE.parent / "how-to" / "choose-a-defense.md").read_text()
if MARKER not in source:
    raise RuntimeError(f"docs/how-to/choose-a-defense.md: the marker {MARKER} is missing")
with mkdocs_gen_files.open("how-to/choose-a-defense.md", "w") as f:
    f.write(source.replace(MARKER, reference.decision_table()))
