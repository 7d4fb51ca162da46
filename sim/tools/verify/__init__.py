r"""Rank-by-rank verification: `python -m sim verify`.

The production path (`cpref.attention` over [`TorchComm`][cpref.comm.torch_dist.TorchComm]
on real processes, gloo on CPUs, NCCL on GPUs, HCCL on Ascend NPUs) is checked **rank by
rank** against the simulated cluster's FP64 ground truth:

```bash
python -m sim verify --backend gloo --nproc 2 --mode all --layout all --docs 100,250,38
```

starts 2 processes, runs every mode of `cpref.MODES` in every layout, forward and backward,
and prints one row per case and rank: the largest error of `out`, `dQ`, `dK`, `dV`, the
tolerance, how far the rank is from the oracle relative to the same attention without CP
(`vs P=1`), the largest error against the oracle, and pass/fail. The p2p zigzag fp32 rows, on
this machine on 2026-12-06 (the test suite re-measures them: ratios to 0.05, errors to 25 %):

```text
mode  layout  dtype  pad  cp rank  dp   r       out        dq        dk        dv      tol      vs P=1    oracle  result
p2p   zigzag  fp32   no    2    0   0   0  5.90e-07  1.32e-06  1.86e-06  2.06e-06  1.0e-05    1.16 <=2  2.06e-06  pass
p2p   zigzag  fp32   no    2    1   0   1  4.45e-07  6.95e-07  8.18e-07  5.68e-07  1.0e-05    0.98 <=2  8.18e-07  pass
```

(`rank` is the world rank, `dp` its CP group, `r` its rank in the group; the page
[Verify your implementation](verify-your-implementation.md#3-read-the-table-column-by-column)
explains every column, the `mask`, `window` and `baseline` columns shown when they apply, and
the notes after the result.) The exit status is
0 if every row passes, 1 on any failure, 2 on bad arguments.

## What is compared

Every rank builds the same global batch from a seed (documents of unequal length, GQA heads,
normal entries rounded to the dtype), takes its shard, and runs forward and backward with an
upstream gradient from the same seed ([`sim.tools.verify.rank`][sim.tools.verify.rank]); only the
results travel back. The ground truth is computed once, by the process that prints the table
(the launching process, or rank 0 under torchrun), while the ranks run only the production
path: it rebuilds each batch, upcasts it to float64 and computes, per rank
([`sim.tools.verify.truth`][sim.tools.verify.truth]):

1. the **simulated cluster** (`sim.cluster.harness.run_attention` in float64): the same mode, layout,
   padding and options, on `SimCluster(P)`: each rank's `out, dq, dk, dv`;
2. the **oracle** (dense FP64 attention), cut into the same shards.

**Pass/fail uses the simulated cluster**, compared as `torch.testing.assert_close` with
`atol = rtol = tol`; the oracle error is reported beside it. The simulated cluster runs the
*same algorithm* as the rank, so a difference beyond rounding is a fault of the real
path (the backend, the device kernel, the dtype), in the rank and tensor where it shows; the
algorithm itself is checked against the oracle by the test suite (`make test-sim`). The
simulated cluster and the oracle agree to float64 rounding ($\sim 10^{-14}$); should they ever differ by more
than $10^{-10}$, the row reads `BAD-REF` (the ground truth is wrong, not the rank).

| dtype | tol (atol = rtol) |
| --- | --- |
| fp64 | 1e-10 |
| fp32 | 1e-5 |
| fp16 | 5e-3 |
| bf16 | 2.5e-2; 3.5e-2 with $H_{kv} < H_q$ |

**Relative to the same attention without CP** (`vs P=1`). A fixed tolerance cannot tell a CP
fault from the kernel's own rounding at large logits, where the kernel alone exceeds it. So a
row also fails when it is more than **2 times as far from the FP64 oracle as the same
attention without CP** (P = 1, same dtype, same inputs: CP rank 0 runs the whole batch once
more, on its device), MagiAttention's criterion. The run without CP is the row's **baseline**
([`sim.tools.verify.baselines`][sim.tools.verify.baselines]): for cpref, its kernel on a
`SingleRank`; for an `--impl`, the implementation itself on a process group of one rank, or
where it raises there the fallback `sdpa/eager` (PyTorch's SDPA and eager attention in the
dtype, each tensor held to the looser; a note says why), or what `--baseline` names (`sdpa`,
`eager`, `kernel`, your local attention); a `baseline` column shows it where it is not the
kernel. The column shows the larger of two ratios, each the largest of the four tensors: the rank's largest error
over the baseline's over the whole batch (both relative to the batch's largest entry, with a
floor of $\epsilon/2$), and the rank's root-mean-square error over the baseline's on the same
rows, which catches a result that rounds more on every row; `<=2` or `>2`; `-` for fp64, whose
truth is no more precise than the result ([`sim.tools.verify.truth`][sim.tools.verify.truth]
has the definitions and the floors).

**Why the baseline matters.** Held to cpref's kernel, which computes the scores in float32,
exact implementations that compute `q @ k^T` in bf16 fail bf16 rows with errors well inside the
tolerance. As issue 42 reports it (the filer's own adapters held to the kernel, the column the
largest-error ratio alone; quoted, not re-measured): a Ulysses adapter at `--nproc 1`, no CP
at all, `vs P=1 2.20 >2`; at `--nproc 2` rank 0 `2.20` FAIL, rank 1 `0.82`; a ring with bf16
scores and a float32 merge `2.70` and `3.33` at P = 2. The repository's reproduction,
`tests.backends.verify_impls:blockwise` at P = 2 in bf16 (2026-12-06, re-measured by the test
suite): held to the kernel 2.05 and 1.90 (rank 0 fails), held to itself 1.09 and 1.05 (both
pass). [Verify your implementation](verify-your-implementation.md#4-the-baseline-the-same-attention-without-cp)
has the whole example, how the baseline is chosen, and what the fallback costs.

**Inputs.** `--docs 1000,3000,500` (default) are the document lengths, each rounded up to
the layout's granularity ($P$ contiguous, $2P$ zigzag); with `--padded` every document ends
in padding instead (padded boundaries in the batch's `cpref.Sharding`; see [`sim.tools.verify.cases`][sim.tools.verify.cases]),
and a `note:` line gives, per layout, the real lengths and the padded boundaries they end in.
Heads default to $H_q = 8$, $H_{kv} = 4$ (`--heads`), head dim 32 (`--head-dim`); the mask is
causal (`--no-causal` for full attention). `--dtype`, `--mode` and `--layout` take a comma
list or `all`; a sweep runs in **one** launch, with a progress bar on stderr (where stderr is not a
terminal, a line per case as it finishes: [`sim.tools.verify.meter`][sim.tools.verify.meter]).

**Sliding windows.** `--window LEFT,RIGHT` is `cpref.attention`'s `window=(left, right)` (the
FlashAttention convention, -1 unbounded; causal means RIGHT = 0, so `--window 127,0` is a causal
window of 128 keys, and `--no-causal --window 64,64` a symmetric one). It goes to every call
alike: the ranks' `cpref.attention` (or `--impl`), their run without CP, the simulated cluster and
the oracle; the table gains a `window` column. Only the modes whose declaration takes a window
(`cpref.MODES[m].windows`) run one: `--mode all` skips the others, with a note naming them, and
naming such a mode in `--mode` is an error. `--window -1,4` (a value starting with a minus) is
read as `--window=-1,4`.

**Attention variants.** `--softcap C` (logit soft-capping, Gemma 2's 50), `--chunk C`
(chunked attention, Llama 4's 8192) and `--sinks S` (learnable sinks $S \cdot
\mathrm{linspace}(-1, 1, H_q)$, a float32 parameter; GPT-OSS's are about 20) are
`cpref.attention`'s `softcap=`, `chunk=` and `sinks=` ([the variants][sim.oracle]); like the window
they reach every call alike (the ranks, their run without CP, the simulated cluster, the oracle),
every mode takes them, and the run's description and every case's label name them. With
`--sinks` each rank has its own copy of the sinks, as of every weight, and the table gains a
`dsinks` column: the sinks' gradient summed over the CP group (what a DP x CP step's all-reduce
sums; each rank's share is the implementation's business, the sum is the contract) against the
simulated cluster's sum. `--baseline sdpa` and `eager` attend without them and are
refused with them; where an `--impl` raises at CP size 1, a case with variants has no fallback
baseline and fails.

**Masks.** `--mask prefix-lm,spans,shared-prompt,random` (or `all`) runs every case once under each mask made of
its documents ([`sim.tools.verify.masks`][sim.tools.verify.masks]), `cpref.attention`'s `mask=`: the ranks, their
run without CP, the simulated cluster and the oracle take it, and the table gains a `mask` column. An `--impl`
receives the `cpref.Mask` as `mask=` (its `.slices` say which keys each query sees; `causal` and `window` keep their
defaults, and `--no-causal`, `--window` and `--chunk` are refused with `--mask`: a mask replaces them); one that
cannot take it is skipped, with a note ([Verify your implementation](verify-your-implementation.md#7-masks-mask)).

## Running it

| where | command |
| --- | --- |
| CPU, gloo | `python -m sim verify --backend gloo --nproc 4` |
| GPUs, NCCL | `python -m sim verify --backend nccl --nproc 8 --dtype bf16` |
| Ascend NPUs | `python -m sim verify --backend hccl --kernel npu --nproc 8 --dtype fp16,bf16` |
| torchrun | `torchrun --nproc-per-node 8 -m sim verify --backend nccl` |

`make test-npu` runs the HCCL line for CP 2, 4 and 8 (as many as the machine has NPUs), in
fp16 and bf16, unpadded and `--padded` (`sim.tools.npu_check.multi_rank_commands`).

Each rank runs on its device (cpu for gloo, `cuda:<local rank>`, `npu:<local rank>`).
Under torchrun (also multi-node) the world is torchrun's and `--nproc` is ignored; rank 0
gathers the results, computes the ground truth and prints the table.

**DP x CP.** `--nproc` is the world size and `--cp` the CP size: the world holds
`nproc / cp` CP groups, each running its own batch (seed + 1000 per DP index), each checked
against its own ground truth. `--cp-ranks strided` places CP groups on non-consecutive
ranks: with `--nproc 4 --cp 2` the groups are $\{0, 2\}$ and $\{1, 3\}$ instead of
$\{0, 1\}$ and $\{2, 3\}$. The groups are made once per run with `TorchComm.split`
(`new_group`s of the listed global ranks). The hierarchical mode's all-to-all group size is `--a2a-size`,
passed only to the modes whose options take it (default: 2 for an even CP size, so
`--cp 4` runs it as 2 x 2; 1, the ring, for an odd one).

## Checking another implementation: `--impl`

```bash
python -m sim verify --nproc 2 --impl mypackage.cp:attention
```

verifies any function with cpref's signature that takes the process group instead of
`comm`, against the same ground truth:

```python
# sketch: the signature your function gives; sim verify calls it on every rank
def attention(q, k, v, sharding, *, process_group, mode, causal, window, **options) -> torch.Tensor: ...
```

It gets this rank's shards (`sharding.shard(x, rank)`) on the rank's device, requiring grad,
and the batch's [`cpref.Sharding`][cpref.batch.sharding.Sharding] (the real and padded boundaries,
`sharding.cp_size` and `sharding.layout`), and returns this rank's output shard; the harness
backpropagates through it. `window` is the case's `(left, right)` (`(-1, -1)` without
`--window`), `options` holds the mode options (`a2a_size`) and, given, `softcap` and `chunk`;
`--kernel` applies to cpref only.
`--impl` may be repeated; `--impl cpref` is cpref itself. `tests/backends/verify_impls.py` has
a correct example (a `TorchComm` over the group, then `cpref.attention`) and wrong ones, and a
plain-torch CP attention with the bugs CP implementations have. Adapters of well-known
implementations ship in [`sim.tools.verify.peers`][sim.tools.verify.peers] (DeepSpeed-Ulysses);
[Verify your implementation](verify-your-implementation.md) walks through a run, column by column.
`examples/stream_ulysses.py` is a peer written the way
DeepSpeed-Ulysses is (`torch.distributed` and SDPA only, contiguous shards of the whole packed
stream): `--layout stream` describes its sharding, so it is verified on packed batches:

```bash
python -m sim verify --nproc 2 --mode a2a --layout stream --padded --docs 100,250,38 \
    --impl examples.stream_ulysses:attention
```

## Faults never hang

Processes are started by `sim.tools.launch.launch`. A rank that fails validation, raises, or is
killed ends the run with the launcher's report (which rank, how, its traceback; a raising
rank names the case it was running) and exit status 1, within the process-group timeout
(`--timeout`, default 300 s); the survivors are stopped after a short grace period.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
from typing import Any, Sequence

import cpref
from cpref.api import check_mode
from cpref.kernels.contract import NO_WINDOW, check_window
from sim.tools.cli import Parser, dtype_name, fail, nonnegative, positive, positive_float, positives, seconds
from sim.tools.launch import LaunchFailure, launch, under_torchrun
from sim.tools.verify.baselines import BASELINES, EAGER, VARIANTS, label
from sim.tools.verify.cases import DTYPES, Case, Setup, build_cases, lengths, lengths_note
from sim.tools.verify.masks import MASKS, random_note
from sim.tools.verify.rank import DEVICE_TYPES, Plan, load_impl, rank_main, takes_mask
from sim.tools.verify.truth import KEY, Report, check

__all__ = ["run", "main", "parse_args", "cases_from_args"]


def run(cases: Sequence[Case], setup: Setup | None = None, *, nproc: int = 2, backend: str = "gloo",
        timeout: float = 300.0, progress: bool | None = None) -> Report | None:  # fmt: skip
    """Run `cases` on `nproc` processes (one launch) and compare every rank with its ground truth.

    Args:
        cases: the cases, run in order by every rank.
        setup: what the cases share (documents, heads, seed, kernel).
        nproc: the world size; ignored under torchrun.
        backend: `"gloo"`, `"nccl"` or `"hccl"`.
        timeout: the process-group timeout in seconds.
        progress: progress bars on stderr (None: if stderr is a terminal, else a line per case;
            [`meter`][sim.tools.verify.meter.meter]; False: neither).

    Returns:
        The report; under torchrun, None on every rank but 0.

    Raises:
        ValueError: on cases that cannot run (unknown mode, a window on a mode that takes none,
            CP size not dividing the world, an `--impl` that does not import), before any process starts.
        LaunchFailure: if a rank raised or died.
    """
    setup = Setup() if setup is None else setup
    # 1) everything that can be checked before a process starts
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else nproc
    _check(cases, world, backend, setup.heads)
    if ":" in setup.baseline:
        load_impl(setup.baseline, "--baseline")
    # 2) the production path, on every rank
    plan = Plan(setup, tuple(cases), backend, progress)
    per_rank = launch(rank_main, nproc, backend=backend, timeout=timeout, args=(plan,), device=plan.device_type)
    if under_torchrun():
        per_rank = per_rank[0]  # every rank's results on rank 0, None elsewhere
        if per_rank is None:
            return None
    # 3) the ground truth, rank by rank
    return check(setup, list(cases), per_rank, progress=progress)


def _check(cases: Sequence[Case], world: int, backend: str, heads: tuple[int, int] = Setup.heads) -> None:
    if backend not in DEVICE_TYPES:
        raise ValueError(f"backend must be one of {sorted(DEVICE_TYPES)}, got {backend!r}")
    if not cases:
        raise ValueError("no cases to run")
    for case in cases:
        if case.mode not in cpref.MODES or case.layout not in cpref.LAYOUTS or case.dtype not in DTYPES:
            raise ValueError(f"case {case.label}: mode, layout or dtype unknown; modes are {sorted(cpref.MODES)}")
        if case.windowed and not cpref.MODES[case.mode].windows:
            raise ValueError(f"case {case.label}: mode {case.mode} takes no sliding window; "
                             f"the modes that do: {', '.join(_window_modes())}")  # fmt: skip
        if case.cp < 1 or world % case.cp:
            raise ValueError(f"case {case.label}: CP size {case.cp} does not divide the world size {world}")
        if case.impl != "cpref":
            if not takes_mask(load_impl(case.impl)) and case.mask is not None:
                raise ValueError(f"case {case.label}: --impl {case.impl} does not take mask= (a keyword, or **options); "
                                 "the command line skips it under --mask")  # fmt: skip
        else:  # what cpref.attention would refuse on every rank (heads that do not split, an option that does not fit)
            try:
                check_mode(case.mode, cp_size=case.cp, heads=heads, causal=case.causal, window=case.window,
                           layout=case.layout, mask=case.mask is not None, **dict(case.options))  # fmt: skip
            except ValueError as exc:
                raise ValueError(f"case {case.label}: {exc}") from None


def _names(value: str, allowed: Sequence[str], what: str) -> list[str]:
    """`all` or a comma list of names from `allowed`."""
    names = list(allowed) if value == "all" else [n.strip() for n in value.split(",") if n.strip()]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{what} {bad or value!r} unknown; choose from {', '.join(allowed)} or all")
    return names


def _option(text: str) -> tuple[str, Any]:
    """`NAME=VALUE` as `(name, value)`, the value a Python literal (`True`, `2`, `'x'`)."""
    name, eq, value = text.partition("=")
    if not eq or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=VALUE, e.g. overlap=True")
    try:
        return name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        raise argparse.ArgumentTypeError(f"{text!r}: the value must be a Python literal (True, 2, 'x')") from None


def _window(value: str) -> tuple[int, int]:
    """`LEFT,RIGHT`: two ints >= -1, `cpref.attention`'s `window=(left, right)`."""
    try:
        left, right = map(int, value.split(","))
        if min(left, right) >= -1:
            return left, right
    except ValueError:  # not two integers
        pass
    raise argparse.ArgumentTypeError(f"expected LEFT,RIGHT, two integers >= -1 (-1: unbounded), e.g. 127,0; got {value!r}")


