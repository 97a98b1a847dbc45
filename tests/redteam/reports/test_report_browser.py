"""The red team's report.html in a real headless browser (Chromium over the DevTools protocol,
``tests/browser.py``): it loads without console errors, every picture renders from a data: URI (the page
is self-contained), the verdict banner is on the first screen and says the certificate's verdict, and
every string that comes from a config or a file name is text, never markup (image and text reports).

Marked ``browser``; skipped when no Chromium is found. Three tiny runs (lenet / idlg with 40 iterations;
transformer3 / TAG with 10) take about 15 s on two cores, the browser about 1 s a page.
``GUARDFL_SCREENSHOT=PATH`` keeps a PNG of the report's first screen there for a person to look at."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from guardfl.cli import main
from guardfl.redteam.certification.run import certify
from guardfl.redteam.modality.image.data import lfw_faces
from guardfl.redteam.modality.image.models import build_model, set_model_state
from guardfl.redteam.modality.text.tokenizer import load_tokenizer
from tests.browser import Browser, browser_path

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(browser_path() is None, reason="no Chromium (chromium, chromium-browser, google-chrome or "
                       "/usr/bin/chromium) to load the report in; install one (apt-get install chromium) to run these"),
]

#: two private samples of lenet on the shipped faces, iDLG with a budget it needs ~0.3 s for
TINY = {
    "model": {"name": "lenet", "state": "wide-init"},
    "data": {"source": "lfw-faces", "limit": 8},
    "client": {"batch_size": 1},
    "attacks": [{"name": "idlg", "budget": {"iterations": 40}}],
    "strength": "quick",
    "certify": {"max_updates": 2},
}

#: markup in names: none holds a '/', so each can be a file or directory name
DIR = "<img src=x onerror=alert(1)>"
NPZ = "faces <script>alert(2) & co.npz"
CKPT = "state \"q\" 'a' <b onmouseover=alert(3)>.pt"
LPIPS = "alexnet <svg onload=alert(4)>.pth"
ROOT = "<marquee>root"
TEXT = "notes <script>alert(5) & <b onclick=alert(6)>.txt"
#: the markup's elements a page must not hold (the report itself uses <b>, <i> and data: <img> only)
INJECTED_TAGS = {"script", "svg", "marquee", "iframe"}
#: words that make "<script>WORD</script>\n" exactly 8 GPT-2 tokens: one private sample per line
WORDS = ("alpha", "beta", "secret", "password", "account", "bank", "patient", "doctor", "health", "address",
         "phone", "email", "private", "letter", "money", "credit", "token")


@pytest.fixture(scope="module")
def browser():
    with Browser(timeout=30) as b:
        yield b


@pytest.fixture(scope="module")
def image_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("image") / "out"
    return certify(TINY, out=out, workers=1, threads=1), out


def _shown(s: str) -> str:
    """``s`` as the page shows it: plain where it is prose, a JSON string where it sits in a config dump
    (a double quote as \\"): the JSON form's inside is the common part."""
    return json.dumps(s)[1:-1]


def _assert_inert(page) -> None:
    """Nothing of the page can run: no script, no on* handler, no javascript: URL, no injected element,
    and nothing failed or alerted while it loaded."""
    assert page.errors == [], page.errors
    assert page.active_content == [], page.active_content
    assert not INJECTED_TAGS & set(page.tags), sorted(INJECTED_TAGS & set(page.tags))
    assert all(img["src_kind"] == "data" for img in page.images), [img["src"] for img in page.images]


def test_the_harness_sees_errors_and_active_content(tmp_path, browser):
    """The checks below are not vacuous: a page with a script, a handler, a broken image and an alert."""
    bad = tmp_path / "bad.html"
    bad.write_text('<!doctype html><body><div class="banner" style="display:none">X</div>'
                   '<img src=x onerror=alert(1)><script>console.error("boom"); throw new Error("bad")</script></body>')
    page = browser.inspect(bad)
    assert any("boom" in e for e in page.errors) and any("bad" in e for e in page.errors)
    assert any(e.startswith("dialog") for e in page.errors) and any("ERR_FILE_NOT_FOUND" in e for e in page.errors)
    assert page.scripts == 1 and page.handlers == ["img[onerror]"] and not page.banner_visible
    (img,) = page.images
    assert img["src_kind"] == "relative" and img["natural_width"] == 0


def test_the_report_loads_clean_self_contained_with_the_verdict_on_screen(image_run, browser, tmp_path):
    cert, out = image_run
    verdict = json.loads((out / "certificate.json").read_text())["verdict"]
    assert verdict == cert.verdict
    shot = Path(os.environ.get("GUARDFL_SCREENSHOT") or tmp_path / "report.png")
    page = browser.inspect(out / "report.html", screenshot=shot)
    _assert_inert(page)
    # one picture per client batch and the overview; each decoded from its data: URI and drawn
    assert len(page.images) >= 1 + len(cert.originals), page.images
    for img in page.images:
        assert img["complete"] and img["natural_width"] > 0 and img["natural_height"] > 0, img
    assert page.banner_visible, "the verdict banner is not on the first screen"
    assert page.banner_text.split(" (")[0] == verdict and verdict in page.title
    assert page.broken_anchors == []
    assert "Claims" in page.text and "Leak rate" in page.text and "idlg" in page.text
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 5_000


def _markup_setting(tmp_path: Path) -> tuple[Path, dict]:
    """A folder named with markup holding private faces (npz), a wide-init lenet checkpoint and the
    config, every path of which carries markup."""
    folder = tmp_path / DIR
    folder.mkdir()
    x, y = lfw_faces(10)
    np.savez(folder / NPZ, x=x[:24, 0].numpy(), y=y[:24].numpy())
    model = build_model("lenet", (1, 25, 25), 10)
    set_model_state(model, "wide-init", seed=0)
    torch.save(model.state_dict(), folder / CKPT)
    cfg = {
        "model": {"name": "lenet", "state": str(folder / CKPT)},
        "data": {"source": "npz", "path": str(folder / NPZ), "limit": 16, "root": ROOT},
        "aux": {"source": "npz", "path": str(folder / NPZ), "offset": 16, "limit": 8},
        "client": {"batch_size": 1},
        # InstaHide's public images: the one free-text path a defense takes
        "defense": {"kind": "instahide", "k": 2, "mode": "inter", "public": str(folder / NPZ)},
        "attacks": [{"name": "idlg", "budget": {"iterations": 40}}],
        "strength": "quick",
        "certify": {"max_updates": 1, "lpips_weights": str(folder / LPIPS)},
    }
    return folder, cfg


def test_config_and_file_name_strings_are_text_not_markup(tmp_path, browser):
    folder, cfg = _markup_setting(tmp_path)
    config = folder / f"{DIR} config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    out = folder / f"out {DIR}"
    code = main(["redteam", "--config", str(config), "--out", str(out), "--workers", "1", "--threads", "1", "--quiet"])
    assert code in (0, 1, 3) and (out / "certificate.json").is_file()
    page = browser.inspect(out / "report.html")
    _assert_inert(page)
    source = (out / "report.html").read_text()
    for raw in (DIR, "<script>alert(2)", "<b onmouseover", "<svg", ROOT):
        assert raw not in source, f"{raw!r} reached the HTML unescaped"
    for img in page.images:
        assert img["complete"] and img["natural_width"] > 0, img
    for path in (folder / NPZ, folder / CKPT, folder / LPIPS):
        assert _shown(str(path)) in page.text, f"{path.name!r} is not shown as text"
    assert ROOT in page.text and page.banner_visible


def test_the_text_report_shows_markup_tokens_as_text(tmp_path, browser):
    folder = tmp_path / DIR
    folder.mkdir()
    lines = [f"<script>{w}</script>\n" for w in WORDS]
    tokenizer = load_tokenizer("gpt2")
    assert all(len(tokenizer.encode(line)) == 8 for line in lines)  # one window = one line
    (folder / TEXT).write_text("".join(lines))
    path = str(folder / TEXT)
    cfg = {
        "model": {"name": "transformer3"},
        "data": {"source": "text", "path": path, "seq_len": 8, "limit": 10},
        "aux": {"source": "text", "path": path, "offset": 10, "limit": 7},
        "attacks": [{"name": "tag", "budget": {"iterations": 10}}],
        "strength": "quick",
        "certify": {"max_updates": 1, "max_rouge1": 0.0, "max_token_acc": 0.0, "prior_margin": None},
    }
    out = tmp_path / "out"
    cert = certify(cfg, out=out, workers=1, threads=1)
    page = browser.inspect(out / "report.html")
    _assert_inert(page)
    source = (out / "report.html").read_text()
    assert "<script>" not in source and DIR not in source
    # no picture of the samples: only the claims' plots (and the bound's), data URIs
    assert all("confidence sequence" in img["alt"] or "bound" in img["alt"].lower() for img in page.images), page.images
    assert page.banner_visible and page.banner_text.startswith(cert.verdict)
    originals = [row["text"] for r in cert.results for row in r["metrics"]["per_image"]]
    assert originals
    for text in originals:  # the private sample, token by token in spans, reads as its text
        assert text.startswith("<script>") and text.strip() in page.text, text
    assert "prior guess" in page.text and "tag" in page.text
    assert path in page.text  # the population line names the file
