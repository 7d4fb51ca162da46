r"""Hardware profiles: the numbers the time model takes, one JSON file per machine.

A profile says how ranks sit on nodes, how fast each link level moves bytes, and how fast the
attention kernel computes, per dtype. Every number is a *measured or published achieved rate*,
not a line rate or a datasheet peak, and carries its source next to it in the file:

```json
{
  "name": "h100-sxm",
  "description": "one line: what machine and layout",
  "ranks_per_node": 8,
  "links": {
    "intra": {"bandwidth_GBps": 370, "latency_us": 3, "source": "where the figures come from"},
    "inter": {"bandwidth_GBps": 46, "latency_us": 10, "source": "..."}
  },
  "compute": {
    "bfloat16": {"peak_tflops": 335, "half_size_gflop": 20, "source": "..."}
  },
  "memory_GB": 80,
  "memory_source": "..."
}
```

* `bandwidth_GBps`: GB/s ($10^9$ bytes) one rank sends in one direction over that level in a large
  collective; `latency_us`: one message's time. A link level may add `send_recv_bandwidth_GBps`
  where one peer-to-peer stream reaches less than a collective that drives every link at once
  (the 910B's HCCS: one direct link per peer, no switch).
* `peak_tflops` and `half_size_gflop` are the kernel's throughput curve: a call of $F$ FLOPs
  (forward and backward counted as [`KernelCall.flops`][sim.plan.dry.KernelCall.flops] counts
  them) runs at $R(F) = R_\infty F / (F + F_{1/2})$, so it takes
  $F / R(F) = (F + F_{1/2}) / R_\infty$: small calls are slower, as if each carried $F_{1/2}$
  FLOPs more. A measured profile may give the curve as `"points": [[gflop, tflops], ...]` instead,
  interpolated linearly in the logarithm of the size (`this-machine` does: a CPU's rate keeps
  growing with the call's size, which two numbers do not follow).
* `by_work` (optional): the rate by the call's shape rather than its FLOPs, one curve per count of query heads,
  `{"heads": [[mpairs, tflops], ...], ...}`, `mpairs` the call's work per head
  ([`KernelCall.work`][sim.plan.dry.KernelCall]: visible query-key pairs, in millions). A CPU kernel computes
  head by head in tiles, so its rate follows the tiles one head's work makes (a forward and its backward, 2.5 times
  the FLOPs, run at one rate) and falls a little with more heads in one call: at one call's FLOPs, one head of
  16384 tokens runs a few percent faster than four heads of 8192 (`bench/results/this-machine.json`, measured by
  `bench/scaling.py`'s calibration). A call of $H_q$ heads and work $w$ takes each
  measured head count's rate at $w$ (linear in $\log w$, held at the ends), then the rate between the two nearest
  head counts (linear in $\log H_q$, held at the ends). Where given it prices every unwindowed call, in place of
  `points` and the two numbers (`this-machine` measures it at 1, 2 and 4 heads).
* `band` (optional): a windowed call's own curve, `[[width, tflops], ...]` by the band's width $W$,
  the most keys one of its rows sees ([`KernelCall.width`][sim.plan.dry.KernelCall]). A kernel
  computes a band in tiles of rows against the keys those rows see, so a windowed call's rate is set
  by its band's width, not by its size or its heads (`bench/window.py` measures both side by side
  here: the same window on 2k and 8k tokens, two heads and four; a narrower window). A banded call takes
  the rate interpolated linearly in $\log W$ (held at the ends); without a `band` curve it is priced
  by its FLOPs on the main curve, as an unwindowed call is.
* `softcap_factor` (optional): a soft-capped call's time (logits $c \tanh(S / c)$, Gemma 2) over
  the same call's without. Soft-capping changes no count, only the kernel's cost; a plan of
  soft-capped layers multiplies every call's time by it, and is refused on a profile without it
  (none is published: `this-machine` measures it).

* `datasheet` (optional, not read by the planner): the hardware's published peaks, each with its source
  (`bf16_dense_tflops`, `hbm_GBps`, `nvlink_GBps_both_directions`, `ib_Gbps_per_gpu`), beside which the
  achieved figures above are read: a test holds every achieved figure under its peak.

Shipped profiles live in this package's `profiles/` folder and are named by their file name: `h100-sxm`,
`a100-sxm`, `h200-sxm`, `b200-sxm` (eight GPUs a node over NVLink and NVSwitch, one InfiniBand NIC per GPU
across nodes; the attention kernel FlashAttention-2, which PyTorch ships and `CudaKernel` calls: on the B200 it
runs at about its H100 rate, and the file says what a Blackwell kernel would change) and `ascend-910b`;
`this-machine` once `python -m sim plan --calibrate` has measured it there (git ignores it; `--calibrate`
never writes over a published profile). Each figure's `source` gives the public measurement or datasheet it
comes from, with its address, or how it is derived from them. A user's own is a path to a file written the
same way; `python -m sim plan --ranks-per-node N` replaces a profile's node size. [`load_profile`][sim.plan.profile.load_profile]
refuses a file with a missing, non-numeric, zero or negative number, naming it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cpref.base.errors import CPInputError

__all__ = ["Link", "Compute", "Profile", "PROFILES", "load_profile", "profile_names"]

PROFILES = Path(__file__).resolve().parent / "profiles"
GB, US, TFLOP, GFLOP = 1e9, 1e-6, 1e12, 1e9


@dataclass(frozen=True)
class Link:
    """One link level: bytes per second one rank sends, a message's latency in seconds."""

    bandwidth: float
    latency: float
    send_recv_bandwidth: float

    def seconds(self, nbytes: float, messages: int = 1, send_recv: bool = False) -> float:
        """`messages` latencies plus `nbytes` at the level's rate (a ring shift's, for `send_recv`)."""
        return messages * self.latency + nbytes / (self.send_recv_bandwidth if send_recv else self.bandwidth)


