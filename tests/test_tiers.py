"""`make test` runs every sweep's pairwise cover, `make test-all` the rest (tests/conftest.py): the cover holds
every value and every pair of values the sweep holds, and the two tiers together are the suite."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import _pairs, pairwise

pytest_plugins = ["pytester"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=5), st.randoms(use_true_random=False), st.sampled_from([1, 2]))
def test_the_cover_holds_every_value_and_pair_of_the_sweep(dims, rnd, strength):
    cases = [c for c in itertools.product(*map(range, dims)) if rnd.random() < 0.8] or [tuple([0] * len(dims))]
    cover = pairwise(cases, strength)
    assert set(cover) <= set(cases) and cover == [c for c in cases if c in cover]  # a subset, in the sweep's order
    held = lambda rows: set().union(*(_pairs(c, 2) for c in rows))  # noqa: E731
    values = lambda rows: {p for p in held(rows) if len(p) == 2}  # noqa: E731
    assert values(cover) == values(cases)  # every value of every field
    if strength == 2:
        assert held(cover) == held(cases)  # and every pair
    assert pairwise(cases, strength) == cover  # the same cover every time: the tiers do not move between runs


def test_a_product_shrinks_to_its_cover_and_the_tiers_together_are_the_suite(pytester):
    pytester.makeconftest("""
        import pytest
        from tests.conftest import tier

        @pytest.hookimpl(tryfirst=True)
        def pytest_collection_modifyitems(config, items):
            tier(items)
    """)
    pytester.makeini("[pytest]\nmarkers =\n    sweep: s\n    full: f\n")
    pytester.makepyfile(test_x='''
        import pytest

        @pytest.mark.sweep
        @pytest.mark.parametrize("mode", ["all_gather", "p2p", "a2a", "a2a+p2p"])
        @pytest.mark.parametrize("P", [2, 4, 8])
        @pytest.mark.parametrize("layout", ["zigzag", "stream"])
        @pytest.mark.parametrize("kernel", [{"a": 1}, {"b": 2}])  # unhashable: compared by repr
        def test_sweep(mode, P, layout, kernel):
            pass

        @pytest.mark.sweep
        @pytest.mark.parametrize("x", [1, 2, 3])
        def test_one_parameter(x):  # every value is its own cover
            pass

        @pytest.mark.full
        def test_slow():
            pass

        def test_plain():
            pass
    ''')
    fast = pytester.runpytest("-m", "not full", "-q")
    rest = pytester.runpytest("-m", "full", "-q")
    # 48 cases: the 4 x 3 pairs of mode and P need 12 at least, the greedy cover takes 13; the one-parameter sweep
    # keeps its 3 values, and the plain test runs in make test too
    fast.assert_outcomes(passed=13 + 3 + 1)
    rest.assert_outcomes(passed=48 - 13 + 1)
