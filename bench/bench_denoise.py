"""What the server's filter on its reads changes (``denoise``, docs/research/malicious-server.md section 23).

    python bench/bench_denoise.py [--config configs/research/malicious-adaptive-clip.yaml] [--clips 0.1 0.3]
                                  [--budgets 1 2 4 16] [--defense-seeds 0] [--json bench/results/denoise.json]

For each clip x round budget x defense seed, the config is certified twice on the same updates (the
defense's seed pinned, so both runs attack the same rounds' noise; the trap fit's shadows draw their own,
so its choice of size can differ between the two): every attack with ``denoise: off`` (the
raw reads) and with ``denoise: auto`` (the filter the server calibrates on its auxiliary images). Per run:
the verdict, the faces past their limit, the worst SSIM and which attack read it; and the wall time of the
filtered run over the raw one, taken in the same process (a busy machine slows both alike). Attacks
without a ``denoise`` option (``exclusive_neurons``, ``seer``) run the same way in both.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def filtering() -> set[str]:
    """The registered attacks with a ``denoise`` option."""
    from guardfl.redteam.attacks.registry import ATTACKS

    return {name for name, cls in ATTACKS.items() if "denoise" in cls.Config.model_fields}


def variant(cfg: dict, clip: float, budget: int, seed: int, mode: str) -> dict:
    """``cfg`` with the defense's clip and seed, the client's round budget and every filtering attack's
    ``denoise`` set."""
    out, names = copy.deepcopy(cfg), filtering()
    out["defense"] = {**out["defense"], "clip": clip, "seed": seed}
    out["client"] = {**out["client"], "max_rounds": budget}
    for attack in out["attacks"]:
        if attack["name"] in names:
            attack["budget"] = {**(attack.get("budget") or {}), "denoise": mode}
    return out


def certify_once(cfg: dict) -> tuple[dict, float]:
    from guardfl.redteam.certification.run import certify

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(yaml.safe_dump(cfg))
        start = time.perf_counter()
        cert = certify(path, out=Path(tmp) / "out")
        seconds = time.perf_counter() - start
    worst, by = 0.0, ""
    for result in cert.results:
        values = [p["ssim"] for p in (result.get("metrics") or {}).get("per_image", [])]
        if values and max(values) > worst:
            worst, by = max(values), result["attack"]
    leak = next((c["note"] for c in cert.checks if c.get("metric") == "leak_rate"), "")
    return {"status": cert.status, "worst": round(worst, 3), "by": by, "leak": leak}, seconds


def line(r: dict) -> str:
    """One run's verdict, leaked faces and worst read, for the table."""
    return f"{r['status']:<14} {r['leak'].split(' private')[0]:<8} worst {r['worst']:.2f} ({r['by']})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "research" / "malicious-adaptive-clip.yaml")
    ap.add_argument("--clips", nargs="+", type=float, default=[0.1, 0.3])
    ap.add_argument("--budgets", nargs="+", type=int, default=[1, 2, 4, 16])
    ap.add_argument("--defense-seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "denoise.json"))
    args = ap.parse_args()
    cfg = yaml.safe_load(args.config.read_text())
    for section in ("data", "aux"):  # paths in the config are relative to it
        if cfg.get(section, {}).get("path"):
            cfg[section]["path"] = str((args.config.parent / cfg[section]["path"]).resolve())
    rows = []
    print(f"{'clip':>5} {'rounds':>6} {'seed':>4}  {'raw reads':<44} {'filtered reads':<44} time x")
    for clip in args.clips:
        for budget in args.budgets:
            for seed in args.defense_seeds:
                raw, t_raw = certify_once(variant(cfg, clip, budget, seed, "off"))
                filtered, t_filtered = certify_once(variant(cfg, clip, budget, seed, "auto"))
                rows.append({"clip": clip, "rounds": budget, "defense_seed": seed, "raw": raw, "filtered": filtered,
                             "seconds_raw": round(t_raw, 1), "seconds_filtered": round(t_filtered, 1)})
                print(f"{clip:>5g} {budget:>6} {seed:>4}  {line(raw):<44} {line(filtered):<44} {t_filtered / t_raw:.2f}",
                      flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"config": str(args.config), "rows": rows}, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