def _interpolated(points: tuple[tuple[float, float], ...], x: float) -> float:
    """The `y` of `points` (`(x, y)` in increasing `x`) at `x`, linear in `log x` between them, held at the ends."""
    (x0, y0), (x1, y1) = points[0], points[-1]
    if x <= x0 or x >= x1:
        return y0 if x <= x0 else y1
    for (xa, ya), (xb, yb) in zip(points, points[1:]):
        if xa <= x <= xb:
            return ya + math.log(x / xa) / math.log(xb / xa) * (yb - ya)
    raise AssertionError("the points cover [x0, x1]")  # pragma: no cover


@dataclass(frozen=True)
class Compute:
    """The kernel's throughput curve in one dtype: `R(F) = peak F / (F + half_size)` FLOP/s, or, where `points` are
    given (`(FLOPs, FLOP/s)` measured, by size), their rate interpolated linearly in `log F` (held at the ends);
    `band`: windowed calls' rates by their band's width (`(keys, FLOP/s)`), interpolated the same way."""

    peak: float
    half_size: float
    points: tuple[tuple[float, float], ...] = ()
    band: tuple[tuple[float, float], ...] = ()
    by_work: tuple[tuple[float, tuple[tuple[float, float], ...]], ...] = ()  # ((heads, ((pairs, FLOP/s), ...)), ...)
    softcap_factor: float | None = None  # a soft-capped call's time over the same call's without (None: not measured)
    factor: float = 1.0  # every call's time multiplied by this: `softcap_factor` once the layers are soft-capped

    def call_seconds(self, call) -> float:
        """A kernel call's time: a banded (windowed) call's FLOPs at its band's rate where the profile has a `band`
        curve; any other call's at its shape's rate where it has `by_work` curves (`work_rate`), else on the curve
        (`seconds`)."""
        return self._priced(call.flops, call.width if call.band else -1, call.work, call.hq)

    def _priced(self, flops: float, width: float, work: float, heads: float) -> float:
        """`call_seconds` of a call of `flops` FLOPs, band width `width` (-1: no window), `work` pairs per head,
        `heads` query heads: the one formula both `call_seconds` and `seconds_array` take."""
        if width >= 0 and self.band and work:
            return self.factor * flops / _interpolated(self.band, width)
        if self.by_work and work:
            return self.factor * flops / self.work_rate(work, heads)
        return self.seconds(flops)

    def rate(self, flops: float) -> float:
        """FLOP/s of a call of `flops` FLOPs."""
        if not self.points:
            return self.peak * flops / (flops + self.half_size)
        return _interpolated(self.points, flops)

    def work_rate(self, work: float, heads: float) -> float:
        """FLOP/s of a call of `work` query-key pairs per head over `heads` query heads on the `by_work` curves: each
        head count's rate at `work` (linear in `log work`), then linear in `log heads` between the two nearest head
        counts, held at the ends of both."""
        return _interpolated(tuple((h, _interpolated(curve, work)) for h, curve in self.by_work), heads)

    def seconds(self, flops: float) -> float:
        """A call of `flops` FLOPs: `flops / rate(flops)` (`(flops + half_size) / peak` on the two-number curve), 0
        for a call with no work."""
        return self.factor * flops / self.rate(flops) if flops > 0 else 0.0

    def seconds_array(self, flops: np.ndarray, work: np.ndarray, heads: np.ndarray, band: np.ndarray | None = None,
                      width: np.ndarray | None = None) -> np.ndarray:  # fmt: skip
        """`call_seconds` of every call (`sim.plan.scale`'s thousands): their `flops`, `work` per head and query `heads`,
        and where given whether each has a window (`band`) and its band's `width` (all broadcast to `flops`' shape);
        each distinct call priced once, by `call_seconds`' own formula, so that both agree to the bit. A call is told
        apart only by what its price reads: its FLOPs, its band's width where the profile has a band curve, its work
        and heads where it has `by_work` curves."""
        shape = flops.shape
        banded = band is not None and bool(self.band) and bool(np.any(band))
        width = np.where(np.broadcast_to(band, shape), width if width is not None else 0, -1) if banded else None
        columns = [flops, width, *((work, heads) if self.by_work else ())]
        keys = [np.broadcast_to(c, shape).ravel().astype(np.float64) for c in columns if c is not None]
        distinct, where = _distinct(keys)
        n = len(distinct[0])
        full = [distinct[0], distinct[1] if banded else np.full(n, -1.0), *(distinct[-2:] if self.by_work else (np.zeros(n),) * 2)]
        priced = [self._priced(f, w, k, h) for f, w, k, h in zip(*(c.tolist() for c in full))]
        return np.array(priced)[where].reshape(shape)


