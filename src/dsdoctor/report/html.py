"""Self-contained HTML from the Markdown that dsdoctor writes (headings, paragraphs, lists, tables, code, a
blockquote for the summary box, <details> blocks), with PNG figures embedded as data URIs, so a report is one
file that opens anywhere offline. A table longer than ``FOLD_ROWS`` rows outside a <details> block is folded
into one."""
from __future__ import annotations

import base64
import html
import re
from pathlib import Path

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI","PingFang SC","Microsoft YaHei",sans-serif;max-width:1100px;
margin:2em auto;padding:0 1em;color:#1b1f24;line-height:1.5}
table{border-collapse:collapse;margin:1em 0;font-size:.92em}th,td{border:1px solid #ccd;padding:.3em .6em;
text-align:left;vertical-align:top;overflow-wrap:anywhere}td:first-child,.w{overflow-wrap:normal;white-space:nowrap}
th{background:#eef1f6}code,pre{background:#f4f5f7;border-radius:4px}
pre{padding:.8em;overflow-x:auto}code{padding:.1em .3em}img{max-width:100%;border:1px solid #dde}
h1,h2,h3{border-bottom:1px solid #e5e7eb;padding-bottom:.2em}
blockquote{margin:1em 0;padding:.6em 1.2em;border:2px solid #2563eb;border-radius:8px;background:#eff6ff}
details{margin:.6em 0}summary{cursor:pointer;color:#1d4ed8}
"""
FOLD_ROWS = 12
WHOLE_CHARS = 16  # a cell this short never wraps


def _inline(text: str) -> str:
    out = html.escape(text, quote=False)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    out = re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", out)
    out = re.sub(r"(?<![\w*])_([^_]+)_(?![\w*])", r"<em>\1</em>", out)
    return out


def _whole(cell: str) -> str:
    """A short cell (a severity, a code, a number) is kept on one line: a wide neighbour that may break anywhere
    would otherwise squeeze its column to one letter per line."""
    return ' class="w"' if len(cell) <= WHOLE_CHARS else ""


def _image(alt: str, src: str, base: Path | None) -> str:
    path = Path(src) if base is None else base / src
    if path.suffix.lower() == ".png" and path.is_file():
        from dsdoctor import door

        data = base64.b64encode(door.read_bytes(path, door.FIGURE)).decode("ascii")
        src = f"data:image/png;base64,{data}"
    return f'<p><img alt="{html.escape(alt)}" src="{html.escape(src)}"></p>'


def _split_row(line: str) -> list[str]:
    cells = re.split(r"(?<!\\)\|", line.strip().strip("|"))
    return [c.strip().replace("\\|", "|") for c in cells]


_NUMBERED = re.compile(r"^\d+\. ")
_DETAILS_OPEN = re.compile(r"<details><summary>(.*)</summary>\s*$")


def markdown_to_html(markdown: str, title: str, base: Path | None = None) -> str:
    body = _blocks(markdown.splitlines(), base, folded=False, state={"quotes": 0})
    return (f"<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{_CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def _blocks(lines: list[str], base: Path | None, folded: bool, state: dict) -> list[str]:  # noqa: C901,PLR0912,PLR0915 (a line reader: one branch per block kind)
    body: list[str] = []
    depth = 1 if folded else 0  # inside <details> (a long table there stays as it is)
    i = 0
    while i < len(lines):
        line = lines[i]
        if (m := _DETAILS_OPEN.match(line.strip())):
            body.append(f"<details><summary>{_inline(m.group(1))}</summary>")
            depth += 1
            i += 1
            continue
        if line.strip() == "</details>":
            body.append("</details>")
            depth = max(depth - 1, 0)
            i += 1
            continue
        if line.startswith(">"):
            inner = []
            while i < len(lines) and lines[i].startswith(">"):
                inner.append(re.sub(r"^> ?", "", lines[i]))
                i += 1
            state["quotes"] += 1
            ident = ' id="summary" class="summary"' if state["quotes"] == 1 else ""
            body.append(f"<blockquote{ident}>" + "\n".join(_blocks(inner, base, True, state)) + "</blockquote>")
            continue
        if line.startswith("```"):
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            body.append("<pre><code>" + html.escape("\n".join(lines[i + 1:j])) + "</code></pre>")
            i = j + 1
            continue
        m = re.match(r"(#{1,6}) (.*)", line)
        if m:
            n = len(m.group(1))
            body.append(f"<h{n}>{_inline(m.group(2))}</h{n}>")
        elif (m := re.fullmatch(r"!\[([^\]]*)\]\(([^)]+)\)", line.strip())):
            body.append(_image(m.group(1), m.group(2), base))
        elif line.startswith("|") and i + 1 < len(lines) and re.match(r"\|[-:| ]+\|?$", lines[i + 1].strip()):
            head = _split_row(line)
            rows = []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(_split_row(lines[i]))
                i += 1
            th = "".join(f"<th{_whole(c)}>{_inline(c)}</th>" for c in head)
            trs = "".join("<tr>" + "".join(f"<td{_whole(c)}>{_inline(c)}</td>" for c in r) + "</tr>" for r in rows)
            table = f"<table><thead><tr>{th}</tr></thead><tbody>{trs}</tbody></table>"
            if len(rows) > FOLD_ROWS and depth == 0:
                table = f"<details><summary>{len(rows)} rows</summary>{table}</details>"
            body.append(table)
            continue
        elif re.match(r"\d+\. ", line):
            items = []
            while i < len(lines) and re.match(r"\d+\. ", lines[i]):
                items.append("<li>" + _inline(_NUMBERED.sub("", lines[i])) + "</li>")
                i += 1
            body.append("<ol>" + "".join(items) + "</ol>")
            continue
        elif re.match(r"\s*[-*] ", line):
            items = []
            while i < len(lines) and re.match(r"\s*[-*] ", lines[i]):
                item = re.sub(r"^\s*[-*] ", "", lines[i])
                items.append(f"<li>{_inline(item)}</li>")
                i += 1
            body.append("<ul>" + "".join(items) + "</ul>")
            continue
        elif line.strip():
            para = [line]
            while i + 1 < len(lines) and lines[i + 1].strip() and \
                    not re.match(r"(#|\||```|\s*[-*] |!\[|>|\d+\. |</?details)", lines[i + 1]):
                i += 1
                para.append(lines[i])
            body.append(f"<p>{_inline(' '.join(para))}</p>")
        i += 1
    return body
