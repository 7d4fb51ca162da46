"""Tables of the docs, computed at build time by running cpref on the simulated cluster.

Each table function takes no input and returns Markdown; `docs/gen_pages.py` appends it to a
page. The figures they show are measured from the cluster's trace; the build only renders
them. So are the rules of thumb (which mode moves less, from which `P`): computed from
`cpref.api.mode_costs`, forward and forward + backward, when the site is built, so that no
sentence can contradict the tables beside it. That the measured figures are the formulas the pages state is a test
(`tests/docs/test_tables.py`, over the very runs these tables render, beside the suite's own
`tests/cp/test_mode_costs.py`).
"""

from __future__ import annotations

from fractions import Fraction

import torch

import cpref
from cpref.api import mode_costs
from sim import summarize
from sim.cluster.harness import mode_trace as without_comparison
from sim.cluster.harness import run_attention, saved_bytes, trace_split

# The all-gather trace example: 2 documents of 16 and 48 tokens, P = 4, zigzag, GQA, float32.
TRACE_CU = torch.tensor([0, 16, 64])
TRACE_P, TRACE_HQ, TRACE_HKV, TRACE_D = 4, 4, 2, 16
TRACE = cpref.Sharding(TRACE_CU, cp_size=TRACE_P, layout="zigzag")  # the batch, sharded once for every table


def traced_run(mode: str):
    """One forward + backward of `mode` on the trace example (with its example options); the cluster."""
    T = int(TRACE_CU[-1])
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(T, TRACE_HQ, TRACE_D, generator=g) for _ in range(2))
    k, v = (torch.randn(T, TRACE_HKV, TRACE_D, generator=g) for _ in range(2))
    _, cluster = run_attention(q, k, v, dout, TRACE, mode=mode, check_ranks=False, between=lambda comm: comm.barrier(),
                               **cpref.MODES[mode].example_options(TRACE_P))  # fmt: skip
    return cluster


def all_gather_trace() -> str:
    """Run one forward + backward of KV all-gather CP; tabulate its collectives and bytes."""
    P = TRACE_P
    cluster = traced_run("all_gather")
    rows = [
        f"Measured on the simulated cluster: `cu_seqlens = {TRACE_CU.tolist()}`, `P = {P}`, "
        f"`Hq = {TRACE_HQ}`, `Hkv = {TRACE_HKV}`, `D = Dv = {TRACE_D}`, float32, one forward and backward "
        "(the default schedule; the barrier marks the end of the forward).",
        "",
        "| # | collective | shape per rank | bytes sent per rank | bytes received per rank |",
        "| --- | --- | --- | --- | --- |",
    ]
    rows += [
        f"| {i} | `{ev.op}` | `{tuple(ev.shape) if ev.shape else '-'}` | {ev.bytes_sent[0]} | {ev.bytes_recv[0]} |"
        for i, ev in enumerate(without_comparison(cluster))
    ]
    (forward, _), (backward, _) = trace_split(without_comparison(cluster), 0)
    summary = summarize(without_comparison(cluster))
    rows += [
        "",
        f"Per rank, the forward's two all-gathers move {forward} bytes: exactly the formula's "
        f"$(P-1) \\frac{{T}}{{P}} H_{{kv}} (D + D_v)$ elements of 4 bytes. The backward gathers K and V "
        f"again and reduce-scatters dK and dV: {backward} bytes, twice as much in float32 (with bf16 input "
        "the gathers move 2 bytes an element and the reduce-scatters still 4, see Precision). "
        f"Total per rank: {summary.bytes_sent[0]} bytes sent, {summary.bytes_recv[0]} received.",
    ]
    return "\n".join(rows)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


MEMORY_CU, MEMORY_P = torch.tensor([0, 64, 256]), (2, 4, 8)


