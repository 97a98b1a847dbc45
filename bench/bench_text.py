"""TAG vs learned inversion (and the embedding readout) on a causal LM, the direction of Wu et al. 2023,
Table 3(b).

    python bench/bench_text.py [--seq-lens 16,32] [--batch-sizes 1,4] [--targets 4]
                               [--defenses none,sign,prune,gauss] [--strength quick|paper]
                               [--tag-iterations N] [--aux 2000] [--model transformer3|transformer3-tied]
                               [--labels inferred|known] [--out PATH]
    python bench/bench_text.py --table RESULTS.json [RESULTS.json ...]   # a markdown table of saved runs

Setting: ``transformer3`` (3 layers, width 96, 8 heads, learned positions, the GPT-2 BPE vocabulary of
50,257 tokens; every weight trained, so the token embedding's gradient is in the update) on the built-in
text (CPython's ``pydoc_data/topics``), FedSGD, labels NOT granted (a causal LM's labels are its text).
``--model transformer3-tied`` is Wu et al.'s own setting (the embedding, tied to the output layer, is
frozen: no token-bag leak). Defenses as Wu et al. Sec. 4.2 for the causal LM: none, SignCompression,
GradPrune 0.99, GaussianNoise sigma 0.01, applied to the BATCH gradient (a real client).

Data: the built-in text cut into non-overlapping windows of ``seq_len`` tokens (``textdata.sequences``,
duplicates removed): the first ``--targets x B`` windows of an interleaved order are the private samples,
the next ``--aux`` are the attacker's auxiliary text (disjoint by content: checked). Both attacks see the
same observations in the same run.

Prints ROUGE-1/2/L, token accuracy (after matching) and the bag-of-words recall, means over the targets,
for each attack and for the certificate's baseline ``prior`` (the attacker's no-update guess: the most
frequent auxiliary token at each position), with wall times, and the paper's Table 3(b) row for the defense (TAG / LTI, %). Writes
JSON to ``--out`` (default ``bench/results/text.json``). Not a test: run it on a quiet machine; report
threads and device. The paper-comparable TAG is ``--model transformer3-tied --labels known`` (Wu et al.
freeze the embedding; without the next tokens TAG on the tied model recovers nothing here).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from guardfl.redteam import FedSGD, ThreatModel, attacks, simulate_client
from guardfl.redteam.auxdata import AuxData
from guardfl.redteam.certification.batches import prior_guess
from guardfl.redteam.modality.text.data import builtin_text, sequences
from guardfl.redteam.modality.text.metrics import evaluate_text
from guardfl.redteam.modality.text.models import TEXT_MODELS, next_token_labels
from guardfl.redteam.modality.text.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results"

DEFENSES = {
    "none": None,
    "sign": {"kind": "sign"},
    "prune": {"kind": "gradprune", "ratio": 0.99},
    "gauss": {"kind": "gaussian", "sigma": 0.01},
}
#: Wu et al. 2023, Table 3(b) (causal LM on WikiText, B = 1): defense -> method -> (acc, R-1, R-2, R-L) in %
PAPER = {
    "none": {"tag": (74.13, 71.92, 50.64, 68.46), "lti": (89.61, 86.91, 80.68, 86.90)},
    "sign": {"tag": (100.0, 100.0, 100.0, 100.0), "lti": (71.15, 64.35, 45.40, 64.29)},
    "prune": {"tag": (34.34, 48.50, 10.21, 35.60), "lti": (70.80, 64.24, 45.79, 64.15)},
    "gauss": {"tag": (64.34, 66.19, 37.86, 59.55), "lti": (82.49, 78.75, 67.06, 78.71)},
}
METRICS = ("rouge1", "rouge2", "rougeL", "token_acc", "bag")


def _means(rows: list[dict]) -> dict[str, float | None]:
    out = {}
    for key in METRICS:
        values = [r[key] for r in rows if r.get(key) is not None]
        out[key] = float(np.mean(values)) if values else None
    return out


def _scores(guesses: list, private, tok) -> dict[str, float | None]:
    """Mean metrics of one guess ``(B, L)`` per client update against that update's B private sequences
    (update t holds ``private[t * B : (t + 1) * B]``)."""
    per = []
    for t, guess in enumerate(guesses):
        b = guess.shape[0]
        per += evaluate_text(guess, private[t * b : (t + 1) * b], tok)["per_image"]
    return _means(per)


def column(row: dict, args: dict) -> str:
    """A table column: the attack and the budget it ran at, so that runs at different budgets (TAG's
    iterations, learned inversion's auxiliary text) never share a cell. Rows saved before the budget was
    recorded show the arguments they were run with."""
    name = row["attack"]
    if name == "tag":
        iterations = (row.get("budget") or {}).get("iterations") or args.get("tag_iterations")
        return f"tag {iterations} it." if iterations else f"tag ({args.get('strength', 'quick')})"
    if name == "learned_inversion":
        return f"learned_inversion aux {row.get('aux') or args.get('aux')}"
    return name


def table(paths: list[str]) -> str:
    """A markdown table of the rows of saved runs: one line per (model, labels, L, B, defense), a column
    per attack with token accuracy / ROUGE-1 / ROUGE-2 / ROUGE-L, the seconds per update and, for an attack
    that prepares (learned inversion), the once-per-setting preparation's seconds."""
    cells: dict[tuple, dict[str, dict]] = {}
    names: list[str] = []
    for path in paths:
        run = json.loads(Path(path).read_text())
        for row in run["rows"]:
            key = (run["args"]["model"], run["args"]["labels"], row["seq_len"], row["batch"], row["defense"])
            name = column(row, run["args"])
            earlier = cells.get(key, {}).get(name)
            if earlier is not None and any(earlier[m] != row[m] for m in METRICS):
                print(f"warning: {path}: {key} {name} repeats an earlier file's cell; the later one is shown",
                      file=sys.stderr)
            cells.setdefault(key, {})[name] = row
            names += [name] if name not in names else []
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    lines = ["| model, labels | L | B | defense | " + " | ".join(f"{n}: acc / R1 / R2 / RL (s per update)" for n in names) + " |",
             "|---|---|---|---|" + "---|" * len(names)]
    for (model, labels, seq_len, b, defense), by in cells.items():
        parts = []
        for n in names:
            r = by.get(n)
            if r is None:
                parts.append("")
                continue
            per = (r["seconds"] - r["prepare_seconds"]) / r["targets"]
            prep = f" + {r['prepare_seconds']:.0f} prep" if r["prepare_seconds"] else ""
            parts.append(" / ".join(fmt(r[k]) for k in ("token_acc", "rouge1", "rouge2", "rougeL")) + f" ({per:.1f}{prep})")
        lines.append(f"| {model}, {labels} | {seq_len} | {b} | {defense} | " + " | ".join(parts) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-lens", default="16,32")
    ap.add_argument("--batch-sizes", default="1,4")
    ap.add_argument("--targets", type=int, default=4, help="client updates attacked per cell")
    ap.add_argument("--defenses", default="none,sign,prune,gauss")
    ap.add_argument("--strength", default="quick", choices=("quick", "paper"))
    ap.add_argument("--tag-iterations", type=int, default=None)
    ap.add_argument("--aux", type=int, default=2000, help="auxiliary windows (LTI's training text)")
    ap.add_argument("--model", default="transformer3", choices=sorted(k for k in TEXT_MODELS if k.startswith("transformer")))
    ap.add_argument("--attacks", default="tag,learned_inversion,embedding_readout")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--labels", default="inferred", choices=("inferred", "known"),
                    help="known: grant the attacks the next tokens (a causal LM's labels are its text: a what-if)")
    ap.add_argument("--out", default=str(OUT / "text.json"), help="where the JSON goes")
    ap.add_argument("--table", nargs="+", metavar="JSON", help="print a markdown table of saved runs and exit")
    args = ap.parse_args()
    if args.table:
        print(table(args.table))
        return

    tok = load_tokenizer("gpt2")
    text = builtin_text()
    rows = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every row: a long run that is stopped keeps what it measured
        out.write_text(json.dumps({"args": vars(args), "threads": torch.get_num_threads(), "rows": rows}, indent=2))
    print(f"threads {torch.get_num_threads()}, device cpu, model {args.model}, strength {args.strength}, labels {args.labels}")
    for seq_len in [int(s) for s in args.seq_lens.split(",")]:
        windows = sequences(text, tok, seq_len)
        order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(args.seed))
        for b in [int(s) for s in args.batch_sizes.split(",")]:
            need = args.targets * b
            private = windows[order[:need]]
            aux_x = windows[order[need : need + args.aux]]
            aux = AuxData(aux_x, next_token_labels(aux_x), name="builtin-text")
            aux.check_disjoint(private)
            model = TEXT_MODELS[args.model](tok.vocab_size, None)
            torch.manual_seed(args.seed)
            for m in model.modules():
                if hasattr(m, "reset_parameters") and m is not model:
                    m.reset_parameters()
            for dname in args.defenses.split(","):
                defense = DEFENSES[dname]
                observations = []
                for t in range(args.targets):
                    x = private[t * b : (t + 1) * b]
                    cfg = None if defense is None else {**defense, "seed": 1000 + t}
                    observations.append(simulate_client(model, x, next_token_labels(x), cfg, FedSGD()))
                threat = ThreatModel(labels=args.labels, aux=aux)
                guess = prior_guess(aux)  # the certificate's baseline: the no-update guess, per position
                rows.append({"seq_len": seq_len, "batch": b, "defense": dname, "attack": "prior",
                             **_scores([guess.expand(b, -1)] * args.targets, private, tok),
                             "seconds": 0.0, "prepare_seconds": 0.0, "targets": args.targets})
                for name in [n for n in args.attacks.split(",") if n]:  # --attacks "": the prior alone
                    cls = attacks.ATTACKS[name]
                    budget = cls.budget_for(args.strength)
                    if name == "tag" and args.tag_iterations:
                        budget["iterations"] = args.tag_iterations
                    attack = attacks.get(name, **budget, seed=args.seed)
                    t0 = time.time()
                    prep = 0.0
                    if cls.capabilities.prepares:
                        attack.prepare(attacks.Setting.of(observations[0]), threat)
                        prep = time.time() - t0
                    recs = attack.reconstruct_many(observations, threat, [args.seed + t for t in range(args.targets)])
                    seconds = time.time() - t0
                    mean = _scores([rec.inputs for rec in recs], private, tok)
                    paper = PAPER.get(dname, {}).get("lti" if name == "learned_inversion" else name)
                    row = {"seq_len": seq_len, "batch": b, "defense": dname, "attack": name, **mean,
                           "budget": budget, "aux": args.aux if cls.capabilities.prepares else None,
                           "seconds": seconds, "prepare_seconds": prep, "targets": args.targets,
                           "paper_b1_percent": paper, "example": {"truth": tok.decode(private[0].tolist()),
                                                                  "recon": tok.decode(recs[0].inputs[0].tolist())}}
                    rows.append(row)
                    save()
                    fmt = lambda v: "  -  " if v is None else f"{v:5.2f}"  # noqa: E731
                    print(f"L={seq_len:2d} B={b} {dname:6s} {name:17s} R1 {fmt(mean['rouge1'])} R2 {fmt(mean['rouge2'])} "
                          f"RL {fmt(mean['rougeL'])} acc {fmt(mean['token_acc'])} bag {fmt(mean['bag'])}  "
                          f"{seconds:6.1f} s (prep {prep:5.1f})  paper B=1 acc/R1/R2/RL {paper}", flush=True)
    save()
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
