"""The certificate's page (``report.html``): its sections composed in the page shell (``page``), the
client batches shown by their modality's view (``image``: PNG grids; ``text``: tokens side by side)."""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from guardfl.redteam import modality
from guardfl.redteam.certification.certificate import Certificate
from guardfl.redteam.reports import image as report_image
from guardfl.redteam.reports.claims import claims_html
from guardfl.redteam.reports import text as report_text
from guardfl.redteam.reports.bound import bound_html
from guardfl.redteam.reports.page import document, fmt, json_pre, verdict_colour, warnings_html
from guardfl.redteam.runtime.files import atomic_write
from guardfl.redteam.certification.judge import rounds_averaged

#: the certificate page's own CSS: the pictures' pixels shown as they are
IMAGE_CSS = "img { image-rendering: pixelated; border: 1px solid #ddd; }\n"


def inspection_line(cert) -> str:
    """The checks an inspecting client ran, and what its opt-in checks (SEER's D-SNR, the leak limit)
    refused, in words."""
    info = (cert.client or {}).get("inspection") or {}
    client = cert.config.get("client") or {}
    line = f"checks: {', '.join(info.get('checks') or []) or 'the defaults'}"
    if not client.get("inspect_disaggregation"):
        line += "; disaggregation (SEER's D-SNR, opt-in) not run"
    else:
        dsnr = [r for r in cert.results if "disaggregation:" in str((r.get("info") or {}).get("refused", ""))]
        line += (f"; the disaggregation check ({info.get('disaggregation_rule', 'D-SNR')}) was among the reasons of "
                 f"{len(dsnr)} refused run(s)")
    if client.get("inspect_leak_limit") is not None:
        limited = [r for r in cert.results if "leak limit:" in str((r.get("info") or {}).get("refused", ""))]
        honest = {r["batch"] for r in limited if (r.get("threat") or {}).get("server") != "malicious"}
        scope = ("across the client's rounds: differences of its updates counted" if client.get("inspect_leak_history", True)
                 else "per update: the client keeps no history, differences of its updates not counted")
        partly = sum(int((r.get("info") or {}).get("refused_queries") or 0) for r in cert.results
                     if "refused" not in (r.get("info") or {}))
        line += (f"; the leak limit ({client['inspect_leak_limit']} samples, {scope}) was among the reasons of {len(limited)} "
                 f"refused run(s), and refused the honest model on {len(honest)} batch(es)")
        if partly:
            line += f"; {partly} model(s) refused within runs that went on with the models accepted"
    return line


def rounds_line(cert) -> str | None:
    """How many rounds a malicious server got from the client (its round budget, ``client.max_rounds``, or
    none), and the most it averaged of one model (``repeats``); None without a malicious-server run."""
    server = [r for r in cert.results if (r.get("threat") or {}).get("server") == "malicious"]
    if not server:
        return None
    averaged = rounds_averaged(server)
    info = [r.get("info") or {} for r in server]
    most = max((int(i.get("rounds_answered", i.get("queries")) or 0) for i in info), default=0)
    past = sum(int(i.get("refused_by_budget") or 0) for i in info)
    budget = (cert.config.get("client") or {}).get("max_rounds")
    got = (f"one attack got up to {most} round{'s' * (most != 1)} of a client batch and averaged up to {averaged} "
           f"of one model")
    if budget is None:
        return (f"the client sets no round budget (client.max_rounds): {got}; the verdict covers no server that "
                f"gets more rounds")
    return (f"the client's round budget is {budget} round{'s' * (budget != 1)} (client.max_rounds): {got}; "
            f"{past} model{'s' * (past != 1)} past the budget refused, nothing sent")


def _where(where: dict | None) -> str:
    if not where:
        return "n/a"
    limit = f', limit there {fmt(where["threshold_here"])}' if where.get("threshold_here") is not None else ""
    return (f'<a href="#batch-{int(where["batch"])}">batch {int(where["batch"])}</a>, sample {html.escape(str(where.get("image")))}, '
            f'{html.escape(str(where.get("attack")))}{limit}')


