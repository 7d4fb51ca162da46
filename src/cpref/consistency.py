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
On backends without tensor all-gather for the group size (HCCL with 3, 5, 6 or 7 ranks) it
uses two all-reduces (max and min) instead. A group of one rank has nothing to compare and
skips it.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import torch

from cpref.call import CPCall
from cpref.comm import Collectives
from cpref.errors import CPInputError

__all__ = ["fingerprint", "check_ranks_agree"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_LAYOUTS = ("contiguous", "zigzag")


def _digest(value: Any) -> int:
    """A 56-bit digest of `repr(value)`, the same in every process (unlike `hash` of a str)."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=7).digest(), "little")


def fingerprint(call: CPCall, mode: str) -> list[tuple[str, int]]:
    """`(argument, int64 code)` for every argument the ranks must agree on."""
    b = call.bounds
    options = tuple(sorted(call.options.items()))
    return [
        ("mode", _digest(mode)),
        ("layout", _LAYOUTS.index(call.layout)),
        ("causal", int(call.causal)),
        ("softmax_scale", struct.unpack("<q", struct.pack("<d", call.scale))[0]),  # the float's bits
        ("cu_seqlens", _digest(b.real)),
        ("cu_seqlens_padded", _digest(b.padded)),
        ("heads (Hq, Hkv, D, Dv)", _digest(call.heads)),
        ("dtype", _DTYPES.index(call.dtype)),
        ("mode options", _digest(options)),
    ]


# codes that can be shown as the value itself; the others are digests
_DECODE = {
    "layout": lambda c: repr(_LAYOUTS[c]),
    "causal": lambda c: repr(bool(c)),
    "softmax_scale": lambda c: repr(struct.unpack("<d", struct.pack("<q", c))[0]),
    "dtype": lambda c: str(_DTYPES[c]),
}


def _show(name: str, code: int) -> str:
    return _DECODE[name](code) if name in _DECODE else f"digest {code:014x}"


def check_ranks_agree(call: CPCall, mode: str, comm: Collectives) -> None:
    """All-gather the fingerprint once per (batch, group, arguments); raise if ranks differ.

    Raises:
        CPInputError: the same message on every rank, naming each argument that differs.
    """
    if comm.size == 1:  # a group of one agrees with itself: no collective, no host copy
        return
    fields = fingerprint(call, mode)
    key = ("ranks-agree", id(comm), tuple(code for _, code in fields))
    if call.entry.checked(key):
        return
    mine = torch.tensor([[code for _, code in fields]], dtype=torch.int64, device=call.device)  # (1, F)
    if "all_gather" in comm.unsupported_ops:
        table = torch.cat([comm.all_reduce(mine, "min"), comm.all_reduce(mine, "max")])  # (2, F)
        who = ["lowest code", "highest code"]
    else:
        table = comm.all_gather(mine)  # (P, F)
        who = [f"rank {r}" for r in range(comm.size)]
    rows = table.tolist()  # one host copy per batch
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
