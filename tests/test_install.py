"""What a user's script sees after installing cpref (issue 19, part 3): `sim` and
`cpref.comm` import from any directory, and the base install brings numpy."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import sys
import cpref
assert "cpref.comm.torch_dist" not in sys.modules, "import cpref imported the backend"
import sim
from sim import SimCluster
from sim.oracle import attention as oracle_attention
comm_class = cpref.comm.TorchComm
assert comm_class.__module__ == "cpref.comm.torch_dist"
print("ok")
"""


def run_in(directory: Path, *args: str) -> subprocess.CompletedProcess:
    """The interpreter in `directory`, without the repository on its path (as a user's script runs)."""
    return subprocess.run([sys.executable, *args], cwd=directory, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "PYTHONNOUSERSITE": "1"})  # fmt: skip


def test_a_script_in_an_empty_directory_imports_cpref_sim_and_the_backends(tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    done = run_in(tmp_path, "-W", "error::UserWarning", "script.py")  # no "Failed to initialize NumPy" either
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_the_quickstart_runs_from_another_directory(tmp_path):
    done = run_in(tmp_path, str(ROOT / "examples" / "quickstart.py"))
    assert done.returncode == 0 and "largest error against the FP64 oracle" in done.stdout, done.stderr


def test_cpref_has_no_other_lazy_attribute():
    import cpref

    try:
        cpref.backend  # noqa: B018 -- a typo must still be an AttributeError
    except AttributeError as exc:
        assert "no attribute 'backend'" in str(exc)
    else:
        raise AssertionError("cpref.backend did not raise")


def test_numpy_is_a_dependency_of_the_base_install():
    requires = importlib.metadata.requires("cpref") or []
    assert any(r.split(">")[0].split("=")[0].strip() == "numpy" and "extra" not in r for r in requires), requires
