"""Pictures of a plan: each path's per-GPU peak as stacked parts against the GPU's capacity.

``write_plots`` writes ``plan.png`` (matplotlib, imported only here) and ``plan.html`` (self-contained:
the bars drawn in inline SVG, no scripts, no external files).
"""
from __future__ import annotations

import html
from pathlib import Path

from dsdoctor import door
from dsdoctor.errors import InputError
from dsdoctor.plan.result import PlanResult, label
from dsdoctor.units import human_bytes

GiB = 1024**3
COLORS = {
    "weights_resident": "#4e79a7", "persistent_params": "#a0cbe8", "gathered_params": "#f28e2b",
    "kv_cache": "#59a14f", "activations": "#e15759", "logits": "#b07aa1", "cublas_workspace": "#bab0ac",
    "load_transient": "#ff9da7", "reduce_bucket": "#9c755f", "optimizer_state": "#76b7b2",
    "outside_allocator": "#d4d4d4",
}


def _stacks(result: PlanResult):
    keys: list[str] = []
    for p in result.paths:
        for k in p.breakdown:
            if k not in keys:
                keys.append(k)
    keys.append("outside_allocator")
    rows = []
    for p in result.paths:
        parts = dict(p.breakdown)
        parts["outside_allocator"] = p.gpu_outside_allocator_bytes
        rows.append((p.name, parts, p.verdict))
    return keys, rows


MARK = {"fits": "", "edge": " ⚠", "unverified": " ⚠"}  # beside a bar: what the plan's verdict is (else ✗)


def require_matplotlib() -> None:
    """An InputError (one line, exit 2) when matplotlib cannot be imported: checked before any work."""
    try:
        import matplotlib
        import matplotlib.pyplot  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install
        raise InputError(f"--plot needs matplotlib, which cannot be imported here ({type(exc).__name__})",
                         hint="pip install matplotlib, or leave out --plot") from None


def render_png(result: PlanResult) -> bytes:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys, rows = _stacks(result)
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(rows) + 2.2))
    names = [r[0] for r in rows]
    left = [0.0] * len(rows)
    for k in keys:
        vals = [r[1].get(k, 0) / GiB for r in rows]
        if any(vals):
            ax.barh(names, vals, left=left, color=COLORS.get(k, "#cccccc"), label=label(k, "en"))
        left = [a + b for a, b in zip(left, vals)]
    cap = result.hardware.gpu_memory / GiB
    ax.axvline(cap, color="black", linestyle="--", linewidth=1)
    ax.annotate(f"GPU {cap:.0f} GiB", (cap, -0.6), ha="right", fontsize=8)
    ax.set_xlabel("GiB per GPU (peak over load + generate)")
    ax.invert_yaxis()
    ax.legend(fontsize=7, loc="best")
    w = result.workload
    ax.set_title(f"{result.model['model_type']} {result.model['num_params'] / 1e9:.2f}B params, batch {w.batch}, "
                 f"prompt {w.prompt_len}, +{w.new_tokens} tokens, {result.hardware.gpus} GPU(s)", fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def render_html(result: PlanResult, lang: str = "en") -> str:
    keys, rows = _stacks(result)
    cap = result.hardware.gpu_memory
    scale_max = max([cap] + [sum(r[1].values()) for r in rows]) * 1.05
    width, bar_h, left_pad = 720, 26, 150
    height = len(rows) * (bar_h + 12) + 40
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width + left_pad + 20}" height="{height}" '
           f'font-family="sans-serif" font-size="12">']
    for i, (name, parts, verdict) in enumerate(rows):
        y = 10 + i * (bar_h + 12)
        svg.append(f'<text x="{left_pad - 8}" y="{y + bar_h * 0.7}" text-anchor="end">{html.escape(name)}'
                   f'{MARK.get(verdict, " ✗")}</text>')
        x = left_pad
        for k in keys:
            v = parts.get(k, 0)
            if not v:
                continue
            w = v / scale_max * width
            svg.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{bar_h}" fill="{COLORS.get(k, "#ccc")}">'
                       f'<title>{html.escape(label(k, lang))}: {human_bytes(v)}</title></rect>')
            x += w
        svg.append(f'<text x="{x + 4:.1f}" y="{y + bar_h * 0.7}">{human_bytes(sum(parts.values()))}</text>')
    cx = left_pad + cap / scale_max * width
    svg.append(f'<line x1="{cx:.1f}" y1="0" x2="{cx:.1f}" y2="{height - 20}" stroke="black" stroke-dasharray="4"/>')
    svg.append(f'<text x="{cx:.1f}" y="{height - 5}" text-anchor="middle">GPU {human_bytes(cap)}</text></svg>')
    legend = "".join(f'<span style="display:inline-block;margin-right:12px"><span style="display:inline-block;'
                     f'width:12px;height:12px;background:{COLORS.get(k, "#ccc")}"></span> {html.escape(label(k, lang))}'
                     f'</span>' for k in keys)
    title = "dsdoctor plan"
    table = result.to_markdown(lang)
    return (f'<!doctype html>\n<html lang="{lang}"><head><meta charset="utf-8"><title>{title}</title></head>\n'
            f'<body style="font-family:sans-serif;max-width:1000px">\n<h1>{title}</h1>\n'
            f'<p>{html.escape(result._header(lang)).replace(chr(10), "<br>")}</p>\n{"".join(svg)}\n<p>{legend}</p>\n'
            f'<pre>{html.escape(table)}</pre>\n</body></html>\n')


def write_plots(result: PlanResult, directory: str | Path, lang: str = "en", force: bool = False) -> list[Path]:
    """Write ``plan.png`` and ``plan.html`` into a new directory (atomically; refuses to replace one
    without ``force``)."""
    png = render_png(result)
    page = render_html(result, lang)
    target = Path(directory)
    with door.atomic_output_dir(target, force=force, command="plan --plot") as tmp:
        door.write_new(tmp / "plan.png", png)
        door.write_new(tmp / "plan.html", page)
    return [target / "plan.png", target / "plan.html"]
