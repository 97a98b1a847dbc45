"""The report's view of an image client: per client batch, the originals and every attack's matched
reconstruction in one PNG grid (leaked samples framed in red) with a table row per attack, and the
picture of every attacked sample under the population claim."""

from __future__ import annotations

import html
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

from guardfl.redteam.certification.certificate import Certificate
from guardfl.redteam.reports.page import fmt, img_tag, png_bytes
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


def closest_run(runs: list[dict], i: int) -> tuple[dict, dict] | None:
    """Of an attack's runs on one batch (certificate records), the one whose reconstruction is closest to
    private sample ``i`` (the highest SSIM; the first run on a tie) and its per-image row; None without one."""
    found = [(p["ssim"] if p.get("ssim") is not None else -2.0, -n, r, p)
             for n, r in enumerate(runs) for p in r["metrics"]["per_image"] if p["index"] == i]
    return None if not found else max(found, key=lambda f: f[:2])[2:]


def overview(cert: Certificate, per_picture: int = 16) -> list[tuple[str, bytes]]:
    """Every attacked sample at a glance: pictures of up to ``per_picture`` samples (columns), the
    originals in the first row and one row per attack, a red frame where that attack leaked the sample.
    An attack run several times (different budgets) shows, for each sample, its run closest to it (the
    highest SSIM: the one that leaked it, where one did), not its last run's. Returns (caption, PNG) pairs."""
    attacks = sorted({r["attack"] for r in cert.results if cert.reconstructions.get(r["job"]) is not None})
    leaked = {(row["batch"], row["image"], hit["attack"]) for row in cert.evidence.get("leaked_samples", []) for hit in row["by"]}
    samples = [(b, i) for b, x in sorted(cert.originals.items()) for i in range(len(x))]
    runs: dict[tuple[int, str], list[dict]] = {}  # an attack run several times (budgets): each sample's closest run
    for r in cert.results:
        if cert.reconstructions.get(r["job"]) is not None and r.get("metrics"):
            runs.setdefault((r["batch"], r["attack"]), []).append(r)
    pictures = []
    for lo in range(0, len(samples), per_picture):
        chunk = samples[lo : lo + per_picture]
        rows = [torch.stack([cert.originals[b][i] for b, i in chunk])]
        marked = set()
        for a, attack in enumerate(attacks, 1):
            cells = []
            for j, (b, i) in enumerate(chunk):
                found = closest_run(runs.get((b, attack), []), i)
                if found is None:
                    cells.append(torch.ones_like(rows[0][j]))
                    continue
                r, p = found
                cells.append(cert.reconstructions[r["job"]][p["matched"]])
                if (b, i, attack) in leaked:
                    marked.add((a, j))
            rows.append(torch.stack(cells))
        names = list(attacks)
        per_batch = ((cert.evidence.get("reid_rate") or {}).get("per_batch")) or {}
        if per_batch:  # the attacker's answer: the candidate it named (red: the right one, re-identified)
            cells, row_index = [], len(rows)
            for j, (b, i) in enumerate(chunk):
                named, hit = cert.reconstructions.get(f"b{b}-named"), per_batch.get(str(b), {}).get("reidentified", [])
                if named is not None and len(named) == len(cert.originals[b]) == 1:
                    cells.append(named[0])
                elif named is not None and i < len(hit) and hit[i]:
                    cells.append(cert.originals[b][i])
                else:
                    cells.append(torch.full_like(rows[0][j], 0.85))
                if i < len(hit) and hit[i]:
                    marked.add((row_index, j))
            rows.append(torch.stack(cells))
            names.append("attacker's answer (named face)")
        caption = f"samples {lo + 1}-{lo + len(chunk)} (batches {chunk[0][0]}-{chunk[-1][0]}); rows: original / {' / '.join(names)}"
        pictures.append((caption, png_bytes(grid(rows, max_cols=per_picture, marked=marked))))
    return pictures


def overview_html(cert: Certificate) -> str:
    return ("<h3>Every attacked sample</h3><p class=legend>Matched reconstructions (an attack run more than once: its run closest to each sample); a red frame: that attack leaked the sample. "
            "With re-identification, the last row is the attacker's answer (the gallery face it named), framed red when it named the right one.</p>"
            + "".join(f"<p class=legend>{html.escape(caption)}</p>{img_tag(png, caption)}" for caption, png in overview(cert)))


def batch_sections(cert: Certificate, out: Path) -> list[tuple[int, str]]:
    """(batch, its section) for every client batch (:func:`batch_section`; the grids saved in ``out``)."""
    return [(b, batch_section(cert, b, originals, out)) for b, originals in sorted(cert.originals.items())]


def best_note(cert: Certificate) -> str:
    """What "best" means in the tables, and whether LPIPS was measured."""
    return '"best" = the most leaking image. LPIPS: ' + ('available' if cert.lpips['available'] else
                                                       'unavailable (' + html.escape(cert.lpips['reason']) + ')') + '.'


def batch_section(cert: Certificate, b: int, originals: torch.Tensor, out: Path) -> str:
    """Client batch ``b`` of images: the grid (originals, the prior guess, one row per attack; also saved as
    ``grid-batch<b>.png``) and a table row per attack."""
    rows, labels = [originals], ["original"]
    if cert.reconstructions.get(f"b{b}-prior") is not None:
        rows.append(cert.reconstructions[f"b{b}-prior"])
        labels.append("prior guess (mean aux image, no update: a baseline, not an attack)")
    for r in cert.results:
        if r["batch"] == b and cert.reconstructions.get(r["job"]) is not None:
            rows.append(cert.reconstructions[r["job"]])
            labels.append(r["attack"])
    png = png_bytes(grid(rows))
    atomic_write(out / f"grid-batch{b}.png", png)
    legend = " / ".join(html.escape(x) for x in labels)
    table = ["<tr><th>attack</th><th>threat</th><th>SSIM mean</th><th>SSIM best</th><th>PSNR best</th>"
             "<th>LPIPS best</th><th>label acc</th><th>images above max SSIM</th><th>time (s)</th></tr>"]
    prior = cert.priors.get(str(b))
    if prior:
        ssims = [p["ssim"] for p in prior]
        table.append(f"<tr><td><i>prior guess</i></td><td>no update used</td><td>{fmt(sum(ssims) / len(ssims))}</td>"
                     f"<td>{fmt(max(ssims))}</td><td>{fmt(max(p['psnr'] for p in prior))}</td><td colspan=3>baseline: "
                     "what the attacker's auxiliary data alone gives</td><td></td></tr>")
    table += [_result_row(r) for r in cert.results if r["batch"] == b]
    return (f"<h2 id=batch-{b}>Client batch {b}</h2><p class=legend>rows: {legend}</p>{img_tag(png, f'batch {b}')}"
            f"<table>{''.join(table)}</table>")


def _result_row(r: dict) -> str:
    """One attack on one client batch of images: its threat (and what decoding or a refusal did), metrics, time."""
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
    return (f"<tr><td>{html.escape(r['attack'])}</td><td>{html.escape(threat)}</td><td>{fmt(get('ssim', 'mean'))}</td>"
            f"<td>{fmt(get('ssim', 'best'))}</td><td>{fmt(get('psnr', 'best'))}</td><td>{fmt(get('lpips', 'best'))}</td>"
            f"<td>{fmt(s.get('label_acc'))}</td><td>{recovered}</td><td>{fmt(r.get('seconds'))}</td></tr>")
