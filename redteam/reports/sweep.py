"""A sweep's outputs for people: the privacy-utility plot (PNG), a self-contained ``report.html`` with it,
and the chosen defense as a ready-to-use YAML.

The plot has two panels sharing the x axis (accuracy drop against the undefended model, in points):
the worst single reconstruction (SSIM for images, ROUGE-1 for text) with the certificate's threshold as
a line and the accuracy's spread over the utility task's repeats as horizontal bars, and the leak rate's upper confidence bound with ``max_leak_rate`` as a line (what the verdict
actually rules on). Each axis of the sweep is a series ordered weak -> strong; a filled marker
certified, a hollow one did not; the chosen setting is a star.
"""

from __future__ import annotations

import html
import io
import json
from typing import Any

import yaml

from guardfl.redteam.reports.page import (FAIL_COLOUR, PASS_COLOUR, document, escape, fmt, img_tag, json_pre,
                                          warnings_html)
from guardfl.redteam.sweep.results import CHOSEN

#: colours of the series (matplotlib's tab10, colour-blind friendly enough for a handful of axes)
_MARKERS = "osD^vP*Xh<>"

#: the sweep page's own CSS: the plot fits the window
PLOT_CSS = "img { max-width: 100%; }\n"


def plot(result) -> bytes:
    """The privacy-utility plot as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric, threshold = result.metric
    base = result.plan.base["certify"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for a in range(len(result.plan.axes)):
        _plot_axis(result, a, colours[a % len(colours)], top, bottom)
    _plot_marks(result, top, bottom)
    if threshold is not None:
        top.axhline(threshold, color="#b3261e", linestyle="--", linewidth=1, label=f"threshold: {metric} {threshold:g}")
    bottom.axhline(base["max_leak_rate"], color="#b3261e", linestyle="--", linewidth=1,
                   label=f"max leak rate {base['max_leak_rate']:g} (certified below)")
    top.set_ylabel(f"worst single reconstruction ({metric})")
    bottom.set_ylabel(f"leak rate, {base['confidence']:.0%} upper bound")
    bottom.set_xlabel("accuracy drop vs no defense (percentage points; left is better)")
    bottom.set_ylim(-0.02, 1.02)
    top.set_title("Privacy-utility trade-off (filled: certified, hollow: not certified)", fontsize=10)
    top.legend(fontsize=8, loc="best")
    bottom.legend(fontsize=8, loc="best")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def _plot_axis(result, a: int, colour: str, top, bottom) -> None:
    """Axis ``a`` of the sweep as one series on both panels (weak -> strong), the accuracy's spread as bars."""
    metric = result.metric[0]
    rows = sorted((p for p in result.points if p["axis"] == a and p.get("verdict")), key=lambda p: p["index"])
    if not rows:
        return
    label = result.plan.config.axes[a].name()
    xs = [100 * p["utility"]["accuracy_drop"] for p in rows]
    for ax, ys in ((top, [p["worst"].get(metric) for p in rows]), (bottom, [p["leak_rate"]["upper_bound"] for p in rows])):
        pairs = [(x, y) for x, y in zip(xs, ys) if y is not None]
        if not pairs:
            continue
        ax.plot(*zip(*pairs), "-", color=colour, alpha=0.5, linewidth=1)
        for p, x, y in zip(rows, xs, ys):
            if y is None:
                continue
            std = 100 * (p["utility"].get("accuracy_std") or 0.0)
            if std and ax is top:  # the spread of the accuracy over the utility task's repeats
                ax.errorbar([x], [y], xerr=[std], fmt="none", ecolor=colour, alpha=0.4, capsize=2)
            ax.plot([x], [y], _MARKERS[a % len(_MARKERS)], color=colour, markersize=7,
                    markerfacecolor=colour if p["certified"] else "white", markeredgewidth=1.5)
            if ax is top:
                ax.annotate(f"{p['value']:g}", (x, y), textcoords="offset points", xytext=(5, 4), fontsize=7, color=colour)
    top.plot([], [], _MARKERS[a % len(_MARKERS)] + "-", color=colour, label=label)


