"""docs/hooks.py: formulas become MathML at build time, and a formula that cannot fails the build.

Skipped where the docs extra (latex2mathml, mkdocs) is not installed; `make docs` installs it.
"""

from __future__ import annotations

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
