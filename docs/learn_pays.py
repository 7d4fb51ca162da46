r"""Learn 9, "When CP pays": its figures and numbers, from cpref's cost model and the planner.

* `pays_memory`: the activations a model keeps for the backward against the sequence length, at
  CP = 1 to 16. Attention's share is what cpref's cost model counts (`mode_costs(...).saved_bytes`);
  the rest of the layer is a stated formula (`other_bytes`); CP shards both by tokens.
* `pays_timeline`: one rank's forward and backward in every mode, played by the planner's time model
  ([`sim.plan.model.played`][sim.plan.model.played]) from the mode's own code run dry
  ([`sim.plan.dry`][sim.plan.dry]) on the `h100-sxm` profile; below it, the overlap condition: a
  zigzag ring step's kernel time against its K/V block's transfer, by block size, on the H100 profile
  and on this machine's measured one (`bench/results/this-machine.json`).
* `pays_where`: the planner's step at CP = P against one device's step over P (short documents, narrow
  windows, many K/V heads).

`TEXT` holds the page's numbers; every one is computed here, none typed.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

import cpref
from cpref.api import mode_costs
from docs import figures as base
from sim.plan import plan
from sim.plan.dry import KernelCall, dry_run
from sim.plan.model import played
from sim.plan.profile import Profile, load_profile

plt, WIDTH, rank_color = base.plt, base.WIDTH, base.rank_color

HEADS = (32, 8, 128, 128)  # (Hq, Hkv, D, Dv): a Llama-3-8B-like layer, the which-mode page's GQA layer
HIDDEN, FFN, LAYERS = 4096, 14336, 32  # its model: hidden size h, MLP width F, layers L
BF16 = torch.bfloat16
GB = 1e9  # bytes: profiles give memory in GB
THIS_MACHINE = Path(__file__).resolve().parents[1] / "bench" / "results" / "this-machine.json"

# ---------------------------------------------------------------------------------------------------------------
# Memory: what a model keeps for the backward, by sequence length and CP size.

MEM_T = tuple(2**k for k in range(12, 21))  # 4k to 1M tokens
MEM_P = (1, 2, 4, 8, 16)


def attention_bytes(T: int, P: int) -> int:
    """Bytes one layer's attention saves for the backward on one rank of P, T tokens (cost model: `all_gather`
    saves its rank's q, k, v, out and lse, the one-device tensors cut in P)."""
    return mode_costs("all_gather", P=P, local_tokens=T // P, heads=HEADS, dtype=BF16).saved_bytes


def other_bytes(tokens: int) -> int:
    """The rest of a Llama block's saved activations for `tokens` tokens, in bf16: the two RMSNorms' inputs and
    outputs (the projections' inputs), 4 h values a token, and the SwiGLU MLP's four F-wide tensors (gate, its
    SiLU, up, their product). Every one is per token, so CP cuts it in P as it cuts the tokens."""
    return tokens * BF16.itemsize * (4 * HIDDEN + 4 * FFN)


def model_bytes(T: int, P: int) -> int:
    """Activations the whole model (LAYERS layers) keeps for the backward on one rank."""
    return LAYERS * (attention_bytes(T, P) + other_bytes(T // P))


def recompute_bytes(T: int) -> int:
    """One device recomputing every layer: it keeps each layer's input (h values a token) and one layer's
    activations at a time."""
    return LAYERS * T * HIDDEN * BF16.itemsize + attention_bytes(T, 1) + other_bytes(T)


def h100_memory() -> float:
    return load_profile("h100-sxm").memory_bytes


def fits(P: int, recompute: bool = False) -> int:
    """The most tokens whose activations fit in an H100's memory at CP = P (memory is linear in T)."""
    T = 2**20
    per_token = (recompute_bytes(T) if recompute else model_bytes(T, P)) / T
    return int(h100_memory() / per_token) // P * P


def pays_memory() -> Figure:
    """`figures/learn/pays_memory.png`: the activations a Llama-3-8B-like model keeps per rank against T."""
    fig, ax = plt.subplots(figsize=(WIDTH, 4.3), constrained_layout=True)
    for i, P in enumerate(MEM_P):
        ax.plot(MEM_T, [model_bytes(T, P) / GB for T in MEM_T], "o-", color=rank_color(i), markersize=4,
                label="one device" if P == 1 else f"CP = {P}")  # fmt: skip
    ax.plot(MEM_T, [recompute_bytes(T) / GB for T in MEM_T], "--", color="0.45",
            label="one device, recomputing")  # fmt: skip
    ax.axhline(h100_memory() / GB, color="black", linewidth=1.2)
    ax.text(MEM_T[-1], h100_memory() / GB * 0.85, f"an H100's {h100_memory() / GB:.0f} GB", va="top", ha="right")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(MEM_T, [f"{T // 1024}k" if T < 2**20 else "1M" for T in MEM_T])
    ax.set_xlabel("sequence length T (tokens)")
    ax.set_ylabel("GB per rank")
    ax.spines[["top", "right"]].set_visible(False)
    ax.legend(frameon=False, loc="upper left", ncols=2)
    ax.set_ylim(top=3e4)
    hq, hkv, d, _ = HEADS
    ax.set_title(f"Activations kept for the backward per rank: {LAYERS} layers, bf16,\n"
                 f"Hq = {hq}, Hkv = {hkv}, D = {d}, h = {HIDDEN}, F = {FFN}", loc="left")
    return fig


# ---------------------------------------------------------------------------------------------------------------
# The overlap condition: a zigzag ring step's kernel time against its K/V block's transfer.


def this_machine() -> Profile:
    return load_profile(THIS_MACHINE)


def step_kernel(b: int, profile: Profile, dtype: str, heads=HEADS) -> float:
    r"""Seconds of one forward ring step's kernel on `profile`: zigzag gives every step but the first half a
    block, $b^2 / 2$ query-key pairs per head, $2 \cdot (b^2/2) \cdot H_q (D + D_v)$ FLOPs."""
    hq, hkv, d, dv = heads
    return profile.kernel(dtype).call_seconds(KernelCall("forward", b * b // 2, b, b, hq, hkv, d, dv))


def step_transfer(b: int, profile: Profile, dtype: str, level: str, heads=HEADS) -> float:
    """Seconds of one ring shift of a K/V block of `b` tokens, $b H_{kv} (D + D_v)$ elements, over `level`."""
    _, hkv, d, dv = heads
    itemsize = {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]
    return profile.links[level].seconds(b * hkv * (d + dv) * itemsize, send_recv=True)


def hidden(b: int, profile: Profile, dtype: str, level: str, heads=HEADS) -> bool:
    return step_kernel(b, profile, dtype, heads) >= step_transfer(b, profile, dtype, level, heads)


def crossover(profile: Profile, dtype: str, level: str, heads=HEADS) -> int | None:
    """The smallest block size (tokens per rank) from which on every ring step hides its transfer (None: every
    block size does). A curve's fixed cost per call can hide tiny blocks too; this is the last crossing."""
    top = 2**22
    assert hidden(top, profile, dtype, level, heads), "a large enough block always hides its transfer"
    grid = [top // 2**k for k in range(22)]
    lo = next((b for b in grid if not hidden(b, profile, dtype, level, heads)), None)
    if lo is None:
        return None
    hi = 2 * lo  # hidden (the grid point above)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if hidden(mid, profile, dtype, level, heads) else (mid, hi)
    return hi


TL_T, TL_P = 131072, 16  # the timeline's run: one document of 128k tokens on two H100 nodes
TL_RANK = 0  # its ring neighbour rank 15 is on the other node
CURVE_B = tuple(2**k for k in range(4, 16))  # block sizes of the condition panels: H100
CURVE_B_HERE = tuple(2**k for k in range(2, 13))  # this machine


@functools.cache
def timelines() -> dict:
    """Each mode's priced step on rank TL_RANK: (its intervals, its step)."""
    profile = load_profile("h100-sxm")
    sharding = cpref.Sharding([0, TL_T], cp_size=TL_P, layout="zigzag")
    out = {}
    for mode, spec in cpref.MODES.items():
        run = dry_run(mode, sharding, TL_RANK, heads=HEADS, dtype=BF16, **spec.example_options(TL_P))
        out[mode] = played(run, profile, profile.kernel("bfloat16"))
    return out


COLORS = {("call", "forward"): "#6baed6", ("call", "backward"): "#2171b5", "wait": "#d62728",
          ("collective", "forward"): "#fdae6b", ("collective", "backward"): "#e6550d"}  # fmt: skip


def _gantt(ax) -> None:
    runs = timelines()
    longest = max(step for _, step in runs.values())
    ticks, labels = [], []
    for i, (mode, (intervals, step)) in enumerate(runs.items()):
        y = -3 * i
        for iv in intervals:
            row = y - 1 if iv.kind == "collective" else y
            color = COLORS["wait"] if iv.kind == "wait" else COLORS[(iv.kind, iv.phase)]
            ax.broken_barh([(iv.start * 1e3, iv.seconds * 1e3)], (row - 0.4, 0.8), facecolors=color,
                           edgecolors="white", linewidth=0.3)  # fmt: skip
        waits = sum(iv.seconds for iv in intervals if iv.kind == "wait")
        ax.text(step * 1e3 + longest * 0.01e3, y - 0.5, f"{step * 1e3:.0f} ms\nwaits {waits * 1e3:.1f}", va="center")
        extra = "".join(f", {k} {v}" for k, v in cpref.MODES[mode].example_options(TL_P).items())
        ticks.append(y - 0.5)
        labels.append(f"{mode}{extra}")
    ax.set_yticks(ticks, labels)
    ax.set_xlim(0, longest * 1.2e3)
    ax.set_xlabel("ms")
    ax.spines[["top", "right", "left"]].set_visible(False)
    ax.tick_params(axis="y", length=0)
    hq, hkv, d, _ = HEADS
    ax.set_title(f"Rank {TL_RANK}'s step: {TL_T // 1024}k tokens, P = {TL_P} (two nodes of 8),\n"
                 f"zigzag, Hq = {hq}, Hkv = {hkv}, D = {d}, bf16, h100-sxm\n"
                 "(each mode: kernels above, transfers below)", loc="left")  # fmt: skip


def _condition(ax, profile: Profile, dtype: str, levels: dict[str, str], title: str, mark: int | None,
               bs: tuple[int, ...]) -> None:
    ax.plot(bs, [step_kernel(b, profile, dtype) * 1e3 for b in bs], "-", color=COLORS[("call", "backward")],
            label="kernel of a step")  # fmt: skip
    for (level, name), style in zip(levels.items(), ("-", "--")):
        ax.plot(bs, [step_transfer(b, profile, dtype, level) * 1e3 for b in bs], style,
                color=COLORS[("collective", "backward")], label=f"its K/V block over {name}")  # fmt: skip
        b = crossover(profile, dtype, level)
        if b is not None:
            ax.plot([b], [step_kernel(b, profile, dtype) * 1e3], "o", color="black")
            ax.annotate(f"b = {b:,}", (b, step_kernel(b, profile, dtype) * 1e3), textcoords="offset points",
                        xytext=(8, -14))  # fmt: skip
    if mark:
        ax.axvline(mark, color="0.5", linestyle=":", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(bs[::3], [f"{b:,}" for b in bs[::3]])
    ax.set_xlabel("b = T/P, tokens per rank")
    ax.set_title(title, loc="left")
    ax.spines[["top", "right"]].set_visible(False)
    ax.legend(frameon=False, loc="upper left")


def pays_timeline() -> Figure:
    """`figures/learn/pays_timeline.png`: every mode's step on one rank, kernels and transfers on their two clocks;
    below, the overlap condition on the H100 profile and this machine's."""
    fig = plt.figure(figsize=(WIDTH, 8.6), constrained_layout=True)
    top, bottom = fig.subfigures(2, 1, height_ratios=[4.4, 4.2])
    _gantt(top.subplots())
    left, right = bottom.subplots(1, 2)
    _condition(left, load_profile("h100-sxm"), "bfloat16", {"inter": "InfiniBand", "intra": "NVLink"},
               "H100 profile, bf16 (ms)", TL_T // TL_P, CURVE_B)  # fmt: skip
    _condition(right, this_machine(), "float32", {"intra": "gloo"}, "this machine, float32 (ms)", None,
               CURVE_B_HERE)  # fmt: skip
    bottom.suptitle("A forward ring step (zigzag) hides its transfer where the kernel\nline is above the transfer "
                    "line; dotted: the run above", x=0.02, ha="left", fontsize=base.FONT)  # fmt: skip
    top.legend(handles=[Patch(color=COLORS[("call", "forward")], label="forward kernel"),
                        Patch(color=COLORS[("call", "backward")], label="backward kernel"),
                        Patch(color=COLORS["wait"], label="waiting for a transfer"),
                        Patch(color=COLORS[("collective", "forward")], label="forward transfer"),
                        Patch(color=COLORS[("collective", "backward")], label="backward transfer")],
               loc="outside lower center", ncols=3, frameon=False)  # fmt: skip
    return fig


# ---------------------------------------------------------------------------------------------------------------
# Where CP does not pay: the planner's step at CP = P against one device's over P.

WHERE_T = 131072
WHERE_DOCS = (512, 2048, 8192, 32768, 131072)
WHERE_WINDOWS = (256, 1024, 4096, 16384, 65536)
WHERE_HKV = (32, 16, 8, 4, 2, 1)  # at Hq = 32


def _kind(window: int | None) -> str:
    return "full" if window is None else f"window {window}"


@functools.cache
def predicted(docs: tuple[int, ...], P: int, heads=HEADS, window: int | None = None, ring: bool = False):
    """The planner's best prediction at CP = P (`ring`: the zigzag ring's) on the h100-sxm profile, bf16."""
    options = {"modes": ["p2p"], "layouts": ["zigzag"]} if ring or P == 1 else {}
    result = plan(list(docs), heads=heads, dtype="bfloat16", P=P, profile="h100-sxm", window=window, **options)
    return result.kinds[_kind(window)].ranked[0]


def efficiency(docs: tuple[int, ...], P: int, heads=HEADS, window: int | None = None, ring: bool = False) -> float:
    """One device's step over P, divided by the step at CP = P: 1 where CP divides the time by P."""
    one = predicted(docs, 1, heads, window).step
    return one / P / predicted(docs, P, heads, window, ring).step


def _docs(L: int) -> tuple[int, ...]:
    return (L,) * (WHERE_T // L)


WHERE_LINES = (("the ring (p2p zigzag), P = 8: one node", 8, True, "o-", 0),
               ("the ring (p2p zigzag), P = 16: two nodes", 16, True, "s-", 1),
               ("the planner's best, P = 16", 16, False, "^--", 2))  # fmt: skip


def pays_where() -> Figure:
    """`figures/learn/pays_where.png`: the planner's step at CP = P against one device's over P, for short documents,
    narrow windows and many K/V heads."""
    fig = plt.figure(figsize=(WIDTH, 6.6), constrained_layout=True)
    axes = base.panel_grid(fig, 3, cols=2)
    hq, hkv, d, _ = HEADS
    panels = [
        (f"(a) documents of L tokens,\npacked to {WHERE_T // 1024}k (Hkv = {hkv})", WHERE_DOCS, "L",
         lambda x, P, ring: efficiency(_docs(x), P, ring=ring)),
        (f"(b) a sliding window of W keys,\none document of {WHERE_T // 1024}k (Hkv = {hkv})", WHERE_WINDOWS, "W",
         lambda x, P, ring: efficiency((WHERE_T,), P, window=x, ring=ring)),
        (f"(c) Hkv K/V heads for Hq = {hq},\none document of {WHERE_T // 1024}k", WHERE_HKV, "Hkv",
         lambda x, P, ring: efficiency((WHERE_T,), P, heads=(hq, x, d, d), ring=ring)),
    ]  # fmt: skip
    for ax, (title, xs, name, eff) in zip(axes, panels):
        for label, P, ring, style, color in WHERE_LINES:
            ax.plot(xs, [eff(x, P, ring) for x in xs], style, color=rank_color(color), markersize=4, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [f"{x // 1024}k" if x >= 1024 else str(x) for x in xs])
        ax.set_ylim(0, 1.08)
        ax.axhline(1, color="0.6", linewidth=0.8)
        ax.set_xlabel(name)
        ax.set_title(title, loc="left")
        ax.spines[["top", "right"]].set_visible(False)
    axes[0].set_ylabel("one device's step / P\nover the step at CP = P")
    axes[2].set_ylabel("one device's step / P\nover the step at CP = P")
    fig.legend(handles=[Line2D([], [], color=rank_color(c), marker=s[0], linestyle=s[1:], label=label)
                        for label, _, _, s, c in WHERE_LINES], loc="outside lower center", ncols=1, frameon=False)  # fmt: skip
    fig.suptitle(f"The planner's forward + backward step, h100-sxm profile, bf16, D = {d}:\n"
                 "1 where CP divides one device's time by P", x=0.02, ha="left")  # fmt: skip
    return fig


FIGURES = {
    "figures/learn/pays_memory.png": pays_memory,
    "figures/learn/pays_timeline.png": pays_timeline,
    "figures/learn/pays_where.png": pays_where,
}


# ---------------------------------------------------------------------------------------------------------------
# The page's numbers.


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _pct(x: float) -> str:
    return f"{100 * x:.0f} %"


def text_fit() -> str:
    """How many tokens' activations fit in an H100 at CP = 1, 8, 16, and with recomputation on one device."""
    T = 2**20
    a, o = attention_bytes(T, 1) / T, other_bytes(T) / T
    return (f"A token costs {a:,.0f} bytes of attention's saved tensors and {o:,.0f} bytes of the rest in every "
            f"layer, so one device fills its {h100_memory() / GB:.0f} GB with the activations of "
            f"{fits(1):,} tokens; CP = 8 holds {fits(8):,}, CP = 16 {fits(16):,}. Recomputing every layer (keeping "
            f"only each layer's input), one device reaches {fits(1, recompute=True):,} tokens")


def text_condition() -> str:
    """The crossover block sizes on the H100 profile and this machine, and the constant-rate estimate."""
    h100, here = load_profile("h100-sxm"), this_machine()
    hq, hkv, _, _ = HEADS
    rate, link = h100.kernel("bfloat16").peak, h100.links["inter"].bandwidth
    estimate = hkv * 2 * rate / (hq * link)
    ib, nv, cpu = crossover(h100, "bfloat16", "inter"), crossover(h100, "bfloat16", "intra"), crossover(here, "float32", "intra")
    nv_text = "at every block size" if nv is None else f"from b = {nv:,}"
    return (f"On the H100 profile a forward step hides its block over InfiniBand from b = {ib:,} tokens per rank "
            f"(the approximate formula, with the profile's peak $R$ = {rate / 1e12:.0f} TFLOP/s and $B$ = "
            f"{link / 1e9:.0f} GB/s, gives {estimate:,.0f}), and over NVLink {nv_text}; on this machine, whose kernel is slow for its link, "
            f"from b = {cpu:,}")


def text_timeline() -> str:
    """The ring's and all-gather's transfers and waits in the timeline's run."""
    runs = timelines()

    def part(mode: str, kind: str) -> float:
        return sum(iv.seconds for iv in runs[mode][0] if iv.kind == kind)

    return (f"The ring's transfers take {_ms(part('p2p', 'collective'))} of its {_ms(runs['p2p'][1])} step and it "
            f"waits {_ms(part('p2p', 'wait'))}, for the last shift of the dK/dV accumulators home, which no kernel "
            f"follows; `all_gather`'s take {_ms(part('all_gather', 'collective'))} and it waits for every one of them")


def text_short_block() -> str:
    """The ring at a block below the crossover: a quarter of the timeline's tokens."""
    docs = (TL_T // 4,)
    ring = predicted(docs, TL_P, ring=True)
    return (f"at {docs[0] // 1024}k tokens (b = {docs[0] // TL_P:,}) the planner's ring waits "
            f"{_pct(ring.slowest.exposed / ring.step)} of its step")


def text_where() -> str:
    """The three panels' worst points, in the planner's numbers."""
    short, W, wide = _docs(WHERE_DOCS[0]), WHERE_WINDOWS[0], (HEADS[0], WHERE_HKV[0], HEADS[2], HEADS[3])
    best_short = predicted(short, 16)
    return "\n".join([
        f"* *Short documents.* Cut into zigzag chunks, documents of {WHERE_DOCS[0]} tokens give a ring step only the "
        "pairs inside each document, far fewer than $b^2/2$, while the whole K/V block travels: the ring reaches "
        f"{efficiency(short, 8, ring=True):.2f} of the ideal at P = 8, "
        f"{efficiency(short, 16, ring=True):.2f} at P = 16. The planner keeps each document whole "
        f"(`{best_short.name}`: {efficiency(short, 16):.2f}), which moves nothing; that is data "
        "parallelism by another name: a batch of short documents needs CP's memory split, not its traffic.",
        f"* *Narrow windows.* Under a window of {W} keys a query sees at most {W} keys: each call has little work, "
        f"so the kernel's fixed cost per call weighs on every rank, and across nodes the halo's transfer too: "
        f"the ring reaches {efficiency((WHERE_T,), 8, window=W, ring=True):.2f} of the ideal at P = 8, the planner's "
        f"best {efficiency((WHERE_T,), 16, window=W):.2f} at P = 16. CP still divides the memory; it no longer divides the time.",
        f"* *Many K/V heads.* The block's bytes grow with $H_{{kv}}$, the step's FLOPs with $H_q$: at "
        f"$H_{{kv}} = H_q = {wide[0]}$ (MHA) the ring over two nodes reaches "
        f"{efficiency((WHERE_T,), 16, heads=wide, ring=True):.2f}, against {efficiency((WHERE_T,), 16, ring=True):.2f} at "
        f"$H_{{kv}} = {HEADS[1]}$ (GQA): the crossover block grows as $H_{{kv}} / H_q$. The head size $D$ cancels "
        "out of the condition; few or small heads hurt only as a narrow window does, by making every call small.",
    ])


TEXT = {
    "pays_fit": text_fit,
    "pays_condition": text_condition,
    "pays_timeline": text_timeline,
    "pays_short_block": text_short_block,
    "pays_where": text_where,
}