def _leaked_item(row: dict) -> str:
    """One leaked sample: where, and every (attack, metric, value) past its limit."""
    attacks = ", ".join(sorted({hit["attack"] for hit in row["by"]}))
    hits = "; ".join(f"{hit['attack']} {hit['metric']} {hit['value']:.3f} (limit {hit['limit']:.3f})" for hit in row["by"])
    return f"<li>{_where({'batch': row['batch'], 'image': row['image'], 'attack': attacks})}: {html.escape(hits)}</li>"


def _evidence_html(cert: Certificate) -> str:
    """The claims (``claims``), what was sampled from what, and the breakdowns: per attack and per class."""
    ev, pop = cert.evidence, cert.population
    rate = ev.get("leak_rate")
    if not rate:
        return ""
    if pop:
        source = f"{html.escape(str(pop['source']))}{' (' + html.escape(str(pop['path'])) + ')' if pop.get('path') else ''}"
        unit = modality.of(cert.config).units
        population = (f"{pop.get('updates', '?')} client updates, each {rate['samples_per_update']} distinct private "
                      f"sample(s) drawn uniformly at random (seed {pop['seed']}; {pop.get('distinct', '?')} distinct over "
                      f"the run) from a population of {pop['size']} {unit}: {source} from index {pop['offset']}"
                      f"{' of its order shuffled by seed ' + str(pop['shuffle']) if pop.get('shuffle') is not None else ''}.")
    else:
        population = f"{rate['samples']} private samples: the data of the user's client (the red team did not draw them)."
    attacks = "".join(
        f"<tr><td>{html.escape(name)}</td><td>{a['leaked']} of {a['of']}</td><td>{fmt(a['upper_bound'])}</td>"
        f"<td>{html.escape(', '.join(f'{m}: {k}' for m, k in a['by_metric'].items()))}</td></tr>"
        for name, a in ev.get("per_attack", {}).items()
    )
    classes = "".join(
        f"<tr class={'fail' if c['leaked'] else ''}><td>{c['class']}</td><td>{c['leaked']} of {c['samples']}</td>"
        f"<td>{fmt(c['observed_rate'])}</td><td>{fmt(c['upper_bound'])}</td></tr>"
        for c in ev.get("per_class", [])
    )
    leaky = [c for c in ev.get("per_class", []) if c["leaked"]]
    class_note = ("Classes that leaked, most first: " + ", ".join(f"{c['class']} ({c['leaked']}/{c['samples']})" for c in leaky)
                  if leaky else "No class leaked.") + " Per-class bounds rest on few samples each: read them as a pointer, not a claim."
    leaked = "".join(_leaked_item(row) for row in ev.get("leaked_samples", []))
    return (f"{claims_html(cert)}<p>{population}</p>"
            f"<h3>Per attack</h3><p class=legend>{html.escape(ev.get('breakdowns', ''))}.</p>"
            f"<table><tr><th>attack</th><th>samples leaked</th><th>{rate['confidence']:.0%} upper bound</th><th>past each threshold</th></tr>{attacks}</table>"
            f"<h3>Per class</h3><p>{html.escape(class_note)}</p>"
            f"<table><tr><th>class</th><th>leaked</th><th>observed rate</th><th>upper bound</th></tr>{classes}</table>"
            + (f"<h3>Leaked samples</h3><ul>{leaked}</ul>" if leaked else ""))


@dataclass(frozen=True)
class SampleView:
    """How the page shows one modality's samples (:data:`VIEWS`, keyed by the modality's name)."""

    #: (certificate, out) -> (batch, section) for every client batch (pictures saved in ``out``)
    batch_sections: Callable[[Certificate, Path], list[tuple[int, str]]]
    #: the setting's line on what "best" means in the tables
    best_note: Callable[[Certificate], str]
    #: the population claim's picture of every attacked sample (None: no picture)
    overview: Callable[[Certificate], str] | None
    #: the worst single one, in the heading ("image", "sample")
    worst: str
    #: the view's own CSS
    css: str = ""


