"""Generate the site's pages at build time (a mkdocs-gen-files script; nothing here is committed).

1. Guide pages: each page's body IS a module's docstring, so the tutorial lives next to the
   code it explains. The summary line becomes the title, figures are appended, and a footer
   names the source file.
2. API reference: one page per module of `src/cpref` and `sim`, found by walking the files.
3. Figures: drawn with matplotlib from cpref itself (`docs/figures.py`).
4. `SUMMARY.md`: the navigation, read by mkdocs-literate-nav.

A module that fails to import fails the build: there is no silent skipping.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import io
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT / "src", ROOT):  # cpref from src/, sim from the repository root
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import mkdocs_gen_files  # noqa: E402
from mkdocs.structure.files import InclusionLevel  # noqa: E402

# The guide, in nav order: (page, nav title, module). Add a module with one line.
GUIDE = [
    ("layout.md", "Data model and layouts", "cpref.layout"),
    ("comm.md", "The collectives protocol", "cpref.comm"),
    ("kernel-contract.md", "The attention kernel contract", "cpref.kernels.contract"),
    ("torch-kernel.md", "TorchKernel", "cpref.kernels.torch_kernel"),
    ("oracle.md", "The FP64 oracle", "sim.oracle"),
    ("cluster.md", "The simulated cluster", "sim.cluster"),
    ("all-gather.md", "KV all-gather CP (MindSpeed RFC)", "cpref.modes.all_gather"),
    ("metadata.md", "Load-balanced metadata", "cpref.metadata"),
    ("api.md", "The attention API", "cpref.api"),
    ("data.md", "The data path and loss", "cpref.data"),
]

# Figures appended to the bottom of a guide page: page -> [(figure path, caption)].
PAGE_FIGURES = {
    "layout.md": [
        ("figures/layouts.png", "Which rank holds which chunk of each document, contiguous vs zigzag."),
        ("figures/work.png", "Causal attention work per rank: zigzag makes every rank's work equal."),
    ],
    "all-gather.md": [
        ("figures/rank_major_index.png",
         "The gathered K/V stay rank-major; `kv_index` picks each query chunk's causal prefix in natural order."),
    ],
    "metadata.md": [
        ("figures/rank_major_index.png",
         "`kv_index` of each rank: the rows of the rank-major buffer each local query chunk sees, in order."),
    ],
}

# Hand-written pages (in docs/) placed around the generated guide pages.
GUIDE_FIRST = ("index.md", "What context parallelism is and why")
GUIDE_LAST = ("glossary.md", "Glossary")

# The packages walked for the API reference: (directory, dotted prefix).
REFERENCE_PACKAGES = [(ROOT / "src" / "cpref", "cpref"), (ROOT / "sim", "sim")]


def _load_docs_module(name: str):
    """`docs/<name>.py`, loaded by path so its name cannot clash with an installed package."""
    spec = importlib.util.spec_from_file_location(f"cpref_docs_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def source_path(module) -> str:
    return Path(module.__file__).resolve().relative_to(ROOT).as_posix()


SNIPPET = re.compile(r'^--8<-- "[^"]+\.py(:[\w-]+)?"\s*$')


def fence_python_snippets(lines: list[str]) -> list[str]:
    """Wrap a bare `--8<-- "file.py:region"` line (outside any fence) in a Python code fence.

    pymdownx.snippets pastes the region's text verbatim; without a fence it would be read as
    Markdown. Docstrings may write the snippet line bare or already fenced; both render as code.
    """
    out, in_fence = [], False
    for line in lines:
        if line.lstrip().startswith(("```", "~~~")):
            in_fence = not in_fence
        if not in_fence and SNIPPET.match(line):
            out += ["```python", line, "```"]
        else:
            out.append(line)
    return out


def guide_page(module_name: str, figures: list[tuple[str, str]], tables=()) -> str:
    """A module's docstring as a page: summary line as `# title`, tables, figures, source footer."""
    module = importlib.import_module(module_name)  # an import error fails the build
    if not module.__doc__:
        raise RuntimeError(f"{module_name} has no module docstring, but the guide's page is its docstring")
    lines = inspect.cleandoc(module.__doc__).splitlines()
    if not lines[0].startswith("#"):
        lines[0] = "# " + lines[0].strip().rstrip(".")
    lines = fence_python_snippets(lines)
    parts = ["\n".join(lines)]
    for title, table in tables:
        parts += [f"## {title}", table()]
    if figures:
        parts.append("## Figures")
        for path, caption in figures:
            parts.append(f'<figure markdown="span">\n  ![{caption}]({path})\n  <figcaption>{caption}</figcaption>\n</figure>')
    parts.append(f"---\n\nSource: `{source_path(module)}`")
    return "\n\n".join(parts) + "\n"