def _distinct(keys: list[np.ndarray]) -> tuple[list[np.ndarray], np.ndarray]:
    """The distinct rows of the columns `keys` (each of length N) as columns, and each row's index among them
    (`np.unique(axis=0)`'s, by one `lexsort` rather than a sort of whole rows: thousands of times faster here)."""
    if len(keys) == 1:
        distinct, where = np.unique(keys[0], return_inverse=True)
        return [distinct], where.ravel()
    order = np.lexsort(keys[::-1])
    ordered = [k[order] for k in keys]
    new = np.ones(len(order), dtype=bool)
    new[1:] = np.any([k[1:] != k[:-1] for k in ordered], axis=0)
    where = np.empty(len(order), dtype=np.int64)
    where[order] = np.cumsum(new) - 1
    return [k[new] for k in ordered], where


@dataclass(frozen=True)
class Profile:
    """A machine: `ranks_per_node`, `links` by level (`intra`, `inter`), `compute` by dtype name, device memory."""

    name: str
    description: str
    ranks_per_node: int
    links: dict[str, Link]
    compute: dict[str, Compute]
    memory_bytes: float
    path: Path

    def kernel(self, dtype_name: str, softcap: bool = False) -> Compute:
        """The throughput curve of `dtype_name` (`"bfloat16"`, ...), refused by name where the profile has none; with
        `softcap`, every call's time multiplied by the profile's `softcap_factor`, refused where it has none."""
        if dtype_name not in self.compute:
            raise CPInputError(f"profile {self.name!r} ({self.path}) has no compute figures for {dtype_name}; it has "
                               f"{sorted(self.compute)}: add a 'compute.{dtype_name}' entry or choose one of those")  # fmt: skip
        compute = self.compute[dtype_name]
        if not softcap:
            return compute
        if compute.softcap_factor is None:
            raise CPInputError(f"profile {self.name!r} has no softcap_factor for {dtype_name}: how much slower its kernel "
                               "runs a soft-capped call is not known; measure it on that machine and add "
                               f"'compute.{dtype_name}.softcap_factor' (python -m sim plan --calibrate does for "
                               "this-machine), or plan without softcap")  # fmt: skip
        return dataclasses.replace(compute, factor=compute.softcap_factor)


def profile_names() -> list[str]:
    """The shipped profiles, by name."""
    return sorted(p.stem for p in PROFILES.glob("*.json"))


def _number(data: Any, path: str, where: Path, what: str) -> float:
    """The positive finite number at dotted `path` of `data`, else a `CPInputError` naming it."""
    value = data
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            raise CPInputError(f"profile {where}: {path} is missing; give {what}")
        value = value[key]
    return _positive(value, path, where, f"{what}, a positive number")


