"""The report's view of a text client: per client update, the private sentences and every attack's
reconstruction side by side, token by token, recovered tokens highlighted (green: the right token at the
right position; amber: a token of the private sample at another position, the bag-of-words leak)."""

from __future__ import annotations

import html
from collections import Counter
from typing import Any

import torch

from guardfl.redteam.modality.text.tokenizer import load_tokenizer
from guardfl.redteam.reports.page import fmt

#: the per-sample text metrics the report shows, in order
COLUMNS = (("rouge1", "ROUGE-1"), ("rouge2", "ROUGE-2"), ("rougeL", "ROUGE-L"), ("token_acc", "token acc"), ("bag", "bag of words"))

STYLE = """
.tok { font-family: ui-monospace, monospace; font-size: 0.85em; white-space: pre-wrap; }
.tok span { border-radius: 3px; padding: 0 1px; }
.hit { background: #b7e4c0; } .bag { background: #ffe08a; }
"""


def tokens_html(ids: list[int], truth: list[int], tokenizer, ignore: tuple[int, ...] = ()) -> str:
    """The tokens of ``ids`` as HTML, each marked against the private ``truth``: ``hit`` (same token at this
    position), ``bag`` (a token of the private sample elsewhere), none (not in it). Padding (``ignore``)
    is left out."""
    texts = tokenizer.tokens(ids)
    left = Counter(t for t in truth if t not in ignore)
    for i, t in enumerate(ids):  # exact positions consume the bag first
        if i < len(truth) and t == truth[i] and t not in ignore:
            left[t] -= 1
    out = []
    for i, (t, text) in enumerate(zip(ids, texts)):
        if t in ignore:
            continue
        if i < len(truth) and t == truth[i]:
            cls = "hit"
        elif left[t] > 0:
            cls, left[t] = "bag", left[t] - 1
        else:
            cls = ""
        out.append(f'<span class="{cls}">{html.escape(text)}</span>' if cls else html.escape(text))
    return "".join(out)


def batch_sections(cert, out=None) -> list[tuple[int, str]]:
    """(update, its section) for every client update (:func:`batch_section`), tokens shown with the
    client's tokenizer; a classifier's end-of-text padding is left out. ``out``: nothing is saved there."""
    tokenizer = load_tokenizer(cert.config["data"]["tokenizer"])
    sections = []
    for b, originals in sorted(cert.originals.items()):
        classifier = any(r["batch"] == b and r.get("metrics", {}).get("summary", {}).get("label_acc") is not None
                         for r in cert.results) or cert.config["model"]["name"] == "text-classifier"
        ignore = (tokenizer.eos_id,) if classifier and tokenizer.eos_id is not None else ()
        sections.append((b, batch_section(cert, b, originals, tokenizer, ignore)))
    return sections


def best_note(cert) -> str:
    """What "best" means in the tables."""
    return '"best" = the most leaking sample; text metrics per sample after matching.'


def batch_section(cert, b: int, originals: torch.Tensor, tokenizer, ignore: tuple[int, ...] = ()) -> str:
    """Client update ``b``: a table per private sample (original, the prior guess, each attack's matched
    reconstruction with its metrics), then the per-attack summary."""
    results = [r for r in cert.results if r["batch"] == b]
    prior = cert.reconstructions.get(f"b{b}-prior")
    prior_rows = cert.priors.get(str(b)) or []
    blocks = []
    for i in range(originals.shape[0]):
        truth = originals[i].tolist()
        plain = "".join(html.escape(t) for t, i in zip(tokenizer.tokens(truth), truth) if i not in ignore)
        rows = [f"<tr><td><b>original</b></td><td class=tok>{plain}</td>"
                + "<td></td>" * len(COLUMNS) + "</tr>"]
        if prior is not None and i < len(prior_rows):
            p = prior_rows[i]
            rows.append(f"<tr><td><i>prior guess</i><br><small>frequent aux tokens, no update</small></td>"
                        f"<td class=tok>{tokens_html(prior[p.get('matched', i)].tolist(), truth, tokenizer, ignore)}</td>"
                        + "".join(f"<td>{_cell(p.get(k))}</td>" for k, _ in COLUMNS) + "</tr>")
        for r in results:
            rec = cert.reconstructions.get(r["job"])
            rows_m = (r.get("metrics") or {}).get("per_image") or []
            if rec is None or i >= len(rows_m):
                continue
            m = rows_m[i]
            rows.append(f"<tr><td>{html.escape(r['attack'])}</td>"
                        f"<td class=tok>{tokens_html(rec[m.get('matched', i)].tolist(), truth, tokenizer, ignore)}</td>"
                        + "".join(f"<td>{_cell(m.get(k))}</td>" for k, _ in COLUMNS) + "</tr>")
        head = "<tr><th></th><th>text (green: right token and position; amber: a private token elsewhere)</th>" + \
            "".join(f"<th>{h}</th>" for _, h in COLUMNS) + "</tr>"
        blocks.append(f"<h3>Sample {i}</h3><table>{head}{''.join(rows)}</table>")
    summary = ["<tr><th>attack</th><th>threat</th>" + "".join(f"<th>{h} best</th>" for _, h in COLUMNS)
               + "<th>label acc</th><th>samples above max ROUGE-1</th><th>time (s)</th></tr>"]
    for r in results:
        s = r["metrics"]["summary"]
        rec_ = r.get("recovered") or {}
        threat = ", ".join(f"{k}={v}" for k, v in r["threat"].items())
        summary.append(f"<tr><td>{html.escape(r['attack'])}</td><td>{html.escape(threat)}</td>"
                       + "".join(f"<td>{_cell(_best(s.get(k)))}</td>" for k, _ in COLUMNS)
                       + f"<td>{_cell(s.get('label_acc'))}</td><td>{rec_.get('above_max_rouge1', '')} of {rec_.get('of', '')}</td>"
                       f"<td>{_cell(r.get('seconds'))}</td></tr>")
    return f"<h2 id=batch-{b}>Client update {b}</h2>{''.join(blocks)}<table>{''.join(summary)}</table>"


def _best(entry: Any):
    return entry.get("best", entry.get("max")) if isinstance(entry, dict) else entry


def _cell(v) -> str:
    """A metric's table cell (empty when it was not measured)."""
    return fmt(v, none="")
