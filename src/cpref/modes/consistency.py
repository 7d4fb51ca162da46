"""Do the ranks of a CP group agree on the call? One tiny host exchange per call says.

Validation without communication sees only this rank's values. Some disagreements it cannot
see give wrong results with no error at all: ranks that pass different `causal`,
`softmax_scale`, `layout`, mode, or `cu_seqlens` with the same total, compute different
functions and still meet in the same collectives; a rank alone without `deterministic=True`
makes the whole run unrepeatable. Others make the ranks call different
collectives (another mode, dtype or head count), which a real backend does not report: gloo
aborts the process (`SIGABRT`, no Python traceback), NCCL hangs until its timeout.

So **every** call, before any of the mode's communication, all-gathers a **fingerprint** of
its arguments (a few int64s: `check_ranks`, the choices, the scale's bits, digests of the
boundaries' values, the shapes) and compares the table: any column that differs raises the
same `CPInputError` on every rank, naming the argument and what each rank passed (the
boundaries themselves, from their first differing document, where the values differ).

## Why every call, and why it costs no device sync

A check made only on a batch's first call has to decide, on each rank, whether *this* call is
a first call. Whatever that decision reads (this rank's arguments, its cache, a new tensor,
`clear_cache()`, `check_ranks`), a rank can read it differently from the others; then some
ranks compare and the others do not, and their collectives no longer match: the failure the
check exists to prevent. The only decision every rank makes alike is one that depends on
nothing a rank can change on its own, so cpref compares on every call.

The exchange is **host-side**: a communicator that has `agree(row)` (the simulated cluster;
[`TorchComm`][cpref.comm.torch_dist.TorchComm], over gloo on the CPU, on its own group where gloo
serves it and on a gloo group of the same ranks under NCCL or HCCL) moves Python ints, so the
comparison never waits for the accelerator's stream: no host-device synchronisation, on any
layer (the hardening test counts them). Its cost is one round trip between the CP group's
hosts per call, a few dozen bytes; `python -m bench.collectives` measures it beside the
collectives the modes make. A communicator without `agree` gets the same comparison through its
own `all_gather` (or, where the backend has none for the group size, two all-reduces, max and
min) on the call's device, and a host copy of the table per call.

Identical values are identical: the boundaries enter as digests of their **values**, so a new
tensor with the same `cu_seqlens`, or a rank that called `cpref.clear_cache()`, changes
nothing.

## `check_ranks`

`check_ranks` is agreed, not decided per rank. The first call on a communicator is always
compared, `check_ranks` included; if every rank passed `check_ranks=False`, the later calls on
that communicator skip the exchange (every rank must then pass the same arguments; a rank that
changes them gets wrong results or a collective mismatch, as without any check). Where the
group agreed on `True`, every later call is compared whatever it passes: a rank passing
`check_ranks=False` alone makes the `check_ranks` column differ, and every rank raises, naming
it (if every rank passes `False`, they agree, and the call runs compared). A later call that
passes `True` after the group agreed on `False` cannot be honoured (the other ranks will not
compare): it warns and runs without the check.

## A rank whose inputs fail validation

Validation runs before any communication, but some inputs are a rank's own: its shard's
length, its tensors' dtype. If rank 2 alone passes a shard two tokens short, it raises, while
the other ranks, whose inputs are fine, enter this comparison and would wait there until the
process group's timeout (minutes, or a hang). So a rank whose inputs fail validation still
takes part in the comparison, with a row that says "invalid" (the first column, 0), and then
raises its own error; every other rank sees the row and raises a `CPInputError` naming the
rank that failed. Nobody is left waiting, and no mode's communication has started. Only where
the group agreed on `check_ranks=False` (nothing is compared) does a failing rank raise alone.

## How it is tested

On the simulated cluster (`tests/cpref/test_later_layers.py`, `test_consistency.py`): rank 1
alone changes `causal`, the scale, the mode, the layout or the dtype on layer 2, and every rank
raises naming it, with nothing of layer 2's mode communicated; a new tensor of the same values, a
list of them, or `clear_cache()` on one rank give bitwise the outputs of a run without the
difference; `check_ranks` differing on the first call or after the group agreed on `True` is
named; no tensor is copied to the host after the first layer, whatever the number of layers.
On 4 gloo processes (`tests/backends/gloo_cases.py::extra_later_layer_divergence`) the same
triggers raise within seconds on every rank; without the check, the rank that differs would
run other collectives than its peers, and gloo ends such a run with a `SIGABRT`.
"""

from __future__ import annotations

import hashlib
import struct
import threading
import warnings
from collections import OrderedDict
from typing import Any

import torch

from cpref.base.errors import CPInputError, PeerInputError
from cpref.batch.seqlens import LAYOUTS
from cpref.comm.protocol import Collectives
from cpref.kernels.contract import FLOAT_DTYPES
from cpref.modes.call import CPCall

