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


_DETAILS_OPEN = re.compile(r"<details><summary>(.*)</summary>\s*$")


def markdown_to_html(markdown: str, title: str, base: Path | None = None) -> str:
    body = _blocks(markdown.splitlines(), base, folded=False, state={"quotes": 0})
    return (f"<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{_CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def _blocks(lines: list[str], base: Path | None, folded: bool, state: dict) -> list[str]:
    """A line reader: each block kind of the Markdown the reports write, to HTML."""
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
            block, i = _quote(lines, i, base, state)
        elif line.startswith("```"):
            j = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), len(lines))
            block, i = "<pre><code>" + html.escape("\n".join(lines[i + 1:j])) + "</code></pre>", j + 1
        elif line.startswith("|") and i + 1 < len(lines) and re.match(r"\|[-:| ]+\|?$", lines[i + 1].strip()):
            block, i = _table(lines, i, depth)
        elif re.match(r"\d+\. ", line):
            block, i = _list(lines, i, r"\d+\. ", "ol")
        elif re.match(r"\s*[-*] ", line):
            block, i = _list(lines, i, r"\s*[-*] ", "ul")
        else:
            block, i = _line_block(lines, i, base)
        if block:
            body.append(block)
    return body


def _quote(lines: list[str], i: int, base: Path | None, state: dict) -> tuple[str, int]:
    """A block quote (the first of a report is its summary box), its inside read as blocks."""
    inner = []
    while i < len(lines) and lines[i].startswith(">"):
        inner.append(re.sub(r"^> ?", "", lines[i]))
        i += 1
    state["quotes"] += 1
    ident = ' id="summary" class="summary"' if state["quotes"] == 1 else ""
    return f"<blockquote{ident}>" + "\n".join(_blocks(inner, base, True, state)) + "</blockquote>", i


def _table(lines: list[str], i: int, depth: int) -> tuple[str, int]:
    """A table (its head, the rule under it, its rows); a long one folded outside <details>."""
    head = _split_row(lines[i])
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
    return table, i


def _list(lines: list[str], i: int, marker: str, tag: str) -> tuple[str, int]:
    """A numbered (``ol``) or bulleted (``ul``) list: the lines that start with ``marker``."""
    items = []
    while i < len(lines) and re.match(marker, lines[i]):
        items.append(f"<li>{_inline(re.sub('^' + marker, '', lines[i]))}</li>")
        i += 1
    return f"<{tag}>" + "".join(items) + f"</{tag}>", i


def _line_block(lines: list[str], i: int, base: Path | None) -> tuple[str, int]:
    """A heading, an image, a paragraph (up to the next line that starts another block), or a blank line."""
    line = lines[i]
    if (m := re.match(r"(#{1,6}) (.*)", line)):
        n = len(m.group(1))
        return f"<h{n}>{_inline(m.group(2))}</h{n}>", i + 1
    if (m := re.fullmatch(r"!\[([^\]]*)\]\(([^)]+)\)", line.strip())):
        return _image(m.group(1), m.group(2), base), i + 1
    if not line.strip():
        return "", i + 1
    para = [line]
    while i + 1 < len(lines) and lines[i + 1].strip() and \
            not re.match(r"(#|\||```|\s*[-*] |!\[|>|\d+\. |</?details)", lines[i + 1]):
        i += 1
        para.append(lines[i])
    return f"<p>{_inline(' '.join(para))}</p>", i + 1
