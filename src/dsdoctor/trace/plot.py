"""Memory timeline per rank: a PNG (matplotlib, imported lazily) and one self-contained HTML page."""
from __future__ import annotations

import base64
import html
import io
import warnings
from pathlib import Path

from dsdoctor import door
from dsdoctor.trace.report import TraceResult
from dsdoctor.units import human_bytes

_GIB = 1024**3


def write_timelines(result: TraceResult, directory: Path) -> list[str]:
    """Write ``timeline-rank-R.png`` per rank and ``timeline.html``; returns the file names written.

    Without matplotlib only the HTML is written: tables, and a line saying why there is no chart."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        plt = None
    written = []
    if plt is not None:
        for r in result.ranks:
            if not r.timeline and not r.phases:
                continue
            name = f"timeline-rank-{r.rank}.png"
            door.write_new(directory / name, _plot_rank(plt, r))
            r.timeline_png = name
            written.append(name)
    note = None if plt is not None else "No memory chart: matplotlib is not installed (pip install matplotlib)."
    door.write_new(directory / "timeline.html", _html(result, directory, note))
    written.append("timeline.html")
    return written


def _plot_rank(plt, r) -> bytes:
    """The rank's memory timeline as PNG bytes."""
    fig, ax = plt.subplots(figsize=(10, 3.6), dpi=100)
    if r.timeline:
        t = [x[0] for x in r.timeline]
        host = [(x[1] or 0) / _GIB for x in r.timeline]
        ax.plot(t, host, label="host RSS", color="#1f77b4")
        if any(x[3] is not None for x in r.timeline):
            ax.plot(t, [(x[3] or 0) / _GIB for x in r.timeline], label="GPU reserved", color="#d62728")
            ax.plot(t, [(x[2] or 0) / _GIB for x in r.timeline], label="GPU allocated", color="#ff9896")
    start = r.t0 if r.t0 is not None else (r.phases[0]["t_start"] if r.phases else None)
    colors = {"load": "#c7e9c0", "init": "#fdd0a2", "generate": "#c6dbef"}
    for p in r.phases:
        if start is None:
            break
        a = p["t_start"] - start
        b = (p["t_end"] if p["t_end"] is not None else p["t_start"] + (p["duration_s"] or 0)) - start
        if p["t_end"] is None and r.timeline:
            b = r.timeline[-1][0]
        ax.axvspan(a, max(b, a + 1e-3), color=colors.get(p["name"], "#eeeeee"), alpha=0.6, lw=0)
        ax.text(a, ax.get_ylim()[1] * 0.98, p["label"], fontsize=7, va="top")
    ax.set_xlabel("seconds since the rank's first observed call")
    ax.set_ylabel("GiB")
    ax.set_title(f"rank {r.rank} ({r.host}): peak GPU {human_bytes(r.peak_gpu_bytes)}, "
                 f"peak host {human_bytes(r.peak_host_bytes)}, peak in {r.peak_phase or '-'}", fontsize=9)
    if ax.get_legend_handles_labels()[0]:  # a run too short for the sampler has no lines to label
        ax.legend(loc="upper left", fontsize=8)
    with warnings.catch_warnings():  # long titles: a layout warning is not the user's business
        warnings.simplefilter("ignore")
        fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def _html(result: TraceResult, directory: Path, note: str | None = None) -> str:
    parts = ["<!doctype html><meta charset='utf-8'><title>dsdoctor trace</title>",
             "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:2px 6px;font-size:13px}</style>",
             f"<h1>dsdoctor trace</h1><p><code>{html.escape(' '.join(result.command))}</code> — status "
             f"<b>{html.escape(result.status)}</b>{' — variant ' + html.escape(result.variant) if result.variant else ''}</p>"]
    if note:
        parts.append(f"<p class='note'><b>{html.escape(note)}</b> The tables below have every figure.</p>")
    for r in result.ranks:
        parts.append(f"<h2>rank {r.rank} ({html.escape(str(r.host))}) — {html.escape(r.status)}</h2>")
        if r.timeline_png and (directory / r.timeline_png).is_file():
            data = base64.b64encode(door.read_bytes(directory / r.timeline_png, door.FIGURE)).decode()
            parts.append(f"<img alt='rank {r.rank} timeline' src='data:image/png;base64,{data}'>")
        parts.append("<table><tr><th>phase</th><th>seconds</th><th>peak GPU</th><th>peak host</th><th>pinned</th>"
                     "<th>tokens/s</th></tr>")
        for p in r.phases:
            tps = "-" if p["tokens_per_s"] is None else f"{p['tokens_per_s']:.1f}"
            dur = "unfinished" if p["duration_s"] is None else f"{p['duration_s']:.2f}"
            parts.append(f"<tr><td>{html.escape(p['label'])}</td><td>{dur}</td><td>{human_bytes(p['peak_gpu_bytes'])}"
                         f"</td><td>{human_bytes(p['peak_host_bytes'])}</td><td>{human_bytes(p['pinned_host_bytes'])}"
                         f"</td><td>{tps}</td></tr>")
        parts.append("</table>")
    parts.append("<h2>Findings</h2><ul>")
    for f in result.findings:
        parts.append(f"<li><b>{f.code}</b> [{f.effective_severity}] {html.escape(f.message('en'))}<br>→ "
                     f"{html.escape(f.fix('en'))}</li>")
    parts.append("</ul>")
    return "\n".join(parts)
