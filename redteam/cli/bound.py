"""``guardfl bound --config X.yaml``: the proven reconstruction bound of a configured client, and
``guardfl calibrate``: the least noise that proves a target bound (from flags, or from a config's client).

Exit status of ``bound``: 0 PROVEN (the bound is below ``certify.max_leak_rate``), 1 NOT PROVEN (a bound
above the claim, or none computable: the reason is printed), 2 bad input or a defense without a mechanism
(one line naming the field). ``calibrate``: 0 with the noise printed, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys

from guardfl.errors import GuardflError


def add_parsers(sub) -> None:
    p = sub.add_parser(
        "bound", help="the proven bound on reconstruction success of a red-team config's client (ReRo)",
        description="Print the reconstruction-robustness bound of the configured client: any attacker whose prior "
                    "succeeds with probability kappa succeeds with probability at most the bound (Hayes et al. 2023; "
                    "Kaissis et al. 2023). kappa: --kappa, else certify.kappa, else estimated from the config's "
                    "auxiliary data against its private samples. Exit status: 0 PROVEN (below certify.max_leak_rate); "
                    "1 NOT PROVEN; 2 bad input, or a defense without a mechanism.")
    p.add_argument("--config", required=True, help="a red-team YAML (its client, defense and certify sections)")
    p.add_argument("--kappa", type=float, default=None, help="the prior's baseline in (0, 1) (default: certify.kappa, "
                   "else estimated from aux)")
    p.add_argument("--rounds", type=int, default=None, help="rounds the client answers (default: client.max_rounds)")
    p.add_argument("--json", action="store_true", help="print the certificate's bound entry as JSON")
    p.set_defaults(func=run_bound)
    c = sub.add_parser(
        "calibrate", help="the least noise that proves a bound on reconstruction success",
        description="The least DP-SGD noise multiplier (or update sigma / Laplace scale for a clip) whose bound on "
                    "reconstruction success over --rounds rounds is at most --rero for a prior of baseline --kappa, "
                    "as Opacus's get_noise_multiplier does for epsilon. With --config: the rate, steps, rounds, clip "
                    "and mechanism of that config's client. Exit status: 0 found; 2 bad input.")
    c.add_argument("--rero", type=float, required=True, help="the target bound, in (kappa, 1)")
    c.add_argument("--kappa", type=float, default=None, help="the prior's baseline, in (0, 1) (with --config: "
                   "default certify.kappa)")
    c.add_argument("--rounds", type=int, default=None, help="the client's round budget (with --config: default "
                   "client.max_rounds)")
    c.add_argument("--config", default=None, help="a red-team YAML whose client and defense give the rest")
    c.add_argument("--mechanism", choices=["dpsgd", "gaussian", "laplace"], default=None, help="default dpsgd")
    c.add_argument("--sample-rate", type=float, default=None, help="DP-SGD's Poisson rate (default 1)")
    c.add_argument("--steps-per-round", type=int, default=None, help="local steps a round (default 1)")
    c.add_argument("--clip", type=float, default=None, help="the update's clip (gaussian, laplace)")
    c.add_argument("--dimension", type=int, default=None, help="entries the Laplace noise covers")
    c.add_argument("--json", action="store_true", help="print JSON")
    c.set_defaults(func=run_calibrate)


def _fail(err: Exception) -> int:
    print(f"error: {str(err).splitlines()[0] if str(err) else type(err).__name__}", file=sys.stderr)
    return 2


def run_bound(args: argparse.Namespace) -> int:
    try:
        entry = config_bound(args.config, args.kappa, args.rounds)
    except (GuardflError, ValueError) as err:
        return _fail(err)
    if entry["status"] == "NO MECHANISM":
        return _fail(GuardflError(f"defense: no proven bound: {entry['reason']}"))
    if args.json:
        print(json.dumps(entry, indent=2))
    else:
        print(f"{entry['status']}: bound {entry['rero'] if entry['rero'] is None else format(entry['rero'], '.4g')} on "
              f"reconstruction success (claim {entry['claim']:g}), kappa {entry['kappa']} ({entry['kappa_source']})")
        for key in ("mechanism", "rounds", "steps", "neighbouring", "accountant", "assumption", "reason"):
            if entry.get(key) not in (None, ""):
                print(f"  {key}: {entry[key]}")
    return 0 if entry["status"] == "PROVEN" else 1


def config_bound(path: str, kappa: float | None = None, rounds: int | None = None) -> dict:
    """The certificate's bound entry of the config at ``path`` (kappa: ``kappa``, else ``certify.kappa``, else
    estimated from its auxiliary data against its population, the data section's samples; ``rounds`` overrides
    ``client.max_rounds``)."""
    from guardfl.bounds.checks import check_count, check_kappa
    from guardfl.redteam.certification.batches import BatchSource, load_aux
    from guardfl.redteam.certification.bound import run_bound
    from guardfl.redteam.config import load_config

    cfg = load_config(path)
    if kappa is not None:
        check_kappa(kappa, "--kappa")
    if rounds is not None:
        from guardfl.integrations.budget import MAX_ROUNDS_LIMIT

        check_count(rounds, "--rounds", 1, MAX_ROUNDS_LIMIT)
        cfg = cfg.model_copy(update={"client": cfg.client.model_copy(update={"max_rounds": rounds})})
    if kappa is not None:
        cfg = cfg.model_copy(update={"certify": cfg.certify.model_copy(update={"kappa": kappa})})
    aux = load_aux(cfg) if cfg.certify.kappa is None else None
    source = BatchSource(cfg, None, aux) if cfg.target is None else None
    entry = run_bound(cfg, aux, source.x_all if source is not None else None, source.model if source is not None else None)
    if kappa is not None:
        entry["kappa_source"] = "--kappa"
    return entry


def run_calibrate(args: argparse.Namespace) -> int:
    from guardfl.bounds import calibrate

    try:
        kwargs = _calibration_arguments(args)
        noise = calibrate(**kwargs)
    except (GuardflError, ValueError) as err:
        return _fail(err)
    name = {"dpsgd": "noise_multiplier", "gaussian": "sigma", "laplace": "scale"}[kwargs["mechanism"]]
    if args.json:
        print(json.dumps({name: noise, **kwargs}))
    else:
        print(f"{name} {noise:.6g}: the least {kwargs['mechanism']} noise whose bound on reconstruction success is at "
              f"most {kwargs['rero']:g} at kappa {kwargs['kappa']:g} over {kwargs['rounds']} round(s) x "
              f"{kwargs['steps_per_round']} step(s)")
    return 0


def _calibration_arguments(args: argparse.Namespace) -> dict:
    """calibrate's keyword arguments from the flags, the config's client filling what they leave out."""
    from guardfl.errors import ConfigError

    kw = dict(rero=args.rero, kappa=args.kappa, rounds=args.rounds, mechanism=args.mechanism or "dpsgd",
              sample_rate=1.0 if args.sample_rate is None else args.sample_rate,
              steps_per_round=args.steps_per_round or 1, clip=args.clip, dimension=args.dimension)
    if args.config is not None:
        kw.update(_from_config(args.config, args))
    for name in ("kappa", "rounds"):
        if kw[name] is None:
            raise ConfigError(f"--{name}: required (or certify.{name if name == 'kappa' else 'max_rounds'} in --config)"
                              if args.config else f"--{name}: required")
    return kw


def _from_config(path: str, args: argparse.Namespace) -> dict:
    from guardfl.bounds import Unbounded, analyse
    from guardfl.errors import ConfigError
    from guardfl.redteam.certification.bound import client_facts
    from guardfl.redteam.config import load_config

    cfg = load_config(path)
    client = client_facts(cfg)
    found = analyse(cfg.defense, client)
    if isinstance(found, Unbounded):
        raise ConfigError(f"defense: nothing to calibrate: {found.reason}")
    m = found[0]
    out = {"mechanism": args.mechanism or ("dpsgd" if m.leaf == "dpsgd" else m.leaf),
           "steps_per_round": args.steps_per_round or m.steps_per_round}
    if out["mechanism"] == "dpsgd":
        out["sample_rate"] = m.sample_rate if args.sample_rate is None else args.sample_rate
    else:
        out["clip"] = args.clip if args.clip is not None else m.params.get("clip")
        out["dimension"] = args.dimension if args.dimension is not None else m.params.get("dimension")
    if args.kappa is None:
        out["kappa"] = cfg.certify.kappa
    if args.rounds is None:
        out["rounds"] = cfg.client.max_rounds
    return out