def _window_modes() -> list[str]:
    """The modes that take a sliding window (`cpref.MODES[m].windows`)."""
    return [m for m in sorted(cpref.MODES) if cpref.MODES[m].windows]


def _glued(argv: Sequence[str]) -> list[str]:
    """`--window -1,4` as `--window=-1,4`: argparse would take a value starting with `-` for an option."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] == "--window" and arg.startswith("-") and arg[1:2].isdigit():
            out[-1] = f"--window={arg}"
        else:
            out.append(arg)
    return out


def _windowed_modes(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """`(modes, skipped)`: under a window, `--mode all` skips the modes that take none; naming one is an error."""
    if args.window == NO_WINDOW:
        return args.modes, []
    skipped = [m for m in args.modes if not cpref.MODES[m].windows]
    if skipped and args.mode != "all":
        raise ValueError(f"--window {_pair(args.window)}: mode {', '.join(skipped)} takes no sliding window; "
                         f"the modes that do: {', '.join(_window_modes())} (--mode all runs those only)")  # fmt: skip
    return [m for m in args.modes if m not in skipped], skipped


def _masked(args: argparse.Namespace) -> list[str | None]:
    """`--mask`'s names (`[None]` without it); refused with `--no-causal`, `--window` or `--chunk`, which it replaces."""
    if args.mask is None:
        return [None]
    names = _names(args.mask, MASKS, "mask")
    given = [flag for flag, on in (("--no-causal", not args.causal), (f"--window {_pair(args.window)}", args.window != NO_WINDOW),
                                   (f"--chunk {args.chunk}", args.chunk is not None)) if on]  # fmt: skip
    if given:
        raise ValueError(f"--mask {args.mask} with {' and '.join(given)}: a mask replaces causal, window and chunk "
                         "(cpref.attention's mask=); leave them out, or --mask")  # fmt: skip
    return names


