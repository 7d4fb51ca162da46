r"""Every Python code block on a page runs, or is included from a file the tests run.

The pages: README.md, `docs/*.md` and `docs/learn/*.md`, the module docstrings of the guide pages
(`docs/gen_pages.py`'s `GUIDE`, read as text: importing it needs mkdocs), and every docstring of
`src/cpref` and `sim` (the API reference renders them). A block is a ```` ```python ```` or
```` ```py ```` fence, or a docstring's bare `--8<-- "file.py:region"` line (the build fences it).
Each block is one of these, told apart by its lines (the first line's comment is the convention):

1. **An include**: nothing but `--8<-- "path:region"` lines, each naming a region of a file the
   tests run (a module of `src/` or `sim/`, which the suite imports, or an example a test names by
   its path, its module or its folder)
   whose `# --8<-- [start:region]` and `# --8<-- [end:region]` markers are both there.
2. **A doctest** (`>>>`): a docstring's runs in `tests/test_doctests.py`, a page's here.
3. **Run here**, as written, with `torch` and `cpref` imported and the names its first line gives:
   `# given: name, name (free text in parentheses); free text after a semicolon`. Each name is one
   of `GIVEN` below: a small packed batch, a tiny Hugging Face checkpoint, a model. A block given
   `comm` runs on every rank of a simulated cluster of `P` ranks (`comm` is the CP group's
   collectives on the pages, and the simulated cluster is one such group).
4. **Run by a test**, for code that needs real processes or a GPU: first line
   `# run by tests/path.py::test_name`; that test must exist, and the block must parse.
5. **A sketch** that cannot run (the signature of a function the reader writes): first line
   `# sketch: why`; it must parse. Rare: `SKETCHES` lists where each stands and why.

A block that breaks (a call with the wrong arguments, a name the page never gives) fails here.
"""

from __future__ import annotations

