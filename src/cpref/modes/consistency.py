"""Do the ranks of a CP group agree on the call? One tiny host exchange per call says.

Validation without communication sees only this rank's values. Some disagreements it cannot
see give wrong results with no error at all: ranks that pass different `causal`,
`softmax_scale`, `layout`, mode, `sinks` values, or `cu_seqlens` with the same total, compute different
functions and still meet in the same collectives; a rank alone without `deterministic=True`
makes the whole run unrepeatable. Others make the ranks call different
collectives (another mode, dtype or head count), which a real backend does not report: gloo
aborts the process (`SIGABRT`, no Python traceback), NCCL hangs until its timeout. A rank that
records no backward (under `torch.no_grad()`, or with no input requiring grad) while the others
do leaves them waiting in the backward's collectives, in every mode, until the timeout.

So **every** call, before any of the mode's communication, all-gathers a **fingerprint** of
its arguments (a few int64s: `check_ranks`, the choices, the scale's bits, digests of the
boundaries' values and of the sinks' values, the shapes, whether the call records a backward)
and compares the table: any column that differs raises the same `CPInputError` on every rank,
naming the argument and what each rank passed (the boundaries and the sinks themselves, from
their first difference, where the values differ) and, for the sinks and the backward, the fix.

| column | what each rank puts in it |
| --- | --- |
| `inputs valid` | 1, or 0 where its own inputs failed validation (below) |
| `check_ranks`, `causal`, `deterministic` | the flag |
| `mode`, `window`, `mode options`, `heads (Hq, Hkv, D, Dv)` | a digest of the value |
| `layout`, `dtype` | its index among the choices |
| `softmax_scale` | the float's 64 bits |
| `cu_seqlens`, `cu_seqlens_padded` | a digest of the values (not the tensor's identity) |
| `variants (softcap, chunk, sinks)` | a digest of softcap, chunk, and whether sinks are given |
| `sinks values` | a digest of the sinks' values as float64 (below) |
| `backward (grad enabled, an input requiring grad)` | `torch.is_grad_enabled()` and any of q, k, v, sinks requiring grad |
| `mask` | 0 without a mask, else a digest of its slices and total (`cpref.Mask.digest`) |
| `layout's mask` | the same of the mask the sharding was balanced by (`Sharding(..., mask=)`), 0 without one |

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
collectives the modes make. The one exception: sinks on an accelerator, read once per
tensor (see "Sinks: their values"). A communicator without `agree` gets the same comparison through its
own `all_gather` (or, where the backend has none for the group size, two all-reduces, max and
min) on the call's device, and a host copy of the table per call.

Identical values are identical: the boundaries enter as digests of their **values**, so a new
tensor with the same `cu_seqlens`, or a rank that called `cpref.clear_cache()`, changes
nothing.

## Sinks: their values

Sinks are a parameter, `(Hq,)` logits that every rank of the group must hold alike (initialised from
one seed or loaded from one checkpoint, and their gradient summed over the group as every replicated
weight's). Ranks whose sinks differ compute another softmax and meet in the same collectives, so
their values are compared too, as a digest of the values in float64 (exact for every float dtype:
a new tensor, or another dtype, of the same values is the same). Where they are read:

* **sinks on the CPU**: at every call. Their memory is the host's, so reading them is no
  synchronisation; an in-place change on one rank (`sinks.add_(...)`) is named at the next call.
* **sinks on an accelerator**: once per tensor, at the first call that passes it (one copy of
  `Hq` numbers to the host, a synchronisation, at the first step); the later calls with that
  tensor compare the values read then (the reads are kept per tensor, by its identity, and go
  with it). Reading them at every call would make every layer wait for the
  device. So sinks that differ from the start (initialised or loaded differently on one rank) are
  named at the first step; an in-place change afterwards (an optimizer step, or a later load) is not
  read. Ranks whose gradients are summed over the group step alike; ranks whose replicas drift
  apart drift in every weight, which an attention call cannot see. A new tensor at every call (a
  cast of the parameter, `sinks.float()`) is read at every call: pass the parameter itself.

Where they differ, the message shows every rank's sinks from the head before the first that differs
(the values read for the comparison, sent in two more exchanges, on the error path only).

## Grad mode: who runs a backward

Every mode's backward communicates (the ring's sends, the all-gather's reduce-scatter, Ulysses'
all-to-alls), so a rank that records no backward for a call while its peers do leaves them
waiting in the backward until the process group's timeout. Whether a call records one is what
`torch.autograd.Function` decides: grad mode on and any of q, k, v and sinks requiring grad
([`records_backward`][cpref.modes.call.records_backward]). That bit is a column: a rank under
`torch.no_grad()` (or `torch.inference_mode()`), or whose inputs do not require grad, is named on
every rank, with the fix, before any communication. Which inputs require grad does not matter as
long as every rank records a backward: the backward's collectives are the same.

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

The sinks and the backward (`tests/cpref/test_agree_sinks_and_backward.py`), in every mode: rank 1's
sinks differing in one head are named with both ranks' values from that head, and an in-place
change on one rank between two calls at the next call; sinks on one rank only are "none" beside a
digest; equal values in a new tensor of another dtype at every call change no output bit. The
accelerator's policy, run on the CPU (`_on_host` answering no): one host copy per tensor, none
after the first step of 3 layers x 2 steps (the hardening count), replicas that drift apart
afterwards unread (the limit above), sinks that differ from the start named. Rank 1 under
`torch.no_grad()`, under `torch.inference_mode()`, with q, k, v not requiring grad, or with frozen
sinks where rank 0 trains only its sinks, is named on every rank with nothing of the mode
communicated (was: rank 0 waited in the backward); ranks that train different inputs but all
record a backward run it, their gradients bitwise those of ranks that train all three. On 4 gloo
processes (`tests/backends/test_torch_dist.py::test_ranks_that_differ_in_grad_mode_or_sinks_raise_on_every_gloo_process_in_every_mode`,
full tier, a process-group timeout of 20 s) rank 1 under `torch.no_grad()` and rank 1 with other
sinks raise on every rank in every mode within seconds. The API fuzz (`tests/cpref/test_fuzz_api.py`)
draws both as one rank's difference from its peers.
"""

