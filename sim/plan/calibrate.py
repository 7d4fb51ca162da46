r"""`this-machine`: a profile measured here, by `python -m sim plan --calibrate`.

Two gloo processes of one thread each (as `bench/scaling.py` runs CP = 2) measure, in about a
minute here:

* **the link**: the fastest of several blocking ring shifts (`send_recv`) and all-gathers of
  float32 tensors from 4 KiB to 16 MiB; a least-squares line $t = \alpha + n / B$ through each gives
  the latency and the rate (the shift's as `send_recv_bandwidth_GBps`). One machine is one node:
  `ranks_per_node` is the processes' count and the inter-node link is given the intra-node figures
  (no rank reaches it).
* **the kernel**: `TorchKernel` forward and backward calls on single causal documents of 256 to
  8192 tokens (4 heads, head dim 64, float32), both processes computing at once, as CP ranks do;
  each call's rate (FLOPs as [`KernelCall.flops`][sim.plan.dry.KernelCall.flops] counts
  them, over its time) is a point of the curve, which the time model interpolates; a line
  (relative least squares) through each length's forward + backward pair,
  $t_f + t_b = (F_f + F_b + 2 F_{1/2}) / R_\infty$, gives the two-number summary beside it ($F_{1/2}$
  at least $10^{-6}$ GFLOP: on a busy machine the line can pass through the origin, and a profile's
  numbers are positive).
  The same documents with 1 and 2 heads as well (to 16384 tokens), each length's forward and backward as
  one pair, give the `by_work` curves the time model prices unwindowed calls by: the rate by the work one
  head's tiles make, per count of heads (a Ulysses call holds half the heads over twice the work per head
  of an all-gather call of the same FLOPs, and runs a few percent faster here).
  Windowed calls, one document of $\max(4096, 2W)$ tokens under causal windows of $W$ = 128 to
  4096 keys, give the `band` curve: each width's rate, forward and backward as one pair (every
  mode makes a backward call per forward call), by the band's width.
  Soft-capped calls (logits capped at 50) on documents of 1024 and 4096 tokens give `softcap_factor`:
  their forward + backward time over the same calls' without, both lengths together.

The file records what was measured where: the CPU, torch's version and the date, next to each
figure, as a published profile records its sources.

**A profile's kernel, checked on its device.** A published profile's curve comes from papers; on
the machine it describes, `python -m sim plan --check-kernel h100-sxm --device cuda --dtype bf16`
([`check_kernel`][sim.plan.calibrate.check_kernel]) times the device's default kernel
(`CudaKernel` on a GPU) on single causal documents with a model's heads (32 heads of 128 by
default, 1024 to 16384 tokens), forward and backward, and prints each call's measured time beside
the one the profile predicts for it, their ratio, and the line the measured pairs fit
($R_\infty$, $F_{1/2}$, as above) beside the profile's. `bench/gpu_check.sh` runs it. On a CPU
it runs `TorchKernel` the same way.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import platform
import time
from pathlib import Path

import torch

from sim.plan.dry import KernelCall
from sim.plan.profile import PROFILES

__all__ = ["calibrate", "fit_line", "kernel_points", "check_kernel"]

SIZES = [2**k for k in range(12, 25, 2)]  # bytes: 4 KiB .. 16 MiB
LENGTHS = [256, 512, 1024, 2048, 4096, 8192]
WIDTHS = [128, 256, 512, 1024, 2048, 4096]  # causal windows of W keys before each row: the band curve
CAPPED = [1024, 4096]  # soft-capped documents: softcap_factor
HEADS, DIM = 4, 64
BY_WORK = {1: LENGTHS + [16384], 2: LENGTHS + [16384], 4: LENGTHS}  # the by_work curves: heads -> document lengths


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """`(a, b)` of the line `y = a + b x` with the least *relative* squared error, `sum ((a + b x - y) / y)^2`
    (weights `1 / y^2`: a small call's or message's time counts as much as a large one's), `a` at least 1e-9."""
    w = [1 / y**2 for y in ys]
    sw, sx, sy = sum(w), sum(wi * x for wi, x in zip(w, xs)), sum(wi * y for wi, y in zip(w, ys))
    sxx, sxy = sum(wi * x * x for wi, x in zip(w, xs)), sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    b = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    return max((sy - b * sx) / sw, 1e-9), b


def _fastest(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        torch.distributed.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _timed(fn, device: torch.device, repeats: int = 3) -> float:
    """The fastest of `repeats` runs of `fn`, the device's queue drained before and after each (a GPU's calls are
    asynchronous)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def kernel_points(kernel, *, device: str | torch.device, dtype: torch.dtype, heads: int, dim: int,
                  lengths: list[int], repeats: int = 3, seed: int = 0) -> list[tuple[KernelCall, float]]:  # fmt: skip
    """`(call, seconds)` of `kernel`'s forward and backward on one causal document of each length, with `heads` heads of
    `dim` (the fastest of `repeats`, after one warm-up call each way), in `dtype` on `device`."""
    from cpref.kernels import Varlen

    device, out_points = torch.device(device), []
    g = torch.Generator(device=device).manual_seed(seed)
    for n in lengths:
        q, k, v, do = (torch.randn(n, heads, dim, generator=g, device=device, dtype=dtype) for _ in range(4))
        seqs, scale = Varlen([0, n]), dim**-0.5
        out, lse = kernel.forward(q, k, v, seqs, causal=True, scale=scale)
        forward = functools.partial(kernel.forward, q, k, v, seqs, causal=True, scale=scale)
        backward = functools.partial(kernel.backward, do, q, k, v, out, lse, seqs, causal=True, scale=scale)
        backward()  # warm, as the forward above
        t_f, t_b = _timed(forward, device, repeats), _timed(backward, device, repeats)
        work = seqs.work(True)
        out_points += [(KernelCall(d, work, n, n, heads, heads, dim, dim), t) for d, t in (("forward", t_f), ("backward", t_b))]
    return out_points


def check_kernel(profile: str, *, device: str = "cuda", dtype: str = "bfloat16", heads: int = 32, dim: int = 128,
                 lengths: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384), repeats: int = 3) -> dict:  # fmt: skip
    """The device's default kernel timed against `profile`'s curve in `dtype` (module docstring).

    Returns:
        `{"rows": [{"tokens", "direction", "gflop", "measured_s", "predicted_s", "ratio"}], "fit": {"peak_tflops",
        "half_size_gflop"}, "profile": {the same two of the profile}}`; `ratio` = measured / predicted.
    """
    from cpref.base.errors import CPInputError
    from cpref.kernels.cuda_kernel import default_kernel
    from sim.plan.profile import load_profile

    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    if dtype not in dtypes:
        raise CPInputError(f"dtype={dtype!r}: give one of {sorted(dtypes)}")
    if len(set(lengths)) < 2:
        raise CPInputError(f"lengths={list(lengths)}: give two lengths or more, through which the curve's line is fitted")
    compute = load_profile(profile).kernel(dtype)
    dt = dtypes[dtype]
    points = kernel_points(default_kernel(torch.device(device)), device=device, dtype=dt, heads=heads, dim=dim,
                           lengths=list(lengths), repeats=repeats)  # fmt: skip
    rows = [{"tokens": c.q_rows, "direction": c.direction, "gflop": c.flops / 1e9, "measured_s": t,
             "predicted_s": compute.call_seconds(c), "ratio": t / compute.call_seconds(c)} for c, t in points]  # fmt: skip
    pairs = [(points[i][0].flops + points[i + 1][0].flops, points[i][1] + points[i + 1][1]) for i in range(0, len(points), 2)]
    overhead, per_flop = fit_line([f for f, _ in pairs], [t for _, t in pairs])
    return {"rows": rows, "fit": {"peak_tflops": 1 / per_flop / 1e12, "half_size_gflop": overhead / 2 / per_flop / 1e9},
            "profile": {"peak_tflops": compute.peak / 1e12, "half_size_gflop": compute.half_size / 1e9}}


def _link(comm, nbytes: int) -> tuple[float, float]:
    """The fastest blocking ring shift and all-gather of `nbytes` bytes of float32."""
    x = torch.zeros(nbytes // 4)
    comm.send_recv(x), comm.all_gather(x)  # warm
    return _fastest(lambda: comm.send_recv(x)), _fastest(lambda: comm.all_gather(x))


def _calls(kernel, n: int, window: tuple[int, int], g: torch.Generator, softcap: float | None = None,
           heads: int = HEADS) -> tuple[KernelCall, float, float]:  # fmt: skip
    """`(forward call, forward seconds, backward seconds)` of one causal document of `n` tokens and `heads` heads
    under `window`."""
    from cpref.kernels import Varlen
    from sim.plan.dry import band_width

    q, k, v, do = (torch.randn(n, heads, DIM, generator=g) for _ in range(4))
    seqs, scale = Varlen([0, n]), DIM**-0.5
    capped = {} if softcap is None else {"softcap": softcap}
    out, lse = kernel.forward(q, k, v, seqs, causal=True, scale=scale, window=window, **capped)
    t_f = _fastest(lambda: kernel.forward(q, k, v, seqs, causal=True, scale=scale, window=window, **capped), 3)
    t_b = _fastest(lambda: kernel.backward(do, q, k, v, out, lse, seqs, causal=True, scale=scale, window=window,
                                           **capped), 3)  # fmt: skip
    band = window != (-1, -1)
    call = KernelCall("forward", seqs.work(True, window), n, n, heads, heads, DIM, DIM, band, n,
                      band_width(seqs, True, window) if band else 0)  # fmt: skip
    return call, t_f, t_b


def _backward(call: KernelCall) -> KernelCall:
    return dataclasses.replace(call, direction="backward")


def _measure_rank() -> dict:
    """Run on each of the two processes: link and kernel timings."""
    from cpref.comm import TorchComm
    from cpref.kernels import TorchKernel

    comm, kernel = TorchComm(), TorchKernel()
    times = [_link(comm, nbytes) for nbytes in SIZES]
    link = {"send_recv": [(n, t[0]) for n, t in zip(SIZES, times)], "all_gather": [(n, t[1]) for n, t in zip(SIZES, times)]}
    g, calls, banded = torch.Generator().manual_seed(comm.rank), [], []
    shaped = []  # (heads, work per head, forward + backward FLOPs, seconds)
    for heads, lengths in BY_WORK.items():
        for n in lengths:
            call, t_f, t_b = _calls(kernel, n, (-1, -1), g, heads=heads)
            shaped.append((heads, call.work, call.flops + _backward(call).flops, t_f + t_b))
            if heads == HEADS:
                calls += [(call.flops, t_f), (_backward(call).flops, t_b)]
    for w in WIDTHS:
        call, t_f, t_b = _calls(kernel, max(4096, 2 * w), (w, 0), g)
        banded.append((call.width, call.flops + _backward(call).flops, t_f + t_b))
    capped = []  # (plain, soft-capped) forward + backward seconds
    for n in CAPPED:
        times = [_calls(kernel, n, (-1, -1), g, softcap)[1:] for softcap in (None, 50.0)]
        capped.append(tuple(t_f + t_b for t_f, t_b in times))
    return {"link": link, "calls": calls, "shaped": shaped, "banded": banded, "capped": capped}


def calibrate(out: Path | str = PROFILES / "this-machine.json", nproc: int = 2) -> dict:
    """Measure this machine (module docstring), write the profile to `out`, return it as data."""
    from sim.tools.launch import launch

    ranks = launch(_measure_rank, nproc, check_calls=False, timeout=600.0)
    slowest = lambda key: [max(r["link"][key][i][1] for r in ranks) for i in range(len(SIZES))]  # noqa: E731
    where = (f"measured by python -m sim plan --calibrate on {datetime.date.today()}, {platform.processor() or platform.machine()}, "
             f"{nproc} gloo processes of 1 thread, torch {torch.__version__}")  # fmt: skip
    fits = {key: fit_line([float(s) for s in SIZES], slowest(key)) for key in ("send_recv", "all_gather")}
    (alpha, per_byte), (alpha_sr, per_byte_sr) = fits["all_gather"], fits["send_recv"]
    link = {"bandwidth_GBps": round(1 / per_byte / 1e9, 4), "send_recv_bandwidth_GBps": round(1 / per_byte_sr / 1e9, 4),
            "latency_us": round(max(alpha, alpha_sr) * 1e6, 3),
            "source": where + ": least squares over blocking all_gathers and ring shifts of 4 KiB to 16 MiB"}  # fmt: skip
    # each length's forward and backward call as one pair (every mode makes a backward call per forward call): a line
    # t_f + t_b = (F_f + F_b + 2 F_half) / R through the pairs, both processes computing at once (the slower's time)
    calls = [[max(r["calls"][i][1] for r in ranks) for i in range(len(ranks[0]["calls"]))], ranks[0]["calls"]]
    pairs = [(calls[1][i][0] + calls[1][i + 1][0], calls[0][i] + calls[0][i + 1]) for i in range(0, len(calls[0]), 2)]
    overhead, per_flop = fit_line([f for f, _ in pairs], [t for _, t in pairs])
    peak, overhead = 1 / per_flop, overhead / 2
    points = sorted([round(f / 1e9, 6), round(f / t / 1e12, 6)] for t, (f, _) in zip(calls[0], calls[1]))
    # each width's forward + backward pair at the slower process's time
    band = [[w, round(f / max(r["banded"][i][2] for r in ranks) / 1e12, 6)] for i, (w, f, _) in enumerate(ranks[0]["banded"])]
    # each (heads, length)'s forward and backward as one pair, at the slower process's time, by the work per head
    by_work: dict[str, list] = {}
    for i, (heads, work, f, _) in enumerate(ranks[0]["shaped"]):
        seconds = max(r["shaped"][i][3] for r in ranks)
        by_work.setdefault(str(heads), []).append([round(work / 1e6, 6), round(f / seconds / 1e12, 6)])
    # soft-capped over plain, both lengths together, each at the slower process's time
    slower = [[max(r["capped"][i][j] for r in ranks) for i in range(len(CAPPED))] for j in (0, 1)]
    softcap_factor = round(sum(slower[1]) / sum(slower[0]), 4)
    profile = {
        "name": "this-machine",
        "description": f"this machine: {nproc} processes of one thread on one node ({platform.node()})",
        "ranks_per_node": nproc,
        "links": {"intra": link, "inter": {**link, "source": "one node: no rank reaches another node; the intra figures"}},
        "compute": {"float32": {"peak_tflops": round(peak / 1e12, 6), "half_size_gflop": max(round(overhead * peak / 1e9, 6), 1e-6),
                                "points": points, "by_work": by_work, "band": band, "softcap_factor": softcap_factor,
                                "source": where + f": TorchKernel forward and backward, one causal document of "
                                          f"{LENGTHS[0]} to {LENGTHS[-1]} tokens, {HEADS} heads, head dim {DIM}; "
                                          "by_work: the same with "
                                          + ", ".join(f"{h} heads to {n[-1]}" for h, n in BY_WORK.items())
                                          + " tokens, each length's forward and backward as one pair; band: "
                                          f"one document under causal windows of {WIDTHS[0]} to {WIDTHS[-1]} keys; "
                                          f"softcap_factor: logits capped at 50 on {CAPPED} tokens over the same "
                                          "calls without"}},
        "memory_GB": round(_memory_bytes() / 1e9, 1),
        "memory_source": "this machine's physical memory (os.sysconf)",
    }  # fmt: skip
    Path(out).write_text(json.dumps(profile, indent=2) + "\n")
    return profile


def _memory_bytes() -> float:
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return 16e9
