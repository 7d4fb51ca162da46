r"""The layouts on packed batches: each layout's padding, causal balance and traffic per mode, counted at P = 2, 4 and 8.

{{ figure figures/bench_bytes.png }}

Every layout of `cpref.LAYOUTS` and every mode of `cpref.MODES` (with `example_options(P)`), at
$P = 2, 4, 8$, on three packs:

* **stdlib 32k** and **stdlib 128k**: the first pack of 32768 and of 131072 tokens of
  `cpref.train.packing.pack_documents(cpref.train.packing.stdlib_documents(), T)`, the lengths of
  this interpreter's standard library files as byte tokens (a few long documents);
* **lognormal 64k**: many documents from a long-tailed distribution. Document lengths in
  pretraining corpora are roughly lognormal with a heavy tail (many short pages, a few books), so
  the lengths are $\lceil X \rceil$, $\ln X \sim \mathcal{N}(\ln 512, 1)$ (median 512 tokens, mean
  $512\, e^{1/2} \approx 844$), drawn with `torch.Generator().manual_seed(0)` and laid end to end
  by `pack_documents` into its first pack of 65536 tokens: each document gets its end-of-document
  token and the one that crosses the pack's end is cut there (69 documents).

Each batch is sharded by `cpref.Sharding.eod_padded(cu_seqlens, cp_size=P, layout=layout)`. Per
layout, whatever the mode: the padding tokens as a share of the padded batch, the busiest rank's
causal work over the mean (`sharding.attention_work(r, exact=True)`, the real scores), and its
**shared rows**, its tokens of documents whose real tokens sit on more than one rank (what
`all_gather` moves for the layouts that keep documents whole; `a2a` moves those and the documents
its balance adds, [Ulysses for stream and balanced](ulysses-split.md), counted in its bytes).

Per mode, from forward + backward of `cpref.attention` on `sim.SimCluster(P)` with a kernel that
computes nothing (zeros of the contract's shapes and dtypes, so the collectives move real-shaped
tensors):

* **bytes**: the busiest rank's bytes sent, exact, summed over the mode's trace events;
* **kernel work**: largest / mean over ranks of $\sum$ `seqs.work(causal, window)` times the
  call's query heads, over the kernel calls, forward and backward: the scores the ranks would
  compute, padding included (times the heads, so that Ulysses' rank, all tokens of $H_q / P$
  heads, compares);
* **model time**: $\max_r (W_r / F + B_r / B)$ with $W_r$ the rank's kernel work, $B_r$ its bytes,
  and the constants $F$ and $B$ printed in the header. It is a model, not a measurement.

Heads are tiny ($H_q = 8$ so that Ulysses splits them over 8 ranks, $H_{kv} = 1$, $D = D_v = 8$,
float32): bytes grow with heads and head dims, the work per head does not. Nothing is timed, so the
figures do not move with the machine. At the end, for the lognormal pack at the largest $P$, the
goals of [the balanced layout](balanced.md) (padding under 1%, work within 1.05 of the mean, a
third of zigzag's bytes), printed as met or not, never asserted, and its shared rows against their
lower bound (the tokens of the documents no rank can hold whole, over $P$).

Run it with `python -m bench.layouts` (or `make bench`); `--quick` runs only $P = 2, 4$ on the 32k
and lognormal packs.

{{ results layouts }}
"""

from __future__ import annotations

import math

import torch

import cpref
from cpref.batch.balanced import TOLERANCE, piece_work
from cpref.kernels.contract import compute_dtype
from cpref.train.packing import pack_documents, stdlib_documents
from sim.cluster.harness import mode_trace, run_attention
from sim.tools.cli import Parser

F = 2e11  # modelled compute: score entries per second
B = 50e9  # modelled bandwidth: bytes per second each rank sends
HQ, HKV, D, DV = 8, 1, 8, 8
GOALS = {"padding %": 1.0, "work max/mean": 1.05, "bytes / zigzag": 1 / 3}  # the balanced layout's, at most


class ZeroKernel:
    """The `AttentionKernel` contract's shapes and dtypes, all zeros; records the work of every call."""

    def __init__(self) -> None:
        self.work = 0

    def count(self, seqs: cpref.Varlen, causal: bool, window: tuple[int, int], heads: int) -> None:
        """Add the call's scores, all its query heads (`Varlen.work` is per head, computed once per `Varlen`)."""
        self.work += heads * seqs.cached(("bench.layouts work", causal, window), lambda: seqs.work(causal, window))

    def forward(self, q, k, v, seqs, *, causal, scale, window=(-1, -1), out_dtype=None):
        self.count(seqs, causal, window, q.shape[1])
        out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2], dtype=out_dtype or q.dtype)  # (T, Hq, Dv)
        return out, q.new_zeros(q.shape[:2], dtype=compute_dtype(q.dtype))  # (T, Hq)

    def backward(self, dout, q, k, v, out, lse, seqs, *, causal, scale, window=(-1, -1), full_rows=False, grad_dtype=None):
        self.count(seqs, causal, window, q.shape[1])
        return tuple(torch.zeros_like(x, dtype=grad_dtype or x.dtype) for x in (q, k, v))  # like (q, k, v)


