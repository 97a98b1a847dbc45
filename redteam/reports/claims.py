"""The claims' section of the certificate page: each claim's decision in words, the confidence sequence
it was decided by (a plot of its bounds over the updates attacked, with the claim's rate), and the
re-identification table."""

from __future__ import annotations

import html
import io
from typing import Any

from guardfl.redteam.certification import evidence, sequential
from guardfl.redteam.reports.page import fmt, img_tag

#: a claim's name in words
CLAIM_WORDS = {"leak_rate": ("Leak rate", "leaked (some attack reconstructed them past a threshold)"),
               "reid_rate": ("Re-identification rate", "were re-identified (the attacker named them among the candidates)")}

#: what each verdict means, for the reader who must sign
MEANING = {
    evidence.CERTIFIED: "the bound on the rate is below the claim: wrong with probability at most {alpha:.0%}, against these attacks",
    evidence.NOT_CERTIFIED: "the attacked updates show the rate above the claim: a true claim is refuted with probability at most {alpha:.0%}",
    evidence.INCONCLUSIVE: "neither within the budget: the attacks neither ruled the rate in nor out; more updates can decide",
}


def _trajectory(xs: list[float], alpha_c: float, alpha_r: float) -> tuple[list[float], list[float]]:
    """The confidence sequence's ends after each update (what a reviewer peeking after every one saw)."""
    ups, lows = [], []
    for t in range(1, len(xs) + 1):
        ups.append(sequential.upper_bound(xs[:t], alpha_c))
        lows.append(sequential.lower_bound(xs[:t], alpha_r))
    return ups, lows


def claim_plot(rate: dict[str, Any], title: str) -> bytes:
    """The bounds on the rate after each update, the observed running mean and the claim's rate (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = rate["per_update"]
    ups, lows = _trajectory(xs, rate["alpha_certify"], rate["alpha_refute"])
    t = list(range(1, len(xs) + 1))
    means = [sum(xs[:i]) / i for i in t]
    fig, ax = plt.subplots(figsize=(5.2, 2.6), dpi=100)
    ax.fill_between(t, lows, ups, color="#9ecae1", alpha=0.6, step=None, label="confidence sequence")
    ax.plot(t, means, color="#08519c", lw=1.2, marker="." if len(t) < 30 else None, label="observed mean")
    if rate.get("max_rate") is not None:
        ax.axhline(rate["max_rate"], color="#b3261e", ls="--", lw=1.2, label=f"claim {rate['max_rate']:g}")
    ax.set_xlabel("client updates attacked")
    ax.set_ylabel("share per update")
    ax.set_ylim(0, 1)
    ax.set_xlim(1, max(2, len(xs)))
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper right", framealpha=0.6)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def _claim_html(name: str, rate: dict[str, Any], stop: dict[str, Any]) -> str:
    title, verb = CLAIM_WORDS[name]
    status = rate["status"]
    alpha = rate["alpha_certify"] if status != evidence.NOT_CERTIFIED else rate["alpha_refute"]
    head = (f"<b>{rate['leaked']} of {rate['samples']}</b> private samples {verb}, in {rate['updates']} client "
            f"update(s) of {rate['samples_per_update']}; mean share per update {fmt(rate['observed_rate'], '.3g')}. "
            f"With {rate['confidence']:.0%} confidence the rate lies in <b>[{rate['lower_bound']:.3g}, "
            f"{rate['upper_bound']:.3g}]</b> (anytime-valid: however often the run looked).")
    if status == evidence.NO_CLAIM:
        body = f"{head} The config makes no claim on it (information)."
    else:
        body = (f"{head} The claim asks for below {rate['max_rate']:g}: <b>{html.escape(status)}</b>, "
                f"{html.escape(MEANING[status].format(alpha=alpha))}.")
        more = rate.get("more_updates") or {}
        if status == evidence.INCONCLUSIVE:
            body += (f" About <b>{more['more']}</b> more update(s) would most likely decide it "
                     f"(<code>guardfl redteam --resume</code> adds them)." if more.get("more") else
                     f" {html.escape(more.get('note', ''))}.")
            need = rate.get("updates_needed_without_leaks")
            if need and rate["updates"] < need:
                body += f" No fewer than {need} leak-free updates can certify it."
    gallery = rate.get("gallery")
    if gallery:
        body += (f" Candidates: {gallery['candidates']} ({gallery['population']} of the population, "
                 f"{gallery['auxiliary']} of the attacker's own); a guess that knows nothing names a sample with "
                 f"probability {gallery['chance_rate']:.3g}.")
    plot = img_tag(claim_plot(rate, title), f"{title}: confidence sequence") if rate["per_update"] else ""
    return f"<h3>{title}</h3><p class=claim>{body}</p>{plot}<p class=legend>{html.escape(rate['rule'])}.</p>"


def _reid_table(rate: dict[str, Any]) -> str:
    rows = rate.get("per_attack") or {}
    if not rows:
        return ""
    sims = sorted({sim for by in rows.values() for sim in by})
    head = "".join(f"<th>{html.escape(sim)}: rank 1</th><th>{html.escape(sim)}: median rank</th>" for sim in sims)
    body = "".join(
        f"<tr><td>{html.escape(attack)}</td>" + "".join(
            f"<td>{by[sim]['rank1']} of {by[sim]['of']}</td><td>{fmt(float(by[sim]['median_rank']), '.1f')}</td>"
            if sim in by else "<td></td><td></td>" for sim in sims) + "</tr>"
        for attack, by in rows.items())
    return ("<p class=legend>Per attack and similarity, the rank of the true sample among the candidates (1: its "
            "reconstruction's nearest). A diagnostic that uses the truth; the claim counts the attacker's own "
            f"answer.</p><table><tr><th>attack</th>{head}</tr>{body}</table>")


def claims_html(cert) -> str:
    """Every claim of the certificate, where its rounds stopped, and the re-identification table."""
    ev = cert.evidence
    stop = ev.get("stop") or {}
    parts = []
    for name in ("leak_rate", "reid_rate"):
        if ev.get(name):
            parts.append(_claim_html(name, ev[name], stop))
            if name == "reid_rate":
                parts.append(_reid_table(ev[name]))
    why = {"decided": "the claims were decided", "budget": "the budget of updates ran out",
           "max_seconds": "the time budget ran out"}.get(stop.get("reason"), stop.get("reason", ""))
    rounds = (f"<p>The unit is the client update: the updates were drawn independently from the deployment and "
              f"attacked in rounds; the run stopped after {stop.get('updates')} of at most {stop.get('budget')} "
              f"updates because {html.escape(str(why))}.</p>") if stop else ""
    return "<h2>Claims</h2>" + rounds + "".join(parts)