def all_gather_saved(P: int, save: bool) -> tuple[int, int]:
    """`(measured, formula)`: bytes rank 0 of the all-gather mode saves for its backward, on the memory example."""
    hq, hkv, d = TRACE_HQ, TRACE_HKV, TRACE_D
    g = torch.Generator().manual_seed(0)
    q = torch.randn(256, hq, d, generator=g)
    k, v = (torch.randn(256, hkv, d, generator=g) for _ in range(2))
    batch = cpref.Sharding(MEMORY_CU, cp_size=P, layout="zigzag")
    kv_rows = cpref.get_thd_load_balanced_cp_metadata(MEMORY_CU, P, 0)["actual_seq_kvlen"][-1]
    got = saved_bytes(q, k, v, batch, mode="all_gather", check_ranks=False, save_gathered_kv=save)[0]
    want = mode_costs("all_gather", P=P, local_tokens=256 // P, heads=(hq, hkv, d, d), dtype=torch.float32,
                      save_gathered_kv=save, selected_kv_rows=kv_rows).saved_bytes  # fmt: skip
    return got, want


def all_gather_memory() -> str:
    """Bytes saved for backward per rank under both schedules, measured, next to the formulas."""
    hq, hkv, d = TRACE_HQ, TRACE_HKV, TRACE_D
    rows = [
        f"Measured with saved-tensor hooks on the simulated cluster: two documents of 64 and 192 tokens, "
        f"`Hq = {hq}`, `Hkv = {hkv}`, `D = Dv = {d}`, float32 (b = 4), zigzag, causal. Bytes per rank.",
        "",
        "| P | default, measured | default, formula | `save_gathered_kv`, measured | `save_gathered_kv`, formula |",
        "| --- | --- | --- | --- | --- |",
    ]
    for P in MEMORY_P:
        cells = []
        for save in (False, True):
            cells += [str(n) for n in all_gather_saved(P, save)]
        rows.append(f"| {P} | " + " | ".join(cells) + " |")
    rows += ["", "The default falls as $1/P$; keeping the selected K/V does not: it is more than the whole stream's K/V."]
    return "\n".join(rows)


