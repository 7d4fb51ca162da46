"""Every `Examples:` block in cpref's, sim's and the benchmarks' docstrings runs, and its printed result holds."""

import doctest
import importlib
import pkgutil

import pytest

import bench
import cpref
import sim


def _modules():
    for pkg in (cpref, sim, bench):
        yield pkg.__name__
        for info in pkgutil.walk_packages(pkg.__path__, prefix=pkg.__name__ + "."):
            if info.name not in ("sim.tools.demo", "bench.report"):  # the demo runs; the page's module times a kernel on import
                yield info.name


@pytest.mark.parametrize("name", sorted(_modules()))
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} doctest failure(s) in {name}"


def test_examples_exist():
    """Guard against a collector that finds nothing: the metadata example at least must run."""
    finder = doctest.DocTestFinder()
    tests = finder.find(importlib.import_module("cpref.modes.metadata"))
    assert sum(len(t.examples) for t in tests) >= 2