def _mask_takers(cases: Sequence[Case]) -> tuple[list[Case], dict[str, int]]:
    """`(cases to run, {impl: cases skipped})`: under a mask, the cases of an `--impl` that does not take `mask=`."""
    skipped: dict[str, int] = {}
    for case in cases:
        if case.mask is None or case.impl == "cpref":
            continue
        try:
            fn = load_impl(case.impl)
        except ValueError:  # one that does not import: `_check` names it
            continue
        if not takes_mask(fn):
            skipped[case.impl] = skipped.get(case.impl, 0) + 1
    return [c for c in cases if c.impl not in skipped or c.mask is None], skipped


def _pair(window: tuple[int, int]) -> str:
    return f"{window[0]},{window[1]}"


def _mask_name(args: argparse.Namespace) -> str:
    """How the run's description names its mask: `mask prefix-lm,spans`, `causal` or `full`."""
    return f"mask {','.join(args.masks)}" if args.mask is not None else "causal" if args.causal else "full"


def _random_totals(setup: Setup, cases: Sequence[Case]) -> dict[str, int]:
    """`{"zigzag cp2": T}`: the real tokens of every batch a `--mask random` case draws its slices over."""
    return {f"{c.layout} cp{c.cp}{' pad' if c.padded else ''}": sum(lengths(setup, c)[0]) for c in cases if c.mask == "random"}


