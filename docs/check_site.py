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
  return {
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
    images: [...document.images].map((i) => ({src: i.currentSrc || i.src, ok: i.complete && i.naturalWidth > 0})),
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
    out += [f"image does not load: {img['src']}" for img in found["images"] if not img["ok"]]
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
    result.links, result.ids = found["links"], set(found["ids"])
    if shots:  # the whole page; a source page's first screen shows how its code renders
        name = result.path.replace("/", "__").removesuffix(".html") + ".png"
        await page.screenshot(path=shots / name, full_page=not result.path.startswith(SOURCE_PAGES))
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
