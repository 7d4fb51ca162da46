r"""What the variants cost: learnable sinks and soft-capping on one rank, and what chunked attention saves at CP = 2.

What the variants of [Attention variants](variants.md) cost and save, in three parts, each measured
side by side in one run, nothing asserted:

1. **Sinks and soft-capping, one rank.** A packed batch of 16384 tokens (documents of 2048, 6144,
   4096 and 4096), $H_q = 8$, $H_{kv} = 2$, head dim 64, float32, forward + backward through
   `cpref.attention` on one rank (the ring of one: one kernel call, the mode's Function around
   it): without a variant; with learnable sinks; with soft-capping at 50 (the explicit kernel
   path, PyTorch's fused attention having no cap, with its elementwise passes compiled:
   [Soft-capping, compiled](softcap-native.md)); the same with PyTorch's passes instead
   (`TorchKernel(fast=False)`, what a machine runs where the loops cannot be built); and that
   explicit path without a variant. Timed in alternation, the fastest of the rounds kept. Goals:
   sinks at most 1.02 times the step without, soft-capping at most 1.3 times.
2. **Chunked attention at CP = 2.** One document of 32768 tokens, 4 heads, head dim 64, float32,
   `p2p` on the simulated cluster (two ranks, two threads), forward + backward, with
   `chunk=8192` (Llama 4's) against full causal, in the zigzag and contiguous layouts: the step's
   time, and the bytes each rank sent (from the trace). Goals: chunked at least 3 times faster;
   its bytes at most the chunks' halo, which here is none: every chunk lies whole on one rank.
3. **The zigzag window halo, counted.** `p2p` under a causal window of 512 keys, zigzag, $P = 4$,
   four documents of 8192: the rows the direct schedule sends forward (one shift to each of the
   two ranks that read them, [The ring under a sliding window](ring-window.md), from the trace),
   against what a one-way ring would carry for the same reads: the back chunks' halo passed on
   over the $P - 1$ ranks between, $m_1 + (P - 1)\, m_{P-1}$ rows.

Run it with `python -m bench.variants` (or `make bench`); `--quick` is a small run.

{{ results variants }}
"""

from __future__ import annotations

import os
import time

import torch

import cpref
from bench.kernel import fastest
from cpref.kernels import softcap_native
from sim.cluster.harness import run_attention, trace_split
from sim.cluster.simcluster import SimCluster
from sim.tools.cli import Parser

NAMES = ("plain", "sinks", "softcap", "softcap, PyTorch passes", "explicit path")


def one_rank_cases(lengths: list[int], heads=(8, 2, 64), seed: int = 0) -> dict:
    """Forward + backward closures of part 1 over one shared batch: each runs `cpref.attention` on one rank."""
    hq, hkv, d = heads
    g, T = torch.Generator().manual_seed(seed), sum(lengths)
    q, dout = (torch.randn(T, hq, d, generator=g) for _ in range(2))
    k, v = (torch.randn(T, hkv, d, generator=g) for _ in range(2))
    sharding = cpref.Sharding([0, *torch.tensor(lengths).cumsum(0).tolist()], cp_size=1)
    sinks = torch.linspace(-20.0, 20.0, hq).requires_grad_()

    def step(kernel=None, **variants):
        def run():
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            out = cpref.attention(*leaves, sharding, comm=cpref.SingleRank(), mode="p2p", kernel=kernel, **variants)
            out.backward(dout)

        return run

    explicit = cpref.TorchKernel(fast=False)
    steps = (step(), step(sinks=sinks), step(softcap=50.0), step(explicit, softcap=50.0), step(explicit))
    return dict(zip(NAMES, steps))


