"""Self-contained HTML from the Markdown that dsdoctor writes (headings, paragraphs, lists, tables, code),
with PNG figures embedded as data URIs, so a report is one file that opens anywhere offline."""
from __future__ import annotations

import base64
import html
import re
from pathlib import Path

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI","PingFang SC","Microsoft YaHei",sans-serif;max-width:1100px;
margin:2em auto;padding:0 1em;color:#1b1f24;line-height:1.5}
table{border-collapse:collapse;margin:1em 0;font-size:.92em}th,td{border:1px solid #ccd;padding:.3em .6em;
text-align:left;vertical-align:top}th{background:#eef1f6}code,pre{background:#f4f5f7;border-radius:4px}
pre{padding:.8em;overflow-x:auto}code{padding:.1em .3em}img{max-width:100%;border:1px solid #dde}
h1,h2,h3{border-bottom:1px solid #e5e7eb;padding-bottom:.2em}
"""


def _inline(text: str) -> str:
    out = html.escape(text, quote=False)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    out = re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", out)
    out = re.sub(r"(?<![\w*])_([^_]+)_(?![\w*])", r"<em>\1</em>", out)
    return out


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


def markdown_to_html(markdown: str, title: str, base: Path | None = None) -> str:
    lines = markdown.splitlines()
    body: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
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
            th = "".join(f"<th>{_inline(c)}</th>" for c in head)
            trs = "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in r) + "</tr>" for r in rows)
            body.append(f"<table><thead><tr>{th}</tr></thead><tbody>{trs}</tbody></table>")
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
            while i + 1 < len(lines) and lines[i + 1].strip() and not re.match(r"(#|\||```|\s*[-*] |!\[)", lines[i + 1]):
                i += 1
                para.append(lines[i])
            body.append(f"<p>{_inline(' '.join(para))}</p>")
        i += 1
    return (f"<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{_CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")
