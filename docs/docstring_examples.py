"""A module docstring's Google-style example section, as the guide pages show it (`docs/gen_pages.py`)."""

from __future__ import annotations


def fence_examples(lines: list[str]) -> list[str]:
    """A module docstring's `Example:` / `Examples:` section (Google style: the heading, then its indented doctest
    lines) as a `pycon` code block under a bold heading; left as it is, Markdown runs it into one paragraph."""
    out, i = [], 0
    while i < len(lines):
        if lines[i].strip() in ("Example:", "Examples:") and i + 1 < len(lines) and lines[i + 1].startswith("    >>>"):
            j = i + 1
            while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
                j += 1
            while not lines[j - 1].strip():
                j -= 1
            out += [f"**{lines[i].strip()}**", "", "```pycon", *(line[4:] for line in lines[i + 1 : j]), "```"]
            i = j
        else:
            out.append(lines[i])
            i += 1
    return out