def per_float(n: int = 2**20, times: int = 20) -> dict[str, float]:
    """Nanoseconds per float32 of `tanh` (PyTorch's and the compiled loop's) and PyTorch's `exp2`, in place over a
    block of `n` floats (4 MiB: one of the explicit path's cache-sized blocks), `times` passes a sample."""
    a, b, c = (torch.randn(n).mul_(3).tanh_() for _ in range(3))  # values of tanh's range, as in a capped block
    fns = {"PyTorch tanh": lambda: [a.tanh_() for _ in range(times)],
           "PyTorch exp2": lambda: [torch.exp2(b, out=c) for _ in range(times)]}  # fmt: skip
    if softcap_native.library()[0] is not None:
        fns["compiled tanh"] = lambda: [softcap_native.cap_tanh(b) for _ in range(times)]
    best = fastest(fns, repeats=3)
    return {name: best[name] / (n * times) * 1e9 for name in fns}


def chunked_step(tokens: int, chunk: int | None, layout: str, heads: int = 4, dim: int = 64) -> tuple[float, list[int]]:
    """Part 2: `(seconds, bytes each rank sent)` of one forward + backward of `p2p` at CP = 2 on the simulated cluster."""
    g = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(tokens, heads, dim, generator=g) for _ in range(4))
    sharding = cpref.Sharding([0, tokens], cp_size=2, layout=layout)
    cluster = SimCluster(2, timeout=600.0)
    start = time.perf_counter()
    run_attention(q, k, v, dout, sharding, mode="p2p", cluster=cluster, chunk=chunk, check_ranks=False,
                  between=lambda comm: comm.barrier())  # fmt: skip
    seconds = time.perf_counter() - start
    return seconds, [sum(b for b, _ in trace_split(cluster.trace, r)) for r in range(2)]


def chunk_halo_bytes(tokens: int, chunk: int, layout: str, heads: int = 4, dim: int = 64) -> int:
    """The most bytes a rank's chunks need of the other rank's keys at CP = 2, forward + backward: the rows they
    read (the plan's shift sizes, which `tests/cp/test_chunked.py` holds to the oracle's mask), sent with K and V
    forward, again backward with their float32 dK and dV."""
    from cpref.modes.ring_window import build_window_ring_plan

    b = cpref.Sharding([0, tokens], cp_size=2, layout=layout).bounds
    rows = max(sum(build_window_ring_plan(b, 2, r, layout, True, (-1, -1), torch.device("cpu"), chunk=chunk).halo.sizes)
               for r in range(2))  # fmt: skip
    return 3 * rows * heads * 2 * dim * 4


def halo_rows(doc: int, window: int, P: int = 4) -> dict[str, int]:
    """Part 3: the rows of one K/V row size each rank sends forward under a causal window, direct, from the trace;
    and the plan's shift sizes `m_d` for the one-way relay's count."""
    from cpref.modes.ring_window import build_window_ring_plan

    sharding = cpref.Sharding([0, doc, 2 * doc, 3 * doc, 4 * doc], cp_size=P, layout="zigzag")
    q, k, v, dout = (torch.zeros(sharding.total, 1, 1, dtype=torch.float64) for _ in range(4))  # a row: 16 B of K/V
    _, cluster = run_attention(q, k, v, dout, sharding, mode="p2p", window=(window, 0), check_ranks=False,
                               between=lambda comm: comm.barrier())  # fmt: skip
    direct = max(trace_split(cluster.trace, r)[0][0] for r in range(P)) // 16
    plan = build_window_ring_plan(sharding.bounds, P, 0, "zigzag", True, (window, 0), torch.device("cpu"))
    sizes = dict(zip(plan.halo.shifts[1:], plan.halo.sizes[1:]))
    return {"direct": direct, "shifts": len(sizes), "m_1": sizes.get(1, 0), "m_back": sizes.get(P - 1, 0),
            "relay": sizes.get(1, 0) + (P - 1) * sizes.get(P - 1, 0), "relay_shifts": P - 1}  # fmt: skip


def verdict(ok: bool) -> str:
    return "met" if ok else "not met"


