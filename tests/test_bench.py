"""The benchmarks' own plumbing (their figures are printed, never asserted)."""

from __future__ import annotations

import torch

from bench import kernel


def test_device_timings_wait_for_the_device(monkeypatch):
    """On an accelerator a kernel launch returns before the work is done: without a
    synchronize on both sides of each timed call the benchmark would time launches."""
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(("sync", device)))
    times = kernel.fastest({"f": lambda: events.append("call")}, repeats=2, warmup=1, device=torch.device("cuda", 0))
    assert events == ["call"] + [("sync", torch.device("cuda", 0)), "call", ("sync", torch.device("cuda", 0))] * 2
    assert set(times) == {"f"}


def test_kernel_table_runs_in_the_dtype_asked_for():
    rows = kernel.table({"2 x 32": [32, 32]}, heads=2, dim=8, repeats=1, dtype=torch.bfloat16)
    assert [set(r) for r in rows] == [{"mix", "fast", "explicit", "sdpa"}]
    steps = kernel.cases([16], heads=2, dim=8, dtype=torch.bfloat16)
    out = steps["fast"]()  # (dq, dk, dv) of the kernel's backward
    assert all(t.dtype == torch.bfloat16 for t in out)
