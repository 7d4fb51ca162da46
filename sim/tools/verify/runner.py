"""`run`: the cases on a launch of processes, every rank compared with its ground truth (the verifier's one entry
point below the command line, `sim.tools.verify.cli`)."""

from __future__ import annotations

import os
from typing import Sequence

import cpref
from cpref.api import check_mode
from sim.tools.launch import launch, under_torchrun
from sim.tools.verify.cases import DTYPES, Case, Setup
from sim.tools.verify.impls import load_impl, takes, takes_mask
from sim.tools.verify.rank import DEVICE_TYPES, Plan, rank_main
from sim.tools.verify.table import Report
from sim.tools.verify.truth import check

__all__ = ["run", "check_cases", "window_modes"]


def run(cases: Sequence[Case], setup: Setup | None = None, *, nproc: int = 2, backend: str = "gloo",
        timeout: float = 300.0, progress: bool | None = None) -> Report | None:  # fmt: skip
    """Run `cases` on `nproc` processes (one launch) and compare every rank with its ground truth.

    Args:
        cases: the cases, run in order by every rank.
        setup: what the cases share (documents, heads, seed, kernel).
        nproc: the world size; ignored under torchrun.
        backend: `"gloo"`, `"nccl"` or `"hccl"`.
        timeout: the process-group timeout in seconds.
        progress: progress bars on stderr (None: if stderr is a terminal, else a line per case;
            [`meter`][sim.tools.verify.meter.meter]; False: neither).

    Returns:
        The report; under torchrun, None on every rank but 0.

    Raises:
        ValueError: on cases that cannot run (unknown mode, a window on a mode that takes none,
            CP size not dividing the world, an `--impl` that does not import), before any process starts.
        LaunchFailure: if a rank raised or died.
    """
    setup = Setup() if setup is None else setup
    # 1) everything that can be checked before a process starts
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else nproc
    check_cases(cases, world, backend, setup.heads)
    if ":" in setup.baseline:
        load_impl(setup.baseline, "--baseline")
    # 2) the production path, on every rank
    plan = Plan(setup, tuple(cases), backend, progress)
    per_rank = launch(rank_main, nproc, backend=backend, timeout=timeout, args=(plan,), device=plan.device_type)
    if under_torchrun():
        per_rank = per_rank[0]  # every rank's results on rank 0, None elsewhere
        if per_rank is None:
            return None
    # 3) the ground truth, rank by rank
    return check(setup, list(cases), per_rank, progress=progress)


def check_cases(cases: Sequence[Case], world: int, backend: str, heads: tuple[int, int] = Setup.heads) -> None:
    """Refuse, before any process starts, cases that cannot run: an unknown mode, layout or dtype, a window on a mode
    that takes none, a CP size that does not divide the world, an `--impl` that does not import (or takes no mask
    under one), what `cpref.attention` would refuse on every rank (`cpref.api.check_mode`).

    Raises:
        ValueError: naming the case and the fix.
    """
    if backend not in DEVICE_TYPES:
        raise ValueError(f"backend must be one of {sorted(DEVICE_TYPES)}, got {backend!r}")
    if not cases:
        raise ValueError("no cases to run")
    for case in cases:
        if case.mode not in cpref.MODES or case.layout not in cpref.LAYOUTS or case.dtype not in DTYPES:
            raise ValueError(f"case {case.label}: mode, layout or dtype unknown; modes are {sorted(cpref.MODES)}")
        if case.windowed and not cpref.MODES[case.mode].windows:
            raise ValueError(f"case {case.label}: mode {case.mode} takes no sliding window; "
                             f"the modes that do: {', '.join(window_modes())}")  # fmt: skip
        if case.cp < 1 or world % case.cp:
            raise ValueError(f"case {case.label}: CP size {case.cp} does not divide the world size {world}")
        if case.impl != "cpref":
            fn = load_impl(case.impl)
            refused = [name for name, _ in case.impl_options if not takes(fn, name)]
            if refused:
                raise ValueError(f"case {case.label}: --impl {case.impl} takes no {refused[0]}= (no such keyword, and "
                                 "no **options); --impl-option passes only the settings it declares")  # fmt: skip
            if not takes_mask(fn) and case.mask is not None:
                raise ValueError(f"case {case.label}: --impl {case.impl} does not take mask= (a keyword, or **options); "
                                 "the command line skips it under --mask")  # fmt: skip
        else:  # what cpref.attention would refuse on every rank (heads that do not split, an option that does not fit)
            try:
                check_mode(case.mode, cp_size=case.cp, heads=heads, causal=case.causal, window=case.window,
                           layout=case.layout, mask=case.mask is not None, **dict(case.options))  # fmt: skip
            except ValueError as exc:
                raise ValueError(f"case {case.label}: {exc}") from None


def window_modes() -> list[str]:
    """The modes that take a sliding window (`cpref.MODES[m].windows`)."""
    return [m for m in sorted(cpref.MODES) if cpref.MODES[m].windows]
