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
    """Exit 0: valid (warnings, if any, on stderr); 1: valid but warnings with --strict; 2: invalid."""
    from guardfl.check import check_config
    from guardfl.errors import ConfigError

    try:
        summary, warnings = check_config(args.config, model=args.model, input_shape=args.input_shape,
                                         num_classes=args.num_classes)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"ok: {summary}")
    for line in warnings:
        print(f"warning: {line}", file=sys.stderr)
    return 1 if warnings and args.strict else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="guardfl", description="Defenses for federated-learning clients against gradient inversion."
    )
    parser.add_argument("--version", action="version", version=f"guardfl {__version__}")
    sub = parser.add_subparsers(dest="command")
    p = sub.add_parser("defenses", help="list the available defenses")
    p.add_argument("-v", "--verbose", action="store_true", help="also print each config's fields")
    p.set_defaults(func=_cmd_defenses)
    from guardfl.redteam.cli.redteam import add_parser as add_redteam

    add_redteam(sub)
    from guardfl.redteam.cli.sweep import add_parser as add_sweep

    add_sweep(sub)
    from guardfl.redteam.cli.bound import add_parsers as add_bounds

    add_bounds(sub)
    p = sub.add_parser(
        "check", help="validate a defense config (YAML file); with --model, warn about layers it never changes",
        description="Validate a defense config: a defense YAML file, or a red-team config (its 'defense' section, "
                    "checked against its built-in 'model'). Zero-strength settings are errors. With a model, every "
                    "parameter tensor the setting never changes is a warning. Exit 0: valid; 1: warnings with "
                    "--strict; 2: invalid.")
    p.add_argument("config", help="path to a YAML file with a defense config (or a red-team config)")
    p.add_argument("--model", help="a built-in model name (lenet, resnet18, ...) to check the setting against; "
                                    "'module:callable' imports and runs that code")
    p.add_argument("--input-shape", type=int, nargs=3, metavar=("C", "H", "W"), help="the model's input shape, C in "
                   "[1, 16], H and W in [1, 1024] (default: the config's model.input_shape, else 3 32 32)")
    p.add_argument("--num-classes", type=int, help="the model's classes, in [2, 100000] (default: the config's, else 10)")
    p.add_argument("--strict", action="store_true", help="exit 1 when there are warnings")
    p.set_defaults(func=_cmd_check)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The ``guardfl`` command (``redteam``, ``sweep``, ``check``, ...; the reference's Command line page).

    Args:
        argv: the arguments after ``guardfl``; ``None``: ``sys.argv[1:]``.

    Returns:
        The exit status: for ``redteam``, 0 CERTIFIED, 1 NOT CERTIFIED, 3 INCONCLUSIVE, 2 a failed run.
    """
    try:
        parser = build_parser()
    except ModuleNotFoundError as err:
        if (err.name or "").startswith("guardfl."):
            # redteam/ and integrations/ become guardfl.redteam / guardfl.integrations only when installed:
            # running from a source folder that shadows the installed package (or with none installed) lands here
            print(f"error: {err.name} is not importable: install guardfl (pip install -e . in the repository) "
                  "and run it from outside a source checkout that is not the installed one", file=sys.stderr)
            return 2
        raise
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
