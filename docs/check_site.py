"""Open every page of the built site in headless Chromium, offline, and fail on what a reader would see broken.

    python docs/check_site.py [site] [--shots site-check] [--browser /usr/bin/chromium-headless-shell]

Each page is loaded from file:// in a 1280 x 900 window with the network off (the browser's
offline mode, and a host resolver that resolves nothing). A page fails on:

* unrendered math: raw `\\(`, `\\)`, `\\[`, `\\]` or `$$` in text outside code, an arithmatex
  element without MathML, an `<merror>`, or a `<math>` the browser does not lay out as math;
* an image that does not load, or any request that fails (a missing script, stylesheet or
  font, or any attempt to reach the network);
* a console error or an uncaught exception;
* a broken internal link: every `<a href>` into the site must name an existing file (not a
  directory: file:// does not serve index.html), and its `#anchor` an id on that page;
* a horizontal scrollbar: the page, or the main content column, wider than its box; a code
  block or a table that scrolls sideways in its own box (both must fit the column: code
  wraps, a table is narrow enough); only display math may scroll in its box;
* a figure caption with raw Markdown in it.

Offline search is checked once: typing into the search box on the home page must list results.
A screenshot of every page goes to `--shots` for review (the whole page; the first screen of
a source listing). The report has one line per page (and one indented line per problem); the
exit status is 1 if anything failed.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit

BROWSERS = ["chromium-headless-shell", "chromium"]  # Debian's packages
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--host-resolver-rules=MAP * ~NOTFOUND"]
VIEWPORT = {"width": 1280, "height": 900}
SEARCH_TERM = "zigzag"
PARALLEL = 4  # pages open at once: loading and screenshots mostly wait on the browser
# Pages only a web server shows (for a missing URL); mkdocs writes their links root-absolute.
SERVER_ONLY = {"404.html"}
SOURCE_PAGES = "source/"  # the generated code listings (docs/source_pages.py): long and alike
LEARN_PAGES = "learn/"  # the Learn path (docs/learn/): screenshots listed in the report for review
MIN_IMAGE = 16  # px: an image with a smaller natural width or height shows nothing a reader can use
FIRST_FIGURE = VIEWPORT["height"]  # px of the content column above a page's first figure, at most

# Runs in the page once it has loaded; returns everything the checks need.
PROBE = r"""() => {
  const skip = "pre, code, script, style, textarea, kbd, samp";
  const raw = [];
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    if (n.parentElement.closest(skip)) continue;
    const m = n.textContent.match(/\\[()\[\]]|\$\$/);
    if (m) raw.push(n.textContent.trim().slice(0, 80));
  }
  const maths = [...document.querySelectorAll("math")];
  const column = document.querySelector(".md-content") || document.body;
  const edge = column.getBoundingClientRect().right;
  const pageOverflow = document.documentElement.scrollWidth - document.documentElement.clientWidth;
  const columnOverflow = column.scrollWidth - column.clientWidth;
  const clipped = (el) => {  // inside a box that scrolls or clips, below the column
    for (let a = el.parentElement; a && a !== column; a = a.parentElement)
      if (getComputedStyle(a).overflowX !== "visible") return true;
    return false;
  };
  const name = (el) => el.tagName.toLowerCase() + (typeof el.className === "string" && el.className
    ? "." + el.className.split(" ")[0] : "");
  const wide = pageOverflow <= 0 && columnOverflow <= 0 ? [] : [...column.querySelectorAll("*")]
    .filter((el) => el.getBoundingClientRect().right > edge + 1 && !clipped(el)).map(name);
  // code blocks of the column that scroll sideways (display formulas may, in their own box)
  const scrolling = [...column.querySelectorAll("pre > code")]
    .filter((el) => el.scrollWidth > el.clientWidth + 1).map(name);
  // tables wider than the column: material scrolls them in a wrapper; named by their first header cells
  const tables = [...column.querySelectorAll("table")].filter((t) => {
    const box = t.closest(".md-typeset__scrollwrap") || t.parentElement;
    return box.scrollWidth > box.clientWidth + 1 || t.getBoundingClientRect().right > edge + 1;
  }).map((t) => [...t.querySelectorAll("th")].slice(0, 3).map((h) => h.textContent.trim()).join(" | ") || "table");
  // punctuation that wrapped onto a line of its own after an inline formula
  const lone = [];
  for (const m of column.querySelectorAll("span.arithmatex")) {
    const next = m.nextSibling;
    if (!next || next.nodeType !== Node.TEXT_NODE || !/^[.,;:!?]/.test(next.textContent)) continue;
    const range = document.createRange();
    range.setStart(next, 0);
    range.setEnd(next, 1);
    const box = m.getBoundingClientRect(), mark = range.getBoundingClientRect();
    if (mark.top >= box.bottom - 1) lone.push(m.textContent.slice(0, 40) + " " + next.textContent.slice(0, 1));
  }
  // formulas: a formula and its parts inside the visible box of every ancestor that clips or scrolls (a
  // display formula's box, a table's scroll wrapper), a display formula inside the column, every part inside
  // the box of the element it belongs to (else it is drawn over its neighbours), no TeX left in its text
  const label = (m) => m.textContent.trim().replace(/\s+/g, " ").slice(0, 60);
  const cutMath = [], strayMath = [], texInMath = [];
  for (const m of maths) {
    const r = m.getBoundingClientRect();
    if (!r.width && !r.height) continue;  // not shown (a closed <details>, another tab)
    const e = {l: r.left, t: r.top, r: r.right, b: r.bottom};
    let stray = 0;
    for (const d of m.querySelectorAll("*")) {
      const q = d.getBoundingClientRect();
      if (!q.width && !q.height) continue;  // an empty space
      e.l = Math.min(e.l, q.left); e.t = Math.min(e.t, q.top); e.r = Math.max(e.r, q.right); e.b = Math.max(e.b, q.bottom);
      const p = d.parentElement.getBoundingClientRect();  // (the <math> box itself: the clipping checks below)
      if (d.parentElement !== m && p.width && q.width) stray = Math.max(stray, p.left - q.left, q.right - p.right);
    }
    if (stray > 2) strayMath.push(`${label(m)} (${Math.round(stray)} px)`);
    let why = "";
    for (let a = m.parentElement; a && !why; a = a === column ? null : a.parentElement) {
      const cs = getComputedStyle(a);
      if (cs.overflowX === "visible" && cs.overflowY === "visible") continue;
      const box = a.getBoundingClientRect();
      const l = box.left + a.clientLeft, t = box.top + a.clientTop;
      if (e.l < l - 1 || e.r > l + a.clientWidth + 1)
        why = `${Math.round(e.r - e.l)} px wide in a box of ${a.clientWidth} px that ${cs.overflowX === "hidden" ? "clips" : "scrolls"}`;
      else if (e.t < t - 1 || e.b > t + a.clientHeight + 1)
        why = `${Math.round(e.b - e.t)} px tall in a box of ${a.clientHeight} px that ${cs.overflowY === "hidden" ? "clips" : "scrolls"}`;
    }
    const edge = column.getBoundingClientRect();
    if (!why && m.getAttribute("display") === "block" && (e.r > edge.right + 1 || e.l < edge.left - 1))
      why = `${Math.round(e.r - e.l)} px wide, past the ${Math.round(edge.width)} px column`;
    if (why) cutMath.push(`${label(m)} (${why})`);
    for (const t of m.querySelectorAll("mi, mn, mo, mtext, ms"))
      if (/\\([a-zA-Z]+|[{}_^$%&#])/.test(t.textContent)) texInMath.push(t.textContent.trim().slice(0, 60));
  }
  // wrapped code lines: every visual line after a code line's first must start at or right of the line's
  // first character (its indentation), else the continuation reads as a line of its own, mis-indented
  const lostIndent = [];
  let wrappedLines = 0;
  for (const code of column.querySelectorAll("pre > code")) {
    const nodes = [];
    let text = "";
    const walk = document.createTreeWalker(code, NodeFilter.SHOW_TEXT);
    for (let n = walk.nextNode(); n; n = walk.nextNode()) { nodes.push([n, text.length]); text += n.textContent; }
    const at = (i) => {  // the text node and offset of character i
      let lo = 0, hi = nodes.length - 1;
      while (lo < hi) { const mid = (lo + hi + 1) >> 1; if (nodes[mid][1] <= i) lo = mid; else hi = mid - 1; }
      return [nodes[lo][0], i - nodes[lo][1]];
    };
    const range = (a, b) => { const g = document.createRange(); g.setStart(...at(a)); g.setEnd(...at(b)); return g; };
    const lineHeight = parseFloat(getComputedStyle(code).lineHeight) || 20;
    let start = 0;
    for (const line of text.split("\n")) {
      const first = start + line.length - line.trimStart().length, end = start + line.length;
      start = end + 1;
      if (first === end || range(first, end).getBoundingClientRect().height < 1.5 * lineHeight) continue;
      wrappedLines++;
      const head = range(first, first + 1).getBoundingClientRect();
      const rows = [...range(first, end).getClientRects()].filter((q) => q.width > 0 && q.top >= head.bottom - 1);
      if (rows.some((q) => q.left < head.left - 1)) lostIndent.push(line.trim().slice(0, 60));
    }
  }
  // the first figure (an image) of the content column: how far down the column it starts
  const figure = [...column.querySelectorAll("figure, img")].find((f) => f.getBoundingClientRect().height > 0);
  const firstFigure = figure ? Math.round(figure.getBoundingClientRect().top - column.getBoundingClientRect().top) : null;
  // a generator's placeholder left in the prose ({{ figure ... }}): the page was not filled in; code may show one
  const prose = column.cloneNode(true);
  prose.querySelectorAll("pre, code, script, style").forEach((e) => e.remove());
  const placeholders = [...new Set(prose.textContent.match(/\{\{[^{}]{1,80}\}\}/g) || [])];
  return {
    placeholders: placeholders.slice(0, 5),
    math_cut: cutMath.slice(0, 5),
    math_cut_count: cutMath.length,
    math_stray: strayMath.slice(0, 5),
    math_tex: [...new Set(texInMath)].slice(0, 5),
    katex_errors: [...document.querySelectorAll(".katex-error")].map((e) => e.textContent.slice(0, 80)),
    code_lines_wrapped: wrappedLines,
    code_indent_lost: lostIndent.slice(0, 3),
    code_indent_lost_count: lostIndent.length,
    first_figure: firstFigure,
    scrolling: [...new Set(scrolling)].slice(0, 5),
    scrolling_count: scrolling.length,
    wide_tables: tables.slice(0, 5),
    wide_table_count: tables.length,
    lone_punctuation: lone.slice(0, 5),
    raw_math: raw,
    math_count: maths.length,
    merror: document.querySelectorAll("merror").length,
    not_math: maths.filter((m) => !getComputedStyle(m).display.includes("math")).length,
    bare_arithmatex: [...document.querySelectorAll(".arithmatex")].filter((e) => !e.querySelector("math"))
      .map((e) => e.textContent.slice(0, 80)),
    images: [...document.images].map((i) => ({src: i.currentSrc || i.src, ok: i.complete && i.naturalWidth > 0,
                                              width: i.naturalWidth, height: i.naturalHeight})),
    links: [...document.querySelectorAll("a[href]")].map((a) => a.href),
    ids: [...document.querySelectorAll("[id]")].map((e) => e.id)
      .concat([...document.querySelectorAll("a[name]")].map((a) => a.name)),
    page_overflow: pageOverflow,
    column_overflow: columnOverflow,
    wide: [...new Set(wide)].slice(0, 5),
    captions: [...document.querySelectorAll("figcaption")].map((f) => f.textContent)
      .filter((t) => /`|\*\*|\]\(/.test(t)),
  };
}"""


@dataclass
class PageResult:
    path: str  # relative to the site
    problems: list[str] = field(default_factory=list)
    math: int = 0
    images: int = 0
    links: list[str] = field(default_factory=list)  # absolute hrefs
    ids: set[str] = field(default_factory=set)
    shot: Path | None = None  # its screenshot
    wrapped_code: int = 0  # code lines that wrap at VIEWPORT's width


def find_browser(explicit: str | None) -> str:
    for name in [explicit] if explicit else BROWSERS:
        path = shutil.which(name) if name else None
        if path:
            return path
    sys.exit(f"check_site: no Chromium found (tried {explicit or ', '.join(BROWSERS)}); "
             "install Debian's chromium-headless-shell, or pass --browser")


def problems_from_probe(found: dict) -> list[str]:
    """The page's failures, from what PROBE returned."""
    out = [f"raw TeX in text: {t!r}" for t in found["raw_math"]]
    out += [f"formula left as TeX (no MathML): {t!r}" for t in found["bare_arithmatex"]]
    if found["merror"]:
        out.append(f"{found['merror']} MathML <merror> element(s)")
    if found["not_math"]:
        out.append(f"{found['not_math']} <math> element(s) not laid out as math (no MathML support?)")
    out += [f"{n} formula(s) cut off or scrolling in their box at {VIEWPORT['width']} px: " + "; ".join(found["math_cut"])
            for n in [found.get("math_cut_count", 0)] if n]
    out += [f"formula drawn over its neighbours (a part outside its box): {t!r}" for t in found.get("math_stray", [])]
    out += [f"TeX left in a formula's MathML (the converter lost it): {t!r}" for t in found.get("math_tex", [])]
    out += [f"KaTeX error: {t!r}" for t in found.get("katex_errors", [])]
    out += [f"placeholder left in the text (the page was not filled in): {t!r}" for t in found.get("placeholders", [])]
    for img in found["images"]:
        if not img["ok"]:
            out.append(f"image does not load: {img['src']}")
        elif "width" in img and min(img["width"], img["height"]) < MIN_IMAGE:
            out.append(f"image of {img['width']} x {img['height']} px (under {MIN_IMAGE} px): {img['src']}")
    if found["page_overflow"] > 0 or found["column_overflow"] > 0:
        out.append(f"horizontal scrollbar at {VIEWPORT['width']} px: page {found['page_overflow']} px, "
                   f"content column {found['column_overflow']} px too wide; past its edge: {', '.join(found['wide']) or '?'}")
    out += [f"raw Markdown in a figure caption: {c.strip()!r}" for c in found["captions"]]
    if found.get("scrolling_count"):
        out.append(f"{found['scrolling_count']} code block(s) scroll sideways at {VIEWPORT['width']} px: "
                   f"{', '.join(found['scrolling'])}")  # fmt: skip
    if found.get("wide_table_count"):
        out.append(f"{found['wide_table_count']} table(s) wider than the column at {VIEWPORT['width']} px: "
                   + "; ".join(f"[{t}]" for t in found["wide_tables"]))  # fmt: skip
    out += [f"punctuation alone on a line after a formula: {t!r}" for t in found.get("lone_punctuation", [])]
    if found.get("code_indent_lost_count"):
        out.append(f"{found['code_indent_lost_count']} wrapped code line(s) continue left of their indentation "
                   "(they read as mis-indented lines): " + "; ".join(repr(t) for t in found["code_indent_lost"]))
    if (found.get("first_figure") or 0) > FIRST_FIGURE:
        out.append(f"first figure {found['first_figure']} px down the content column: more than a screen "
                   f"({FIRST_FIGURE} px) of text before it")
    return out


def broken_links(results: list[PageResult], site: Path) -> dict[str, list[str]]:
    """Internal links whose file or anchor does not exist: page -> problems. External links are skipped."""
    site = site.resolve()
    ids = {r.path: r.ids for r in results}
    broken: dict[str, list[str]] = {}
    for r in results:
        for href in sorted(set(r.links)):
            url = urlsplit(href)
            if url.scheme != "file":
                continue  # http(s), mailto: not checked offline
            target = Path(unquote(url.path))
            try:
                rel = target.resolve().relative_to(site).as_posix()
            except ValueError:
                problem = "points outside the site"
            else:
                anchor = unquote(url.fragment)
                if target.is_dir():
                    problem = "is a directory (file:// does not open its index.html)"
                elif not target.exists():
                    problem = "no such file"
                elif anchor and rel in ids and anchor not in ids[rel]:
                    problem = f"no id {anchor!r} on {rel}"
                else:
                    continue
            broken.setdefault(r.path, []).append(f"broken link {href.removeprefix(site.as_uri() + '/')}: {problem}")
    return broken


def pages(site: Path) -> list[Path]:
    """Every HTML page of the site but SERVER_ONLY ones."""
    return [p for p in sorted(site.rglob("*.html")) if p.relative_to(site).as_posix() not in SERVER_ONLY]


async def check_page(context, site: Path, path: Path, shots: Path | None) -> PageResult:
    result = PageResult(path.relative_to(site).as_posix())
    page = await context.new_page()
    page.on("console", lambda m: m.type == "error" and result.problems.append(f"console error: {m.text}"))
    page.on("pageerror", lambda e: result.problems.append(f"uncaught exception: {e}"))
    page.on("requestfailed", lambda r: result.problems.append(f"request failed: {r.url} ({r.failure})"))
    await page.goto(path.as_uri(), wait_until="load")
    await page.wait_for_timeout(50)  # material's bundle wraps tables and mounts components after load
    found = await page.evaluate(PROBE)
    result.problems += problems_from_probe(found)
    result.math, result.images = found["math_count"], len(found["images"])
    result.wrapped_code = found["code_lines_wrapped"]
    result.links, result.ids = found["links"], set(found["ids"])
    if shots:  # the whole page (a Learn page always); a source page's first screen shows how its code renders
        result.shot = shots / (result.path.replace("/", "__").removesuffix(".html") + ".png")
        await page.screenshot(path=result.shot, full_page=not result.path.startswith(SOURCE_PAGES))
    await page.close()
    return result


async def check_search(context, site: Path) -> str | None:
    """None if typing into the home page's search box lists results offline, else the problem."""
    page = await context.new_page()
    errors: list[str] = []
    page.on("console", lambda m: m.type == "error" and errors.append(m.text))
    try:
        await page.goto((site / "index.html").as_uri(), wait_until="load")
        await page.click("input.md-search__input", timeout=5_000)
        await page.keyboard.type(SEARCH_TERM)  # key events, as material's search listens for them
        await page.wait_for_selector(".md-search-result__item", timeout=10_000)
    except Exception as e:  # playwright's TimeoutError, or a page without a search box
        detail = "; ".join(errors) or str(e).splitlines()[0]
        return f"searching for {SEARCH_TERM!r} lists no results offline ({detail})"
    finally:
        await page.close()
    return None


async def check_all(site: Path, shots: Path | None, browser: str, search: bool) -> tuple[list[PageResult], str | None]:
    from playwright.async_api import async_playwright  # the docs extra; never downloads a browser here

    async with async_playwright() as p:
        chromium = await p.chromium.launch(executable_path=browser, args=FLAGS)
        context = await chromium.new_context(viewport=VIEWPORT, service_workers="block")
        await context.set_offline(True)
        slots = asyncio.Semaphore(PARALLEL)

        async def check(path: Path) -> PageResult:
            async with slots:
                return await check_page(context, site, path, shots)

        results = await asyncio.gather(*(check(path) for path in pages(site)))
        search_problem = await check_search(context, site) if search else None
        await chromium.close()
    return list(results), search_problem


def run(site: Path, shots: Path | None, browser: str, search: bool = True) -> tuple[list[PageResult], str | None]:
    """Check every page of `site`; returns the per-page results and the search problem (or None)."""
    site = site.resolve()
    if shots:
        shutil.rmtree(shots, ignore_errors=True)
        shots.mkdir(parents=True)
    results, search_problem = asyncio.run(check_all(site, shots, browser, search))
    broken = broken_links(results, site)
    for r in results:
        r.problems += broken.get(r.path, [])
    return results, search_problem


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def report(results: list[PageResult], search_problem: str | None, seconds: float) -> int:
    """Print one line per page and its problems; return the exit status."""
    for r in results:
        status = "FAIL" if r.problems else "ok  "
        print(f"{status} {r.path}  ({plural(r.math, 'formula')}, {plural(r.images, 'image')}, "
              f"{plural(len(set(r.links)), 'link')})")
        for problem in r.problems:
            print(f"       - {problem}")
    for path in sorted(SERVER_ONLY):
        print(f"skip {path}  (shown only by a web server)")
    learn = [r for r in results if r.path.startswith(LEARN_PAGES)]
    if not learn:
        print(f"note no Learn pages ({LEARN_PAGES}*.html) in this site")
    elif learn[0].shot:
        print(f"\nScreenshots of the {plural(len(learn), 'Learn page')} (whole pages), for review:")
        for r in learn:
            print(f"  {r.shot}")
    print(f"{'FAIL' if search_problem else 'ok  '} offline search" + (f": {search_problem}" if search_problem else ""))
    failed = sum(bool(r.problems) for r in results) + bool(search_problem)
    print(f"\n{len(results)} pages checked in {seconds:.0f} s: {failed} failed")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", nargs="?", default="site", type=Path, help="the built site (default: site)")
    parser.add_argument("--shots", default="site-check", type=Path, help="screenshot folder (default: site-check)")
    parser.add_argument("--browser", help="Chromium executable (default: chromium-headless-shell, then chromium)")
    args = parser.parse_args(argv)
    if not (args.site / "index.html").exists():
        sys.exit(f"check_site: {args.site}/index.html not found: build the site first (make docs)")
    start = time.monotonic()
    results, search_problem = run(args.site, args.shots, find_browser(args.browser))
    return report(results, search_problem, time.monotonic() - start)


if __name__ == "__main__":
    sys.exit(main())
