"""docs/hooks.py: formulas become MathML at build time, and a formula that cannot fails the build.

Skipped where the docs extra (latex2mathml, mkdocs) is not installed; `make docs` installs it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("latex2mathml")
pytest.importorskip("mkdocs")

from mkdocs.exceptions import PluginError  # noqa: E402

from docs import hooks  # noqa: E402


def test_inline_and_display_math_become_mathml():
    page = ('<p>cost <span class="arithmatex">\\((P-1) \\frac{T}{P}\\)</span></p>\n'
            '<div class="arithmatex">\\[ x &lt; y \\]</div>')
    out = hooks.render_math(page, "page.md")
    assert '<span class="arithmatex"><math' in out and 'display="inline"' in out
    assert '<div class="arithmatex"><math' in out and 'display="block"' in out
    assert "<mfrac>" in out and "&#x0003C;" in out  # the HTML-escaped `<` reached the converter as `<`
    assert "\\(" not in out and "\\[" not in out


def test_text_mode_escapes_are_characters():
    mathml = hooks.tex_to_mathml(r"\text{save\_gathered\_kv: 5\%}", display=False)
    assert "<mtext>save_gathered_kv:&#x000A0;5%</mtext>" in mathml


@pytest.mark.parametrize(
    "tex, problem",
    [
        (r"\unknowncommand x", "unconverted TeX"),
        (r"\frac{a", "<mfrac> with 1 children"),
        (r"x^", "latex2mathml cannot convert it"),
        (r"\begin{aligned} a &= b \end{aligned}", "not well-formed MathML"),
        (r"a \\ b", "a line break"),
    ],
)
def test_a_formula_that_does_not_convert_fails_the_build(tex, problem):
    with pytest.raises(hooks.MathError, match=problem.replace("(", r"\(")):
        hooks.tex_to_mathml(tex, display=True)
    page = f'<div class="arithmatex">\\[{tex}\\]</div>'
    with pytest.raises(PluginError, match="guide.md: formula"):
        hooks.render_math(page, "guide.md")


def test_an_inline_formula_keeps_the_punctuation_after_it_on_its_line():
    """`\\(x\\).` becomes one unbreakable unit (`span.math-punct`, `white-space: nowrap` in extra.css), so the
    period never wraps onto a line of its own; a display formula's is left as it is."""
    out = hooks.render_math('<p>so <span class="arithmatex">\\(x\\)</span>. And <span class="arithmatex">\\(y\\)</span> '
                            'too</p><div class="arithmatex">\\[ z \\]</div>.', "page.md")
    assert out.count('<span class="math-punct"><span class="arithmatex"><math') == 1
    assert '</math></span>.</span> And <span class="arithmatex"><math' in out and out.endswith("</math></div>.")
    css = (Path(__file__).resolve().parents[2] / "docs" / "css" / "extra.css").read_text()
    assert ".md-typeset .math-punct {\n  white-space: nowrap;" in css


def test_the_build_fails_without_the_signature_formatter(monkeypatch):
    """mkdocstrings would print the API reference's signatures unformatted, with one INFO line a strict build
    lets through; the hook fails the build instead (and passes where the docs extra's ruff is installed)."""
    import sys

    hooks.check_formatter()
    monkeypatch.setitem(sys.modules, "ruff.__main__", None)  # import fails
    with pytest.raises(PluginError, match="Ruff, which is not installed"):
        hooks.on_config({})


def test_long_code_in_a_table_cell_breaks_after_separators_and_short_code_never():
    long = "tests/cp/test_x.py::test_a_long_name"
    page = (f"<table><tr><td><code>{long}</code> and <code>all_gather</code></td></tr></table>"
            f"<p><code>{long}</code></p>")  # fmt: skip
    out = hooks.break_long_code(page)
    assert ("<td><code>tests/<wbr>cp/<wbr>test_<wbr>x.<wbr>py::<wbr>test_<wbr>a_<wbr>long_<wbr>name</code> and "
            "<code>all_gather</code></td>") in out  # fmt: skip
    assert out.endswith(f"<p><code>{long}</code></p>")  # outside a table: untouched
    assert out.replace("<wbr>", "") == page


def test_a_labelled_arrow_is_drawn_under_its_label_not_squeezed_into_the_arrow():
    r"""latex2mathml's `\xrightarrow{a}` puts the label in an <mpadded width="+0.833em">, a width MathML Core
    ignores (the label then runs over its neighbours); the hook makes the base a phantom of the label, on which
    extra.css draws the arrow, and spaces it as a relation."""
    mathml = hooks.tex_to_mathml(r"a \xrightarrow{\text{all-to-all}} b", display=True)
    assert "mpadded width" not in mathml and "<mstyle scriptlevel=\"0\"><mo>" not in mathml
    assert ('<mover><mpadded class="xarrow-right" height="0.5em" depth="0"><mphantom><mstyle scriptlevel="1">'
            '<mrow><mspace width="0.4em" /><mrow><mtext>all-to-all</mtext></mrow><mspace width="0.4em" /></mrow>'
            "</mstyle></mphantom></mpadded><mrow>") in mathml  # fmt: skip
    assert mathml.count('<mspace width="0.2778em" />') == 2
    below_above = hooks.tex_to_mathml(r"a \xleftarrow[x]{yy} b", display=False)
    assert 'class="xarrow-left"' in below_above and '<mover accent="true">' in below_above  # as wide as the wider
    other = hooks.tex_to_mathml(r"a \xLeftarrow{x} b", display=False)  # not drawn: its own glyph, unsqueezed
    assert "<mover><mo>&#x21D0;</mo><mrow><mspace" in other and "mpadded" not in other
    css = (Path(__file__).resolve().parents[2] / "docs" / "css" / "extra.css").read_text()
    assert all(f".md-typeset mpadded.xarrow-{side} {{" in css for side in ("right", "left", "both"))


