"""`examples/gather_sdpa.py`, the page's adapter of a peer without document boundaries, through `sim verify`.

One launch of 2 gloo processes: every layout over one document in fp32 and bf16 passes (the adapter reads its
tokens' positions from `sharding.global_index`), its work is measured at SDPA (contiguous 1.50, zigzag 1.00), and
with `--impl-option contiguous_grads=False` the bug it works around shows: PyTorch's `all_gather` backward on gloo
scatters a strided gradient wrongly, so dk and dv fail on every rank while out and dq pass.
"""

from __future__ import annotations

import pytest
import torch

import cpref
from examples.gather_sdpa import attention
from sim.tools import verify
from sim.tools.verify.cases import Setup, build_cases
from sim.tools.verify.wire import balance

IMPL = "examples/gather_sdpa.py:attention"
SETUP = Setup(docs=(256,))


@pytest.fixture(scope="module")
def report():
    cases = build_cases(["all_gather"], list(cpref.LAYOUTS), ("fp32", "bf16"), cp=2, impls=(IMPL,))
    cases += build_cases(["all_gather"], ["zigzag"], ("fp32",), cp=2, impls=(IMPL,),
                         impl_options={"contiguous_grads": False})  # fmt: skip
    return verify.run(cases, SETUP, nproc=2, timeout=60.0, progress=False)


def test_every_layout_passes_over_one_document(report):
    rows = [r for r in report.rows if not r.case.impl_options]
    assert len(rows) == 4 * 2 * 2 and all(r.ok for r in rows), report.format()


def test_the_work_is_measured_at_sdpa(report):
    measured = {c.layout: balance([t[0] for t in g]) for c, (g,) in report.traffic if c.dtype == "fp32" and not c.impl_options}
    assert measured["contiguous"] == pytest.approx(24640 / ((8256 + 24640) / 2)) and measured["zigzag"] == 1.0


def test_strided_gradients_through_pytorchs_all_gather_on_gloo_come_back_wrong(report):
    rows = [r for r in report.rows if r.case.impl_options]
    assert len(rows) == 2 and not any(r.ok for r in rows)
    for r in rows:
        assert r.errors["out"] < 1e-5 and r.errors["dq"] < 1e-5 and min(r.errors["dk"], r.errors["dv"]) > 0.1, r
        assert r.ratio <= 2  # wrong at CP size 1 alike: vs P=1 alone would not see it, the FP64 truth does


def test_what_it_cannot_attend_is_refused_before_it_communicates():
    """No process group at all: a refusal raises before any collective would."""
    two = cpref.Sharding(torch.tensor([0, 40, 64]), cp_size=2, layout="zigzag")
    one = cpref.Sharding(torch.tensor([0, 64]), cp_size=2, layout="zigzag")
    q = torch.zeros(32, 2, 4)
    for sharding, extra in ((two, {}), (one, {"window": (8, 0)}), (one, {"softcap": 30.0})):
        with pytest.raises(NotImplementedError, match="one document"):
            attention(q, q, q, sharding, process_group=None, **extra)