def _positive(value: Any, name: str, where: Path, what: str = "a positive number") -> float:
    """`value` as a float if it is a finite number > 0, else a `CPInputError` naming `name` and `what` to give."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise CPInputError(f"profile {where}: {name} is {value!r}; give {what}")
    return float(value)


def _curve(points: Any, name: str, pair: str, size: str, where: Path, unit: float) -> tuple[tuple[float, float], ...]:
    """`points` `[[x, tflops], ...]` as `((x * unit, FLOP/s), ...)`, refused by `name` unless every number is positive
    and `x` increases."""
    if not isinstance(points, list) or any(not isinstance(p, list) or len(p) != 2 for p in points):
        raise CPInputError(f"profile {where}: {name} must be [[{pair}], ...]")
    curve = tuple((_positive(x, f"{name}[{i}][0]", where) * unit, _positive(r, f"{name}[{i}][1]", where) * TFLOP)
                  for i, (x, r) in enumerate(points))  # fmt: skip
    if any(a[0] >= b[0] for a, b in zip(curve, curve[1:])):
        raise CPInputError(f"profile {where}: {name} must be in increasing {size}")
    return curve


def _by_work(curves: Any, name: str, where: Path) -> tuple[tuple[float, tuple[tuple[float, float], ...]], ...]:
    """`{"heads": [[mpairs, tflops], ...], ...}` as `((heads, ((pairs, FLOP/s), ...)), ...)` in increasing heads,
    refused by `name` unless every head count is a whole number > 0 and every curve a `_curve`."""
    if not isinstance(curves, dict):
        raise CPInputError(f"profile {where}: {name} must be {{\"heads\": [[mpairs, tflops], ...], ...}}")
    out = []
    for key, points in curves.items():
        if not key.isdigit() or int(key) < 1:
            raise CPInputError(f"profile {where}: {name} has the key {key!r}; give the query heads of the curve's "
                               "calls, a whole number >= 1")  # fmt: skip
        curve = _curve(points, f"{name}.{key}", "mpairs, tflops", "work", where, 1e6)
        if not curve:
            raise CPInputError(f"profile {where}: {name}.{key} is empty; give at least one [mpairs, tflops]")
        out.append((float(key), curve))
    return tuple(sorted(out))


def load_profile(name_or_path: str | Path) -> Profile:
    """The profile named `name_or_path` (a shipped one) or in that file.

    Raises:
        CPInputError: for an unknown name or a file that is not there, not JSON, or has a missing or
            non-positive number (each named, with what it should be).
    """
    path = Path(name_or_path)
    if not path.is_file():
        shipped = PROFILES / f"{name_or_path}.json"
        if not shipped.is_file() and str(name_or_path) == "this-machine":
            raise CPInputError("profile 'this-machine' is not measured yet: run python -m sim plan --calibrate (about a "
                               "minute) to write it")  # fmt: skip
        if not shipped.is_file():
            raise CPInputError(f"unknown profile {str(name_or_path)!r}: not a file, and not one of the shipped profiles "
                               f"{profile_names()}; give one of those or the path of a JSON file written as "
                               "sim.plan.profile describes")  # fmt: skip
        path = shipped
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CPInputError(f"profile {path}: cannot read it as JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CPInputError(f"profile {path}: holds {type(data).__name__}, not a JSON object")
    rpn = _number(data, "ranks_per_node", path, "the ranks (GPUs, NPUs) of one node")
    if rpn != int(rpn):
        raise CPInputError(f"profile {path}: ranks_per_node is {rpn:g}; give a whole number")
    links = {}
    for lv in ("intra", "inter"):
        bw = _number(data, f"links.{lv}.bandwidth_GBps", path, "GB/s one rank sends over the level")
        lat = _number(data, f"links.{lv}.latency_us", path, "one message's latency in microseconds")
        sr = bw
        if "send_recv_bandwidth_GBps" in data["links"][lv]:
            sr = _number(data, f"links.{lv}.send_recv_bandwidth_GBps", path, "GB/s of one ring shift")
        links[lv] = Link(bw * GB, lat * US, sr * GB)
    compute = {}
    if not isinstance(data.get("compute"), dict) or not data["compute"]:
        raise CPInputError(f"profile {path}: compute is missing; give one entry per dtype, e.g. 'bfloat16'")
    for dtype_name in data["compute"]:
        peak = _number(data, f"compute.{dtype_name}.peak_tflops", path, "the kernel's TFLOP/s on large calls")
        half = _number(data, f"compute.{dtype_name}.half_size_gflop", path, "the call size (GFLOP) at half that rate")
        entry = data["compute"][dtype_name]
        curve = _curve(entry.get("points", []), f"compute.{dtype_name}.points", "gflop, tflops", "call size", path, GFLOP)
        band = _curve(entry.get("band", []), f"compute.{dtype_name}.band", "width, tflops", "width", path, 1.0)
        by_work = _by_work(entry.get("by_work", {}), f"compute.{dtype_name}.by_work", path)
        if "band_rows" in entry:
            raise CPInputError(f"profile {path}: compute.{dtype_name}.band_rows is no longer read: windowed calls take "
                               "a 'band' curve, [[width, tflops], ...]; run python -m sim plan --calibrate again, or "
                               "remove band_rows")  # fmt: skip
        factor = None
        if "softcap_factor" in entry:
            factor = _positive(entry["softcap_factor"], f"compute.{dtype_name}.softcap_factor", path,
                               "a soft-capped call's time over the same call's without, a positive number")  # fmt: skip
        compute[dtype_name] = Compute(peak * TFLOP, half * GFLOP, curve, band, by_work, factor)
    memory = _number(data, "memory_GB", path, "the device memory in GB")
    return Profile(str(data.get("name", path.stem)), str(data.get("description", "")), int(rpn), links, compute,
                   memory * GB, path)  # fmt: skip
