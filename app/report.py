"""Views of a run's history: the status table (text and JSON rows) and the report (PNG or HTML).

The plot draws one line per dataset (mean reward vs step, measured points only) and marks every
non-measured step on the bottom edge of the axes: skips as grey `x` with the reason written
above, failed/crashed points as red `X`, points still in flight as hollow circles. Artists carry
a `gid` (`score:<ds>`, `skipped`, `failed`, `inflight`) so tests can find them. matplotlib runs
on the Agg backend; no display is needed.
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.history import PointHistory, RunHistory

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from pinned_eval.results.compare import DatasetFlips
    from pinned_eval.results.transcripts import TranscriptDiff

FAILED = ("failed", "crashed", "cancelled")
INFLIGHT = ("running", "pending", "scheduled")


def status_rows(history: RunHistory) -> list[dict[str, Any]]:
    """One flat row per step: step, state, reason, eval/<ds> per dataset, weight_version, lag, attempts."""
    out = []
    for p in history.points:
        row: dict[str, Any] = {"step": p.step, "state": p.outcome, "reason": p.reason}
        for ds in history.datasets:
            row[f"eval/{ds}"] = p.scores.get(ds)
        row.update(weight_version=p.weight_version, lag_steps=p.lag_steps, attempts=len(p.attempts))
        out.append(row)
    return out


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if not value.is_integer() or abs(value) < 1 else f"{value:.0f}"
    return str(value)


def format_table(history: RunHistory) -> str:
    rows = status_rows(history)
    if not rows:
        return f"run {history.run}: no eval points"
    headers = list(rows[0])
    cells = [[_cell(r[h]) for h in headers] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(cell, widths, strict=True)) for cell in cells]
    return "\n".join(lines)


def attempts_lines(point: PointHistory) -> list[str]:
    return [
        f"  attempt {a.number}: {a.state_name} ({a.state_type.lower()}) {a.flow_run_id}"
        + (f" — {a.message}" if a.message else "")
        for a in point.attempts
    ]


def plot_history(history: RunHistory) -> Figure:
    """The report figure: score per dataset vs step, non-measured steps marked on the bottom edge."""
    import matplotlib  # matplotlib: optional `report` extra

    matplotlib.use("Agg")
    from matplotlib.figure import Figure  # matplotlib: optional `report` extra
    from matplotlib.ticker import MaxNLocator  # matplotlib: optional `report` extra

    fig = Figure(figsize=(10, 5.5), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(f"pinned-eval: run {history.run}")
    ax.set_xlabel("training step (weight version)")
    ax.set_ylabel("mean reward (eval/<dataset>)")
    for ds in history.datasets:
        pts = [(p.step, p.scores[ds]) for p in history.points if ds in p.scores]
        xs, ys = zip(*pts, strict=True)
        ax.plot(xs, ys, marker="o", label=ds, gid=f"score:{ds}")
    bottom = ax.get_xaxis_transform()  # x in data units, y in axes fraction
    skipped = [p for p in history.points if p.outcome == "skipped"]
    failed = [p for p in history.points if p.outcome in FAILED]
    inflight = [p for p in history.points if p.outcome in INFLIGHT]
    if skipped:
        ax.scatter([p.step for p in skipped], [0.03] * len(skipped), marker="x", s=60, color="0.35",
                   transform=bottom, clip_on=False, zorder=3, label="skipped", gid="skipped")
        for p in skipped:
            ax.annotate(p.reason or "skipped", (p.step, 0.06), xycoords=bottom, rotation=90, fontsize=8,
                        ha="center", va="bottom", color="0.35", gid=f"skip-reason:{p.step}")
    if failed:
        ax.scatter([p.step for p in failed], [0.03] * len(failed), marker="X", s=80, color="tab:red",
                   transform=bottom, clip_on=False, zorder=3, label="failed / crashed", gid="failed")
        for p in failed:
            ax.annotate(p.outcome, (p.step, 0.06), xycoords=bottom, rotation=90, fontsize=8,
                        ha="center", va="bottom", color="tab:red", gid=f"fail-reason:{p.step}")
    if inflight:
        ax.scatter([p.step for p in inflight], [0.03] * len(inflight), marker="o", s=50, facecolors="none",
                   edgecolors="tab:blue", transform=bottom, clip_on=False, zorder=3, label="in flight",
                   gid="inflight")
    if history.points:
        steps = [p.step for p in history.points]
        pad = max(1.0, (max(steps) - min(steps)) * 0.05)
        ax.set_xlim(min(steps) - pad, max(steps) + pad)
    lo, hi = 0.0, 1.0  # rewards are usually in [0, 1]: show that whole range
    values = [v for p in history.points for v in p.scores.values()]
    if values:
        lo, hi = min(lo, *values), max(hi, *values)
    span = hi - lo or 1.0
    ax.set_ylim(lo - 0.3 * span, hi + 0.05 * span)  # room at the bottom for the markers
    ax.set_yticks([t for t in ax.get_yticks() if lo - 1e-9 <= t <= hi + 1e-9])  # no score ticks down there
    ax.axhline(lo - 0.02 * span, color="0.8", linewidth=0.8, zorder=1)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    if history.points:
        ax.legend(loc="upper left", fontsize=9)
    return fig


def png_bytes(history: RunHistory) -> bytes:
    buf = io.BytesIO()
    plot_history(history).savefig(buf, format="png")
    return buf.getvalue()


def comparison_html(step_a: int, step_b: int, flips: list[DatasetFlips]) -> str:
    """The report's comparison section: per dataset, the examples that flipped each way between
    steps A and B, with prompt, label and both responses, then (agentic samples) where each
    example's transcripts first differ (every text escaped)."""
    parts = [f"<h2 id='compare'>Step {step_a} (A) vs step {step_b} (B): examples that flipped</h2>"]
    for d in flips:
        parts.append(f"<h3>{html.escape(d.dataset)}: {len(d.lost)} correct in A, wrong in B; "
                     f"{len(d.gained)} wrong in A, correct in B ({d.examples} examples)</h3>")
        for kind, title, items in (("lost", "correct in A, wrong in B", d.lost),
                                   ("gained", "wrong in A, correct in B", d.gained)):
            if not items:
                continue
            rows = "".join(
                f"<tr><td>{f.example_id}</td><td>{html.escape(f.prompt)}</td><td>{html.escape(f.label)}</td>"
                f"<td>{html.escape(f.response_a)}</td><td>{html.escape(f.response_b)}</td></tr>"
                for f in items
            )
            parts.append(f"<table class='flips' data-flip='{kind}'>"
                         f"<caption>{title}</caption><thead><tr><th>example</th><th>prompt</th><th>label</th>"
                         f"<th>response A</th><th>response B</th></tr></thead><tbody>{rows}</tbody></table>")
        if d.transcripts:
            parts.append(_transcripts_html(d.transcripts))
    return "".join(parts)


