"""Every benchmark of `make bench`, in turn: each prints its tables, and they are kept.

Each benchmark's `main()` runs with its defaults; what it prints goes to the terminal and, with
one header line (when, on what machine, which torch), to `<folder>/<name>.txt`. What it
returns, its measured figures as plain numbers, goes to `<folder>/<name>.json` with the
same header; `bench.scaling` also writes there the `this-machine` profile it calibrates
(`this-machine.json`).

**Where.** By default `<folder>` is `bench/out/` (`OUT`, ignored by git): a run on any machine
leaves the committed results as they are. The docs' performance pages (the overview, `bench/report.py`,
and one page per benchmark, its module's docstring) render its tables and draw its figures
(`docs/bench_figures.py`) from the committed ones, `bench/results/` (`RESULTS`); to replace those on
purpose, run `python -m bench.all --update-results` (what `make bench KEEP=1` does) and commit them,
so that the pages show the last full run and say when and where it was measured.

Run it with `python -m bench.all` (what `make bench` does); `--only kernel scaling` runs some.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import io
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from sim.tools.cli import Parser

BENCHMARKS = ("kernel", "window", "overhead", "scaling", "memory", "all_gather", "collectives", "layouts", "variants",
              "plan", "masks")
ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"  # committed: what the performance page shows
OUT = ROOT / "bench" / "out"  # ignored by git: where a run writes unless told to update RESULTS
# the arguments a benchmark's `main` takes for the files it writes itself, given the folder of the run
FOLDER_ARGS = {"scaling": lambda folder: ["--calibration", str(folder / "this-machine.json")]}


class _Tee(io.TextIOBase):
    """Writes to every stream it was given (the terminal and the kept copy)."""

    def __init__(self, *streams) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


def header() -> str:
    """When and where: UTC date, cores, processor, torch and Python versions."""
    now = datetime.datetime.now(datetime.timezone.utc)
    cpu = platform.processor() or platform.machine()
    return f"Measured {now:%Y-%m-%d %H:%M} UTC on {os.cpu_count()} cores ({cpu}), torch {torch.__version__}, Python {platform.python_version()}."


def run(name: str, results: Path = OUT) -> float:
    """Run `bench.<name>`'s `main`, print its output and keep it and its results in `results`; return its seconds."""
    module = importlib.import_module(f"bench.{name}")
    kept, head, start = io.StringIO(), header(), time.perf_counter()  # when it started
    results.mkdir(parents=True, exist_ok=True)
    with contextlib.redirect_stdout(_Tee(sys.stdout, kept)):
        measured = module.main(FOLDER_ARGS[name](results) if name in FOLDER_ARGS else [])
    seconds = time.perf_counter() - start
    if not isinstance(measured, dict):
        raise TypeError(f"bench.{name}.main returned {type(measured).__name__}: a benchmark returns its results as a dict")
    (results / f"{name}.txt").write_text(f"{head} ({seconds:.0f} s)\n\n{kept.getvalue().strip()}\n")
    kept_json = {"measured": head, "seconds": round(seconds), "results": measured}
    (results / f"{name}.json").write_text(json.dumps(kept_json, indent=1) + "\n")
    return seconds


def load(name: str, results: Path = RESULTS) -> dict:
    """What `run(name)` kept in `results` (default: the committed ones, the page's): `{"measured": header, "seconds":
    s, "results": main's dict}`."""
    return json.loads((results / f"{name}.json").read_text())


def main(argv: list[str] | None = None) -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=BENCHMARKS, default=list(BENCHMARKS))
    parser.add_argument("--update-results", action="store_true", help="write into bench/results/, the committed "
                        "results the docs' performance page shows (default: bench/out/, ignored by git); make bench KEEP=1")
    args = parser.parse_args(argv)
    folder = RESULTS if args.update_results else OUT
    total = sum(run(name, folder) for name in args.only)
    kept = f"tables kept in {folder}"
    if not args.update_results:
        kept += f"; the committed {RESULTS} (the performance page's) unchanged: --update-results (make bench KEEP=1) replaces them"
    print(f"\nall benchmarks: {total:.0f} s; {kept}")


if __name__ == "__main__":
    main()
