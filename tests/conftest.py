"""The suite's two tiers: `make test` runs every sweep's pairwise cover, `make test-all` the rest and the slow runs.

A parametrized test marked `@pytest.mark.sweep` is a sweep: of its cases, the pairwise cover
(`tests.helpers.pairwise`: every pair of values two of its parameters take together somewhere in the sweep)
runs in `make test`, and every other case is marked `full`; `@pytest.mark.sweep(strength=1)` keeps only a case
for each value of each parameter, for a sweep whose every case is slow. A test marked `full` itself (a slow multi-process
run) runs in `make test-all` alone. `make test` deselects `full` (`-m "not full"`), `make test-all` selects it
(`-m full`): nothing is dropped, the two together are the suite.

Under `pytest -n auto` each worker computes on one thread: two workers of two torch threads each on two cores
spent a third of `make test`'s time waiting on each other (190 s, 122 s with one thread each; 2 cores, 2026-12-06).
"""

from __future__ import annotations

import os
from collections import defaultdict

import pytest
import torch

from tests.helpers import pairwise

if os.environ.get("PYTEST_XDIST_WORKER"):  # `-n auto`: as many workers as cores, so one thread each, as a rank runs
    os.environ["OMP_NUM_THREADS"] = "1"  # and the processes a test starts (its ranks, a tool) the same
    torch.set_num_threads(1)


def _value(item: pytest.Item, name: str):
    """A case's value of parameter `name`, as the cover compares it (by value, or by its repr where unhashable)."""
    value = item.callspec.params[name]
    try:
        hash(value)
    except TypeError:
        return ("repr", repr(value))
    return value


def tier(items: list[pytest.Item]) -> None:
    """Mark `full` every case of a sweep outside its pairwise cover."""
    sweeps: dict[tuple, list[pytest.Item]] = defaultdict(list)
    for item in items:
        if item.get_closest_marker("sweep") is not None and hasattr(item, "callspec"):
            sweeps[(item.module.__name__, item.originalname)].append(item)
    for cases in sweeps.values():
        names = sorted(cases[0].callspec.params)
        rows = [tuple(_value(item, n) for n in names) for item in cases]
        cover = set(pairwise(rows, strength=cases[0].get_closest_marker("sweep").kwargs.get("strength", 2)))
        for item, row in zip(cases, rows):
            if row not in cover:
                item.add_marker(pytest.mark.full)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects what is marked
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tier(items)
