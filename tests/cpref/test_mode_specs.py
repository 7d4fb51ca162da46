"""Modes that declare themselves: each file's `MODE` is the whole mode, and `cpref.api` collects them."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest
import torch

import cpref
import cpref.modes
from cpref.api import collect_modes, mode_costs
from cpref.models.context import OPTIONS
from cpref.modes.spec import ModeSpec
from sim.cluster.simcluster import SimCluster
from tests.helpers import random_qkv

MODES_DIR = Path(cpref.modes.__file__).parent


def test_every_mode_is_declared_at_the_end_of_its_own_file():
    """One file, one `MODE = ModeSpec(...)`, its last statement; no other file names a mode's options."""
    declared = {}
    for path in sorted(MODES_DIR.glob("*.py")):
        body = ast.parse(path.read_text()).body
        assigns = [n for n in body if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "MODE" for t in n.targets)]
        if assigns:
            assert body[-1] is assigns[0], f"{path.name}: MODE is not the file's last statement"
            declared[path.stem] = assigns[0]
    assert sorted(declared) == ["all_gather", "hierarchical", "ring", "ulysses"]
    assert list(cpref.MODES) == ["all_gather", "p2p", "a2a", "a2a+p2p"]  # in their declared order
    for name, spec in cpref.MODES.items():
        assert isinstance(spec, ModeSpec) and spec.name == name
        assert spec.run.__module__ == spec.costs.__module__
        assert spec.plan.__module__ in (spec.run.__module__, spec.run.__module__ + "_plan")  # the mode's file or its plan's


def test_no_generic_module_switches_on_a_mode_or_an_option_name():
    """The generic layer reads declarations: no comparison with a mode's name (`mode == "a2a"`), no
    lookup of an option by name (`options["a2a_size"]`) outside the mode files (a default mode is fine)."""
    names = {*cpref.MODES, *(o.name for spec in cpref.MODES.values() for o in spec.options)}
    names -= {op for spec in cpref.MODES.values() for op in spec.collectives}  # "all_gather" the collective is fine
    src = Path(cpref.__file__).parent
    for path in [src / "api.py", src / "modes" / "costs.py", src / "modes" / "call.py", src / "modes" / "consistency.py",
                 src / "modes" / "spec.py", src / "models" / "context.py", src / "train" / "training.py"]:  # fmt: skip
        found = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                parts = [node.left, *node.comparators]
            elif isinstance(node, ast.Subscript):
                parts = [node.slice]
            else:
                continue
            found += [p.value for p in parts if isinstance(p, ast.Constant) and p.value in names]
        assert found == [], f"{path.name} switches on {found}"


def test_a_mode_in_a_new_file_is_collected_with_its_options(tmp_path, monkeypatch):
    """Adding a mode touches one file: a module with a MODE in the modes' package is in the registry,
    at its place, with its option's default, parser and example."""
    (tmp_path / "toy_mode.py").write_text(textwrap.dedent('''
        from cpref.base.checks import as_int
        from cpref.modes.costs import ModeCosts
        from cpref.modes.spec import ModeSpec, Option

        def run_toy(q, k, v, call, comm):
            return q

        def toy_plan(call):
            return None

        def toy_costs(*, P, local_tokens, heads, dtype, selected_kv_rows, halo_sizes, gathered_rows, window, width):
            return ModeCosts(width * local_tokens, 0)

        MODE = ModeSpec(name="toy", order=1.5, run=run_toy, plan=toy_plan, collectives=frozenset(), costs=toy_costs,
                        options=(Option("width", 3, lambda v: as_int("width", v, lo=1), "how wide", example=lambda P: P),))
    '''))
    monkeypatch.setattr(cpref.modes, "__path__", [*cpref.modes.__path__, str(tmp_path)])
    modes = collect_modes()
    assert list(modes) == ["all_gather", "p2p", "toy", "a2a", "a2a+p2p"]
    toy = modes["toy"]
    assert toy.defaults() == {"width": 3} and toy.example_options(4) == {"width": 4}
    assert toy.parse_options({}) == {"width": 3} and toy.parse_options({"width": None}) == {"width": 3}
    assert toy.mode_costs(P=2, local_tokens=10, heads=(1, 1, 1, 1), dtype=torch.float32, width=5).forward_bytes == 50
    with pytest.raises(cpref.CPInputError, match="width=0 is outside"):
        toy.parse_options({"width": 0})
    with pytest.raises(cpref.CPInputError, match="mode 'toy' has no option 'a2a_size'"):
        toy.mode_costs(P=2, local_tokens=10, heads=(1, 1, 1, 1), dtype=torch.float32, a2a_size=2)


