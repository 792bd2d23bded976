import base64

from dsdoctor.report.html import markdown_to_html
from dsdoctor.report.render import markdown_table


def test_markdown_table_round_trips_to_html_with_escaped_pipes():
    md = "# Report\n\n" + markdown_table(("path", "note"), [("zero3", "a | b"), ("<tp>", "`code`")])
    page = markdown_to_html(md, "r")
    assert "<h1>Report</h1>" in page
    assert "<td class=\"w\">a | b</td>" in page  # a short cell stays on one line
    assert "&lt;tp&gt;" in page and "<code>code</code>" in page


def test_png_is_embedded_so_the_page_is_self_contained(tmp_path):
    png = tmp_path / "fig.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\nfake")
    page = markdown_to_html("![memory](fig.png)\n", "r", base=tmp_path)
    assert "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode() in page