def mode_trace(mode: str):
    """A table function: one forward + backward of a mode, its collectives and bytes per rank."""

    def table() -> str:
        extra = cpref.MODES[mode].example_options(TRACE_P)
        P = TRACE_P
        cluster = traced_run(mode)
        (fwd, _), (bwd, _) = trace_split(without_comparison(cluster), 0)
        args = ", ".join(f"`{key}={value}`" for key, value in extra.items())
        rows = [
            f"Measured on the simulated cluster: `cu_seqlens = {TRACE_CU.tolist()}`, `P = {P}`{', ' + args if args else ''}, "
            f"`Hq = {TRACE_HQ}`, `Hkv = {TRACE_HKV}`, `D = Dv = {TRACE_D}`, float32, zigzag, causal: the collectives "
            "rank 0 takes part in, in order.",
            "",
            "| # | pass | collective | group (global ranks) | shape per rank | dtype | bytes sent by rank 0 |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        cut = [ev.op for ev in without_comparison(cluster)].index("barrier")
        mine = [(i, ev) for i, ev in enumerate(without_comparison(cluster)) if 0 in ev.group and ev.op not in ("barrier", "split")]
        for n, (i, ev) in enumerate(mine):
            rows.append(f"| {n} | {'forward' if i < cut else 'backward'} | `{ev.op}` | {ev.group} | `{tuple(ev.shape)}` | "
                        f"{str(ev.dtype).replace('torch.', '')} | {ev.bytes_sent[ev.group.index(0)]} |")  # fmt: skip
        rows += ["", f"Per rank: {fwd} bytes forward and {bwd} backward, exactly what the mode's cost formulas (this "
                 "page's table) give; the test suite checks that they agree, on this very run."]  # fmt: skip
        return "\n".join(rows)

    return table


# A transformer layer of a Llama-3-8B-like model, and an MHA one, at 128K tokens in bf16.
REFERENCE = {"GQA: Hq = 32, Hkv = 8, D = Dv = 128": (32, 8, 128, 128), "MHA: Hq = Hkv = 16, D = Dv = 128": (16, 16, 128, 128)}
REFERENCE_T = 131072


def _mode_header(mode: str) -> str:
    extra = cpref.MODES[mode].example_options(2)  # what the table runs it with (at every even P)
    return mode + "".join(f", {name} = {value}" for name, value in extra.items())


def which_mode() -> str:
    """Per-rank traffic and memory of every mode at P = 2 .. 16 for two reference layers (from cpref.modes.costs)."""
    out = []
    for title, heads in REFERENCE.items():
        out += [f"**{title}**, T = {REFERENCE_T:,} tokens, bf16; MiB per rank and layer, forward + backward "
                "traffic / saved for backward (`-`: the heads cannot be split so).", "",
                "| P | " + " | ".join(_mode_header(m) for m in cpref.MODES) + " |",
                "| --- |" + " --- |" * len(cpref.MODES)]  # fmt: skip
        for P in (2, 4, 8, 16):
            cells = []
            for mode, spec in cpref.MODES.items():
                try:
                    c = mode_costs(mode, P=P, local_tokens=REFERENCE_T // P, heads=heads, dtype=torch.bfloat16,
                                   **spec.example_options(P))  # fmt: skip
                except cpref.CPInputError:  # the heads cannot be split so
                    cells.append("-")
                    continue
                cells.append(f"{_mib(c.forward_bytes + c.backward_bytes)} / {_mib(c.saved_bytes)}")
            out.append(f"| {P} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


# The rules of thumb: one layer of 8 key/value heads, D = Dv = 128, at each GQA group size G = Hq / Hkv.
RULE_HKV, RULE_GROUPS, RULE_P, RULE_T = 8, (1, 2, 4, 8), (2, 4, 8, 16, 32, 64), 131072


def traffic_ratios(G: int, P: int, dtype: torch.dtype = torch.bfloat16, hkv: int = RULE_HKV) -> tuple[Fraction, Fraction] | None:
    """`a2a`'s bytes per rank over `all_gather`'s: `(forward, forward + backward)`; None where `a2a` cannot split the heads."""
    heads = (G * hkv, hkv, 128, 128)
    try:
        a2a, ag = (mode_costs(m, P=P, local_tokens=RULE_T // P, heads=heads, dtype=dtype, **cpref.MODES[m].example_options(P))
                   for m in ("a2a", "all_gather"))  # fmt: skip
    except cpref.CPInputError:
        return None
    return (Fraction(a2a.forward_bytes, ag.forward_bytes),
            Fraction(a2a.forward_bytes + a2a.backward_bytes, ag.forward_bytes + ag.backward_bytes))  # fmt: skip


def rule_coefficients(dtype: torch.dtype = torch.bfloat16) -> tuple[Fraction, Fraction]:
    """`(c_forward, c_total)`: without replicated heads `a2a` moves `c (G + 1) / P` times `all_gather`'s bytes.

    Read from the cost formulas at `G = 1, P = 2` (`P` divides `Hkv`); that the same `c` holds at every
    `G` and every `P` dividing `Hkv` is `tests/docs/test_tables.py`'s to check.
    """
    G, P = 1, 2
    forward, total = traffic_ratios(G, P, dtype)
    return forward * P / (G + 1), total * P / (G + 1)


def _times(c: Fraction) -> str:
    """`c (G + 1) / P` in TeX."""
    top = "G + 1" if c.numerator == 1 else f"{c.numerator}(G + 1)"
    return f"\\frac{{{top}}}{{{'' if c.denominator == 1 else c.denominator}P}}"


def _crossover(c: Fraction) -> str:
    """`P > c (G + 1)` in TeX."""
    if c == 1:
        return "P > G + 1"
    top = "G + 1" if c.numerator == 1 else f"{c.numerator}(G + 1)"
    return f"P > \\frac{{{top}}}{{{c.denominator}}}" if c.denominator != 1 else f"P > {top}"


def least_of_all(G: int, P: int) -> bool:
    """Whether `a2a` moves the fewest bytes forward + backward of every mode (with the tables' options)."""
    total = {}
    for mode, spec in cpref.MODES.items():
        try:
            c = mode_costs(mode, P=P, local_tokens=RULE_T // P, heads=(G * RULE_HKV, RULE_HKV, 128, 128),
                           dtype=torch.bfloat16, **spec.example_options(P))  # fmt: skip
        except cpref.CPInputError:
            continue
        total[mode] = c.forward_bytes + c.backward_bytes
    return "a2a" in total and total["a2a"] == min(total.values())


def a2a_moves_less(G: int, P: int, which: int) -> bool:
    """Whether `a2a` moves fewer bytes than `all_gather`: forward (`which = 0`), forward + backward (1)."""
    return traffic_ratios(G, P)[which] < 1


def _from_p(G: int, holds, *args) -> str:
    """The least `P` of `RULE_P` from which `holds(G, P, *args)`, at every larger `P` that splits the heads too."""
    valid = [P for P in RULE_P if traffic_ratios(G, P) is not None]
    first = next((P for P in valid if holds(G, P, *args)), None)
    if first is None:
        return f"none up to {valid[-1]}"
    return str(first) if all(holds(G, P, *args) for P in valid if P > first) else f"{first}, not at every larger P"


def _as(x: float) -> str:
    return "as much as" if x == 1 else f"{x:g} times"


def ulysses_rule() -> str:
    """The rules of thumb of the mode pages, recomputed from `mode_costs` when the site is built: forward, and forward +
    backward."""
    (c_fwd, c_tot), (_, c_tot32) = rule_coefficients(torch.bfloat16), rule_coefficients(torch.float32)
    costs = {m: mode_costs(m, P=2, local_tokens=RULE_T // 2, heads=(RULE_HKV, RULE_HKV, 128, 128), dtype=torch.bfloat16)
             for m in ("all_gather", "p2p", "a2a")}  # fmt: skip
    ag, ring, a2a = costs["all_gather"], costs["p2p"], costs["a2a"]
    block = (RULE_T // 2) * RULE_HKV * 256 * 4  # one rank's K/V rows in float32
    rows = [
        "Recomputed from the cost formulas above when this page was built, with $D = D_v$ and no replicated "
        "heads ($P$ divides $H_{kv}$), $G = H_q / H_{kv}$, in bf16:",
        "",
        f"* **Forward only**, `a2a` moves ${_times(c_fwd)}$ times `all_gather`'s bytes, so less once ${_crossover(c_fwd)}$.",
        f"* **Forward + backward**, ${_times(c_tot)}$ times, so less once ${_crossover(c_tot)}$: the backward of "
        f"`all_gather` moves {_as(ag.backward_bytes / ag.forward_bytes)} its forward (K and V gathered again, dK and "
        f"dV reduce-scattered in float32), that of `a2a` {_as(a2a.backward_bytes / a2a.forward_bytes)} its own. In "
        f"float32, where the reduce-scatters' 4 bytes are the input's, ${_times(c_tot32)}$.",
        f"* `p2p` moves {_as(ring.forward_bytes / ag.forward_bytes)} `all_gather` forward, and "
        f"{'one' if ring.backward_bytes - ag.backward_bytes == block else (ring.backward_bytes - ag.backward_bytes) / block} "
        "block more backward (one rank's K/V, in float32).",
        "",
        f"With replicated heads ($P > H_{{kv}}$) `a2a` moves more than these say. For a layer of "
        f"$H_{{kv}} = {RULE_HKV}$, $D = D_v = 128$, bf16: `a2a`'s bytes over `all_gather`'s, forward / forward + "
        "backward (`-`: the heads cannot be split so); the least `P` from which `a2a` moves less than `all_gather`, and "
        "from which it moves the least of the four modes, forward + backward.",
        "",
        "| G | " + " | ".join(f"P = {P}" for P in RULE_P[:4]) + " | less from P =, forward only | forward + backward | least of all from P = |",
        "| --- |" + " --- |" * (len(RULE_P[:4]) + 3),
    ]
    for G in RULE_GROUPS:
        cells = []
        for P in RULE_P[:4]:
            r = traffic_ratios(G, P)
            cells.append("-" if r is None else f"{float(r[0]):.3g} / {float(r[1]):.3g}")
        rows.append(f"| {G}{' (MHA)' if G == 1 else ''} | " + " | ".join(cells) + f" | {_from_p(G, a2a_moves_less, 0)} | "
                    f"{_from_p(G, a2a_moves_less, 1)} | {_from_p(G, least_of_all)} |")
    return "\n".join(rows)


WINDOW_DOCS, WINDOW_P = [8192, 4096, 2048], 4  # three documents, 14336 tokens over 4 ranks


def window_balance() -> str:
    """Max / mean of the exact causal work per rank, contiguous vs zigzag, as the window shrinks."""
    rows = [f"Exact causal work per rank (visible scores), max / mean over the ranks: documents of "
            f"{', '.join(map(str, WINDOW_DOCS))} tokens, `P = {WINDOW_P}`, `window=(w, 0)`.", "",
            "| w | contiguous | zigzag |", "| --- | --- | --- |"]  # fmt: skip
    cu = torch.tensor([0, *torch.tensor(WINDOW_DOCS).cumsum(0).tolist()])
    for w in (None, 4096, 1024, 256, 64):
        cells = []
        for layout in ("contiguous", "zigzag"):
            sharding = cpref.Sharding(cu, cp_size=WINDOW_P, layout=layout)
            work = [sharding.attention_work(r, exact=True, window=(-1, -1) if w is None else (w, 0)) for r in range(WINDOW_P)]
            cells.append(f"{max(work) * WINDOW_P / sum(work):.3f}")
        rows.append(f"| {'none' if w is None else w} | " + " | ".join(cells) + " |")
    chunks = f"{min(WINDOW_DOCS) // WINDOW_P} to {max(WINDOW_DOCS) // WINDOW_P}"  # contiguous chunks; zigzag's are half
    rows += ["", f"Once the window is much smaller than a chunk (here {chunks} tokens), every rank does about "
             "`(w + 1) T / P` and contiguous is balanced on its own; zigzag still helps while the window is "
             "comparable to the chunks, and costs the ring a second halo, from the rank after (see the ring's window page)."]  # fmt: skip
    return "\n".join(rows)


def window_traffic() -> str:
    """Per-rank bytes of the ring with a causal window against the ring without one, from the plans."""
    from cpref.api import mode_costs
    from cpref.modes.ring_window import build_window_ring_plan

    heads, T = (32, 8, 128, 128), 32768
    rows = [f"One document of {T:,} tokens, a GQA layer (`Hq = 32`, `Hkv = 8`, `D = Dv = 128`), bf16: MiB per rank, "
            "forward + backward, of `p2p` with `window=(w, 0)` against full causal.", "",
            "| P | layout | full causal | w = 4095 | w = 1023 | w = 255 |", "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    sent = {}  # (P, layout, w) -> bytes
    for P in (4, 8):
        for layout in ("contiguous", "zigzag"):
            sharding = cpref.Sharding([0, T], cp_size=P, layout=layout)
            full = mode_costs("p2p", P=P, local_tokens=T // P, heads=heads, dtype=torch.bfloat16)
            cells = [_mib(full.forward_bytes + full.backward_bytes)]
            for w in (4095, 1023, 255):
                plan = build_window_ring_plan(sharding.bounds, P, 0, layout, True, (w, 0), torch.device("cpu"))
                c = mode_costs("p2p", P=P, local_tokens=T // P, heads=heads, dtype=torch.bfloat16, halo_sizes=plan.halo.sizes)
                sent[P, layout, w] = c.forward_bytes + c.backward_bytes
                cells.append(_mib(sent[P, layout, w]))
            rows.append(f"| {P} | {layout} | " + " | ".join(cells) + " |")
    ratio = {(P, w): sent[P, "zigzag", w] / sent[P, "contiguous", w] for P, layout, w in sent}
    within = sorted({r for (P, w), r in ratio.items() if w < T // (2 * P)})  # the window inside one zigzag chunk
    beyond = [f"{r:.3g} times at P = {P}, w = {w}" for (P, w), r in sorted(ratio.items()) if w >= T // (2 * P)]
    times = ("twice" if within == [2] else f"{within[0]:.3g} times") if len(within) == 1 else \
        f"{within[0]:.3g} to {within[-1]:.3g} times"
    rows += ["", "Contiguous: one shift, a halo of `w` rows from the left neighbour, and its dK/dV back. Zigzag: two, "
             "the front chunk's halo from the rank before and the back chunk's from the rank after (`P - 1` ranks "
             f"back), so {times} the bytes while the window is shorter than a zigzag chunk (`T / 2P` tokens)"
             + (f", and more where it reaches further ({'; '.join(beyond)})" if beyond else "")
             + "; with a window much smaller than a chunk, contiguous is both balanced and cheapest."]  # fmt: skip
    return "\n".join(rows)


def mode_declarations() -> str:
    """Every mode as it declares itself: collectives, options (default, what it does), checks."""
    rows = ["| mode | file | collectives | options | own checks |", "| --- | --- | --- | --- | --- |"]
    for name, spec in cpref.MODES.items():
        options = "<br>".join(f"`{o.name}` (default `{o.default!r}`): {o.doc}" for o in spec.options) or "none"
        check = f"`{spec.check.__name__}`" if spec.check else "none"
        file = f"`{spec.run.__module__.replace('.', '/')}.py`"
        rows.append(f"| `{name}` | {file} | {', '.join(f'`{c}`' for c in sorted(spec.collectives))} | {options} | {check} |")
    return "\n".join(rows)


# page -> [(section title, table function)]
def train_output() -> str:
    """What `python -m sim train --model llama --cp 4 --mode p2p --layout zigzag --steps 2` prints, run now."""
    import contextlib
    import io

    from sim.tools.train import main

    argv = ["--model", "llama", "--cp", "4", "--mode", "p2p", "--layout", "zigzag", "--steps", "2"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    if status:
        raise RuntimeError(f"sim train {' '.join(argv)} exited {status}: {err.getvalue()}")
    return (f"`python -m sim train {' '.join(argv)}`, run when this site was built (tokens per second are this "
            f"machine's):\n\n```text\n{err.getvalue().strip()}\n{out.getvalue().strip()}\n```")


def planner_output() -> str:
    """`python -m sim plan` on a 128k-token packed batch at P = 16 on the H100 profile, run at build."""
    import contextlib
    import io

    from sim.tools.plan import main

    argv = ["--lengths", "32768,16384x3,8192x6", "--heads", "32,8,128", "--dtype", "bf16", "--cp", "16",
            "--profile", "h100-sxm", "--layouts", "zigzag,balanced", "--window", "4096", "--top", "6", "--layers",
            "full=8,window=24"]  # fmt: skip
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    if status:
        raise RuntimeError(f"sim plan {' '.join(argv)} exited {status}: {err.getvalue()}")
    text = out.getvalue().strip().replace("\n## ", "\n#### ")
    return (f"`python -m sim plan {' '.join(argv)}` (Llama-3-8B-like heads, 128k tokens in ten documents, two nodes of "
            f"eight H100s, a model of 8 full and 24 windowed layers), run when this site was built:\n\n{text}")


def study_winners() -> str:
    """The winner of every P of `sim.plan.study`, per profile and model, and what decided each crossover."""
    from sim.plan.study import MODELS, PROFILES, curves

    runs = {(prof, model): curves(prof, heads) for prof in PROFILES for model, heads in MODELS.items()}
    first = next(iter(runs.values()))
    lines = ["| P | " + " | ".join(f"{prof}, {model}" for prof, model in runs) + " |",
             "| ---: |" + " --- |" * len(runs)]  # fmt: skip
    for i, P in enumerate(first.Ps):
        cells = []
        for c in runs.values():
            best = next(p for p in c.points[c.winners[i]] if p is not None and p.P == P)
            cells.append(f"{best.name} ({best.step * 1e3:.1f} ms)")
        lines.append(f"| {P} | " + " | ".join(cells) + " |")
    lines += ["", "Each crossover, with the planner's deciding term at the larger P:", ""]
    for (prof, model), c in runs.items():
        for p0, p1, w0, w1 in c.crossovers:
            lines.append(f"* {prof}, {model}: {w0} at {p0} ranks, {w1} at {p1}: {c.decided_by[c.Ps.index(p1)]}")
    return "\n".join(lines)


def study_single_documents() -> str:
    """One long document instead of the packed batch: each mode's best step at a few P (H100s, 8B-like heads)."""
    from sim.plan.study import MODELS, MODES_SHOWN, best_per_mode

    lines = ["| document | P | " + " | ".join(MODES_SHOWN) + " |", "| --- | ---: |" + " ---: |" * len(MODES_SHOWN)]
    for n in (131072, 1048576):
        for P in (8, 16, 64, 128):
            best = best_per_mode((n,), MODELS["Llama-3-8B-like"], "h100-sxm", P)
            cells = [f"{best[m].step * 1e3:.1f} ms" if m in best else "-" for m in MODES_SHOWN]
            size = f"{n // 1024}k" if n < 2**20 else f"{n // 2**20}M"
            lines.append(f"| {size} tokens | {P} | " + " | ".join(cells) + " |")
    return ("The planner on one document of 128k and of 1M tokens, the H100 profile, Llama-3-8B-like heads (each "
            "mode's best candidate; `-`: none runs):\n\n" + "\n".join(lines))


def study_whole_documents() -> str:
    """Each mode's best in the chunked layouts against its best in stream or balanced, at 8 and 16 ranks."""
    from sim.plan.study import MODELS, MODES_SHOWN, documents_kept_whole

    lines = ["| P | mode | best in contiguous or zigzag | best in stream or balanced |", "| ---: | --- | --- | --- |"]
    for P in (8, 16):
        pairs = documents_kept_whole("h100-sxm", MODELS["Llama-3-8B-like"], P)
        for mode in MODES_SHOWN:
            if mode in pairs:
                a, b = pairs[mode]
                lines.append(f"| {P} | {mode} | {a.name} ({a.step * 1e3:.1f} ms) | {b.name} ({b.step * 1e3:.1f} ms) |")
        lines.append(f"| {P} | **winner** | **{pairs['winner'][0].name}** ({pairs['winner'][0].step * 1e3:.1f} ms) | |")
    return ("The planner with every layout on the study's batch (the H100 profile, Llama-3-8B-like heads), the stream "
            "and balanced candidates dry-run on every rank:\n\n" + "\n".join(lines))


TABLES = {
    "mode-study.md": [("The winner at every P", study_winners), ("One long document", study_single_documents),
                      ("Documents kept whole, at 8 and 16 ranks", study_whole_documents)],
    "planner.md": [("An example: 128k tokens on two H100 nodes", planner_output)],
    "train.md": [("What the command printed", train_output)],
    "mode-spec.md": [("The modes, as they declare themselves", mode_declarations)],
    "layout.md": [("Balance under a sliding window", window_balance)],
    "ring-window.md": [("Traffic per rank, against full causal", window_traffic)],
    "all-gather.md": [("Communication, measured", all_gather_trace), ("Memory, measured", all_gather_memory)],
    "ring.md": [("Communication, measured", mode_trace("p2p"))],
    "ulysses.md": [("Communication, measured", mode_trace("a2a"))],
    "hierarchical.md": [("Communication, measured", mode_trace("a2a+p2p"))],
    "which-mode.md": [("Per-rank costs of two reference layers", which_mode), ("Rules of thumb, recomputed", ulysses_rule)],
}
