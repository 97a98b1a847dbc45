"""The shell every report page shares: one self-contained HTML document (the CSS, the verdict banner),
numbers and text formatted and escaped for it, and PNG pictures embedded as data URIs."""

from __future__ import annotations

import base64
import html
import io
import json
from typing import Any

from PIL import Image

from guardfl.redteam.certification.evidence import CERTIFIED, INCONCLUSIVE

PASS_COLOUR, FAIL_COLOUR = "#1b7f3b", "#b3261e"
#: the banner's colour per verdict (anything else, NOT CERTIFIED included: ``FAIL_COLOUR``)
VERDICT_COLOURS = {CERTIFIED: PASS_COLOUR, INCONCLUSIVE: "#9a6700"}

#: the CSS of every page; ``{colour}`` is the banner's
STYLE = """body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
.banner {{ background: {colour}; color: white; padding: 1em 1.5em; font-size: 1.6em; border-radius: 6px; }}
table {{ border-collapse: collapse; margin: 1em 0; }} td, th {{ border: 1px solid #ccc; padding: 4px 8px; font-size: 0.9em; }}
tr.fail td {{ background: #fde7e7; }} tr.pass td {{ background: #e8f5ea; }} tr.chosen td {{ background: #fff2a8; font-weight: bold; }}
.legend {{ color: #555; }} .warn {{ background: #fff4d6; border-left: 4px solid #d9a400; padding: 6px; }}
pre {{ background: #f6f6f6; padding: 1em; overflow-x: auto; }}
"""


def escape(value: Any) -> str:
    """``value`` as text safe inside HTML (quotes included)."""
    return html.escape(str(value))


def fmt(value: Any, spec: str = ".3f", none: str = "n/a") -> str:
    """A table cell's number: a float with ``spec``, ``none`` for a missing value, anything else escaped."""
    if value is None:
        return none
    if isinstance(value, float):
        return format(value, spec)
    return escape(value)


def verdict_colour(verdict: str) -> str:
    """The banner's colour for a certificate's verdict."""
    return VERDICT_COLOURS.get(verdict, FAIL_COLOUR)


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def png_data_uri(png: bytes) -> str:
    return f"data:image/png;base64,{base64.b64encode(png).decode()}"


def img_tag(png: bytes, alt: str) -> str:
    """``png`` embedded in the page (no file beside it to lose)."""
    return f'<img alt="{html.escape(alt)}" src="{png_data_uri(png)}">'


def warnings_html(warnings: list[str]) -> str:
    return "".join(f"<p class=warn><b>Warning</b>: {html.escape(w)}</p>" for w in warnings)


def json_pre(value: Any, **dumps: Any) -> str:
    """``value`` as indented JSON in a ``<pre>`` block."""
    return f"<pre>{html.escape(json.dumps(value, indent=2, **dumps))}</pre>"


def document(title: str, banner: str, colour: str, body: str, css: str = "") -> str:
    """The whole page: ``title`` (plain text), the ``banner`` (HTML) on ``colour``, then ``body`` (HTML);
    ``css``: the page's own rules after the shared ones."""
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
{STYLE.format(colour=colour)}{css}
</style></head><body>
<div class="banner">{banner}</div>
{body}
</body></html>
"""
