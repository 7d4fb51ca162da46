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
5. Arrows with labels. latex2mathml writes `\\xrightarrow{a}` as an arrow under a label in an
   `<mpadded width="+0.833em">`, a relative width MathML Core does not accept: browsers then
   squeeze the label into the arrow's width ("all-" over the next symbol). `fix_xarrows` makes
   the arrow stretchy and pads the label with spaces, so the arrow grows under its label.
6. Wide display formulas. MathML has no line breaking, so a display formula wider than the
   column would scroll (or be cut) in its box. `display_lines` splits a display formula at its
   top-level `\\qquad`s (outside braces, `\\left...\\right` and environments), or where it has
   none at its top-level `\\quad`s, into one `<math>` per piece, laid out by extra.css as a
   wrapping row: side by side, as far apart as the space they replace, where they fit, one
   under another where they do not. A formula that must wrap needs such a space where it may
   break; one without is as wide as it is (docs/check_site.py fails a page where one is wider
   than the column).
7. Wrapped code keeps its indentation. Code wraps in the column (extra.css, `pre-wrap`) rather
   than scrolling sideways; wrapped plainly, a long line's continuation starts at column 0 and
   Python looks mis-indented. `code_lines` puts every code line in a block of its own
   (`span.cl`, its indentation in `--i`) so extra.css can give it a hanging indent: the
   continuation starts two columns right of the line's own indentation. A line-numbered
   listing (the source pages) becomes one such block with its numbers in a gutter beside each
   line (`a.ln`), so a wrapped line does not shift the numbers below it out of step.
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

# latex2mathml's `\x...arrow`: the arrow in an <mstyle>, then each label in this <mpadded>.
_LABEL = r'<mpadded width="\+0\.833em" lspace="0\.556em" voffset="-\.2em" height="-\.2em">(.*?)<mspace depth="\.25em" /></mpadded>'
XARROW = re.compile(r'<(mover|munderover)><mstyle scriptlevel="0"><mo>([^<]*)</mo></mstyle>' + _LABEL + f"(?:{_LABEL})?</\\1>",
                    re.DOTALL)  # fmt: skip
XARROW_DRAWN = {"&#x2192;": "right", "&#x2190;": "left", "&#x2194;": "both"}  # extra.css draws these
XARROW_PAD = '<mspace width="0.4em" />'  # each side of a label (TeX pads about as much)
RELATION_SPACE = '<mspace width="0.2778em" />'  # each side of a relation (an arrow), as TeX spaces it
# What moves the nesting depth of TeX (an escaped brace does not), and `\qquad`, where display lines split.
TEX_TOKEN = re.compile(r"\\[a-zA-Z]+|\\.|[{}]")

# A code block as pymdownx.highlight writes it, and a line-numbered one (a table: numbers, code).
PRE_CODE = re.compile(r"(<pre[^>]*>(?:<span></span>)?)<code([^>]*)>(.*?)</code></pre>", re.DOTALL)
NUMBERED = re.compile(r'<table class="highlighttable"><tr><td class="linenos">.*?</td>'
                      r'<td class="code"><div>(<pre[^>]*>(?:<span></span>)?)<code>(.*?)</code></pre></div></td></tr></table>',
                      re.DOTALL)  # fmt: skip
LINE_ANCHOR = re.compile(r'<a id="(__codelineno-\d+-(\d+))" name="\1"></a>')
TAG = re.compile(r"(<[^>]*>)")
TAG_NAME = re.compile(r"<([a-zA-Z0-9]+)")
VOID = {"br", "wbr", "img"}  # tags without a closing tag


LONG_CODE = 24
CELL = re.compile(r"<td[^>]*>.*?</td>", re.DOTALL)
CELL_CODE = re.compile(r"<code>([^<\n]{%d,})</code>" % (LONG_CODE + 1))
BREAK_AFTER = re.compile(r"(::|/|\.|_)(?=.)")


def break_long_code(page_html: str) -> str:
    """Every inline code of more than LONG_CODE characters inside a table cell, breakable after its separators."""
    def cell(match: re.Match) -> str:
        return CELL_CODE.sub(lambda m: "<code>" + BREAK_AFTER.sub(r"\1<wbr>", m[1]) + "</code>", match[0])

    return CELL.sub(cell, page_html)


def split_code_lines(code: str) -> list[tuple[str, str]]:
    """Highlighted code (text and `<span>`/`<a>` tags) as `(html, text)` per line, every line's tags balanced:
    a span open across a newline (a docstring) is closed at the line's end and reopened on the next."""
    lines: list[tuple[str, str]] = []
    stack: list[str] = []  # the open tags
    parts: list[str] = []
    text: list[str] = []
    for token in TAG.split(code):
        if token.startswith("</"):
            stack.pop()
            parts.append(token)
        elif token.startswith("<"):
            if not token.endswith("/>") and TAG_NAME.match(token)[1].lower() not in VOID:
                stack.append(token)
            parts.append(token)
        else:
            *done, rest = token.split("\n")
            for piece in done:
                parts.append(piece)
                text.append(piece)
                closing = "".join(f"</{TAG_NAME.match(t)[1]}>" for t in reversed(stack))
                lines.append(("".join(parts) + closing + "\n", "".join(text)))
                parts, text = list(stack), []
            parts.append(rest)
            text.append(rest)
    if "".join(text):  # a last line without its newline; an empty one is only reopened tags
        lines.append(("".join(parts), "".join(text)))
    return lines


