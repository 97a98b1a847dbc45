"""The human-readable report: one self-contained HTML page (images embedded) and PNG grids."""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

from guardfl.redteam.reports import text as report_text
from guardfl.redteam.certification.certificate import Certificate
from guardfl.redteam import modality
from guardfl.redteam.modality.text.tokenizer import load_tokenizer
from guardfl.redteam.runtime.files import atomic_write


def _to_pil(images: torch.Tensor, scale: int) -> list[Image.Image]:
    out = []
    for img in images.detach().float().cpu().clamp(0, 1):
        arr = (img.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
        pil = Image.fromarray(arr[..., 0] if arr.shape[-1] == 1 else arr)
        out.append(pil.resize((pil.width * scale, pil.height * scale), Image.NEAREST))
    return out


def grid(rows: list[torch.Tensor], max_cols: int = 16, marked: set[tuple[int, int]] = frozenset()) -> Image.Image:
    """Rows of images (each ``(n, C, H, W)`` in [0, 1]) as one picture, 2 px gaps; the (row, column)
    cells in ``marked`` get a red frame (a leaked sample)."""
    h, w = rows[0].shape[-2:]
    scale = max(1, 64 // max(h, w))
    cols = min(max_cols, max(len(r) for r in rows))
    gap = 2
    canvas = Image.new("RGB", (cols * (w * scale + gap) + gap, len(rows) * (h * scale + gap) + gap), "white")
    draw = ImageDraw.Draw(canvas)
    for i, row in enumerate(rows):
        for j, pil in enumerate(_to_pil(row[:cols], scale)):
            x, y = gap + j * (w * scale + gap), gap + i * (h * scale + gap)
            canvas.paste(pil.convert("RGB"), (x, y))
            if (i, j) in marked:
                draw.rectangle((x - 1, y - 1, x + w * scale, y + h * scale), outline=(220, 30, 30), width=2)
    return canvas


def overview(cert: Certificate, per_picture: int = 16) -> list[tuple[str, bytes]]:
    """Every attacked sample at a glance: pictures of up to ``per_picture`` samples (columns), the
    originals in the first row and one row per attack, a red frame where that attack leaked the sample.
    Returns (caption, PNG) pairs."""
    attacks = sorted({r["attack"] for r in cert.results if cert.reconstructions.get(r["job"]) is not None})
    leaked = {(row["batch"], row["image"], hit["attack"]) for row in cert.evidence.get("leaked_samples", []) for hit in row["by"]}
    samples = [(b, i) for b, x in sorted(cert.originals.items()) for i in range(len(x))]
    by_job = {(r["batch"], r["attack"]): r for r in cert.results}
    pictures = []
    for lo in range(0, len(samples), per_picture):
        chunk = samples[lo : lo + per_picture]
        rows = [torch.stack([cert.originals[b][i] for b, i in chunk])]
        marked = set()
        for a, attack in enumerate(attacks, 1):
            cells = []
            for j, (b, i) in enumerate(chunk):
                r = by_job.get((b, attack))
                rec = cert.reconstructions.get(r["job"]) if r else None
                if rec is None:
                    cells.append(torch.ones_like(rows[0][j]))
                    continue
                matched = next((p["matched"] for p in r["metrics"]["per_image"] if p["index"] == i), i)
                cells.append(rec[matched])
                if (b, i, attack) in leaked:
                    marked.add((a, j))
            rows.append(torch.stack(cells))
        caption = f"samples {lo + 1}-{lo + len(chunk)} (batches {chunk[0][0]}-{chunk[-1][0]}); rows: original / {' / '.join(attacks)}"
        pictures.append((caption, _png(grid(rows, max_cols=per_picture, marked=marked))))
    return pictures


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def inspection_line(cert) -> str:
    """The checks an inspecting client ran, and what SEER's D-SNR check (opt-in) refused, in words."""
    info = (cert.client or {}).get("inspection") or {}
    checks = info.get("checks") or []
    if not (cert.config.get("client") or {}).get("inspect_disaggregation"):
        return f"checks: {', '.join(checks) or 'the defaults'}; disaggregation (SEER's D-SNR, opt-in) not run"
    dsnr = [r for r in cert.results if "disaggregation:" in str((r.get("info") or {}).get("refused", ""))]
    return (f"checks: {', '.join(checks)}; the disaggregation check ({info.get('disaggregation_rule', 'D-SNR')}) "
            f"was among the reasons of {len(dsnr)} refused run(s)")


def _fmt(v) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return "inf" if v == float("inf") else f"{v:.3f}"
    return html.escape(str(v))


def _where(where: dict | None) -> str:
    if not where:
        return "n/a"
    limit = f', limit there {_fmt(where["threshold_here"])}' if where.get("threshold_here") is not None else ""
    return (f'<a href="#batch-{int(where["batch"])}">batch {int(where["batch"])}</a>, sample {html.escape(str(where.get("image")))}, '
            f'{html.escape(str(where.get("attack")))}{limit}')


def _leaked_item(row: dict) -> str:
    """One leaked sample: where, and every (attack, metric, value) past its limit."""
    attacks = ", ".join(sorted({hit["attack"] for hit in row["by"]}))
    hits = "; ".join(f"{hit['attack']} {hit['metric']} {hit['value']:.3f} (limit {hit['limit']:.3f})" for hit in row["by"])
    return f"<li>{_where({'batch': row['batch'], 'image': row['image'], 'attack': attacks})}: {html.escape(hits)}</li>"


def _evidence_html(cert: Certificate) -> str:
    """The population claim: what was sampled from what, how many leaked, the bound, per attack and class."""
    ev, pop = cert.evidence, cert.population
    rate = ev.get("leak_rate")
    if not rate:
        return ""
    if pop:
        source = f"{html.escape(str(pop['source']))}{' (' + html.escape(str(pop['path'])) + ')' if pop.get('path') else ''}"
        unit = modality.of(cert.config).units
        population = (f"{rate['samples']} private samples drawn uniformly at random (seed {pop['seed']}) from a population "
                      f"of {pop['size']} {unit}: {source} from index {pop['offset']}.")
    else:
        population = f"{rate['samples']} private samples: the data of the user's client (the red team did not draw them)."
    claim = (f"<b>{rate['leaked']} of {rate['samples']}</b> samples leaked (some attack reconstructed them past a threshold). "
             f"With {rate['confidence']:.0%} confidence the population's leak rate is below "
             f"<b>{rate['upper_bound']:.3g}</b> (one-sided Clopper-Pearson bound); the claim asks for below "
             f"{rate['max_leak_rate']:g}: <b>{html.escape(rate['status'])}</b>.")
    if rate["status"] == "INSUFFICIENT EVIDENCE":
        claim += f" Nothing leaked, but {rate['samples']} samples cannot support the claim: {rate['samples_needed']} are needed."
    elif rate["status"] == "NOT CERTIFIED" and rate.get("samples_needed"):
        claim += f" At the observed rate, about {rate['samples_needed']} samples could support it."
    attacks = "".join(
        f"<tr><td>{html.escape(name)}</td><td>{a['leaked']} of {a['of']}</td><td>{_fmt(a['upper_bound'])}</td>"
        f"<td>{html.escape(', '.join(f'{m}: {k}' for m, k in a['by_metric'].items()))}</td></tr>"
        for name, a in ev.get("per_attack", {}).items()
    )
    classes = "".join(
        f"<tr class={'fail' if c['leaked'] else ''}><td>{c['class']}</td><td>{c['leaked']} of {c['samples']}</td>"
        f"<td>{_fmt(c['observed_rate'])}</td><td>{_fmt(c['upper_bound'])}</td></tr>"
        for c in ev.get("per_class", [])
    )
    leaky = [c for c in ev.get("per_class", []) if c["leaked"]]
    class_note = ("Classes that leaked, most first: " + ", ".join(f"{c['class']} ({c['leaked']}/{c['samples']})" for c in leaky)
                  if leaky else "No class leaked.") + " Per-class bounds rest on few samples each: read them as a pointer, not a claim."
    leaked = "".join(_leaked_item(row) for row in ev.get("leaked_samples", []))
    return (f"<h2>Population claim</h2><p>{population}</p><p class=claim>{claim}</p><p class=legend>{html.escape(rate['rule'])}.</p>"
            f"<table><tr><th>attack</th><th>samples leaked</th><th>{rate['confidence']:.0%} upper bound</th><th>past each threshold</th></tr>{attacks}</table>"
            f"<h3>Per class</h3><p>{html.escape(class_note)}</p>"
            f"<table><tr><th>class</th><th>leaked</th><th>observed rate</th><th>upper bound</th></tr>{classes}</table>"
            + (f"<h3>Leaked samples</h3><ul>{leaked}</ul>" if leaked else ""))


def write_report(cert: Certificate, out: Path) -> None:
    """``report.html`` and ``grid-batch<b>.png`` (originals, then one row per attack) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    sections = []
    text = modality.of(cert.config).tokenized
    tokenizer = load_tokenizer(cert.config["data"]["tokenizer"]) if text else None
    for b, originals in sorted(cert.originals.items()):
        if text:
            classifier = any(r["batch"] == b and r.get("metrics", {}).get("summary", {}).get("label_acc") is not None
                             for r in cert.results) or cert.config["model"]["name"] == "text-classifier"
            ignore = (tokenizer.eos_id,) if classifier and tokenizer.eos_id is not None else ()
            sections.append((b, report_text.batch_section(cert, b, originals, tokenizer, ignore)))
            continue
        rows, labels = [originals], ["original"]
        if cert.reconstructions.get(f"b{b}-prior") is not None:
            rows.append(cert.reconstructions[f"b{b}-prior"])
            labels.append("prior guess (mean aux image, no update: a baseline, not an attack)")
        for r in cert.results:
            if r["batch"] == b and cert.reconstructions.get(r["job"]) is not None:
                rows.append(cert.reconstructions[r["job"]])
                labels.append(r["attack"])
        picture = grid(rows)
        png = _png(picture)
        atomic_write(out / f"grid-batch{b}.png", png)
        img_tag = f'<img alt="batch {b}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'
        legend = " / ".join(html.escape(x) for x in labels)
        table = ["<tr><th>attack</th><th>threat</th><th>SSIM mean</th><th>SSIM best</th><th>PSNR best</th>"
                 "<th>LPIPS best</th><th>label acc</th><th>images above max SSIM</th><th>time (s)</th></tr>"]
        prior = cert.priors.get(str(b))
        if prior:
            ssims = [p["ssim"] for p in prior]
            table.append(f"<tr><td><i>prior guess</i></td><td>no update used</td><td>{_fmt(sum(ssims) / len(ssims))}</td>"
                         f"<td>{_fmt(max(ssims))}</td><td>{_fmt(max(p['psnr'] for p in prior))}</td><td colspan=3>baseline: "
                         "what the attacker's auxiliary data alone gives</td><td></td></tr>")
        for r in cert.results:
            if r["batch"] != b:
                continue
            threat = ", ".join(f"{k}={v}" for k, v in r["threat"].items())
            if r.get("info", {}).get("decode"):
                threat += f"; decoded: {r['info']['decode']}"
            if r.get("info", {}).get("refused"):
                reason = r["info"]["refused"]
                threat += f"; REFUSED by the client's inspection (nothing sent): {reason[:160]}{'...' if len(reason) > 160 else ''}"
            rec_ = r.get("recovered") or {}
            recovered = f"{rec_['above_max_ssim']} of {rec_['of']}" if rec_ else ""
            s = r["metrics"]["summary"]
            get = lambda k, f: None if s.get(k) is None else s[k][f]  # noqa: E731
            table.append(
                f"<tr><td>{html.escape(r['attack'])}</td><td>{html.escape(threat)}</td><td>{_fmt(get('ssim', 'mean'))}</td>"
                f"<td>{_fmt(get('ssim', 'best'))}</td><td>{_fmt(get('psnr', 'best'))}</td><td>{_fmt(get('lpips', 'best'))}</td>"
                f"<td>{_fmt(s.get('label_acc'))}</td><td>{recovered}</td><td>{_fmt(r.get('seconds'))}</td></tr>"
            )
        section = f"<h2 id=batch-{b}>Client batch {b}</h2><p class=legend>rows: {legend}</p>{img_tag}<table>{''.join(table)}</table>"
        sections.append((b, section))
    leaked_batches = {row["batch"] for row in cert.evidence.get("leaked_samples", [])}
    leaked_batches |= {w["where"]["batch"] for w in cert.worst if w.get("where")}
    shown = "".join(sec for b, sec in sections if b in leaked_batches or len(sections) <= 4)
    rest = [sec for b, sec in sections if not (b in leaked_batches or len(sections) <= 4)]
    if rest:
        shown += (f"<details><summary>{len(rest)} more client batches (no sample leaked, not the worst image)</summary>"
                  f"{''.join(rest)}</details>")

    checks = "".join(
        f"<tr class={'pass' if c['passed'] else 'fail'}><td>{html.escape(c['metric'])}</td><td>{html.escape(c.get('rule', ''))}</td>"
        f"<td>{_fmt(c.get('worst'))}</td><td>{html.escape(json.dumps(c['where'])) if c.get('where') else ''}</td>"
        f"<td>{'pass' if c['passed'] else 'FAIL'}</td><td>{html.escape(c.get('note', ''))}</td></tr>"
        for c in cert.checks
    )
    worst = "".join(
        f"<tr class={'fail' if w['exceeds'] else 'pass'}><td>{html.escape(w['metric'])}</td><td>{html.escape(w['rule'])}</td>"
        f"<td>{_fmt(w.get('worst'))}</td><td>{_where(w.get('where'))}</td>"
        f"<td>{'past its limit' if w['exceeds'] else 'within'}</td></tr>"
        for w in cert.worst
    )
    evidence_html = _evidence_html(cert)
    if cert.originals and not text:
        evidence_html += "<h3>Every attacked sample</h3><p class=legend>Matched reconstructions; a red frame: that attack leaked the sample.</p>"
        evidence_html += "".join(f'<p class=legend>{html.escape(caption)}</p><img alt="{html.escape(caption)}" '
                                 f'src="data:image/png;base64,{base64.b64encode(png).decode()}">' for caption, png in overview(cert))
    color = {"CERTIFIED": "#1b7f3b", "INSUFFICIENT EVIDENCE": "#9a6700"}.get(cert.verdict, "#b3261e")
    defense = cert.config.get("defense")
    client = cert.client or {}
    attacked = (f"the user's {client.get('kind')} <code>{html.escape(str(client.get('ref')))}</code>"
                if client.get("kind") in ("clientapp", "train_fn", "nvflare") else "guardfl's client simulation")
    attack_rows = "".join(
        f"<tr class={'pass' if a['status'] == 'ran' else ''}><td>{html.escape(a['attack'])}</td>"
        f"<td>{html.escape(a['status'])}{(': ' + html.escape(a['reason'])) if a.get('reason') else ''}"
        f"{(' (' + html.escape(a['reused']['note']) + ')') if a.get('reused') else ''}</td>"
        f"<td><code>{html.escape(json.dumps(a.get('budget', {})))}</code></td>"
        f"<td><code>{html.escape(json.dumps(a.get('paper_budget', {})))}</code></td>"
        f"<td>{html.escape(a.get('paper_reference', ''))}</td></tr>"
        for a in cert.attacks
    )
    warnings_html = "".join(f"<p class=warn><b>Warning</b>: {html.escape(w)}</p>" for w in cert.warnings)
    privacy_html = ""
    if cert.privacy:
        pv = cert.privacy
        eps = "not accounted (" + html.escape(pv.get("note", "")) + ")" if pv.get("epsilon") is None else f"epsilon = {pv['epsilon']:.3g} at delta = {pv['delta']:g}"
        privacy_html = (f"<p><b>DP-SGD</b>: {eps}; noise multiplier {_fmt(pv.get('noise_multiplier'))}, clipping norm "
                        f"{_fmt(pv.get('max_grad_norm'))}, sample rate {_fmt(pv.get('sample_rate'))}, epochs {pv.get('epochs')} "
                        f"({html.escape(str(pv.get('accountant', '')))} accountant, Opacus).</p>")
    encoding_html = ""
    if any(r.get("info", {}).get("decode") for r in cert.results):
        encoding_html = ("<p>The client encodes its inputs (MixUp / InstaHide): every attack reconstructed the encodings the "
                         "client trained on, then demixed them blind (k and the coefficient bound known, never the partners "
                         "or coefficients); the images shown and measured are the estimates of the PRIVATE images.</p>")
        if any("known public set" in str(r.get("info", {}).get("decode", "")) for r in cert.results):
            encoding_html += ("<p>Inter-InstaHide, <b>public set known</b> (threat public_data: known): those attacks' "
                              "encodings were decoded by identifying each encoding's public partners in the public set "
                              "and subtracting them (never given the partners, coefficients or sign masks).</p>")
    server = sorted({r["attack"] for r in cert.results if r.get("threat", {}).get("server") == "malicious"})
    if server:
        queries = sorted({str(r.get("info", {}).get("queries")) for r in cert.results if r["attack"] in server})
        encoding_html += (f"<p><b>A malicious server</b> ({html.escape(', '.join(server))}): the server sent the client "
                          f"models of its own making ({html.escape(', '.join(sorted({str(r['info']['malicious_model']) for r in cert.results if r['attack'] in server and r.get('info', {}).get('malicious_model')})) or 'refused before training')}; "
                          f"{html.escape('/'.join(queries))} quer{'y' if queries == ['1'] else 'ies'} per client update) and "
                          "attacked what the client sent back; an honest-server certificate does not cover this.</p>")
        tried = [r for r in cert.results if r["attack"] in server]
        refused = [r for r in tried if r.get("info", {}).get("refused")]
        if (cert.config.get("client") or {}).get("inspect"):
            names = sorted({r["attack"] + (f" (rows {r['budget']['rows']})" if r["budget"].get("rows") else "")
                            + (f" (cuts {r['budget']['cuts']})" if r["budget"].get("cuts") else "")
                            + (" (disguised)" if r["budget"].get("disguise") else "") for r in refused})
            encoding_html += (f"<p><b>The client inspects</b> every model it receives (<code>guardfl.inspect_model</code>, "
                              f"strict, with its own batch and model; {html.escape(inspection_line(cert))}): {len(refused)} of "
                              f"{len(tried)} malicious-server attack runs refused (nothing sent"
                              f"{': ' + html.escape(', '.join(names)) if names else ''}); the others "
                              "passed the inspection and were attacked (their rows in the tables below).</p>")
    prep_html = ""
    if cert.preparations:
        prep_html = ("<h2>Prepared attacks</h2><p>Once-per-setting preparations (e.g. the inverter trained on auxiliary "
                     "data with the defense as augmentation); held-out figures are on auxiliary data, never on the "
                     "client's.</p><pre>" + html.escape(json.dumps(cert.preparations, indent=2, default=str)) + "</pre>")
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>guardfl red team: {cert.verdict}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
.banner {{ background: {color}; color: white; padding: 1em 1.5em; font-size: 1.6em; border-radius: 6px; }}
table {{ border-collapse: collapse; margin: 1em 0; }} td, th {{ border: 1px solid #ccc; padding: 4px 8px; font-size: 0.9em; }}
tr.fail td {{ background: #fde7e7; }} tr.pass td {{ background: #e8f5ea; }}
img {{ image-rendering: pixelated; border: 1px solid #ddd; }} .legend {{ color: #555; }} .warn {{ background: #fff4d6; border-left: 4px solid #d9a400; padding: 6px; }}
pre {{ background: #f6f6f6; padding: 1em; overflow-x: auto; }}
{report_text.STYLE if text else ""}
</style></head><body>
<div class="banner">{cert.verdict} <small>({html.escape(cert.strength)} attack budgets)</small></div>
<p>Attacked: {attacked}. {html.escape(client.get('note', '')[:1].upper() + client.get('note', '')[1:])}.<br>
Defense: <code>{html.escape(json.dumps(defense))}</code><br>
Model: <code>{html.escape(json.dumps(cert.config['model']))}</code>, client: <code>{html.escape(json.dumps(cert.config['client']))}</code><br>
{'"best" = the most leaking sample; text metrics per sample after matching.' if text else '"best" = the most leaking image. LPIPS: ' + ('available' if cert.lpips['available'] else 'unavailable (' + html.escape(cert.lpips['reason']) + ')') + '.'}</p>
{warnings_html}{privacy_html}{encoding_html}
{evidence_html}
<h2>Requirements of the verdict</h2>
<table><tr><th>requirement</th><th>rule</th><th>measured</th><th>where</th><th>result</th><th>note</th></tr>{checks}</table>
<h2>Worst single {'sample' if text else 'image'}</h2>
<p>Per threshold, the one reconstruction that leaked most over every attack and sample (its limit accounts for the
attacker's prior guess on that image). Shown for inspection; the verdict is the population claim above.</p>
<table><tr><th>metric</th><th>rule</th><th>worst</th><th>where</th><th>result</th></tr>{worst}</table>
{shown}
<h2>Attacks ({html.escape(cert.strength)} strength)</h2>
<table><tr><th>attack</th><th>status</th><th>budget</th><th>paper budget</th><th>source of the paper budget</th></tr>{attack_rows}</table>
{prep_html}
<h2>Client runs</h2><pre>{html.escape(json.dumps(client.get('batches', {}), indent=2))}</pre>
<h2>Run</h2>
<pre>{html.escape(json.dumps({'config_hash': cert.config_hash, 'environment': cert.environment, 'wall_time_s': round(cert.wall_time_s, 1)}, indent=2))}</pre>
<h2>Config</h2><pre>{html.escape(json.dumps(cert.config, indent=2))}</pre>
</body></html>
"""
    atomic_write(out / "report.html", page)