#: the page's view of each modality's samples
VIEWS = {
    "image": SampleView(report_image.batch_sections, report_image.best_note, report_image.overview_html, "image"),
    "text": SampleView(report_text.batch_sections, report_text.best_note, None, "sample", css=report_text.STYLE),
}


def write_report(cert: Certificate, out: Path) -> None:
    """``report.html`` and, for images, ``grid-batch<b>.png`` (originals, then one row per attack) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    view = VIEWS[modality.of(cert.config).name]
    sections = view.batch_sections(cert, out)
    evidence = _evidence_html(cert) + (view.overview(cert) if cert.originals and view.overview is not None else "")
    body = "\n".join([
        _setting_html(cert, view.best_note(cert)),
        warnings_html(cert.warnings) + _privacy_html(cert) + _encoding_html(cert) + _malicious_html(cert),
        evidence, _checks_html(cert), bound_html(cert.bound, cert.verdict), _worst_html(cert, view.worst),
        _batches_html(cert, sections),
        _attacks_html(cert), _runs_html(cert), _preparations_html(cert), _run_html(cert),
    ])
    banner = f"{cert.verdict} <small>({html.escape(cert.strength)} attack budgets)</small>"
    page = document(f"guardfl red team: {cert.verdict}", banner, verdict_colour(cert.verdict), body, IMAGE_CSS + view.css)
    atomic_write(out / "report.html", page)


def _batches_html(cert: Certificate, sections: list[tuple[int, str]]) -> str:
    """The client batches' sections: those where a sample leaked or the worst image is (all of them up to
    four), the others folded."""
    leaked_batches = {row["batch"] for row in cert.evidence.get("leaked_samples", [])}
    leaked_batches |= {w["where"]["batch"] for w in cert.worst if w.get("where")}
    shown = "".join(sec for b, sec in sections if b in leaked_batches or len(sections) <= 4)
    rest = [sec for b, sec in sections if not (b in leaked_batches or len(sections) <= 4)]
    if rest:
        shown += (f"<details><summary>{len(rest)} more client batches (no sample leaked, not the worst image)</summary>"
                  f"{''.join(rest)}</details>")
    return shown


def _setting_html(cert: Certificate, best: str) -> str:
    """What was attacked: the client (the user's code or guardfl's simulation), the defense, the model;
    ``best``: what "best" means in the tables."""
    defense = cert.config.get("defense")
    client = cert.client or {}
    attacked = (f"the user's {client.get('kind')} <code>{html.escape(str(client.get('ref')))}</code>"
                if client.get("kind") in ("clientapp", "train_fn", "nvflare") else "guardfl's client simulation")
    return f"""<p>Attacked: {attacked}. {html.escape(client.get('note', '')[:1].upper() + client.get('note', '')[1:])}.<br>
