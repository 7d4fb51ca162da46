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

Shipped profiles live in this package's `profiles/` folder and are named by their file name
(`h100-sxm`, `ascend-910b`; `this-machine` once `python -m sim plan --calibrate` has measured it there);
a user's own is a path to a file written the same way. [`load_profile`][sim.plan.profile.load_profile]
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
    softcap_factor: float | None = None  # a soft-capped call's time over the same call's without (None: not measured)
    factor: float = 1.0  # every call's time multiplied by this: `softcap_factor` once the layers are soft-capped

    def call_seconds(self, call) -> float:
        """A kernel call's time: a banded (windowed) call's FLOPs at its band's rate where the profile has a `band`
        curve, any other call's FLOPs on the curve (`seconds`)."""
        if call.band and self.band and call.work:
            return self.factor * call.flops / _interpolated(self.band, call.width)
        return self.seconds(call.flops)

    def rate(self, flops: float) -> float:
        """FLOP/s of a call of `flops` FLOPs."""
        if not self.points:
            return self.peak * flops / (flops + self.half_size)
        return _interpolated(self.points, flops)

    def seconds(self, flops: float) -> float:
        """A call of `flops` FLOPs: `flops / rate(flops)` (`(flops + half_size) / peak` on the two-number curve), 0
        for a call with no work."""
        return self.factor * flops / self.rate(flops) if flops > 0 else 0.0

    def seconds_array(self, flops: np.ndarray, band: np.ndarray | None = None, width: np.ndarray | None = None) -> np.ndarray:
        """`call_seconds` of every call (`sim.plan.scale`'s thousands): `flops`, and where given whether each has a
        window (`band`) and its band's `width`; each distinct call priced once, by `seconds` or `call_seconds`'s
        band rate itself, so that both agree to the bit."""
        if band is None or not self.band or not band.any():
            sizes, where = np.unique(flops, return_inverse=True)
            return np.array([self.seconds(float(x)) for x in sizes])[where].reshape(flops.shape)
        keys = np.stack([flops.ravel(), np.where(band, width, -1).ravel().astype(np.float64)], axis=1)
        distinct, where = np.unique(keys, axis=0, return_inverse=True)
        priced = [self.seconds(f) if w < 0 or not f else self.factor * f / _interpolated(self.band, w) for f, w in distinct]
        return np.array(priced)[where.ravel()].reshape(flops.shape)


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
            raise CPInputError("profile 'this-machine' is not measured yet: run python -m sim plan --calibrate (about 15 "
                               "seconds) to write it")  # fmt: skip
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
        if "band_rows" in entry:
            raise CPInputError(f"profile {path}: compute.{dtype_name}.band_rows is no longer read: windowed calls take "
                               "a 'band' curve, [[width, tflops], ...]; run python -m sim plan --calibrate again, or "
                               "remove band_rows")  # fmt: skip
        factor = None
        if "softcap_factor" in entry:
            factor = _positive(entry["softcap_factor"], f"compute.{dtype_name}.softcap_factor", path,
                               "a soft-capped call's time over the same call's without, a positive number")  # fmt: skip
        compute[dtype_name] = Compute(peak * TFLOP, half * GFLOP, curve, band, factor)
    memory = _number(data, "memory_GB", path, "the device memory in GB")
    return Profile(str(data.get("name", path.stem)), str(data.get("description", "")), int(rpn), links, compute,
                   memory * GB, path)  # fmt: skip