from __future__ import annotations

import hashlib
import struct
import threading
import warnings
from collections import OrderedDict
from typing import Any, Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from cpref.base.errors import CPInputError, PeerInputError
from cpref.batch.seqlens import LAYOUTS
from cpref.comm.protocol import Collectives
from cpref.kernels.contract import FLOAT_DTYPES
from cpref.modes.call import CPCall

__all__ = ["FIELDS", "BACKWARD", "fingerprint", "check_ranks_agree", "report_invalid_inputs", "exchange", "check_same", "agree",
           "SINKS_READ"]  # fmt: skip

_DTYPES, _LAYOUTS = FLOAT_DTYPES, LAYOUTS  # a column holds the index of the value in its tuple


def _digest(value: Any) -> int:
    """A 56-bit digest of `repr(value)`, the same in every process (unlike `hash` of a str)."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=7).digest(), "little")


BACKWARD = "backward (grad enabled, an input requiring grad)"
# the compared columns, in order; the first says whether the rank's own inputs passed validation
FIELDS = ("inputs valid", "check_ranks", "mode", "layout", "causal", "window", "softmax_scale", "cu_seqlens",
          "cu_seqlens_padded", "heads (Hq, Hkv, D, Dv)", "dtype", "mode options", "deterministic",
          "variants (softcap, chunk, sinks)", "sinks values", BACKWARD, "mask", "layout's mask")  # fmt: skip
# what to do, for the columns whose fix the closing sentence does not say
_FIXES = {
    "sinks values": "Sinks are a parameter that every rank of the CP group holds alike: initialise them from one seed "
                    "or load one checkpoint on every rank, and sum their gradient over the group as every replicated "
                    "weight's",
    BACKWARD: "A rank that records no backward (under torch.no_grad() or torch.inference_mode(), or none of q, k, v and "
              "sinks requiring grad) would leave the others waiting in the backward's collectives until the timeout: "
              "call attention under the same grad mode on every rank, with the same inputs requiring grad",
}  # fmt: skip


def _on_host(device: torch.device) -> bool:
    """Whether a tensor on `device` is read without a host-device synchronisation: the CPU's memory is the host's."""
    return device.type == "cpu"


class _SinksRead:
    """The sinks' values as the comparison reads them, as float64 (exact for every float dtype): on the host at every
    call; on an accelerator once per tensor, at the first call that passes it (see "Sinks: their values")."""

    def __init__(self) -> None:
        self.lock, self.by_tensor = threading.Lock(), WeakIdKeyDictionary()  # a dead tensor's entry goes with it

    def __call__(self, sinks: torch.Tensor | None) -> tuple[float, ...] | None:
        if sinks is None:
            return None
        if _on_host(sinks.device):
            return tuple(sinks.detach().double().tolist())
        with self.lock:
            held = self.by_tensor.get(sinks)
        if held is None:
            held = tuple(sinks.detach().double().tolist())  # (Hq,) to the host: one synchronisation, once per tensor
            with self.lock:
                self.by_tensor[sinks] = held
        return held


SINKS_READ = _SinksRead()
_NO_SINKS = _digest(None)  # the sinks values column of a call without sinks


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
        _digest((call.softcap, call.chunk, call.sinks is not None)),  # whether sinks are given
        _digest(SINKS_READ(call.sinks)),  # their values (None: none)
        int(call.backward),  # a rank without a backward would leave the others waiting in the backward's collectives
        0 if call.mask is None else call.mask.digest,  # its slices and total
        0 if b.mask is None else b.mask.digest,  # the mask the balanced layout placed the tokens by
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
    BACKWARD: lambda c: repr(bool(c)),
    "sinks values": lambda c: "none" if c == _NO_SINKS else f"digest {c:014x}",
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
        raise CPInputError(_disagreement(call, comm, [fields[i][0] for i in bad], [[row[i] for row in rows] for i in bad], who))
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


def _disagreement(call: CPCall, comm: Any, names: list[str], columns: list[list[int]], who: list[str]) -> str:
    """The message of a comparison whose columns `names` differ (`columns[i]`: every row's code of `names[i]`)."""
    lines = []
    for name, codes in zip(names, columns):
        groups: dict[int, list[str]] = {}
        for label, code in zip(who, codes):
            groups.setdefault(code, []).append(label)
        lines.append(f"  {name}: " + "; ".join(f"{', '.join(g)}: {_show(name, code)}" for code, g in groups.items()))
        if who[0] == "rank 0" and (name.startswith("cu_seqlens") or name == "sinks values" and _NO_SINKS not in codes):
            lines.append(_values(comm, call, name))  # every rank is here, and has values to show
    fixes = "".join(f"\n{_FIXES[name]}." for name in names if name in _FIXES)
    return ("the ranks of the CP group pass different arguments to cpref.attention, which would give wrong results "
            "without any error, or leave ranks waiting in collectives the others do not call:\n" + "\n".join(lines) + fixes
            + "\nPass the same mode, layout, causal, window, softmax_scale, softcap, chunk, mask, sinks (their values), "
            "cu_seqlens (and cu_seqlens_padded), head counts, dtype, options and check_ranks on every rank, under the "
            "same grad mode.")  # fmt: skip


def _values(comm: Any, call: CPCall, name: str) -> str:
    """Every rank's boundaries or sinks from their first difference with rank 0's (error path only)."""
    if name == "sinks values":  # as the float64 bits, back to floats to show them
        sinks = SINKS_READ(call.sinks) or ()
        rows = _every_rank(comm, [struct.unpack("<q", struct.pack("<d", x))[0] for x in sinks], call.device)
        return _from_first_difference(rows, name, "head", lambda c: repr(struct.unpack("<d", struct.pack("<q", c))[0]))
    values = call.bounds.real if name == "cu_seqlens" else call.bounds.padded
    return _from_first_difference(_every_rank(comm, list(values), call.device), f"{name} values", "entry", str)


def _every_rank(comm: Any, values: list[int], device: torch.device) -> list[list[int]]:
    """Every rank's list of ints, of any length: two more exchanges (the lengths, then the lists)."""
    lengths, _ = exchange(comm, [len(values)], device)
    longest = max(n for (n,) in lengths)
    rows, _ = exchange(comm, values + [-1] * (longest - len(values)), device)  # (P, longest), -1 past the end
    return [row[:n] for row, (n,) in zip(rows, lengths)]


def _from_first_difference(rows: list[list[int]], name: str, what: str, render: Callable[[int], str]) -> str:
    """Every rank's row from one entry before the first that differs from rank 0's, six entries of it at most."""
    first = min((next((i for i, (a, b) in enumerate(zip(row, rows[0])) if a != b), min(len(row), len(rows[0])))
                 for row in rows[1:]), default=0)  # fmt: skip
    start = max(first - 1, 0)

    def shown(row: list[int]) -> str:
        if not row:
            return "none"
        cut = row[start : start + 6]
        return ("[" if start == 0 else "[..., ") + ", ".join(map(render, cut)) + (", ...]" if start + 6 < len(row) else "]")

    return (f"    {name} from {what} {start} (first difference at {what} {first}): "
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


MOST_BYTES = 2000  # bytes of a message `agree` shares (one line; a longer one is cut)


def agree(comm: Any, error: Exception | None, kinds: tuple[type[Exception], ...] = (CPInputError,),
          cleanup: Callable[[], Any] | None = None) -> None:  # fmt: skip
    """Raise the same error on every rank of `comm` if any rank's `error` is not None (collective).

    A rank that finds its own inputs wrong must not raise alone: the others would wait for it in their next
    collective. So every rank validates, then calls this: the lowest rank that failed sends its message, and every
    rank raises it, as the last of `kinds` the error is an instance of (`cleanup` runs on every rank first). Returns
    where no rank failed, after one exchange.
    """
    text = "" if error is None else " ".join(str(error).split()).encode()[:MOST_BYTES].decode(errors="ignore")
    kind = 0 if error is None else max(i for i, k in enumerate(kinds) if isinstance(error, k))
    # (rank, kind) in one int, so that its min is the lowest failing rank's; a rank that did not fail sends `size`
    row = [(comm.rank if error is not None else comm.size) * len(kinds) + kind, len(text.encode())]
    # every row, or (where the group has no all-gather) the columns' min and max: each reads the same below
    rows = [row] if comm.size == 1 else exchange(comm, row, torch.device("cpu"))[0]
    first, kind = divmod(min(r[0] for r in rows), len(kinds))  # the lowest rank that failed, and its kind
    if first == comm.size:
        return
    if cleanup is not None:
        cleanup()
    width = max(r[1] for r in rows)
    if comm.size > 1:  # the failing rank's bytes; the others send zeros, so a column's max is its byte
        mine = text.encode().ljust(width, b"\0") if comm.rank == first else bytes(width)
        rows = exchange(comm, list(mine) or [0], torch.device("cpu"))[0]
        text = bytes(max(col) for col in zip(*rows)).rstrip(b"\0").decode(errors="ignore")
    cls = kinds[kind]
    if error is not None and type(error) is cls and str(error) == text:
        raise error
    raise cls(text) from error