def _plot_marks(result, top, bottom) -> None:
    """The undefended model (a cross at no accuracy drop) and the chosen setting (a star)."""
    metric = result.metric[0]
    base_row = result.baseline
    if base_row.get("worst") and base_row["worst"].get(metric) is not None:
        top.plot([0], [base_row["worst"][metric]], "x", color="black", markersize=9, label="no defense")
        bottom.plot([0], [base_row["leak_rate"]["upper_bound"]], "x", color="black", markersize=9)
    chosen = result.chosen
    if chosen is not None:
        x = 100 * chosen["utility"]["accuracy_drop"]
        if chosen["worst"].get(metric) is not None:
            top.plot([x], [chosen["worst"][metric]], "*", color="gold", markeredgecolor="black", markersize=18, zorder=5,
                     label=f"chosen: {chosen['label']}")
        bottom.plot([x], [chosen["leak_rate"]["upper_bound"]], "*", color="gold", markeredgecolor="black", markersize=18, zorder=5)


def chosen_yaml(result) -> str:
    """The chosen defense as YAML (``defense:`` at the top: ``guardfl check`` and ``from_config`` read
    it), with what it certified and cost in the comments."""
    c = result.chosen
    rate = c["leak_rate"]
    u = c["utility"]
    lines = [
        f"# guardfl sweep {result.plan.digest}: the certified setting with the least accuracy drop",
        f"# {c['label']}: {c['verdict']} ({rate['leaked']} of {rate['samples']} samples leaked; "
        f"{rate['confidence']:.0%} upper bound {rate['upper_bound']:.3g} < {rate['max_leak_rate']:g})",
        f"# accuracy {u['accuracy']:.4f} vs {u['baseline_accuracy']:.4f} without a defense (drop {u['accuracy_drop']:+.4f}); "
        f"training time x{u['time_ratio']:.2f}",
        f"# strength {c.get('strength')}; the certificate: {c.get('report', '').replace('report.html', 'certificate.json')}",
        "# No seed: the deployed defense draws its randomness from OS entropy.",
    ]
    return "\n".join(lines) + "\n" + yaml.safe_dump({"defense": c["defense"]}, sort_keys=False)


def _fmt(v: Any, spec: str = ".3f") -> str:
    """A cell of the table of settings (a dash when missing)."""
    return fmt(v, spec, none="&ndash;")


def _spread(u: dict[str, Any]) -> str:
    """" &plusmn; std (n runs)" when the utility task was repeated."""
    runs = len(u.get("accuracies") or [])
    return f" &plusmn; {u['accuracy_std']:.3f} ({runs} runs)" if runs > 1 else ""


def write_report(result, png: bytes, path) -> None:
    """``report.html``: the verdict banner (the chosen setting, or none certifies), the plot, a table of
    every evaluated point (linked to its own red-team report), the chosen YAML, warnings and the config."""
    from guardfl.redteam.runtime.files import atomic_write

    data = result.to_dict()
    chosen = result.chosen
    if chosen is not None:
        banner = f"CHOSEN: {chosen['label']} (accuracy drop {100 * chosen['utility']['accuracy_drop']:.1f} points)"
    else:
        banner = "NO SETTING CERTIFIED"
    body = "\n".join([
        _summary_html(result, data), warnings_html(result.warnings),
        img_tag(png, "privacy-utility trade-off"),
        _axes_html(data), _points_html(result), _chosen_html(result),
        f"<h2>Sweep config</h2>{json_pre(data['sweep'])}",
        f"<h2>Base red-team config</h2>{json_pre(data['base'])}",
    ])
    colour = PASS_COLOUR if chosen is not None else FAIL_COLOUR
    atomic_write(path, document(f"guardfl sweep: {banner}", escape(banner), colour, body, css=PLOT_CSS))