def reference_modules() -> list[tuple[str, Path]]:
    """Every public module of the reference packages: (dotted name, file), packages first."""
    found = []
    for directory, prefix in REFERENCE_PACKAGES:
        for file in sorted(directory.rglob("*.py")):
            parts = list(file.relative_to(directory).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            if any(p.startswith("_") for p in parts):
                continue  # private modules, and __main__
            found.append((".".join([prefix, *parts]), file))
    return sorted(found, key=lambda item: (item[0].split(".")[0] != "cpref", item[0]))


def public_names(file: Path) -> list[str] | None:
    """The module's `__all__`, read statically (no import), or None if it has none."""
    for node in ast.parse(file.read_text()).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                return list(ast.literal_eval(node.value))
    return None


def reference_page(name: str, file: Path, guide: dict[str, tuple[str, str]], doc_path: str) -> str:
    """`::: name` for mkdocstrings; a module with a guide page shows its members only."""
    parts = [f"# `{name}`"]
    names = public_names(file)
    if name in guide and names and file.name != "__init__.py":
        page, title = guide[name]
        up = "../" * doc_path.count("/")  # back to the site root, where the guide pages live
        parts.append(f"The module docstring is the guide page [{title}]({up}{page}). Public API:")
        parts += [f"::: {name}.{member}" for member in names]
    elif file.name == "__init__.py":
        # A package's docstring is a mini-guide; its names are documented in their own modules.
        parts.append(f"::: {name}\n    options:\n      show_root_heading: false\n      members: false")
    else:
        parts.append(f"::: {name}\n    options:\n      show_root_heading: false")
    parts.append(f"Source: `{file.relative_to(ROOT).as_posix()}`")
    return "\n\n".join(parts) + "\n"


def main() -> None:
    # 1) Guide pages, with their measured tables.
    tables = _load_docs_module("tables").TABLES
    for page, _title, module_name in GUIDE:
        with mkdocs_gen_files.open(page, "w") as f:
            f.write(guide_page(module_name, PAGE_FIGURES.get(page, []), tables.get(page, [])))

    # 2) API reference.
    guide = {module_name: (page, title) for page, title, module_name in GUIDE}
    reference = []  # (dotted name, doc path)
    for name, file in reference_modules():
        # cpref.layout -> reference/cpref/layout.md; the package cpref -> reference/cpref/index.md
        stem = "/".join(name.split("."))
        doc_path = f"reference/{stem}/index.md" if file.name == "__init__.py" else f"reference/{stem}.md"
        with mkdocs_gen_files.open(doc_path, "w") as f:
            f.write(reference_page(name, file, guide, doc_path))
        reference.append((name, doc_path))

    # 3) Figures.
    figures = _load_docs_module("figures")
    for path, draw in figures.FIGURES.items():
        fig = draw()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=130)
        figures.plt.close(fig)
        with mkdocs_gen_files.open(path, "wb") as f:
            f.write(buf.getvalue())

    # 4) Navigation.
    nav = ["* Guide", f"    * [{GUIDE_FIRST[1]}]({GUIDE_FIRST[0]})"]
    nav += [f"    * [{title}]({page})" for page, title, _ in GUIDE]
    nav += [f"    * [{GUIDE_LAST[1]}]({GUIDE_LAST[0]})", "* API reference"]
    for package in ("cpref", "sim"):
        nav.append(f"    * {package}")
        nav += [f"        * [{name}]({path})" for name, path in reference if name.split(".")[0] == package]
    with mkdocs_gen_files.open("SUMMARY.md", "w") as f:
        f.write("\n".join(nav) + "\n")
    # literate-nav reads SUMMARY.md; it is not a page of the site.
    summary = mkdocs_gen_files.FilesEditor.current().files.get_file_from_path("SUMMARY.md")
    summary.inclusion = InclusionLevel.EXCLUDED


main()
