"""The ``guardfl`` command line."""

from __future__ import annotations

import argparse
import json
import sys

from guardfl._version import __version__


def _cmd_defenses(args: argparse.Namespace) -> int:
    from guardfl.defenses import REGISTRY

    for kind in sorted(REGISTRY):
        cls = REGISTRY[kind]
        doc = (cls.__doc__ or "").strip().splitlines()[0]
        print(f"{kind:10s} {cls.__name__:16s} {doc}")
        if args.verbose:
            schema = cls.Config.model_json_schema()
            print("  " + json.dumps(schema.get("properties", {})))
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    from guardfl.defenses import from_config
    from guardfl.errors import ConfigError

    try:
        defense = from_config(args.config)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"ok: {defense!r}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="guardfl", description="Defenses for federated-learning clients against gradient inversion."
    )
    parser.add_argument("--version", action="version", version=f"guardfl {__version__}")
    sub = parser.add_subparsers(dest="command")
    p = sub.add_parser("defenses", help="list the available defenses")
    p.add_argument("-v", "--verbose", action="store_true", help="also print each config's fields")
    p.set_defaults(func=_cmd_defenses)
    from guardfl.redteam.cli import add_parser as add_redteam

    add_redteam(sub)
    p = sub.add_parser("check", help="validate a defense config (YAML file)")
    p.add_argument("config", help="path to a YAML file with a defense config")
    p.set_defaults(func=_cmd_check)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