Defense: <code>{html.escape(json.dumps(defense))}</code><br>
Model: <code>{html.escape(json.dumps(cert.config['model']))}</code>, client: <code>{html.escape(json.dumps(cert.config['client']))}</code><br>
{best}</p>"""


def _privacy_html(cert: Certificate) -> str:
    if not cert.privacy:
        return ""
    pv = cert.privacy
    eps = "not accounted (" + html.escape(pv.get("note", "")) + ")" if pv.get("epsilon") is None else f"epsilon = {pv['epsilon']:.3g} at delta = {pv['delta']:g}"
    return (f"<p><b>DP-SGD</b>: {eps}; noise multiplier {fmt(pv.get('noise_multiplier'))}, clipping norm "
            f"{fmt(pv.get('max_grad_norm'))}, sample rate {fmt(pv.get('sample_rate'))}, epochs {pv.get('epochs')} "
            f"({html.escape(str(pv.get('accountant', '')))} accountant, Opacus).</p>")


def _encoding_html(cert: Certificate) -> str:
    """When the client encodes its inputs (MixUp / InstaHide): what the attacks reconstructed and decoded."""
    if not any(r.get("info", {}).get("decode") for r in cert.results):
        return ""
    out = ("<p>The client encodes its inputs (MixUp / InstaHide): every attack reconstructed the encodings the "
           "client trained on, then demixed them blind (k and the coefficient bound known, never the partners "
           "or coefficients); the images shown and measured are the estimates of the PRIVATE images.</p>")
    if any("known public set" in str(r.get("info", {}).get("decode", "")) for r in cert.results):
        out += ("<p>Inter-InstaHide, <b>public set known</b> (threat public_data: known): those attacks' "
                "encodings were decoded by identifying each encoding's public partners in the public set "
                "and subtracting them (never given the partners, coefficients or sign masks).</p>")
    return out


def _malicious_html(cert: Certificate) -> str:
    """The malicious-server attacks: the models the server sent, and what the client's inspection refused."""
    server = sorted({r["attack"] for r in cert.results if r.get("threat", {}).get("server") == "malicious"})
    if not server:
        return ""
    queries = sorted({str(r.get("info", {}).get("queries")) for r in cert.results if r["attack"] in server})
    rounds = rounds_line(cert) or ""
    out = (f"<p><b>A malicious server</b> ({html.escape(', '.join(server))}): the server sent the client "
           f"models of its own making ({html.escape(', '.join(sorted({str(r['info']['malicious_model']) for r in cert.results if r['attack'] in server and r.get('info', {}).get('malicious_model')})) or 'refused before training')}; "
           f"{html.escape('/'.join(queries))} quer{'y' if queries == ['1'] else 'ies'} per client update) and "
           f"attacked what the client sent back; an honest-server certificate does not cover this. "
           f"{html.escape(rounds[:1].upper() + rounds[1:])}.</p>")
    tried = [r for r in cert.results if r["attack"] in server]
    refused = [r for r in tried if r.get("info", {}).get("refused")]
    if (cert.config.get("client") or {}).get("inspect"):
        names = sorted({r["attack"] + (f" (rows {r['budget']['rows']})" if r["budget"].get("rows") else "")
                        + (f" (cuts {r['budget']['cuts']})" if r["budget"].get("cuts") else "")
                        + (" (disguised)" if r["budget"].get("disguise") else "") for r in refused})
        out += (f"<p><b>The client inspects</b> every model it receives (<code>guardfl.inspect_model</code>, "
                f"strict, with its own batch and model; {html.escape(inspection_line(cert))}): {len(refused)} of "
                f"{len(tried)} malicious-server attack runs refused (nothing sent"
                f"{': ' + html.escape(', '.join(names)) if names else ''}); the others "
                "passed the inspection and were attacked (their rows in the tables below).</p>")
    return out


def _checks_html(cert: Certificate) -> str:
    def result(c: dict) -> tuple[str, str]:  # a claim says its own status; an undecided one is neither
        if "status" in c:
            return {"CERTIFIED": "pass", "NOT CERTIFIED": "fail"}.get(c["status"], "open"), c["status"]
        return ("pass", "pass") if c["passed"] else ("fail", "FAIL")

    checks = "".join(
        f"<tr class={result(c)[0]}><td>{html.escape(c['metric'])}</td><td>{html.escape(c.get('rule', ''))}</td>"
        f"<td>{fmt(c.get('worst'))}</td><td>{html.escape(json.dumps(c['where'])) if c.get('where') else ''}</td>"
        f"<td>{html.escape(result(c)[1])}</td><td>{html.escape(c.get('note', ''))}</td></tr>"
        for c in cert.checks
    )
    return ("<h2>Requirements of the verdict</h2>\n"
            f"<table><tr><th>requirement</th><th>rule</th><th>measured</th><th>where</th><th>result</th><th>note</th></tr>{checks}</table>")