def _summary_html(result, data: dict[str, Any]) -> str:
    """What the sweep asked and how it ran: the claim per point, the utility task, how many settings."""
    certify = result.plan.base["certify"]
    return f"""<p>Which defense setting costs the least accuracy and still certifies: every point is a full red-team run
(at most {html.escape(str(certify['max_updates']))} client update(s), decided sequentially; claim: leak rate below {certify['max_leak_rate']:g} at
{certify['confidence']:.0%} confidence) and a training run of the utility task
(<code>{html.escape(result.plan.config.utility.source)}</code>, {result.plan.config.utility.epochs} epoch(s), held-out accuracy).
Evaluated {data['evaluations']} of {data['grid_size']} settings{' (autotune: bisection per monotone axis)' if data['autotune'] else ''};
backend <code>{html.escape(json.dumps(data['backend']))}</code>; {data['wall_time_s']:.0f} s.</p>"""


def _axes_html(data: dict[str, Any]) -> str:
    axes = "".join(
        f"<li><b>{html.escape(a['label'])}</b> ({html.escape(str(a['kind']))}.{html.escape(a['param'])}, stronger: "
        f"{html.escape(a['stronger'])}): values {html.escape(', '.join(f'{v:g}' for v in a['values']))}; evaluated "
        f"{len(a['evaluated'])}; weakest certified: {html.escape(str(a['weakest_certified']))}</li>"
        for a in data["axes"])
    return f"<h2>Axes</h2><ul>{axes}</ul>"


def _points_html(result) -> str:
    """Every evaluated setting, the undefended baseline first, each linked to its red-team report."""
    metric, threshold = result.metric
    chosen = result.chosen
    base = result.baseline
    rows = [f"<tr><td><i>no defense</i></td><td>{_fmt(base.get('verdict'))}</td><td>{_fmt((base.get('worst') or {}).get(metric))}</td>"
            f"<td>{_fmt((base.get('leak_rate') or {}).get('upper_bound'))}</td><td>{_fmt(base['utility']['accuracy'])}{_spread(base['utility'])}</td>"
            "<td>0</td><td>1.00</td><td>&ndash;</td><td>"
            + (f"<a href=\"{html.escape(base['report'])}\">report</a>" if base.get("report") else "") + "</td></tr>"]
    for p in result.points:
        if p["axis"] < 0:
            continue
        u = p["utility"]
        cls = "chosen" if chosen is not None and p["id"] == chosen["id"] else ("pass" if p["certified"] else "fail")
        rate = p.get("leak_rate") or {}
        rows.append(
            f"<tr class={cls}><td>{html.escape(p['label'])}</td><td>{_fmt(p.get('verdict'))}</td>"
            f"<td>{_fmt(p['worst'].get(metric))}</td><td>{_fmt(rate.get('upper_bound'))}"
            f"{' (' + str(rate.get('leaked')) + '/' + str(rate.get('samples')) + ')' if rate else ''}</td>"
            f"<td>{_fmt(u['accuracy'])}{_spread(u)}</td><td>{_fmt(100 * u['accuracy_drop'], '+.1f')}</td><td>{_fmt(u['time_ratio'], '.2f')}</td>"
            f"<td>{_fmt(u.get('epsilon'), '.3g')}</td>"
            f"<td><a href=\"{html.escape(p['report'])}\">report</a></td></tr>")
    return f"""<h2>Every evaluated setting</h2>
<table><tr><th>setting</th><th>verdict</th><th>worst {html.escape(metric)}{f' (threshold {threshold:g})' if threshold is not None else ''}</th>
<th>leak bound (leaked/attacked)</th><th>accuracy</th><th>drop (points)</th><th>training time ratio</th><th>epsilon</th><th>red team</th></tr>
{''.join(rows)}</table>"""


def _chosen_html(result) -> str:
    if result.chosen is None:
        return ""
    return (f"<h2>The chosen defense</h2><p>Saved as <code>{CHOSEN}</code>; use it with "
            "<code>guardfl.protect</code>, <code>local_update</code> or the Flower mod.</p>"
            f"<pre>{html.escape(chosen_yaml(result))}</pre>")