def parse_args(argv: Sequence[str] | None = None, prog: str = "python -m sim verify") -> argparse.Namespace:
    """The command line of `python -m sim verify` (`--help` lists it)."""
    p = Parser(prog=prog, description="Rank-by-rank verification of CP attention against the simulated cluster's "
               "FP64 ground truth (see the sim.tools.verify docs page).")  # fmt: skip
    p.add_argument("--backend", choices=sorted(DEVICE_TYPES), default="gloo")
    p.add_argument("--nproc", type=positive, default=2, help="world size: processes to start (ignored under torchrun)")
    p.add_argument("--cp", type=positive, help="CP size (default: the world size); the world holds nproc / cp CP groups")
    p.add_argument("--cp-ranks", choices=("consecutive", "strided"), default="consecutive",
                   help="CP groups {0..cp-1}, ... or {0, nproc/cp, ...}, ... (non-consecutive ranks)")
    p.add_argument("--mode", default="all", help=f"comma list or all; of {', '.join(sorted(cpref.MODES))}")
    p.add_argument("--layout", default="all", help=f"comma list or all; of {', '.join(cpref.LAYOUTS)}")
    p.add_argument("--dtype", default="fp32", help=f"comma list or all; of {', '.join(DTYPES)} (or torch's names: float32, ...)")
    p.add_argument("--option", action="append", type=_option, default=[], metavar="NAME=VALUE",
                   help="a mode option, for the modes that declare it, e.g. overlap=True (repeatable; Python literals)")
    p.add_argument("--a2a-size", type=positive, help="all-to-all group size, for the modes that take a2a_size (default: 2 for an even CP size, else 1)")
    p.add_argument("--docs", type=positives, default=Setup.docs, help="document lengths (default 1000,3000,500)")
    p.add_argument("--heads", type=positives, default=Setup.heads, help="Hq,Hkv (default 8,4)")
    p.add_argument("--head-dim", type=positive, default=Setup.head_dim)
    p.add_argument("--seed", type=nonnegative, default=0)
    p.add_argument("--kernel", choices=("torch", "npu"), default="torch", help="cpref's attention kernel")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--window", type=_window, default=NO_WINDOW, metavar="LEFT,RIGHT",
                   help="sliding window (-1: unbounded; causal: RIGHT 0), for the modes that take one: "
                   f"{', '.join(_window_modes())}; --mode all skips the others (default -1,-1: none)")  # fmt: skip
    p.add_argument("--softcap", type=positive_float, metavar="C",
                   help="logit soft-capping: every score C tanh(S / C) (Gemma 2: 50); every mode takes it")
    p.add_argument("--sinks", type=positive_float, metavar="S",
                   help="learnable sinks of S linspace(-1, 1, Hq) (GPT-OSS's are about 20); every mode; the sinks' "
                        "gradient, summed over the CP group, is a fifth column")  # fmt: skip
    p.add_argument("--chunk", type=positive, metavar="C",
                   help="chunked attention: a query sees only its chunk of C positions (Llama 4: 8192); every mode")
    p.add_argument("--mask", metavar="NAMES", help=f"comma list or all; of {', '.join(MASKS)}: every case once under each "
                   "mask, built from its documents and given as cpref.attention's mask= (an --impl gets the cpref.Mask); "
                   "replaces causal, --window and --chunk (default: none, the documents' causal or full mask)")  # fmt: skip
    p.add_argument("--padded", action="store_true", help="real lengths off the granularity, with cu_seqlens_padded")
    p.add_argument("--impl", action="append", metavar="package.module:function", help="verify this function (repeatable)")
    p.add_argument("--baseline", default="auto", metavar="NAME", help="the run without CP of the vs P=1 column: auto "
                   "(impl for --impl rows, falling back to the looser of sdpa and eager where the implementation "
                   "raises at CP size 1; kernel for cpref), impl (the implementation at CP size 1), sdpa (PyTorch's "
                   "SDPA in the dtype), eager (scores and probabilities in the dtype, softmax in float32), kernel "
                   "(cpref's) or package.module:function (your local attention)")  # fmt: skip
    p.add_argument("--timeout", type=seconds, default=300.0, help="process-group timeout in seconds")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None, help="a progress bar on stderr "
                   "(default: if stderr is a terminal, else one line per case as it finishes; --no-progress: neither)")
    args = p.parse_args(_glued(sys.argv[1:] if argv is None else argv))
    try:
        args.window = check_window(args.window, args.causal)  # canonical: (w, 0) under causal, (-1, -1) for none
    except ValueError as exc:  # RIGHT > 0 under causal
        p.error(f"--window {_pair(args.window)}: {exc} (--no-causal)")
    try:
        args.masks = _masked(args)
        args.modes = _names(args.mode, sorted(cpref.MODES), "mode")
        args.modes, args.skipped = _windowed_modes(args)
        unknown = [name for name, _ in args.option if all(name not in cpref.MODES[m].defaults() for m in args.modes)]
        if unknown:
            raise ValueError(f"--option {unknown[0]}: no mode of {args.modes} takes it")
        args.layouts = _names(args.layout, list(cpref.LAYOUTS), "layout")
        args.dtypes = _names(",".join(dtype_name(x) for x in args.dtype.split(",")), list(DTYPES), "dtype")
        if args.baseline not in BASELINES and ":" not in args.baseline:
            raise ValueError(f"--baseline {args.baseline!r}: expected {', '.join(BASELINES)} or package.module:function")
        args.variants = {name: getattr(args, name) for name in VARIANTS if getattr(args, name) is not None}
        if args.variants and args.baseline in ("sdpa", "eager"):
            flags = " ".join(f"--{name} {value:g}" for name, value in args.variants.items())
            raise ValueError(f"--baseline {args.baseline} with {flags}: {args.baseline} attends without the variants; "
                             "use --baseline auto (cpref's kernel, or your implementation on one rank) or kernel")  # fmt: skip
        baseline = EAGER if args.baseline == "eager" else args.baseline  # eager is a function, named as yours is
        args.setup = Setup(args.docs, tuple(args.heads), args.head_dim, args.seed, args.kernel, baseline)
        if ":" in baseline and not takes_mask(load_impl(baseline, "--baseline")) and args.mask is not None:
            raise ValueError(f"--baseline {args.baseline} does not take mask= (a keyword, or **options), which every "
                             f"run without CP gets under --mask {args.mask}; give it one, or use --baseline auto")  # fmt: skip
    except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
        p.error(str(exc))
    return args