def _worst_html(cert: Certificate, unit: str) -> str:
    worst = "".join(
        f"<tr class={'fail' if w['exceeds'] else 'pass'}><td>{html.escape(w['metric'])}</td><td>{html.escape(w['rule'])}</td>"
        f"<td>{fmt(w.get('worst'))}</td><td>{_where(w.get('where'))}</td>"
        f"<td>{'past its limit' if w['exceeds'] else 'within'}</td></tr>"
        for w in cert.worst
    )
    return f"""<h2>Worst single {unit}</h2>
<p>Per threshold, the one reconstruction that leaked most over every attack and sample (its limit accounts for the
attacker's prior guess on that image). Shown for inspection; the verdict is the population claim above.</p>
<table><tr><th>metric</th><th>rule</th><th>worst</th><th>where</th><th>result</th></tr>{worst}</table>"""


def _attacks_html(cert: Certificate) -> str:
    """Every attack of the plan: ran, not applicable (why) or reused, its budget and the paper's."""
    attack_rows = "".join(
        f"<tr class={'pass' if a['status'] == 'ran' else ''}><td>{html.escape(a['attack'])}</td>"
        f"<td>{html.escape(a['status'])}{(': ' + html.escape(a['reason'])) if a.get('reason') else ''}"
        f"{(' (' + html.escape(a['reused']['note']) + ')') if a.get('reused') else ''}</td>"
        f"<td><code>{html.escape(json.dumps(a.get('budget', {})))}</code></td>"
        f"<td><code>{html.escape(json.dumps(a.get('paper_budget', {})))}</code></td>"
        f"<td>{html.escape(a.get('paper_reference', ''))}</td></tr>"
        for a in cert.attacks
    )
    return (f"<h2>Attacks ({html.escape(cert.strength)} strength)</h2>\n"
            f"<table><tr><th>attack</th><th>status</th><th>budget</th><th>paper budget</th><th>source of the paper budget</th></tr>{attack_rows}</table>")


#: runs whose lines ``_runs_html`` shows (the first batch's; the certificate JSON has every one)
RUN_LINES_BATCH = 0


def _runs_html(cert: Certificate) -> str:
    """What each attack run on the first batch did, in its own words (``info``: the model it sent and how it
    was sized, the rounds it averaged, the filter of its reads, what the client refused), one collapsible
    entry per run."""
    runs = [r for r in cert.results if r.get("batch", 0) == RUN_LINES_BATCH and r.get("info")]
    if not runs:
        return ""
    entries = "".join(
        f"<details><summary>{html.escape(r['attack'])} <code>{html.escape(json.dumps(r.get('budget', {})))}</code></summary>"
        f"<table>{''.join(f'<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>' for k, v in r['info'].items())}"
        "</table></details>"
        for r in runs)
    return (f"<h2>What each attack did (batch {RUN_LINES_BATCH})</h2><p>Each run's own account: the models it sent "
            "and how it sized them, the rounds it averaged, the filter its reads went through, what the client "
            f"refused. Every batch's are in certificate.json.</p>{entries}")


def _preparations_html(cert: Certificate) -> str:
    if not cert.preparations:
        return ""
    return ("<h2>Prepared attacks</h2><p>Once-per-setting preparations (e.g. the inverter trained on auxiliary "
            "data with the defense as augmentation); held-out figures are on auxiliary data, never on the "
            "client's.</p>" + json_pre(cert.preparations, default=str))


def _run_html(cert: Certificate) -> str:
    """How the client ran, the run's hash and environment, and the whole config."""
    run = {'config_hash': cert.config_hash, 'environment': cert.environment, 'wall_time_s': round(cert.wall_time_s, 1)}
    return (f"<h2>Client runs</h2>{json_pre((cert.client or {}).get('batches', {}))}\n"
            f"<h2>Run</h2>\n{json_pre(run)}\n"
            f"<h2>Config</h2>{json_pre(cert.config)}")