def lognormal_pack(tokens: int = 65536, median: float = 512.0, sigma: float = 1.0, seed: int = 0) -> list[int]:
    """`cu_seqlens` of the first pack of `tokens` of lognormal documents (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.empty(4 * tokens // int(median)).log_normal_(math.log(median), sigma, generator=g).ceil().long()
    documents = (torch.zeros(n, dtype=torch.long) for n in lengths.tolist())  # (n,) token ids do not matter
    return next(pack_documents(documents, tokens)).cu_seqlens.tolist()


def packs(quick: bool) -> dict[str, list[int]]:
    """`{name: cu_seqlens}` of the packs to run."""
    sizes = {"stdlib 32k": 32768} if quick else {"stdlib 32k": 32768, "stdlib 128k": 131072}
    out = {name: next(pack_documents(stdlib_documents(), n)).cu_seqlens.tolist() for name, n in sizes.items()}
    return {**out, "lognormal 64k": lognormal_pack()}


def ratio(values: list[int]) -> float:
    """Largest over mean."""
    return max(values) * len(values) / sum(values) if sum(values) else 1.0


def run_mode(sharding: cpref.Sharding, mode: str) -> dict[str, float]:
    """Forward + backward of `mode` with zero kernels: busiest rank's bytes, kernel work max/mean, model time."""
    P, T = sharding.cp_size, sharding.total
    q, dout = torch.zeros(T, HQ, D), torch.zeros(T, HQ, DV)  # (T, Hq, D), (T, Hq, Dv)
    k, v = torch.zeros(T, HKV, D), torch.zeros(T, HKV, DV)  # (T, Hkv, D), (T, Hkv, Dv)
    kernels = [ZeroKernel() for _ in range(P)]
    _, cluster = run_attention(q, k, v, dout, sharding, mode=mode, kernels=kernels, check_ranks=False,
                               **cpref.MODES[mode].example_options(P))  # fmt: skip
    events = mode_trace(cluster)
    sent = [sum(ev.bytes_sent[ev.group.index(r)] for ev in events if r in ev.group) for r in range(P)]
    work = [kern.work for kern in kernels]
    model = max(w / F + b / B for w, b in zip(work, sent))
    return {"bytes": max(sent), "kernel work": ratio(work), "model ms": model * 1e3}


def shared_rows(sharding: cpref.Sharding) -> int:
    """The busiest rank's rows of documents whose real tokens sit on more than one rank."""
    cu, cu_padded, P = sharding.cu_seqlens, sharding.cu_seqlens_padded, sharding.cp_size
    pieces = [sharding.local_chunks(r) for r in range(P)]
    holders: dict[int, set[int]] = {}
    for r in range(P):
        for doc, s, _e in pieces[r]:
            if s - cu_padded[doc] < cu[doc + 1] - cu[doc]:  # the piece holds real tokens
                holders.setdefault(doc, set()).add(r)
    return max(sum(e - s for doc, s, e in pieces[r] if len(holders.get(doc, ())) > 1) for r in range(P))


def shared_bound(cu: list[int], P: int) -> float:
    """A lower bound on `shared_rows` of `balanced`: the tokens of the documents heavier than a rank may be
    (`cpref.batch.balanced.TOLERANCE`), which no rank can hold whole, over `P`."""
    works = [piece_work(0, b - a) for a, b in zip(cu, cu[1:])]
    cap = (1 + TOLERANCE) * sum(works) / P
    return sum(b - a for a, b, w in zip(cu, cu[1:], works) if w > cap) / P


def run_layout(cu: list[int], P: int, layout: str) -> dict:
    """Padding %, exact causal work max/mean, shared rows and `{mode: run_mode(...)}` of one layout."""
    sharding = cpref.Sharding.eod_padded(cu, cp_size=P, layout=layout)
    padding = 100.0 * (sharding.total - cu[-1]) / sharding.total
    work = ratio([sharding.attention_work(r, exact=True) for r in range(P)])
    return {"padding %": padding, "work max/mean": work, "shared rows": shared_rows(sharding),
            "modes": {m: run_mode(sharding, m) for m in sorted(cpref.MODES)}}  # fmt: skip


