"""The seams hold: cpref never imports sim; no algorithm imports torch.distributed or torch_npu."""

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "cpref"


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
            assert not name.startswith("torch.distributed"), f"{file} imports {name}"


def test_importing_cpref_loads_neither_sim_nor_torch_npu():
    code = "import sys, cpref; print(sorted(m for m in sys.modules if m.split('.')[0] in ('sim', 'torch_npu')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.strip() == "[]"