__all__ = ["FIELDS", "fingerprint", "check_ranks_agree", "report_invalid_inputs", "exchange", "check_same"]

_DTYPES, _LAYOUTS = FLOAT_DTYPES, LAYOUTS  # a column holds the index of the value in its tuple


def _digest(value: Any) -> int:
    """A 56-bit digest of `repr(value)`, the same in every process (unlike `hash` of a str)."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=7).digest(), "little")


# the compared columns, in order; the first says whether the rank's own inputs passed validation
FIELDS = ("inputs valid", "check_ranks", "mode", "layout", "causal", "window", "softmax_scale", "cu_seqlens",
          "cu_seqlens_padded", "heads (Hq, Hkv, D, Dv)", "dtype", "mode options", "deterministic",
          "variants (softcap, chunk, sinks)")  # fmt: skip


def fingerprint(call: CPCall, mode: str, check_ranks: bool = True) -> list[tuple[str, int]]:
    """`(argument, int64 code)` for every argument the ranks must agree on, in the order of `FIELDS`."""
    b = call.bounds
    options = tuple(sorted(call.options.items()))
    codes = [
        1,  # inputs valid
        int(check_ranks),
        _digest(mode),
        _LAYOUTS.index(call.layout),
        int(call.causal),
        _digest(call.window),
        struct.unpack("<q", struct.pack("<d", call.scale))[0],  # the float's bits
        _digest(b.real),  # values, not tensor identity: a new tensor of the same values is the same batch
        _digest(b.padded),
        _digest(call.heads),
        _DTYPES.index(call.dtype),
        _digest(options),
        int(call.deterministic),  # a rank summing in another order makes the run unrepeatable, not wrong
        _digest((call.softcap, call.chunk, call.sinks is not None)),  # whether sinks are given (their values: a parameter)
    ]
    return list(zip(FIELDS, codes))


# codes that can be shown as the value itself; the others are digests
_DECODE = {
    "check_ranks": lambda c: repr(bool(c)),
    "layout": lambda c: repr(_LAYOUTS[c]),
    "causal": lambda c: repr(bool(c)),
    "softmax_scale": lambda c: repr(struct.unpack("<d", struct.pack("<q", c))[0]),
    "dtype": lambda c: str(_DTYPES[c]),
    "deterministic": lambda c: repr(bool(c)),
}


def _show(name: str, code: int) -> str:
    return _DECODE[name](code) if name in _DECODE else f"digest {code:014x}"


def exchange(comm: Any, row: list[int], device: torch.device) -> tuple[list[list[int]], list[str]]:
    """Every rank's `row` (or the columns' min and max where all-gather is missing), and who each row is.

    Over the host with `comm.agree` where the communicator has it; else a collective on `device`.
    """
    if hasattr(comm, "agree"):
        return comm.agree(row), [f"rank {r}" for r in range(comm.size)]
    mine = torch.tensor([row], dtype=torch.int64, device=device)  # (1, F)
    if "all_gather" in comm.unsupported_ops:
        table = torch.cat([comm.all_reduce(mine, "min"), comm.all_reduce(mine, "max")])  # (2, F)
        return table.tolist(), ["lowest code", "highest code"]
    return comm.all_gather(mine).tolist(), [f"rank {r}" for r in range(comm.size)]  # (P, F), one host copy


def check_same(comm: Any, what: str, values: dict[str, Any], device: torch.device | None = None) -> None:
    """Raise the same `CPInputError` on every rank of `comm` unless every rank passes equal `values`.

    One host exchange of a digest per value (by `repr`), e.g. a training run's settings, whose
    difference between ranks would make them call different collectives or train different models.
    """
    if comm.size == 1:
        return
    names = sorted(values)
    rows, who = exchange(comm, [_digest(values[n]) for n in names], device or torch.device("cpu"))
    lines = []
    for i, name in enumerate(names):
        groups: dict[int, list[str]] = {}
        for label, row in zip(who, rows):
            groups.setdefault(row[i], []).append(label)
        if len(groups) > 1:
            lines.append(f"{name}: " + " vs ".join(", ".join(g) for g in groups.values()))
    if lines:
        raise CPInputError(f"{what}: the ranks pass different values, which would make them train different models or "
                           "wait in different collectives (ranks that agree are listed together): " + "; ".join(lines)
                           + "; pass the same on every rank")  # fmt: skip


class _Agreed:
    """The `check_ranks` each communicator's ranks agreed on at their first call (an LRU by identity).

    Not part of the batch cache: `cpref.clear_cache()` on one rank must not change what it
    decides. Eviction follows the order of calls, the same on every rank of a group.
    """

    def __init__(self, capacity: int = 256) -> None:
        self.capacity, self.lock, self.by_id = capacity, threading.Lock(), OrderedDict()

    def get(self, comm: Any) -> bool | None:
        with self.lock:
            held = self.by_id.get(id(comm))  # an entry holds its comm: no other object has that id meanwhile
            if held is None:
                return None
            self.by_id.move_to_end(id(comm))
            return held[1]

    def set(self, comm: Any, value: bool) -> None:
        with self.lock:
            self.by_id[id(comm)] = (comm, value)  # holds comm: its id cannot be reused meanwhile
            while len(self.by_id) > self.capacity:
                self.by_id.popitem(last=False)


AGREED = _Agreed()


def check_ranks_agree(call: CPCall, mode: str, comm: Collectives, check_ranks: bool = True) -> None:
    """Compare this call's fingerprint across the group (every call, see the module docstring).

    Raises:
        CPInputError: the same message on every rank, naming each argument that differs; or,
            if another rank's inputs failed validation, naming that rank (a `PeerInputError`,
            so that the rank's own error is told apart as the root cause).
    """
    if comm.size == 1 or _skipped(comm, check_ranks):  # a group of one agrees with itself
        return
    fields = fingerprint(call, mode, check_ranks)
    rows, who = exchange(comm, [code for _, code in fields], call.device)
    failed = [label for label, row in zip(who, rows) if row[0] == 0]
    if failed:
        named = "a rank" if who[0] == "lowest code" else ", ".join(failed)
        raise PeerInputError(
            f"cpref.attention: the inputs of {named} of the CP group failed validation (that rank's own error "
            f"names the value and the fix); rank {comm.rank} raises too, so that no rank waits in a collective"
        )
    bad = [i for i in range(len(fields)) if len({row[i] for row in rows}) > 1]
    if bad:
        lines = []
        for i in bad:
            name = fields[i][0]
            groups: dict[int, list[str]] = {}
            for label, row in zip(who, rows):
                groups.setdefault(row[i], []).append(label)
            lines.append(f"  {name}: " + "; ".join(f"{', '.join(g)}: {_show(name, code)}" for code, g in groups.items()))
            if name.startswith("cu_seqlens") and who[0] == "rank 0":  # every rank is here: show the values
                values = call.bounds.real if name == "cu_seqlens" else call.bounds.padded
                lines.append(_boundaries(comm, list(values), call.device, name))
        raise CPInputError(
            "the ranks of the CP group pass different arguments to cpref.attention, which would give wrong "
            "results without any error:\n" + "\n".join(lines)
            + "\nPass the same mode, layout, causal, window, softmax_scale, softcap, chunk, sinks, cu_seqlens (and cu_seqlens_padded), "
            "head counts, dtype, options and check_ranks on every rank."
        )
    if AGREED.get(comm) is None:
        AGREED.set(comm, check_ranks)


def _skipped(comm: Any, check_ranks: bool) -> bool:
    """Whether this call skips the comparison: only where the group agreed on `check_ranks=False`."""
    if AGREED.get(comm) is not False:
        return False
    if check_ranks:
        warnings.warn(
            "cpref.attention(check_ranks=True) on a communicator whose ranks agreed on check_ranks=False at their "
            "first call: the other ranks do not compare, so this call runs unchecked; pass the same check_ranks "
            "on every call", stacklevel=4,
        )  # fmt: skip
    return True


def _boundaries(comm: Any, values: list[int], device: torch.device, name: str) -> str:
    """Every rank's boundaries from their first difference with rank 0's (a second exchange, error path only)."""
    lengths, _ = exchange(comm, [len(values)], device)
    longest = max(n for (n,) in lengths)
    rows, _ = exchange(comm, values + [-1] * (longest - len(values)), device)  # (P, longest), -1 past the end
    rows = [row[:n] for row, (n,) in zip(rows, lengths)]
    first = min((next((i for i, (a, b) in enumerate(zip(row, rows[0])) if a != b), min(len(row), len(rows[0])))
                 for row in rows[1:]), default=0)  # fmt: skip
    start = max(first - 1, 0)

    def shown(row: list[int]) -> str:
        cut = row[start : start + 6]
        return ("[" if start == 0 else "[..., ") + ", ".join(map(str, cut)) + (", ...]" if start + 6 < len(row) else "]")

    return (f"    {name} values from entry {start} (first difference at entry {first}): "
            + "; ".join(f"rank {r}: {shown(row)}" for r, row in enumerate(rows)))  # fmt: skip


def report_invalid_inputs(comm: Collectives, q: Any) -> None:
    """Tell the other ranks that this rank's inputs failed validation: take part in the comparison
    they are entering with a row marked invalid (see the module docstring). The caller raises next.

    Does nothing where the others do not compare: a group of one, or a group that agreed on
    `check_ranks=False`. `comm` must have passed its own validation.
    """
    if comm.size == 1 or AGREED.get(comm) is False:
        return
    device = q.device if isinstance(q, torch.Tensor) else getattr(comm, "device", torch.device("cpu"))
    exchange(comm, [0] * len(FIELDS), device)  # column 0 = 0: invalid
