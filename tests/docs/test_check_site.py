"""docs/check_site.py: it passes a sound page and catches every kind of breakage it claims to.

The browser tests build a tiny site by hand (one good page, one page with every fault the
checker looks for) and run the checker on it in headless Chromium. They are skipped where the
docs extra (playwright) or a Debian Chromium is missing; `make docs-check` installs both.
"""

from __future__ import annotations

import base64
import importlib.util
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load(name: str):
    return importlib.import_module(f"docs.{name}")


check_site = load("check_site")

# A 1 x 1 PNG.
PIXEL = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==")
MATH = '<math display="block"><mfrac><mi>a</mi><mi>b</mi></mfrac></math>'
PAGE = "<!doctype html><html><head><meta charset='utf-8'></head><body><div class='md-content'>{}</div></body></html>"
GOOD = f"""<h1 id="there">Good</h1><div class="md-typeset__scrollwrap" style="overflow-x: auto"><table>
<tr><th>a</th><th>b</th></tr><tr><td>{"a long cell that wraps " * 20}</td><td>1</td></tr></table></div><div class="arithmatex">{MATH}</div><img src="pixel.png">
<figure><img src="pixel.png"><figcaption>A plain caption.</figcaption></figure>
<a href="bad.html">bad</a> <a href="#there">here</a> <a href="https://example.com/">external</a>
<pre><code>code may say \\(x\\) and $$</code></pre>"""
BAD = f"""<p>raw \\(x^2\\) math</p><span class="arithmatex">\\(y\\)</span>
<math><merror><mtext>oops</mtext></merror></math>
<img src="missing.png"><img src="https://example.com/remote.png">
<a href="nowhere.html">1</a> <a href="good.html#no-such-id">2</a> <a href="sub/">3</a> <a href="/etc/hosts">4</a>
<div style="width: 3000px">too wide</div>
<figure><figcaption>the `kv_index` buffer</figcaption></figure>
<pre><code style="display: block; overflow-x: auto; white-space: pre">{"x" * 400}</code></pre>
<div class="md-typeset__scrollwrap" style="overflow-x: auto"><table><tr><th>wide</th><th>head</th></tr>
<tr><td style="white-space: nowrap">{"y " * 300}</td><td>z</td></tr></table></div>
<p style="width: min-content">a formula <span class="arithmatex"><math><mi>alongvariablename</mi></math></span>.</p>
<script>console.error("boom"); throw new Error("uncaught")</script>"""

# What the checker must report on BAD: one substring per fault.
EXPECTED = [
    "raw TeX in text: 'raw \\\\(x^2\\\\) math'",
    "formula left as TeX (no MathML)",
    "MathML <merror>",
    "image does not load: file://",  # missing.png
    "request failed: https://example.com/remote.png",  # the network is off
    "console error: boom",
    "uncaught exception: uncaught",
    "broken link nowhere.html: no such file",
    "broken link good.html#no-such-id: no id 'no-such-id' on good.html",
    "broken link sub/: is a directory",
    "broken link file:///etc/hosts: points outside the site",
    "horizontal scrollbar at 1280 px",
    "raw Markdown in a figure caption",
    "1 code block(s) scroll sideways at 1280 px: code",
    "1 table(s) wider than the column at 1280 px: [wide | head]",
    "punctuation alone on a line after a formula: 'alongvariablename .'",
]


def test_broken_links_without_a_browser(tmp_path):
    (tmp_path / "a.html").write_text("")
    (tmp_path / "d").mkdir()
    page = check_site.PageResult("a.html", ids={"x"})
    base = tmp_path.resolve().as_uri()
    page.links = [f"{base}/a.html#x", f"{base}/a.html", "https://example.com/", f"{base}/a.html#y",
                  f"{base}/b.html", f"{base}/d"]
    problems = check_site.broken_links([page], tmp_path)["a.html"]
    assert problems == [
        "broken link a.html#y: no id 'y' on a.html",
        "broken link b.html: no such file",
        "broken link d: is a directory (file:// does not open its index.html)",
    ]


def test_probe_problems_name_each_fault():
    found = {"raw_math": ["\\(x\\)"], "bare_arithmatex": [], "merror": 0, "not_math": 2,
             "images": [{"src": "a.png", "ok": True}, {"src": "b.png", "ok": False}],
             "page_overflow": 0, "column_overflow": 12, "wide": ["div.x"], "captions": []}
    assert check_site.problems_from_probe(found) == [
        "raw TeX in text: '\\\\(x\\\\)'",
        "2 <math> element(s) not laid out as math (no MathML support?)",
        "image does not load: b.png",
        "horizontal scrollbar at 1280 px: page 0 px, content column 12 px too wide; past its edge: div.x",
    ]


def browser() -> str:
    pytest.importorskip("playwright")
    found = next(filter(None, map(shutil.which, check_site.BROWSERS)), None)
    if not found:
        pytest.skip("no Debian Chromium (make docs-check installs chromium-headless-shell)")
    return found


def test_checker_passes_a_sound_page_and_fails_a_broken_one(tmp_path):
    site = tmp_path / "site"
    (site / "sub").mkdir(parents=True)
    (site / "pixel.png").write_bytes(PIXEL)
    (site / "good.html").write_text(PAGE.format(GOOD))
    (site / "bad.html").write_text(PAGE.format(BAD))
    results, _ = check_site.run(site, tmp_path / "shots", browser(), search=False)

    by_page = {r.path: r for r in results}
    assert by_page["good.html"].problems == []
    assert by_page["good.html"].math == 1 and by_page["good.html"].images == 2
    report = "\n".join(by_page["bad.html"].problems)
    missing = [e for e in EXPECTED if e not in report]
    assert not missing, f"not reported: {missing}\nreport:\n{report}"
    assert sorted(p.name for p in (tmp_path / "shots").iterdir()) == ["bad.png", "good.png"]
    assert check_site.report(results, None, 1.0) == 1
