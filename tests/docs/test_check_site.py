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

# A 1 x 1 PNG (too small to show anything), and a 40 x 30 image.
PIXEL = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==")
BOX = '<svg xmlns="http://www.w3.org/2000/svg" width="40" height="30"><rect width="40" height="30" fill="teal"/></svg>'
MATH = '<math display="block"><mfrac><mi>a</mi><mi>b</mi></mfrac></math>'
PAGE = "<!doctype html><html><head><meta charset='utf-8'></head><body><div class='md-content'>{}</div></body></html>"
GOOD = f"""<h1 id="there">Good</h1><div class="md-typeset__scrollwrap" style="overflow-x: auto"><table>
<tr><th>a</th><th>b</th></tr><tr><td>{"a long cell that wraps " * 20}</td><td>1</td></tr></table></div><div class="arithmatex">{MATH}</div><img src="box.svg">
<figure><img src="box.svg"><figcaption>A plain caption.</figcaption></figure>
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
    (site / "box.svg").write_text(BOX)
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


# What a reader sees broken that the page's HTML alone does not show: one page per fault, beside a page
# that does the same thing right. name -> (faulty body, what the check reports, sound body).
WIDE = "<mi>x</mi><mo>+</mo>" * 80
OLD_XARROW = ('<math display="block"><mrow><mi>a</mi><mover><mstyle scriptlevel="0"><mo>&#x2192;</mo></mstyle>'
              '<mpadded width="+0.833em" lspace="0.556em" voffset="-.2em" height="-.2em"><mrow><mtext>all-to-all</mtext>'
              '</mrow><mspace depth=".25em" /></mpadded></mover><mi>b</mi></mrow></math>')  # latex2mathml's \xrightarrow
CODE = "<pre><code style='display: block; width: 320px; white-space: pre-wrap'>{}</code></pre>"
LONG_LINE = "    result = " + " + ".join(f"term_{i}" for i in range(12))
HANGING = "<span style='display: block; padding-left: 6ch; text-indent: -6ch'>{}</span>"
FAULTS = {
    "math-scrolls": (f'<div class="arithmatex" style="overflow-x: auto"><math display="block">{WIDE}</math></div>',
                     "1 formula(s) cut off or scrolling in their box at 1280 px: x+x+x",
                     f'<div class="arithmatex" style="overflow-x: auto">{MATH}</div>'),
    "math-clipped": (f'<div style="overflow: hidden; height: 8px">{MATH}</div>', "px tall in a box of 8 px that clips",
                     f'<div style="overflow: hidden">{MATH}</div>'),
    "math-overlaps": (OLD_XARROW, "formula drawn over its neighbours (a part outside its box): 'a→all-to-allb",
                      '<math display="block"><mi>a</mi><mover><mo>&#x27F6;</mo><mtext>x</mtext></mover><mi>b</mi></math>'),
    "math-tex": ('<math><mi>a</mi><mtext>\\xrightarrow</mtext><mi>b</mi></math>',
                 "TeX left in a formula's MathML (the converter lost it): '\\\\xrightarrow'",
                 '<math><mi>a</mi><mtext>all-to-all</mtext><mi>b</mi></math>'),
    "katex": ('<span class="katex-error" title="ParseError">\\frac{a</span>', "KaTeX error: '\\\\frac{a'",
              '<span class="katex">a/b</span>'),
    "tiny-image": ('<img src="pixel.png">', "image of 1 x 1 px (under 16 px): file://", '<img src="box.svg">'),
    "code-indent": (CODE.format(LONG_LINE), "1 wrapped code line(s) continue left of their indentation",
                    CODE.format(HANGING.format(LONG_LINE))),
    "placeholder": ('<p>A figure: {{ figure figures/x.png }}, here.</p>',
                    "placeholder left in the text (the page was not filled in): '{{ figure figures/x.png }}'",
                    '<p>The marker <code>{{ figure PATH }}</code>, quoted in code, is no placeholder.</p>'),
    "figure-late": ('<p style="height: 1000px">A screen of text.</p><figure><img src="box.svg"></figure>',
                    "px down the content column: more than a screen (900 px) of text before it",
                    '<p style="height: 800px">Less than a screen of text.</p><figure><img src="box.svg"></figure>'),
}


@pytest.fixture(scope="module")
def fault_pages(tmp_path_factory):
    """The FAULTS site checked once: page name -> its problems."""
    site = tmp_path_factory.mktemp("faults")
    (site / "pixel.png").write_bytes(PIXEL)
    (site / "box.svg").write_text(BOX)
    for name, (bad, _, good) in FAULTS.items():
        (site / f"{name}.html").write_text(PAGE.format(bad))
        (site / f"{name}-sound.html").write_text(PAGE.format(good))
    results, _ = check_site.run(site, None, browser(), search=False)
    return {r.path.removesuffix(".html"): r.problems for r in results}


@pytest.mark.parametrize("name", FAULTS)
def test_the_checker_sees_what_a_reader_sees(fault_pages, name):
    _, expected, _ = FAULTS[name]
    assert fault_pages[f"{name}-sound"] == []
    report = "\n".join(fault_pages[name])
    assert expected in report, report
    assert len(fault_pages[name]) == 1, report  # that fault, and nothing else


# A page styled as the site's: its extra.css, its classes, a narrow column (so code wraps and formulas must).
STYLED_PAGE = ("<!doctype html><html><head><meta charset='utf-8'><link rel='stylesheet' href='css/extra.css'></head>"
               "<body><div class='md-content md-typeset' style='width: 500px; font-size: 13px'>{}</div></body></html>")


def test_the_sites_hooks_and_css_pass_the_checks(tmp_path):
    """What docs/hooks.py and extra.css make of a long code line (a hanging indent), a numbered listing, a
    labelled arrow and a display formula wider than the column (split at its \\qquad) passes."""
    pytest.importorskip("latex2mathml")
    from docs import hooks

    code = "".join(f'<a id="__codelineno-0-{i}" name="__codelineno-0-{i}"></a>{line}\n' for i, line in enumerate(
        ["def f():", LONG_LINE, '    """A docstring', "    " + "that goes on " * 12 + '"""'], 1))
    numbered = ('<table class="highlighttable"><tr><td class="linenos"><div class="linenodiv"><pre>1\n2</pre></div></td>'
                f'<td class="code"><div><pre><span></span><code>{code}</code></pre></div></td></tr></table>')
    wide = " \\qquad ".join(["x_1 + x_2 + x_3 + x_4 + x_5 + x_6 + x_7 + x_8"] * 4)
    body = hooks.render_math(f'<div class="arithmatex">\\[a \\xrightarrow{{\\text{{all-to-all}}}} b\\]</div>'
                             f'<div class="arithmatex">\\[{wide}\\]</div>', "page.md")
    body = hooks.code_lines(f"{body}<pre><span></span><code>{code}</code></pre>{numbered}")
    site = tmp_path / "site"
    (site / "css").mkdir(parents=True)
    (site / "css" / "extra.css").write_text((ROOT / "docs" / "css" / "extra.css").read_text())
    (site / "page.html").write_text(STYLED_PAGE.format(body))
    results, _ = check_site.run(site, None, browser(), search=False)
    assert results[0].problems == []
    assert results[0].math == 5  # the arrow, and the wide formula's four pieces
    assert results[0].wrapped_code == 4  # the long line and the docstring's, in both blocks


def test_learn_pages_are_screenshot_whole_and_listed(tmp_path, capsys):
    site = tmp_path / "site"
    (site / "learn").mkdir(parents=True)
    (site / "index.html").write_text(PAGE.format("<p>home</p>"))
    (site / "learn" / "ring.html").write_text(PAGE.format('<p style="height: 2000px">a long page</p>'))
    results, _ = check_site.run(site, tmp_path / "shots", browser(), search=False)
    shot = tmp_path / "shots" / "learn__ring.png"
    assert shot.exists() and png_height(shot) >= 2000  # the whole page, not its first screen
    assert check_site.report(results, None, 1.0) == 0
    assert f"Screenshots of the 1 Learn page (whole pages), for review:\n  {shot}" in capsys.readouterr().out

    (site / "learn" / "ring.html").unlink()
    check_site.report(check_site.run(site, None, browser(), search=False)[0], None, 1.0)
    assert "no Learn pages (learn/*.html) in this site" in capsys.readouterr().out


def png_height(path: Path) -> int:
    return int.from_bytes(path.read_bytes()[20:24], "big")  # the IHDR chunk: width, then height