def code_line(line: str, text: str) -> str:
    """One code line as a block with its indentation (leading spaces) in `--i`, for extra.css's hanging indent."""
    indent = len(text) - len(text.lstrip(" "))
    return f'<span class="cl" style="--i:{indent}">{line}</span>'


def code_lines(page_html: str) -> str:
    """Every code block of a page line by line (`code_line`); a numbered listing with its numbers beside each line."""

    def numbered(match: re.Match) -> str:
        last = max((int(m[2]) for m in LINE_ANCHOR.finditer(match[2])), default=1)
        body = LINE_ANCHOR.sub(r'<a id="\1" name="\1" href="#\1" class="ln" data-n="\2"></a>', match[2])
        return f'{match[1]}<code class="numbered" style="--w:{len(str(last))}">{body}</code></pre>'

    def block(match: re.Match) -> str:
        lines = "".join(code_line(line, text) for line, text in split_code_lines(match[3]))
        return f"{match[1]}<code{match[2]}>{lines}</code></pre>"

    return PRE_CODE.sub(block, NUMBERED.sub(numbered, page_html))


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
        elif name == "mpadded" and el.get("width", "").startswith(("+", "-")):
            problems.append(f"<mpadded width={el.get('width')!r}>: a relative width MathML Core ignores")
    return problems


def unescape_text(mathml: str) -> str:
    r"""`\_` -> `_` (and `\% \$ \# \{ \} \&`) inside <mtext>, as TeX's text mode reads them."""

    def fix(match: re.Match) -> str:
        body = TEXT_ESCAPE.sub(lambda m: html.escape(m[1]), match[2])
        return match[1] + body + match[3]

    return MTEXT.sub(fix, mathml)


def fix_xarrows(mathml: str) -> str:
    """latex2mathml's `\\xrightarrow[b]{a}` (and the other `\\x...arrow`s) in MathML Core, labels padded by
    `XARROW_PAD`. A stretchy operator is no answer: Chromium sizes it to the label but paints it shifted or
    headless in some formulas. The base of → ← ↔ is instead a phantom of the labels, as wide as they are,
    on which extra.css draws the arrow (`mpadded.xarrow-right` ...); another arrow keeps its glyph."""

    def arrow(m: re.Match) -> str:
        labels = [f"<mrow>{XARROW_PAD}{label}{XARROW_PAD}</mrow>" for label in (m[3], m[4]) if label is not None]
        drawn = XARROW_DRAWN.get(m[2])
        if drawn is None:  # an operator: MathML spaces the arrow as a relation itself
            return f"<{m[1]}><mo>{m[2]}</mo>{''.join(labels)}</{m[1]}>"
        else:  # the phantom: both labels (an accent over keeps the label size), at the labels' script level
            width = labels[0] if len(labels) == 1 else f'<mover accent="true">{labels[0]}{labels[1]}</mover>'
            base = (f'<mpadded class="xarrow-{drawn}" height="0.5em" depth="0"><mphantom>'
                    f'<mstyle scriptlevel="1">{width}</mstyle></mphantom></mpadded>')  # fmt: skip
        return f"{RELATION_SPACE}<{m[1]}>{base}{''.join(labels)}</{m[1]}>{RELATION_SPACE}"

    return XARROW.sub(arrow, mathml)


def display_lines(tex: str) -> tuple[list[str], str]:
    """A display formula's pieces between its top-level `\\qquad`s, else between its top-level `\\quad`s, and
    that separator (`""` and the whole formula if it has neither)."""
    cuts: dict[str, list[tuple[int, int]]] = {"\\qquad": [], "\\quad": []}
    depth = 0
    for m in TEX_TOKEN.finditer(tex):
        if m[0] in ("{", "\\left", "\\begin"):
            depth += 1
        elif m[0] in ("}", "\\right", "\\end"):
            depth -= 1
        elif m[0] in cuts and depth == 0:
            cuts[m[0]].append(m.span())
    for separator, spans in cuts.items():
        bounds = [0, *(i for span in spans for i in span), len(tex)]
        pieces = [tex[a:b].strip() for a, b in zip(bounds[::2], bounds[1::2])]
        if len([p for p in pieces if p]) > 1:
            return [p for p in pieces if p], separator[1:]
    return [tex], ""


def tex_to_mathml(tex: str, display: bool) -> str:
    """One formula (without delimiters) as a `<math>` element; raises MathError if it cannot be."""
    try:
        mathml = fix_xarrows(unescape_text(convert(tex, display="block" if display else "inline")))
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
        pieces, separator = display_lines(tex) if tag == "div" else ([tex], "")
        try:
            mathml = "".join(tex_to_mathml(piece, display=tag == "div") for piece in pieces)
        except MathError as e:
            raise PluginError(f"{where}: formula {tex!r}: {e}") from e
        lines = f" math-lines {separator}" if separator else ""  # extra.css: a row that wraps
        out = f'<{tag} class="arithmatex{lines}">{mathml}</{tag}>'
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
    return code_lines(break_long_code(render_math(html_text, page.file.src_uri)))
