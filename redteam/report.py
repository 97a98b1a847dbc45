"""The human-readable report: one self-contained HTML page (images embedded) and PNG grids."""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from guardfl.redteam.certify import Certificate
from guardfl.redteam.files import atomic_write


def _to_pil(images: torch.Tensor, scale: int) -> list[Image.Image]:
    out = []
    for img in images.detach().float().cpu().clamp(0, 1):
        arr = (img.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
        pil = Image.fromarray(arr[..., 0] if arr.shape[-1] == 1 else arr)
        out.append(pil.resize((pil.width * scale, pil.height * scale), Image.NEAREST))
    return out


def grid(rows: list[torch.Tensor], max_cols: int = 16) -> Image.Image:
    """Rows of images (each ``(n, C, H, W)`` in [0, 1]) as one picture, 2 px gaps."""
    h, w = rows[0].shape[-2:]
    scale = max(1, 64 // max(h, w))
    cols = min(max_cols, max(len(r) for r in rows))
    gap = 2
    canvas = Image.new("RGB", (cols * (w * scale + gap) + gap, len(rows) * (h * scale + gap) + gap), "white")
    for i, row in enumerate(rows):
        for j, pil in enumerate(_to_pil(row[:cols], scale)):
            canvas.paste(pil.convert("RGB"), (gap + j * (w * scale + gap), gap + i * (h * scale + gap)))
    return canvas


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _fmt(v) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return "inf" if v == float("inf") else f"{v:.3f}"
    return html.escape(str(v))


def write_report(cert: Certificate, out: Path) -> None:
    """``report.html`` and ``grid-batch<b>.png`` (originals, then one row per attack) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    sections = []
    for b, originals in sorted(cert.originals.items()):
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
            rec_ = r.get("recovered") or {}
            recovered = f"{rec_['above_max_ssim']} of {rec_['of']}" if rec_ else ""
            s = r["metrics"]["summary"]
            get = lambda k, f: None if s.get(k) is None else s[k][f]  # noqa: E731
            table.append(
                f"<tr><td>{html.escape(r['attack'])}</td><td>{html.escape(threat)}</td><td>{_fmt(get('ssim', 'mean'))}</td>"
                f"<td>{_fmt(get('ssim', 'best'))}</td><td>{_fmt(get('psnr', 'best'))}</td><td>{_fmt(get('lpips', 'best'))}</td>"
                f"<td>{_fmt(s.get('label_acc'))}</td><td>{recovered}</td><td>{_fmt(r.get('seconds'))}</td></tr>"
            )
        sections.append(f"<h2>Client batch {b}</h2><p class=legend>rows: {legend}</p>{img_tag}<table>{''.join(table)}</table>")

    checks = "".join(
        f"<tr class={'pass' if c['passed'] else 'fail'}><td>{html.escape(c['metric'])}</td><td>{html.escape(c.get('rule', ''))}</td>"
        f"<td>{_fmt(c.get('worst'))}</td><td>{html.escape(json.dumps(c.get('where')))}</td>"
        f"<td>{'pass' if c['passed'] else 'FAIL'}</td><td>{html.escape(c.get('note', ''))}</td></tr>"
        for c in cert.checks
    )
    color = "#1b7f3b" if cert.certified else "#b3261e"
    defense = cert.config.get("defense")
    client = cert.client or {}
    attacked = (f"the user's {client.get('kind')} <code>{html.escape(str(client.get('ref')))}</code>"
                if client.get("kind") in ("clientapp", "train_fn") else "guardfl's client simulation")
    attack_rows = "".join(
        f"<tr class={'pass' if a['status'] == 'ran' else ''}><td>{html.escape(a['attack'])}</td>"
        f"<td>{html.escape(a['status'])}{(': ' + html.escape(a['reason'])) if a.get('reason') else ''}</td>"
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
</style></head><body>
<div class="banner">{cert.verdict} <small>({html.escape(cert.strength)} attack budgets)</small></div>
<p>Attacked: {attacked}. {html.escape(client.get('note', ''))}<br>
Defense: <code>{html.escape(json.dumps(defense))}</code><br>
Model: <code>{html.escape(json.dumps(cert.config['model']))}</code>, client: <code>{html.escape(json.dumps(cert.config['client']))}</code><br>
Worst case over every attack and image; "best" = the most leaking image. LPIPS: {'available' if cert.lpips['available'] else 'unavailable (' + html.escape(cert.lpips['reason']) + ')'}.</p>
{warnings_html}{privacy_html}{encoding_html}
<h2>Thresholds</h2>
<table><tr><th>metric</th><th>rule</th><th>worst measured</th><th>where</th><th>result</th><th>note</th></tr>{checks}</table>
{''.join(sections)}
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
