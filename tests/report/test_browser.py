"""The diagnose report as a user sees it: opened in a real headless browser (Debian's chromium), its DOM read back.

The summary box comes first (after the title), each finding is listed once, long tables are folded, and no
path of the folder the report was built in (``.partial``) shows. `make test` installs chromium where it can (Debian,
root or passwordless sudo); where it cannot, this test skips and says why, on CI too: a machine without chromium
still gives a green `make test`. DSDOCTOR_REQUIRE_BROWSER=1 makes a missing or broken browser a failure."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from html.parser import HTMLParser

import pytest

pytestmark = pytest.mark.process

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _browser() -> str:
    """A chromium that starts (a snap stub or a broken install is no browser), else skip with the reason."""
    found = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    why = "chromium is not installed and `make test` could not install it (it needs Debian's apt-get and root " \
        "or passwordless sudo: apt-get install -y chromium)"
    if found is not None:
        try:
            proc = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=60)
            why = None if proc.returncode == 0 else \
                f"{found} --version exited with {proc.returncode}: {(proc.stderr or proc.stdout).strip()[:200]}"
        except (OSError, subprocess.TimeoutExpired) as e:
            why = f"{found} does not start: {e}"
    if why is None:
        return found
    if os.environ.get("DSDOCTOR_REQUIRE_BROWSER") == "1":
        pytest.fail(f"DSDOCTOR_REQUIRE_BROWSER=1 and {why}")
    pytest.skip(f"the report's browser check did not run: {why}")


class _Page(HTMLParser):
    """The body's top-level elements in order, every table (rows, first cells, whether inside <details>)."""

    def __init__(self):
        super().__init__()
        self.stack: list[str] = []
        self.top: list[tuple[str, dict]] = []
        self.tables: list[dict] = []
        self.cell: list[str] | None = None
        self.row: list[str] | None = None
        self.details = 0
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag in ("br", "img", "meta", "hr", "input", "link"):
            return
        if self.stack and self.stack[-1] == "body":
            self.top.append((tag, dict(attrs)))
        self.stack.append(tag)
        if tag == "details":
            self.details += 1
        elif tag == "table":
            self.tables.append({"rows": [], "folded": self.details > 0})
        elif tag == "tr":
            self.row = []
        elif tag in ("td", "th"):
            self.cell = []

    def handle_endtag(self, tag):
        while self.stack and self.stack.pop() != tag:
            pass
        if tag == "details":
            self.details -= 1
        elif tag in ("td", "th") and self.cell is not None and self.row is not None:
            self.row.append("".join(self.cell).strip())
            self.cell = None
        elif tag == "tr" and self.row is not None and self.tables:
            self.tables[-1]["rows"].append(self.row)
            self.row = None

    def handle_data(self, data):
        self.text.append(data)
        if self.cell is not None:
            self.cell.append(data)


def _dump_dom(browser: str, page, profile) -> str:
    proc = subprocess.run([browser, *FLAGS, f"--user-data-dir={profile}", "--dump-dom", page.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "<body" in proc.stdout, proc.stderr[-2000:]
    return proc.stdout


def test_diagnose_report_leads_with_the_answer_in_a_real_browser(tmp_path):
    browser = _browser()
    from dsdoctor.diagnose import diagnose

    out = tmp_path / "diag"
    diagnose(out=str(out))  # the bundled example: a training config reused for inference
    page = out / "report.html"
    dom = _dump_dom(browser, page, tmp_path / "profile")
    parsed = _Page()
    parsed.feed(dom)

    # the summary box first: the title, then the verdict with its actions and before -> after
    tags = [t for t, _ in parsed.top]
    assert tags[:2] == ["h1", "blockquote"], tags[:6]
    assert parsed.top[1][1].get("id") == "summary"
    box = dom.split('<blockquote id="summary"', 1)[1].split("</blockquote>", 1)[0]
    assert "Verdict:" in box and "<ol>" in box and "before:" in box and "after:" in box
    assert "tokens/s" in box and "GPU peak" in box and "host peak" in box

    # each finding once: a finding's code and message appear in one table row only
    rows = [tuple(r[:3]) for t in parsed.tables for r in t["rows"] if r and re.fullmatch(r"DSD\d{3}", r[0])]
    assert rows and len(rows) == len(set(rows)), [r for r in rows if rows.count(r) > 1][:3]
    assert len({r[0] for r in rows}) == len(rows)  # and no code twice with another wording

    # long tables folded; nothing of the scratch folder the report was built in
    long = [t for t in parsed.tables if len(t["rows"]) > 13]
    assert long and all(t["folded"] for t in long)
    assert ".partial" not in dom and str(out) in dom

    # and a picture to look at (kept for a human: tmp_path/report.png)
    shot = tmp_path / "report.png"
    proc = subprocess.run([browser, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1200,1600",
                           f"--screenshot={shot}", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and shot.stat().st_size > 10_000, proc.stderr[-2000:]


# laid out by the browser: every short cell (a severity, a code) on one line, written back into the DOM
_LINES_SCRIPT = """<script>
const wrapped = [];
for (const cell of document.querySelectorAll("td, th")) {
  const text = cell.textContent.trim();
  if (!text || text.length > 16) continue;
  const range = document.createRange();
  range.selectNodeContents(cell);
  // one line holds inline boxes whose tops differ by a pixel or two (a <code> beside text): a new line starts
  // only where a box starts more than half a line below the one before
  const tops = [...range.getClientRects()].map(r => r.top).sort((a, b) => a - b);
  const half = parseFloat(getComputedStyle(cell).fontSize) / 2;
  const lines = tops.filter((t, i) => i === 0 || t - tops[i - 1] > half).length;
  if (lines > 1) wrapped.push(text + ":" + lines);
}
document.body.setAttribute("data-wrapped", JSON.stringify(wrapped));
</script>"""


def test_failed_runs_report_keeps_its_severity_column_readable(tmp_path):
    """Issue 31.6: the report of a run that failed, at a laptop's width: no severity (or any short cell) wraps
    one letter per line, as it did when a long message beside it could break anywhere."""
    import json
    import sys

    browser = _browser()
    from dsdoctor.diagnose import diagnose

    script = tmp_path / "infer.py"
    script.write_text("raise RuntimeError('CUDA out of memory. Tried to allocate 2.00 GiB')\n")
    out = tmp_path / "diag"
    diagnose(command=[sys.executable, str(script)], out=str(out), timeout=120)
    html = (out / "report.html").read_text(encoding="utf-8")
    assert "DSD3" in html and "error" in html  # the failure is reported, with its severity
    page = tmp_path / "laid_out.html"
    page.write_text(html.replace("</body>", _LINES_SCRIPT + "</body>"), encoding="utf-8")
    for width in (1200, 700):
        proc = subprocess.run([browser, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}",
                               f"--window-size={width},1600", "--dump-dom", page.as_uri()],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        found = re.search(r'data-wrapped="([^"]*)"', proc.stdout)
        assert found, "the layout script did not run"
        assert json.loads(found.group(1).replace("&quot;", '"')) == [], width