import ast
import doctest
import importlib
import inspect
import os
import re
import textwrap
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import cpref

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*\{?\.?(?P<lang>[\w+-]*)")
SNIPPET = re.compile(r'^--8<-- "(?P<path>[^":]+)(?::(?P<region>[\w-]+))?"\s*$')
GIVEN_LINE = re.compile(r"^#\s*given:(?P<names>.*)$")
RUN_BY = re.compile(r"^#\s*run by (?P<file>tests/[\w/]+\.py)::(?P<test>\w+)\s*$")
SKETCH = re.compile(r"^#\s*sketch:\s*(?P<why>\S.*)$")

# Where the sketches stand, and why none of them can run: a new one is a decision, made here.
SKETCHES = {
    "docs/verify-reference.md": "the signature of the function the reader writes; sim verify calls it",
    "sim.tools.verify": "the same signature, on the verifier's own page",
}


@dataclass(frozen=True)
class Block:
    where: str  # the page: a Markdown file, or a module (and member) whose docstring it is
    line: int  # the block's first line in that text
    code: str  # dedented, without the fence
    docstring: bool

    def __str__(self) -> str:
        return f"{self.where}, line {self.line}"


def fenced_blocks(where: str, text: str, *, docstring: bool) -> list[Block]:
    """The Python blocks of a Markdown text: fenced ones, and (in a docstring) bare snippet lines."""
    found, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            if docstring and SNIPPET.match(lines[i].strip()):
                found.append(Block(where, i + 1, lines[i].strip() + "\n", docstring))
            i += 1
            continue
        fence, start = m["fence"], i
        end = next((j for j in range(i + 1, len(lines))
                    if lines[j].strip().startswith(fence) and not lines[j].strip().strip(fence[0])), len(lines))  # fmt: skip
        if m["lang"] in ("python", "py"):
            found.append(Block(where, start + 1, textwrap.dedent("\n".join(lines[start + 1:end])) + "\n", docstring))
        i = end + 1
    return found


def guide_modules() -> list[str]:
    tree = ast.parse((ROOT / "docs" / "gen_pages.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "GUIDE" for t in node.targets):
            return [module for _, _, module in ast.literal_eval(node.value)]
    raise AssertionError("docs/gen_pages.py has no GUIDE")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT / "src" if path.is_relative_to(ROOT / "src") else ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def docstrings(path: Path):
    """`(where, docstring)` of a file's module, classes and functions."""
    name = module_name(path)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                yield (name if isinstance(node, ast.Module) else f"{name}.{node.name}"), doc


def all_blocks() -> list[Block]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs").glob("learn/*.md"))]
    found = [b for page in pages for b in fenced_blocks(str(page.relative_to(ROOT)), page.read_text(), docstring=False)]
    files = sorted((ROOT / "src" / "cpref").rglob("*.py")) + sorted((ROOT / "sim").rglob("*.py"))
    seen = set()
    for path in files:
        for where, doc in docstrings(path):
            seen.add(where)
            found += fenced_blocks(where, doc, docstring=True)
    for module in guide_modules():  # a guide page outside src/ and sim/ (the performance page)
        if module not in seen:
            found += fenced_blocks(module, inspect.cleandoc(importlib.import_module(module).__doc__ or ""), docstring=True)
    return found


def kind(block: Block) -> str:
    lines = [line for line in block.code.splitlines() if line.strip()]
    first = lines[0].strip() if lines else ""
    if lines and all(SNIPPET.match(line.strip()) for line in lines):
        return "include"
    if first.startswith(">>>"):
        return "doctest"
    if RUN_BY.match(first):
        return "run by"
    if SKETCH.match(first):
        return "sketch"
    return "run"


# ---- 1. includes ---------------------------------------------------------------------------------------------------


def file_the_tests_run(path: str) -> str | None:
    """Why the tests run `path`, or None: a library module imports; an example is named by a test."""
    file = ROOT / path
    if file.suffix != ".py" or not file.exists():
        return None
    if path.startswith(("src/cpref/", "sim/")):
        importlib.import_module(module_name(file))  # the suite imports the library; so does this
        return "a module of the library"
    stem = file.relative_to(ROOT).with_suffix("")
    # its path or module, or its folder's (a test that runs every example of a folder, e.g. by a glob)
    names = [path, ".".join(stem.parts)]
    if len(stem.parent.parts) > 1:  # a folder of examples (examples/learn), not examples/ itself
        names += [f"{stem.parent}/", f'"{stem.parent}"', ".".join(stem.parent.parts) + "."]
    tests = [t for t in (ROOT / "tests").rglob("*.py") if t.resolve() != Path(__file__).resolve()]
    return next((f"named by {t.relative_to(ROOT)}" for t in tests if any(n in t.read_text() for n in names)), None)


def include_problems(block: Block) -> list[str]:
    problems = []
    for line in block.code.split("\n"):
        m = SNIPPET.match(line.strip())
        if not m:
            continue
        if not m["region"]:
            problems.append(f'{block}: {line.strip()} includes a whole file; include a named region ("path:region")')
        elif file_the_tests_run(m["path"]) is None:
            problems.append(f"{block}: {m['path']} is no file the tests run")
        else:
            source = (ROOT / m["path"]).read_text()
            for end in ("start", "end"):
                if not re.search(rf"#\s*--8<--\s*\[{end}:{re.escape(m['region'])}\]", source):
                    problems.append(f"{block}: {m['path']} has no [{end}:{m['region']}] marker")
    return problems


# ---- 3. the names a block may be given -----------------------------------------------------------------------------

P = 4
VOCAB = 64
CU = [0, 8, 24, 32]  # three documents, each a multiple of 2P: zigzag over P = 4 ranks needs no padding


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"q": torch.randn(32, 4, 8, generator=g), "k": torch.randn(32, 2, 8, generator=g),
            "v": torch.randn(32, 2, 8, generator=g), "tokens": torch.randint(0, VOCAB, (32,), generator=g)}  # fmt: skip


def _model():
    from cpref.models import CausalLM, ModelConfig

    config = ModelConfig(family="llama", vocab_size=VOCAB, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                         mlp_size=64)  # fmt: skip
    return CausalLM(config, seed=0)


_SAVING = threading.Lock()


def _checkpoint(tmp: Path) -> str:
    """A tiny random Llama, saved as `save_pretrained` does.

    A block given `comm` builds its names on every rank's thread: the first saves, under a lock, into a side folder
    renamed into place, so no rank reads a half-written config (a race CI once hit)."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    path = tmp / "llama"
    with _SAVING:
        if not path.exists():
            config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                              num_attention_heads=4, num_key_value_heads=2, bos_token_id=0,
                                              eos_token_id=0, pad_token_id=0)  # fmt: skip
            torch.manual_seed(0)
            side = tmp / f"llama.saving-{os.getpid()}"
            transformers.LlamaForCausalLM(config).save_pretrained(side)
            os.replace(side, path)
    return str(path)


def _padded_batch() -> dict[str, torch.Tensor]:
    """Two rows as a `transformers` collator pads them: 11 and 6 tokens, padded on the right."""
    ids = torch.randint(1, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 11, dtype=torch.long)
    ids[1, 6:], mask[1, 6:] = 0, 0
    return {"input_ids": ids, "attention_mask": mask}


# name -> what it is on the pages, and how to make it (from a folder for files); `comm` is the rank's, see above.
GIVEN: dict[str, tuple[str, Callable[[Path], Any]]] = {
    "P": ("the CP size", lambda tmp: P),
    "cu_seqlens": ("a packed batch's document boundaries", lambda tmp: torch.tensor(CU)),
    "q": ("(T, Hq, D) queries of the whole packed batch", lambda tmp: _tensors()["q"]),
    "k": ("(T, Hkv, D) keys", lambda tmp: _tensors()["k"]),
    "v": ("(T, Hkv, Dv) values", lambda tmp: _tensors()["v"]),
    "tokens": ("(T,) token ids of the whole batch", lambda tmp: _tensors()["tokens"]),
    "position_ids": ("(T,) each token's position in its document", lambda tmp: cpref.Sharding(CU, cp_size=1).positions(0)),
    "cp": ("a CPContext (here CP = 1)", lambda tmp: __import__("cpref.models", fromlist=["x"]).CPContext.single(CU)),
    "packed": ("a packed training batch: tokens, labels",
               lambda tmp: {"tokens": _tensors()["tokens"], "labels": _tensors()["tokens"].roll(-1)}),
    "model": ("a cpref.models.CausalLM", lambda tmp: _model()),
    "path": ("a Hugging Face checkpoint's directory", _checkpoint),
    "batch": ("a padded transformers batch: input_ids, attention_mask", lambda tmp: _padded_batch()),
    "comm": ("this rank's CP group: the block runs on every rank of a simulated cluster", lambda tmp: None),
}


def given_names(block: Block) -> list[str]:
    first = block.code.lstrip().splitlines()[0].strip()
    m = GIVEN_LINE.match(first)
    if not m:
        return []
    return re.findall(r"[A-Za-z_]\w*", re.sub(r"\([^)]*\)", "", m["names"]).split(";")[0])


def run_block(block: Block, tmp: Path) -> None:
    names = given_names(block)
    unknown = [n for n in names if n not in GIVEN]
    assert not unknown, f"{block}: given names this test does not know: {unknown} (add them to GIVEN, or import them)"
    code = compile(block.code, f"<{block}>", "exec")

    def namespace() -> dict[str, Any]:
        return {"__name__": "__doc_block__", "torch": torch, "cpref": cpref,
                **{n: GIVEN[n][1](tmp) for n in names if n != "comm"}}  # fmt: skip

    if "comm" in names:
        from sim import SimCluster

        def rank(comm):
            exec(code, {**namespace(), "comm": comm})  # noqa: S102

        SimCluster(P).run(rank)
    else:
        exec(code, namespace())  # noqa: S102


# ---- the tests -----------------------------------------------------------------------------------------------------

BLOCKS = all_blocks()
RUN = [b for b in BLOCKS if kind(b) == "run"]


def test_blocks_are_found_everywhere_pages_come_from():
    where = {b.where for b in BLOCKS}
    assert {"README.md", "docs/your-model.md", "cpref.batch.sharding", "cpref.hf", "cpref.api"} <= where, sorted(where)
    assert {kind(b) for b in BLOCKS} >= {"include", "run", "doctest", "sketch", "run by"}


@pytest.mark.parametrize("block", [b for b in BLOCKS if kind(b) == "include"], ids=str)
def test_an_include_names_a_region_of_a_file_the_tests_run(block):
    assert include_problems(block) == []


@pytest.mark.parametrize("block", RUN, ids=str)
def test_a_block_runs_as_written(block, tmp_path_factory):
    run_block(block, tmp_path_factory.getbasetemp())


def test_a_pages_doctests_run():
    """A docstring's run in tests/test_doctests.py; a Markdown page's (none now) here."""
    for block in [b for b in BLOCKS if kind(b) == "doctest" and not b.docstring]:
        test = doctest.DocTestParser().get_doctest(block.code, {"torch": torch, "cpref": cpref}, str(block), str(block), 0)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        runner.run(test)
        assert runner.failures == 0, f"{block}: {runner.failures} doctest failure(s)"


@pytest.mark.parametrize("block", [b for b in BLOCKS if kind(b) == "run by"], ids=str)
def test_a_block_run_by_a_test_names_one_that_exists(block):
    m = RUN_BY.match(block.code.lstrip().splitlines()[0].strip())
    file = ROOT / m["file"]
    assert file.exists(), f"{block}: {m['file']} does not exist"
    assert re.search(rf"^def {m['test']}\(", file.read_text(), re.M), f"{block}: {m['file']} has no {m['test']}"
    ast.parse(block.code)


def test_sketches_are_few_parse_and_are_listed_with_their_reason():
    sketches = [b for b in BLOCKS if kind(b) == "sketch"]
    for block in sketches:
        ast.parse(block.code)
    assert sorted(b.where for b in sketches) == sorted(SKETCHES)


# ---- the checker itself --------------------------------------------------------------------------------------------


def test_the_conventions_are_told_apart():
    text = textwrap.dedent('''\
        Text.

        ```python
        x = 1
        ```

        ````md
        ```python
        inside another fence: not a block
        ```
        ````

        --8<-- "src/cpref/batch/layout.py:chunks"

          ```py
          # given: q, k (shards; any size); and more words
          y = 2
          ```
        ```python
        # run by tests/test_quickstart.py::test_the_own_module_example_trains_over_torchrun_as_on_one_device
        ```
        ```python
        # sketch: a signature
        def f(x): ...
        ```
        ```python
        >>> 1 + 1
        2
        ```
        ''')
    blocks = fenced_blocks("x", text, docstring=True)
    assert [(b.line, kind(b)) for b in blocks] == [(3, "run"), (13, "include"), (15, "run"), (19, "run by"),
                                                    (22, "sketch"), (26, "doctest")]  # fmt: skip
    assert given_names(blocks[2]) == ["q", "k"]
    assert include_problems(blocks[1]) == []
    assert fenced_blocks("x", text, docstring=False)[1].line == 15  # a page's bare snippet line is the page's own


def test_a_broken_block_fails(tmp_path):
    wrong = Block("x", 1, "# given: tokens\ncpref.cp_loss(tokens, tokens, tokens, 3)\n", False)
    with pytest.raises(TypeError):
        run_block(wrong, tmp_path)
    with pytest.raises(AssertionError, match="given names this test does not know"):
        run_block(Block("x", 1, "# given: logits\nlogits\n", False), tmp_path)
    with pytest.raises(NameError):
        run_block(Block("x", 1, "out = attention(q)\n", False), tmp_path)
    gone = Block("x", 1, '--8<-- "src/cpref/batch/layout.py:no_such_region"\n', False)
    assert [p.split(": ", 1)[1] for p in include_problems(gone)] == [
        "src/cpref/batch/layout.py has no [start:no_such_region] marker",
        "src/cpref/batch/layout.py has no [end:no_such_region] marker"]  # fmt: skip
    untested = Block("x", 1, '--8<-- "examples/no_such_example.py:x"\n', False)
    assert include_problems(untested)[0].endswith("examples/no_such_example.py is no file the tests run")