def table(name: str, cu: list[int], P: int, rows: dict[str, dict]) -> str:
    """One pack at one `P`: a Markdown table, a row per layout and mode."""
    lines = [f"### {name}: {len(cu) - 1} documents, {cu[-1]} tokens, P = {P} (model: F = {F:.0e} scores/s, B = {B:.0e} B/s)",
             "", "| layout | padding | causal work max/mean | shared rows | mode | bytes (busiest rank) "
             "| kernel work max/mean | model time |", "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |"]  # fmt: skip
    for layout, row in rows.items():
        for i, (mode, m) in enumerate(row["modes"].items()):
            head = (f"| {layout} | {row['padding %']:.2f}% | {row['work max/mean']:.3f} | {row['shared rows']:,} |"
                    if i == 0 else "| | | | |")  # fmt: skip
            lines.append(f"{head} {mode} | {m['bytes']:,} | {m['kernel work']:.3f} | {m['model ms']:.2f} ms |")
    return "\n".join(lines)


def goals(rows: dict[str, dict], cu: list[int], P: int, layout: str = "balanced") -> str:
    """`layout`'s goals against `GOALS` (bytes against zigzag's, mode by mode), each met or not."""
    if layout not in rows:
        return f"goals: layout {layout!r} is not in cpref.LAYOUTS {cpref.LAYOUTS}; nothing to check"
    row, lines = rows[layout], [f"goals of {layout!r}, lognormal pack, P = {P} (printed, not asserted):", ""]

    def line(what: str, value: float, goal: float) -> str:
        return f"- {what}: {value:.3f} (goal {'<' if what == 'padding %' else '<='} {goal:.3g}): " + (
            "met" if (value < goal if what == "padding %" else value <= goal) else "not met")

    lines += [line(what, row[what], GOALS[what]) for what in ("padding %", "work max/mean")]
    bound = shared_bound(cu, P)
    lines.append(f"- shared rows (busiest rank): {row['shared rows']:,}, {row['shared rows'] / bound:.3f} times the bound "
                 f"{bound:,.1f} (the tokens of the documents no rank can hold whole, over P)")  # fmt: skip
    for mode, m in row["modes"].items():
        base = rows["zigzag"]["modes"][mode]["bytes"]
        lines.append(line(f"{mode} bytes / zigzag", m["bytes"] / base if base else math.inf, GOALS["bytes / zigzag"]))
    return "\n".join(lines)


def bytes_table(pack: dict) -> str:
    """One pack, every `P`, compact (the page's): per layout its padding, work and shared rows, and per mode the
    busiest rank's MiB sent, forward + backward."""
    modes = list(next(iter(pack["runs"][0]["layouts"].values()))["modes"])
    lines = ["| P | layout | padding | work max/mean | shared rows | " + " | ".join(f"`{m}` MiB" for m in modes) + " |",
             "| ---: | --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in modes) + " |"]  # fmt: skip
    for run in pack["runs"]:
        for i, (layout, row) in enumerate(run["layouts"].items()):
            mib = " | ".join(f"{row['modes'][m]['bytes'] / 2**20:.2f}" for m in modes)
            lines.append(f"| {run['P'] if i == 0 else ''} | {layout} | {row['padding %']:.2f}% | {row['work max/mean']:.3f} "
                         f"| {row['shared rows']:,} | {mib} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="P = 2, 4 on the 32k and the lognormal pack only")
    args = parser.parse_args(argv)
    sizes = (2, 4) if args.quick else (2, 4, 8)
    title = (f"Layouts on packed batches: heads Hq = {HQ}, Hkv = {HKV}, D = Dv = {D}, float32, causal, forward + backward "
             "on the simulated cluster; model times are a model, not a measurement")  # fmt: skip
    print(f"## {title}\n")
    results = {"title": title, "F": F, "B": B, "packs": []}
    for name, cu in packs(args.quick).items():
        pack = {"name": name, "documents": len(cu) - 1, "tokens": cu[-1], "runs": []}
        for P in sizes:
            cpref.clear_cache()  # one batch's plans at a time
            rows = {layout: run_layout(cu, P, layout) for layout in cpref.LAYOUTS}
            print(table(name, cu, P, rows) + "\n", flush=True)
            pack["runs"].append({"P": P, "layouts": rows})
        results["packs"].append(pack)
    results["goals"] = goals(rows, cu, P)  # the last pack is the lognormal one, the last P the largest
    print(results["goals"])
    return results

if __name__ == "__main__":
    main()
