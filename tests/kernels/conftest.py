"""Fixtures the kernel tests share."""

from __future__ import annotations

import pytest

from cpref.kernels import torch_fused


@pytest.fixture
def op_calls(monkeypatch):
    """Counts calls of the fused op, forward and backward."""
    calls = []
    for name in ("_FORWARD", "_BACKWARD"):
        real = getattr(torch_fused, name)
        monkeypatch.setattr(torch_fused, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    return calls
