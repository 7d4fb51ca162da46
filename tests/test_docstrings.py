"""Every public function, class and method of cpref and sim has a docstring (the API pages show them)."""

import importlib
import inspect
import pkgutil

import cpref
import sim


def undocumented() -> list[str]:
    missing = []
    for pkg in (cpref, sim):
        for info in pkgutil.walk_packages(pkg.__path__, prefix=pkg.__name__ + "."):
            if info.name == "sim.__main__":
                continue
            module = importlib.import_module(info.name)
            for name in getattr(module, "__all__", []):
                obj = getattr(module, name)
                if (inspect.isfunction(obj) or inspect.isclass(obj)) and not inspect.getdoc(obj):
                    missing.append(f"{info.name}.{name}")
                if not inspect.isclass(obj) or obj.__module__ != module.__name__:
                    continue
                for attr, member in vars(obj).items():
                    fn = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
                    if not attr.startswith("_") and (callable(fn) or isinstance(member, property)) and not (fn.__doc__ or "").strip():
                        missing.append(f"{info.name}.{name}.{attr}")
    return missing


def test_every_public_api_has_a_docstring():
    assert undocumented() == []


def test_every_source_file_compiles_without_an_invalid_escape():
    """A docstring with TeX (`\\,`, `\\text`) must be raw: in a plain string `\\t` is a tab and `\\,` a warning (and a
    SyntaxError in a later Python), so the page would show a formula the file does not hold."""
    import warnings
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    files = [f for top in ("src", "sim", "bench", "docs", "examples", "tests") for f in (root / top).rglob("*.py")]
    bad = []
    for f in files:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            try:
                compile(f.read_text(), str(f), "exec")
            except (SyntaxError, SyntaxWarning, DeprecationWarning) as err:
                bad.append(f"{f.relative_to(root)}: {err}")
    assert len(files) > 100 and not bad, bad