def cases_from_args(args: argparse.Namespace, world: int) -> list[Case]:
    """The product of the command line's choices."""
    cp = args.cp or world
    return build_cases(args.modes, args.layouts, args.dtypes, cp=cp, strided=args.cp_ranks == "strided",
                       padded=(args.padded,), causal=args.causal, impls=args.impl or ("cpref",),
                       a2a_size=args.a2a_size, window=args.window, options=dict(args.option),
                       variants=args.variants, masks=args.masks)  # fmt: skip


def main(argv: Sequence[str] | None = None, prog: str = "python -m sim verify") -> int:
    """Parse, run, print the table; return the exit status (0: every row passes)."""
    args = parse_args(argv, prog)
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else args.nproc
    cases, printer = cases_from_args(args, world), int(os.environ.get("RANK", "0")) == 0
    cases, maskless = _mask_takers(cases)
    if printer and maskless:
        print("".join(f"note: --mask {args.mask}: --impl {impl} skipped (does not take mask=): {n} case(s); give it a "
                      "mask keyword (a cpref.Mask: its .slices say which keys each query sees) to verify it under masks\n"
                      for impl, n in maskless.items()), end="", flush=True)  # fmt: skip
    if not cases:
        return fail(prog, f"--mask {args.mask}: no case left to run, every --impl skipped (does not take mask=)")
    try:
        _check(cases, world, args.backend, args.setup.heads)  # refused in one line, before anything is printed
    except ValueError as exc:
        return fail(prog, str(exc))
    s, window = args.setup, "" if args.window == NO_WINDOW else f", window {_pair(args.window)}"
    window += "".join(f", {name} {value:g}" for name, value in args.variants.items())
    if printer and args.skipped:
        print(f"note: --window {_pair(args.window)} skips mode {', '.join(args.skipped)} (no sliding window); "
              f"the modes that take one: {', '.join(_window_modes())}", flush=True)  # fmt: skip
    if printer:
        print(f"rank-by-rank verification: {len(cases)} case(s) on {world} {args.backend} rank(s), kernel {s.kernel}; "
              f"documents {','.join(map(str, s.docs))}{' padded' if args.padded else ''}, Hq={s.heads[0]} "
              f"Hkv={s.heads[1]} D={s.head_dim}, {_mask_name(args)}{window}, seed {s.seed}; "
              "errors against the simulated cluster in FP64 "
              f"(pass/fail), vs P=1: error against the oracle over that of the same attention without CP (baseline "
              f"{label(s.baseline)}; pass: <= 2), "
              "oracle column: against the FP64 oracle", flush=True)  # fmt: skip
    note = "\n".join(n for n in (lengths_note(s, cases), random_note(s.seed, _random_totals(s, cases))) if n)
    if printer and note:
        print(note, flush=True)
    try:
        report = run(cases, s, nproc=args.nproc, backend=args.backend, timeout=args.timeout, progress=args.progress)
    except ValueError as exc:
        return fail(prog, str(exc))
    except LaunchFailure as failure:
        print(f"verification FAILED: a rank failed before every case was compared\n{failure}", file=sys.stderr)
        return 1
    if report is None:
        return 0  # torchrun rank > 0: rank 0 compares and prints
    print(report.format())
    print(KEY)
    print("verification " + ("passed" if report.ok else "FAILED"), flush=True)
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