def test_a_relative_mpadded_width_fails_the_build():
    problems = hooks.mathml_problems('<math><mpadded width="+1em"><mi>x</mi></mpadded></math>')
    assert problems == ["<mpadded width='+1em'>: a relative width MathML Core ignores"]
    assert hooks.mathml_problems('<math><mpadded width="1em"><mi>x</mi></mpadded></math>') == []


@pytest.mark.parametrize(
    "tex, pieces, separator",
    [
        (r"a = 1, \qquad b = 2", ["a = 1,", "b = 2"], "qquad"),
        (r"a \quad b \quad c", ["a", "b", "c"], "quad"),
        (r"a \quad b \qquad c", [r"a \quad b", "c"], "qquad"),  # the wider space first
        (r"\left( a \qquad b \right) \text{c \qquad d} \begin{matrix} e \qquad f \end{matrix}",
         [r"\left( a \qquad b \right) \text{c \qquad d} \begin{matrix} e \qquad f \end{matrix}"], ""),  # nested
        (r"\{ a \qquad b", [r"\{ a", "b"], "qquad"),  # an escaped brace opens nothing
        (r"\qquad a", [r"\qquad a"], ""),  # nothing to split from
        (r"x \quadruple y", [r"x \quadruple y"], ""),  # a longer command is not \quad
    ],
)
def test_a_display_formula_splits_at_its_top_level_spaces(tex, pieces, separator):
    assert hooks.display_lines(tex) == (pieces, separator)


def test_a_split_display_formula_is_a_row_of_formulas_that_wraps():
    out = hooks.render_math('<div class="arithmatex">\\[ a = 1, \\qquad b = 2 \\]</div>'
                            '<div class="arithmatex">\\[ c \\quad d \\]</div><div class="arithmatex">\\[ e \\]</div>',
                            "page.md")  # fmt: skip
    assert out.count('<div class="arithmatex math-lines qquad"><math') == 1
    assert out.count('<div class="arithmatex math-lines quad"><math') == 1
    assert out.count('<div class="arithmatex"><math') == 1
    assert out.count('display="block"') == 5
    css = (Path(__file__).resolve().parents[2] / "docs" / "css" / "extra.css").read_text()
    assert ".md-typeset div.arithmatex.math-lines {\n  display: flex;\n  flex-wrap: wrap;" in css


CODE = ('<a id="__codelineno-0-1" name="__codelineno-0-1" href="#__codelineno-0-1"></a><span class="k">def</span> '
        'f():\n<a id="__codelineno-0-2" name="__codelineno-0-2" href="#__codelineno-0-2"></a>    <span class="sd">'
        '"""One\n<a id="__codelineno-0-3" name="__codelineno-0-3" href="#__codelineno-0-3"></a>      two"""</span>\n'
        '<a id="__codelineno-0-4" name="__codelineno-0-4" href="#__codelineno-0-4"></a>\n')


def test_every_code_line_is_a_block_with_its_indentation():
    """Each line in a `span.cl` with its leading spaces in `--i` (extra.css hangs its continuation under it); a
    span open across a newline (a docstring) is closed and reopened, so the text and the tags are the same."""
    out = hooks.code_lines(f"<pre><span></span><code>{CODE}</code></pre>")
    lines = re.findall(r'<span class="cl" style="--i:(\d+)">(.*?\n)</span>', out, re.DOTALL)
    assert [indent for indent, _ in lines] == ["0", "4", "6", "0"]
    assert lines[1][1].endswith('<span class="sd">"""One</span>\n')  # closed at the line's end ...
    assert lines[2][1].startswith('<span class="sd"><a id="__codelineno-0-3"')  # ... and reopened
    assert re.sub(r"<[^>]+>", "", out) == re.sub(r"<[^>]+>", "", CODE)  # what the copy button copies
    css = (Path(__file__).resolve().parents[2] / "docs" / "css" / "extra.css").read_text()
    assert ".md-typeset pre > code .cl {\n  display: block;\n  padding-left: calc((var(--i, 0) + 2) * 1ch);" in css


def test_a_numbered_listing_keeps_its_numbers_beside_its_lines():
    """pymdownx's table of numbers beside code would put a wrapped line's continuation beside the next number;
    the hook makes it one block whose every line carries its number (a link to the line) in a gutter."""
    anchors = re.sub(r' href="#__codelineno-0-\d"', "", CODE)  # a numbered listing's anchors have none
    table = ('<div class="highlight"><table class="highlighttable"><tr><td class="linenos"><div class="linenodiv"><pre>'
             '<span></span><span class="normal"><a href="#__codelineno-0-1">1</a></span>\n</pre></div></td>'
             f'<td class="code"><div><pre><span></span><code>{anchors}</code></pre></div></td></tr></table></div>')
    out = hooks.code_lines(table)
    assert "highlighttable" not in out and "linenos" not in out
    assert out.startswith('<div class="highlight"><pre><span></span><code class="numbered" style="--w:1">')
    assert out.count('class="ln" data-n="') == 4
    assert '<a id="__codelineno-0-3" name="__codelineno-0-3" href="#__codelineno-0-3" class="ln" data-n="3"></a>' in out
    assert out.count('<span class="cl"') == 4
