"""The report's proven-bound section: the sentence that combines the empirical verdict with the theorem,
the bound's facts, and its curves (against rounds, where the client's budget stops, and against kappa)
as one PNG embedded in the page."""

from __future__ import annotations

import io
from typing import Any

from guardfl.redteam.certification.bound import summary_sentence
from guardfl.redteam.reports.page import FAIL_COLOUR, PASS_COLOUR, escape, fmt, img_tag

#: the banner colour of each bound status
STATUS_COLOURS = {"PROVEN": PASS_COLOUR, "NOT PROVEN": "#9a6700", "NO MECHANISM": FAIL_COLOUR}


def bound_plot(bound: dict[str, Any]) -> bytes | None:
    """Bound vs rounds and bound vs kappa (two panels) as PNG bytes; None without curves."""
    if not bound.get("curve_rounds"):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    claim, kappa, budget = bound.get("claim"), bound.get("kappa"), bound.get("rounds")
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    rounds, values = zip(*bound["curve_rounds"])
    left.plot(rounds, values, "o-", color="#1f77b4", markersize=4, label=f"bound (kappa {kappa:.3g})")
    if budget:
        left.axvline(budget, color="#555", linestyle=":", label=f"round budget {budget}")
    left.set_xscale("log", base=2)
    left.set_xlabel("rounds the client answers" + ("" if budget else " (no budget set)"))
    left.set_title("bound on reconstruction success vs rounds", fontsize=10)
    kappas, kvalues = zip(*bound["curve_kappa"])
    right.plot(kappas, kvalues, "o-", color="#1f77b4", markersize=4,
               label=f"bound at {bound.get('curve_kappa_rounds')} round(s)")
    right.plot(kappas, kappas, "--", color="#999", linewidth=1, label="kappa (the prior alone)")
    right.axvline(kappa, color="#555", linestyle=":", label=f"kappa {kappa:.3g}")
    right.set_xscale("log")
    right.set_xlabel("kappa: the prior's baseline success")
    right.set_title("bound vs kappa", fontsize=10)
    for ax in (left, right):
        if claim is not None:
            ax.axhline(claim, color="#b3261e", linestyle="--", linewidth=1, label=f"claimed leak rate {claim:g}")
        ax.set_ylim(-0.02, 1.02)
        ax.set_ylabel("P[success] at most")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def bound_html(bound: dict[str, Any] | None, verdict: str) -> str:
    """The section (HTML): the sentence, the facts, the curves. Empty without a bound entry."""
    if not bound:
        return ""
    status = bound.get("status", "")
    colour = STATUS_COLOURS.get(status, FAIL_COLOUR)
    rows = [("status", f"<b style='color:{colour}'>{escape(status)}</b>"),
            ("bound on any attacker's success", fmt(bound.get("rero"), ".4g", "none")),
            ("claimed leak rate", fmt(bound.get("claim"), "g")),
            ("kappa (prior's baseline)", f"{fmt(bound.get('kappa'), '.4g', 'unknown')} ({escape(bound.get('kappa_source') or '')})"),
            ("mechanism", escape(bound.get("mechanism") or "none")),
            ("rounds / steps", f"{fmt(bound.get('rounds'), 'd', 'no budget')} / {fmt(bound.get('steps'), 'd', 'n/a')}"),
            ("reference (neighbouring relation)", escape(bound.get("neighbouring") or "n/a")),
            ("accountant", escape(bound.get("accountant") or "n/a")),
            ("assumption", escape(bound.get("assumption") or "")),
            ("why not proven", escape(bound.get("reason") or "-"))]
    others = bound.get("others") or []
    if others:
        rows.append(("other mechanisms (larger bounds)", escape("; ".join(others))))
    table = "".join(f"<tr><th style='text-align:left'>{k}</th><td>{v}</td></tr>" for k, v in rows)
    png = bound_plot(bound)
    return (f"<h2 id=bound>Proven bound</h2><p><b>{escape(summary_sentence(verdict, bound))}</b></p>"
            f"<table>{table}</table>" + (img_tag(png, "bound vs rounds and vs kappa") if png else ""))
