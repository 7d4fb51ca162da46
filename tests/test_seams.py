"""The seams hold: cpref never imports sim or torch_npu; only its two backends import torch.distributed;
and no import runs against the package's layers."""

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "cpref"
# the modules that may import torch.distributed: the collectives over it, and DCP checkpoint payloads
BACKENDS = {"cpref.comm.torch_dist", "cpref.comm.capabilities", "cpref.train.dcp"}


def module_name(file: Path) -> str:
    parts = ["cpref", *file.relative_to(SRC).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(file: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_no_cpref_module_imports_sim_torch_distributed_or_torch_npu():
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 10
    for file in files:
        for name in imported_modules(file):
            root = name.split(".")[0]
            assert root != "sim", f"{file} imports {name}"
            assert root != "torch_npu", f"{file} imports {name} (import it lazily, by name)"
            if module_name(file) not in BACKENDS:
                assert not name.startswith("torch.distributed"), f"{file} imports {name} (only {sorted(BACKENDS)} may)"
            if module_name(file) not in BACKENDS | {"cpref.comm"}:
                assert name not in BACKENDS, f"{file} imports {name} (pass the comm in instead)"


def test_importing_cpref_loads_neither_sim_nor_torch_npu():
    code = "import sys, cpref; print(sorted(m for m in sys.modules if m.split('.')[0] in ('sim', 'torch_npu')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.strip() == "[]"


def test_the_torch_distributed_allowance_is_used_by_the_backends():
    """The allowance above is used where meant: each backend module imports torch.distributed."""
    for name in BACKENDS:
        file = SRC.joinpath(*name.split(".")[1:]).with_suffix(".py")
        assert any(n.startswith("torch.distributed") for n in imported_modules(file)), name


def test_importing_cpref_leaves_the_backends_unloaded():
    code = f"import sys, cpref; print(sorted(m for m in sys.modules if m in {sorted(BACKENDS)!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.strip() == "[]"


def test_the_backend_loads_on_first_use():
    code = "import cpref.comm as c; print(c.TorchComm.__module__, c.unsupported_ops.__module__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.split() == ["cpref.comm.torch_dist", "cpref.comm.capabilities"]


# The layers, bottom up: a module imports only modules of its own part or of a lower layer. Parts on one
# layer are independent of each other (the three seams: the batch description, the kernels, the collectives).
LAYERS = [{"cpref.base"}, {"cpref.batch", "cpref.kernels", "cpref.comm"}, {"cpref.modes"}, {"cpref.api"}, {"cpref.infer"},
          {"cpref.models"}, {"cpref.train"}, {"cpref.hf"}]  # fmt: skip


def part_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def layer_of(module: str) -> int:
    return next(i for i, parts in enumerate(LAYERS) if part_of(module) in parts)


def test_the_top_level_is_one_entry_a_concept():
    """Issue 43: the tree tells the story. Every entry of src/cpref is a part of a layer (or the package's
    __init__), so a new top-level module must be given a place here first."""
    entries = {p.stem for p in SRC.iterdir() if p.name != "__pycache__" and not p.name.endswith(".egg-info")}
    assert entries - {"__init__"} == {part.split(".")[1] for layer in LAYERS for part in layer}
    assert len(entries) <= 11  # ten since issue 43, and infer/ (issue 60): a new top-level concept is a decision


def test_no_import_runs_against_the_layers():
    """Every import, function-level ones too, goes to the module's own part or down. Before issue 43,
    cpref.costs reached up into cpref.modes, and the modes imported cpref.costs."""
    up = []
    for file in SRC.rglob("*.py"):
        name = module_name(file)
        if name == "cpref":
            continue
        for target in imported_modules(file):
            if target.startswith("cpref.") and part_of(target) != part_of(name) and layer_of(target) >= layer_of(name):
                up.append(f"{name} -> {target}")
    assert up == []


def test_the_layer_check_sees_an_import_upwards():
    assert layer_of("cpref.batch.sharding") < layer_of("cpref.modes.ring") < layer_of("cpref.train.data")
    assert layer_of("cpref.kernels.merge") == layer_of("cpref.comm.protocol")  # same layer: independent seams


FORBIDDEN_ROOTS = ("torch.distributed", "torch_npu", "sim")


def reaches(source: str) -> list[str]:
    """What `source` reaches of torch.distributed, torch_npu or sim, by import, attribute or name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            parts, cur = [node.attr], node.value
            while isinstance(cur, ast.Attribute):
                parts.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name):
                dotted = ".".join([cur.id, *reversed(parts)])
                found += [dotted for root in FORBIDDEN_ROOTS if dotted == root or dotted.startswith(root + ".")]
        elif isinstance(node, ast.Name) and node.id in ("torch_npu", "sim", "dist", "__import__"):
            found.append(node.id)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module":
            found.append("importlib.import_module")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [n for n in names for root in FORBIDDEN_ROOTS if n == root or n.startswith(root + ".")]
    return found


def test_the_checker_sees_attribute_access_and_dynamic_imports():
    assert reaches("import torch\ntorch.distributed.all_reduce(x)") == ["torch.distributed.all_reduce", "torch.distributed"]
    assert reaches("getattr(torch, 'x')\nimportlib.import_module('torch_npu')") == ["importlib.import_module"]
    assert reaches("x = sim.SimCluster") == ["sim.SimCluster", "sim"]
    assert reaches("from torch.distributed import all_reduce") == ["torch.distributed"]
    assert reaches("import torch\ny = torch.cat([x])") == []


def test_no_mode_reaches_torch_distributed_torch_npu_or_sim_at_all():
    files = sorted((SRC / "modes").glob("*.py"))
    assert files
    for file in files:
        assert reaches(file.read_text()) == [], f"{file} reaches {reaches(file.read_text())}"


def _module_graph(root: Path, package: str) -> dict[str, set[str]]:
    """`{module: the package's modules it imports}`, from every import in it, function-level ones too
    (a lazy import hides a circle, it does not remove it). `from p import name` counts `p.name` if
    that is a module, else `p`; a package's `__init__` is the package itself."""
    modules = {}
    for file in root.rglob("*.py"):
        parts = [package, *file.relative_to(root).with_suffix("").parts]
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = file
    graph = {}
    for name, file in modules.items():
        found = set()
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom) and node.module in modules and node.level == 0:
                subs = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
                found |= subs or {node.module}
                if len(subs) < len(node.names):
                    found.add(node.module)  # some names come from the package itself
        graph[name] = found - {name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while not part or part[-1] != v:
                part.append(stack.pop())
                on.discard(part[-1])
            if len(part) > 1:
                out.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles_in_cpref():
    """Issue 19: layout <-> seqlens, models.config <-> models.hf_config, models.hf_weights <-> models.model
    were circles held together by lazy imports. The package's __init__ importing its modules, and a
    module importing a sibling through the package (`from cpref.comm import capabilities`), are not."""
    graph = _module_graph(SRC, "cpref")
    assert len(graph) > 30 and "cpref.batch.sharding" in graph["cpref.train.data"]
    assert "cpref.batch.layout" in graph["cpref.batch.sharding"]
    packages = {name for name, deps in graph.items() if (SRC / Path(*name.split(".")[1:]) / "__init__.py").is_file()}
    for name in graph:  # a package's own __init__ re-exporting its modules is not a circle
        graph[name] -= {p for p in packages if p != name and name.startswith(p + ".")}
    assert _circles(graph) == []


def test_no_import_circles_in_sim():
    """Issue 58: the verifier's `baselines` <-> `rank` (through `load_impl`, now `sim.tools.verify.impls`), and `cases`
    <-> `masks` (a type hint), were circles."""
    root = SRC.parents[1] / "sim"
    graph = _module_graph(root, "sim")
    assert "sim.tools.verify.impls" in graph["sim.tools.verify.baselines"]
    packages = {name for name in graph if (root / Path(*name.split(".")[1:]) / "__init__.py").is_file()}
    for name in graph:
        graph[name] -= {p for p in packages if p != name and name.startswith(p + ".")}
    assert _circles(graph) == []


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_the_readmes_changelog_names_where_every_moved_module_went():
    """Issue 43: a moved module's old path is listed in README's changelog with its new one; each new one imports,
    and no old one does (an old path that still imported would need no line)."""
    import importlib.util
    import re

    readme = (SRC.parents[1] / "README.md").read_text()
    rows = re.findall(r"^\| `((?:cpref|sim)[\w.]*)` \| `((?:cpref|sim)[\w.]*)` \|$", readme.split("## Changelog")[1], re.M)
    assert len(rows) >= 20
    for old, new in rows:
        assert importlib.util.find_spec(new) is not None, new
        try:
            found = importlib.util.find_spec(old)
        except ModuleNotFoundError:  # its parent package is gone too
            found = None
        assert found is None, f"{old} still imports: it needs no changelog line"