def report(r: dict) -> str:
    """The three parts' tables and their goals, as Markdown."""
    t, lines = r["one_rank"], ["| case | time | / plain |", "| --- | ---: | ---: |"]
    lines += [f"| {n} | {t[n] * 1e3:.1f} ms | {t[n] / t['plain']:.3f} |" for n in NAMES]
    sinks, cap = t["sinks"] / t["plain"], t["softcap"] / t["plain"]
    built = "yes" if softcap_native.library()[0] is not None else f"no ({softcap_native.library()[1]})"
    lines += ["", f"- sinks / plain: {sinks:.3f} (goal <= 1.02): {verdict(sinks <= 1.02)}",
              f"- softcap / plain: {cap:.2f} (goal <= 1.3): {verdict(cap <= 1.3)}, compiled loops: {built}; "
              f"softcap / explicit path: {t['softcap'] / t['explicit path']:.2f} (the cap on the path it takes)",
              f"- with PyTorch's passes instead (fast=False; where the loops cannot be built): "
              f"{t['softcap, PyTorch passes'] / t['plain']:.2f} of the plain step",
              "- per float32, in place over a 4 MiB block: " + ", ".join(f"{name} {ns:.2f} ns" for name, ns in
                                                                         r["per_float"].items()), ""]  # fmt: skip
    lines += ["| layout | full causal | chunked | full / chunked | bytes sent per rank, full | chunked |",
              "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for layout, c in r["chunked"].items():
        lines.append(f"| {layout} | {c['full'][0]:.2f} s | {c['chunked'][0]:.2f} s | {c['full'][0] / c['chunked'][0]:.1f} | "
                     f"{max(c['full'][1]):,} | {max(c['chunked'][1]):,} |")  # fmt: skip
    for layout, c in r["chunked"].items():
        speedup, sent = c["full"][0] / c["chunked"][0], max(c["chunked"][1])
        lines.append(f"- chunked speedup, {layout}: {speedup:.1f}x full causal's (goal >= 3): {verdict(speedup >= 3)}")
        lines.append(f"- chunked bytes, {layout}: {sent} (goal <= {c['halo']}, the chunks' halo): {verdict(sent <= c['halo'])}")
    h = r["halo"]
    lines += ["", f"- zigzag window halo, forward rows a rank sends: direct {h['direct']:,} in {h['shifts']} shifts "
              f"(m_1 = {h['m_1']:,}, m_P-1 = {h['m_back']:,}), a one-way relay {h['relay']:,} in {h['relay_shifts']} "
              f"shifts: {h['relay'] / max(h['direct'], 1):.1f}x"]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: a check that it runs")
    args = parser.parse_args(argv)
    lengths = [256, 768, 512, 512] if args.quick else [2048, 6144, 4096, 4096]
    tokens, chunk = (4096, 1024) if args.quick else (32768, 8192)
    title = (f"Attention variants: sinks and soft-capping on {sum(lengths)} packed tokens (one rank), chunked attention "
             f"(chunk {chunk}) on one {tokens}-token document at CP = 2, fp32, forward + backward, "
             f"{torch.get_num_threads()} threads (load average {os.getloadavg()[0]:.2f})")  # fmt: skip
    print(f"## {title}\n")
    one_rank = fastest(one_rank_cases(lengths), repeats=2, warmup=1, budget=20.0 if not args.quick else 0.0)
    chunked = {}
    for layout in ("zigzag", "contiguous"):
        full, cut = chunked_step(tokens, None, layout), chunked_step(tokens, chunk, layout)
        chunked[layout] = {"full": full, "chunked": cut, "halo": chunk_halo_bytes(tokens, chunk, layout)}
    results = {"title": title, "one_rank": one_rank, "chunked": chunked, "per_float": per_float(),
               "halo": halo_rows(8192, 512)}  # counted, not timed: the same at --quick  # fmt: skip
    print(report(results))
    print(f"(load average now {os.getloadavg()[0]:.2f})")
    return results


if __name__ == "__main__":
    main()
