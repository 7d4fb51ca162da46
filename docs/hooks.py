"""mkdocs hooks: math rendered to MathML at build time, and the header's link to the source pages.

1. Math. pymdownx.arithmatex (generic mode) leaves every formula as TeX in
   `<span class="arithmatex">\\( ... \\)</span>` or `<div class="arithmatex">\\[ ... \\]</div>`.
   `on_page_content` converts each one to MathML with latex2mathml, so the site needs no
   JavaScript math renderer and no network: browsers render MathML Core natively. A formula
   the converter cannot turn into valid MathML fails the build with its page and its TeX; it
   never reaches the site as raw TeX.
2. Repository link. The project has no public URL, so the header's repository link points to
   the source pages generated into the site (`docs/source_pages.py`). mkdocs accepts only an
   absolute `repo_url`, so it is set here, after validation, to the site path of the source
   index; `docs/overrides/partials/source.html` makes it relative to each page.
3. Long code in tables. A test id or path in a table cell (often 100 characters) must wrap
   inside its column, but breaking any word anywhere squeezes short names (`all_gather` into
   "all_gathe r"). `break_long_code` lets inline code of more than `LONG_CODE` characters in a
   cell break after `/`, `::`, `.` and `_` (a `<wbr>`), and only there; shorter code never breaks.
4. Signatures. mkdocstrings formats the signatures of the API reference with Black or Ruff;
   without either it prints them unformatted and says so in one INFO line that a strict build
   lets through. `on_config` fails the build instead, naming the fix (the docs extra pins ruff).
"""

from __future__ import annotations

import html
import re
import xml.etree.ElementTree as ET

from latex2mathml.converter import convert
from mkdocs.exceptions import PluginError

SOURCE_INDEX = "source/index.html"  # use_directory_urls is off (material's offline plugin)

# What arithmatex emits in generic mode; the TeX inside is HTML-escaped and holds no tags.
ARITHMATEX = re.compile(r'<(?P<tag>span|div) class="arithmatex">(?P<tex>.*?)</(?P=tag)>(?P<punct>[.,;:!?]*)', re.DOTALL)
DELIMITERS = {"span": ("\\(", "\\)"), "div": ("\\[", "\\]")}

# MathML elements that take a fixed number of children, and the token elements (text only).
ARITY = {"mfrac": 2, "msub": 2, "msup": 2, "msubsup": 3, "mover": 2, "munder": 2, "munderover": 3, "mroot": 2}
TOKENS = {"mi", "mn", "mo", "mtext", "ms"}
NS = "{http://www.w3.org/1998/Math/MathML}"

# latex2mathml copies text-mode escapes such as `\text{kv\_len}` into <mtext> verbatim; in TeX
# they stand for the character itself.
MTEXT = re.compile(r"(<mtext[^>]*>)(.*?)(</mtext>)", re.DOTALL)
TEXT_ESCAPE = re.compile(r"\\([_%$#{}&])")


LONG_CODE = 24
CELL = re.compile(r"<td[^>]*>.*?</td>", re.DOTALL)
CELL_CODE = re.compile(r"<code>([^<\n]{%d,})</code>" % (LONG_CODE + 1))
BREAK_AFTER = re.compile(r"(::|/|\.|_)(?=.)")


def break_long_code(page_html: str) -> str:
    """Every inline code of more than LONG_CODE characters inside a table cell, breakable after its separators."""
    def cell(match: re.Match) -> str:
        return CELL_CODE.sub(lambda m: "<code>" + BREAK_AFTER.sub(r"\1<wbr>", m[1]) + "</code>", match[0])

    return CELL.sub(cell, page_html)


class MathError(ValueError):
    """A formula that does not convert to valid MathML."""


def mathml_problems(mathml: str) -> list[str]:
    """What is wrong with converted MathML: raw TeX left in it, or elements a browser rejects."""
    try:
        root = ET.fromstring(mathml)
    except ET.ParseError as e:  # e.g. a bare `&` from an alignment the converter did not handle
        return [f"not well-formed MathML ({e})"]
    problems = []
    for el in root.iter():
        name = el.tag.removeprefix(NS)
        text = "".join(el.itertext()) if name in TOKENS else ""
        if name == "merror":
            problems.append("an <merror> element")
        elif name in ARITY and len(el) != ARITY[name]:
            problems.append(f"<{name}> with {len(el)} children instead of {ARITY[name]} (a missing argument?)")
        elif "\\" in text:
            problems.append(f"unconverted TeX {text!r} (a command the converter does not know)")
        elif name == "mspace" and el.get("linebreak"):
            problems.append("a line break `\\\\` outside an array/cases (browsers ignore MathML line breaks)")
    return problems


def unescape_text(mathml: str) -> str:
    r"""`\_` -> `_` (and `\% \$ \# \{ \} \&`) inside <mtext>, as TeX's text mode reads them."""

    def fix(match: re.Match) -> str:
        body = TEXT_ESCAPE.sub(lambda m: html.escape(m[1]), match[2])
        return match[1] + body + match[3]

    return MTEXT.sub(fix, mathml)


def tex_to_mathml(tex: str, display: bool) -> str:
    """One formula (without delimiters) as a `<math>` element; raises MathError if it cannot be."""
    try:
        mathml = unescape_text(convert(tex, display="block" if display else "inline"))
    except Exception as e:  # latex2mathml raises its own exception types for malformed TeX
        raise MathError(f"latex2mathml cannot convert it: {type(e).__name__}: {e}") from e
    problems = mathml_problems(mathml)
    if problems:
        raise MathError("; ".join(problems))
    return mathml


def render_math(page_html: str, where: str) -> str:
    """Replace every arithmatex element of a page by its MathML, keeping the wrapper (for CSS)."""

    def replace(match: re.Match) -> str:
        tag, tex = match["tag"], html.unescape(match["tex"]).strip()
        opening, closing = DELIMITERS[tag]
        if tex.startswith(opening) and tex.endswith(closing):
            tex = tex[len(opening) : -len(closing)]  # a `\begin{env}` block comes without them
        try:
            mathml = tex_to_mathml(tex, display=tag == "div")
        except MathError as e:
            raise PluginError(f"{where}: formula {tex!r}: {e}") from e
        out = f'<{tag} class="arithmatex">{mathml}</{tag}>'
        if tag == "span" and match["punct"]:  # the punctuation after an inline formula never wraps onto its own line
            return f'<span class="math-punct">{out}{match["punct"]}</span>'
        return out + match["punct"]

    return ARITHMATEX.sub(replace, page_html)


def check_formatter() -> None:
    """Raise unless Ruff, the formatter of the API reference's signatures, is installed with its binary."""
    try:
        from ruff.__main__ import find_ruff_bin

        find_ruff_bin()
    except (ImportError, FileNotFoundError) as err:
        raise PluginError("mkdocstrings formats signatures with Ruff, which is not installed: "
                          "pip install -e '.[docs]' (make docs does)") from err  # fmt: skip


def on_config(config):
    check_formatter()
    config["repo_url"] = SOURCE_INDEX  # after mkdocs' validation, which wants an absolute URL
    config["repo_name"] = "Source code"
    return config


def on_page_content(html_text, page, config, files):
    return break_long_code(render_math(html_text, page.file.src_uri))