def _transcripts_html(diffs: list[TranscriptDiff]) -> str:
    """Where each example's transcripts first differ (`pinned_eval.results.transcripts`): turn,
    role and excerpt of each side. Transcripts are model output: every text is escaped."""
    rows = "".join(
        f"<tr><td>{t.example_id}</td><td>{t.turn}</td><td>{html.escape(t.role_a)}</td>"
        f"<td>{html.escape(t.excerpt_a)}</td><td>{html.escape(t.role_b)}</td><td>{html.escape(t.excerpt_b)}</td></tr>"
        for t in diffs
    )
    return ("<table class='transcripts'><caption>transcripts: where they first differ</caption><thead><tr>"
            "<th>example</th><th>turn</th><th>role A</th><th>A</th><th>role B</th><th>B</th></tr></thead>"
            f"<tbody>{rows}</tbody></table>")


def html_report(history: RunHistory, comparison: str = "") -> str:
    """A self-contained page: the PNG embedded as base64, then the status table, then
    `comparison` (`comparison_html`) when given."""
    png = base64.b64encode(png_bytes(history)).decode()
    rows = status_rows(history)
    headers = list(rows[0]) if rows else []
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(
        f'<tr class="{html.escape(str(r["state"]))}">'
        + "".join(f"<td>{html.escape(_cell(r[h]))}</td>" for h in headers)
        + "</tr>"
        for r in rows
    )
    title = html.escape(f"pinned-eval report: run {history.run}")
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title><style>"
        "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}"
        "tr.skipped{color:#555}tr.failed,tr.crashed{color:#b00}</style></head><body>"
        f"<h1>{title}</h1><img alt='score per dataset vs step' src='data:image/png;base64,{png}'>"
        f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{comparison}</body></html>"
    )


def write_report(history: RunHistory, out: Path, comparison: str = "") -> Path:
    """Write `out` as PNG or HTML by its suffix (the HTML with `comparison` after the table)."""
    suffix = out.suffix.lower()
    if suffix == ".png":
        out.write_bytes(png_bytes(history))
    elif suffix in (".html", ".htm"):
        out.write_text(html_report(history, comparison))
    else:
        raise ValueError(f"out: {out.name!r} must end in .png or .html")
    return out