def test_the_options_come_from_the_declarations():
    assert OPTIONS == ("a2a_size", "balance", "check_ranks", "deterministic", "head_groups", "overlap", "save_gathered_kv")
    assert cpref.MODES["a2a+p2p"].example_options(4) == {"a2a_size": 2}
    assert cpref.MODES["a2a+p2p"].example_options(3) == {"a2a_size": 1}
    assert all(spec.example_options(4) == {} for name, spec in cpref.MODES.items() if name != "a2a+p2p")
    for spec in cpref.MODES.values():
        for option in spec.options:
            assert option.doc and option.parse(option.default if option.default is not None else 1) is not None


def _first_error(mode, **options):
    s = cpref.Sharding([0, 16], cp_size=2)
    q, k, v = random_qkv(16, 4, 2, 8)
    local = [[s.shard(t, r) for t in (q, k, v)] for r in range(2)]

    def rank_fn(comm):
        try:
            cpref.attention(*local[comm.rank], s, comm=comm, mode=mode, **options)
        except cpref.CPInputError as e:
            return str(e)
        return None

    return SimCluster(2, timeout=10.0).run(rank_fn)[0]


@pytest.mark.parametrize(
    "mode, options, match",
    [
        ("p2p", {"a2a_size": 2}, r"a2a_size=2 is only used by mode a2a\+p2p, not mode='p2p'"),
        ("a2a", {"save_gathered_kv": True}, r"save_gathered_kv=True is only used by mode all_gather, not mode='a2a'"),
        ("p2p", {"windw": 4}, r"unknown option windw=4; the modes' options are \['a2a_size', 'balance', 'head_groups', 'overlap', "
                                r"'save_gathered_kv'\]"),
        ("a2a", {"balance": "maybe"}, r"balance must be True or False, got 'maybe'"),
        ("p2p", {"balance": False}, r"balance=False is only used by mode a2a / a2a\+p2p, not mode='p2p'"),
        ("all_gather", {"save_gathered_kv": "yes"}, r"save_gathered_kv"),
        ("a2a+p2p", {"a2a_size": 1.5}, r"a2a_size must be an int, got 1\.5"),
        ("a2a+p2p", {"a2a_size": 0}, r"a2a_size=0 is outside"),
        ("a2a+p2p", {}, r"mode 'a2a\+p2p' needs a2a_size.*e\.g\. a2a_size=2"),
        ("p2p", {"layout": "contiguous"}, r"layout= is not an argument of cpref\.attention.*cpref\.Sharding"),
    ],
)
def test_options_are_parsed_by_their_mode_and_refused_elsewhere(mode, options, match):
    import re

    got = _first_error(mode, **options)
    assert got is not None and re.search(match, got), got


def test_the_parsed_option_is_the_one_the_mode_runs_with():
    """`check_hierarchical` validated a2a_size and the raw value went on; now the parser's int is what the
    mode runs with and what the ranks compare: one rank passing `np.int64(2)`, the other `2`, agree (the
    raw values' reprs differ), and the output is bitwise that of `2` on both."""
    np = pytest.importorskip("numpy")
    s = cpref.Sharding([0, 32], cp_size=4)
    q, k, v = random_qkv(32, 4, 2, 8)
    local = [[s.shard(t, r) for t in (q, k, v)] for r in range(4)]

    def rank_fn(comm, mixed):
        a = np.int64(2) if mixed and comm.rank % 2 else 2
        return cpref.attention(*local[comm.rank], s, comm=comm, mode="a2a+p2p", a2a_size=a)

    plain, mixed = (SimCluster(4).run(lambda comm, m=m: rank_fn(comm, m)) for m in (False, True))
    assert all(torch.equal(x, y) for x, y in zip(plain, mixed))


def test_mode_costs_asks_the_mode():
    with pytest.raises(cpref.CPInputError, match="unknown mode 'ring'"):
        mode_costs("ring", P=2, local_tokens=8, heads=(1, 1, 1, 1), dtype=torch.float32)
    c = mode_costs("a2a+p2p", P=4, local_tokens=8, heads=(4, 4, 8, 8), dtype=torch.float32, a2a_size=4)
    assert c == mode_costs("a2a", P=4, local_tokens=8, heads=(4, 4, 8, 8), dtype=torch.float32)  # a = P is Ulysses
