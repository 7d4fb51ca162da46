"""Do the ranks of a CP group agree on the call? One tiny collective per batch says.

Validation without communication sees only this rank's values. Some disagreements it cannot
see give wrong results with no error at all: ranks that pass different `causal`,
`softmax_scale`, `layout`, mode, or `cu_seqlens` with the same total, compute different
functions and still meet in the same collectives. So the first time a rank calls attention
on a batch, it all-gathers a **fingerprint** of its arguments (a few int64s: the choices,
the scale's bits, digests of the boundaries, the shapes) and compares the table: any column
that differs raises the same `CPInputError` on every rank, naming the argument and what each
rank passed. The verdict is cached with the batch (`cpref.cache`), so later layers skip it.

The check is on by default; `cpref.attention(..., check_ranks=False)` turns it off (every
rank must then pass the same value, or ranks disagree on whether to communicate). It assumes
every rank calls attention on the same batches in the same order, which CP requires anyway.

**What it cannot catch.** A rank skips the comparison when it has already compared *its own*
arguments on this batch. If, on a later call of a batch (a later layer), only some ranks change
an argument, those ranks compare again and the others do not: their collectives no longer
match. The simulated cluster reports that as a collective mismatch; a real backend may hang
instead of raising. Comparing on every call would catch it, at a host copy per layer; keying
the check on the batch alone would make the decision the same on every rank, but then a later
call's arguments would never be compared.
On backends without tensor all-gather for the group size (HCCL with 3, 5, 6 or 7 ranks) it
uses two all-reduces (max and min) instead. A group of one rank has nothing to compare and
skips it.

## A rank whose inputs fail validation

Validation runs before any communication, but some inputs are a rank's own: its shard's
length, its tensors' dtype. If rank 2 alone passes a shard two tokens short, it raises, while
the other ranks, whose inputs are fine, enter this comparison and would wait there until the
process group's timeout (minutes, or a hang). So a rank whose inputs fail validation still
takes part in the comparison, with a row that says "invalid" (the first column, 0), and then
raises its own error; every other rank sees the row and raises a `CPInputError` naming the
rank that failed. Nobody is left waiting, and no mode's communication has started.

It does so only where the other ranks compare: on the first call of a batch, with
`check_ranks` on and more than one rank. On a later call of a batch the ranks already
compared (a later layer) they skip the comparison, so a rank that fails there raises alone;
a shard's length and dtype come from the batch, so they cannot change between layers of one
batch. With `check_ranks=False` nothing is compared, and a rank that fails raises alone.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import torch

from cpref.cache import CACHE
from cpref.call import CPCall
from cpref.comm import Collectives
from cpref.errors import CPInputError

__all__ = ["FIELDS", "fingerprint", "check_ranks_agree", "report_invalid_inputs"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_LAYOUTS = ("contiguous", "zigzag")


def _digest(value: Any) -> int:
    """A 56-bit digest of `repr(value)`, the same in every process (unlike `hash` of a str)."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=7).digest(), "little")


# the compared columns, in order; the first says whether the rank's own inputs passed validation
FIELDS = ("inputs valid", "mode", "layout", "causal", "softmax_scale", "cu_seqlens", "cu_seqlens_padded",
          "heads (Hq, Hkv, D, Dv)", "dtype", "mode options")


def fingerprint(call: CPCall, mode: str) -> list[tuple[str, int]]:
    """`(argument, int64 code)` for every argument the ranks must agree on, in the order of `FIELDS`."""
    b = call.bounds
    options = tuple(sorted(call.options.items()))
    codes = [
        1,  # inputs valid
        _digest(mode),
        _LAYOUTS.index(call.layout),
        int(call.causal),
        struct.unpack("<q", struct.pack("<d", call.scale))[0],  # the float's bits
        _digest(b.real),
        _digest(b.padded),
        _digest(call.heads),
        _DTYPES.index(call.dtype),
        _digest(options),
    ]
    return list(zip(FIELDS, codes))


# codes that can be shown as the value itself; the others are digests
_DECODE = {
    "layout": lambda c: repr(_LAYOUTS[c]),
    "causal": lambda c: repr(bool(c)),
    "softmax_scale": lambda c: repr(struct.unpack("<d", struct.pack("<q", c))[0]),
    "dtype": lambda c: str(_DTYPES[c]),
}


def _show(name: str, code: int) -> str:
    return _DECODE[name](code) if name in _DECODE else f"digest {code:014x}"


def _compare(comm: Collectives, mine: torch.Tensor) -> tuple[list[list[int]], list[str]]:
    """Every rank's row of codes (or their min and max where all-gather is missing), and who each row is."""
    if "all_gather" in comm.unsupported_ops:
        table = torch.cat([comm.all_reduce(mine, "min"), comm.all_reduce(mine, "max")])  # (2, F)
        return table.tolist(), ["lowest code", "highest code"]
    table = comm.all_gather(mine)  # (P, F)
    return table.tolist(), [f"rank {r}" for r in range(comm.size)]  # one host copy per batch


def check_ranks_agree(call: CPCall, mode: str, comm: Collectives) -> None:
    """All-gather the fingerprint once per (batch, group, arguments); raise if ranks differ.

    Raises:
        CPInputError: the same message on every rank, naming each argument that differs; or,
            if another rank's inputs failed validation, naming that rank.
    """
    if comm.size == 1:  # a group of one agrees with itself: no collective, no host copy
        return
    fields = fingerprint(call, mode)
    key = ("ranks-agree", id(comm), tuple(code for _, code in fields))
    if call.entry.checked(key):
        return
    mine = torch.tensor([[code for _, code in fields]], dtype=torch.int64, device=call.device)  # (1, F)
    rows, who = _compare(comm, mine)
    failed = [label for label, row in zip(who, rows) if row[0] == 0]
    if failed:
        named = "a rank" if who[0] == "lowest code" else ", ".join(failed)
        raise CPInputError(
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
        raise CPInputError(
            "the ranks of the CP group pass different arguments to cpref.attention, which would give wrong "
            "results without any error:\n" + "\n".join(lines)
            + "\nPass the same mode, layout, causal, softmax_scale, cu_seqlens (and cu_seqlens_padded), "
            "head counts, dtype and options on every rank."
        )
    call.entry.mark_checked(key, keep=comm)


def report_invalid_inputs(comm: Collectives, cu_seqlens: Any, cu_seqlens_padded: Any, q: Any) -> None:
    """Tell the other ranks that this rank's inputs failed validation: take part in the comparison
    they are entering with a row marked invalid (see the module docstring). The caller raises next.

    Does nothing where the others do not compare: a group of one, or a batch this
    communicator has already compared. `comm` must have passed its own validation.
    """
    if comm.size == 1:
        return
    entry = CACHE.find(cu_seqlens, cu_seqlens_padded)
    if entry is not None and entry.has_check(("ranks-agree", id(comm))):
        return  # a later call of a compared batch: the other ranks skip the comparison
    device = q.device if isinstance(q, torch.Tensor) else getattr(comm, "device", torch.device("cpu"))
    _compare(comm, torch.zeros((1, len(FIELDS)), dtype=torch.int64, device=device))  # (1, F), column 0 = 0
