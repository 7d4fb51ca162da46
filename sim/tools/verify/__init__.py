r"""Rank-by-rank verification: `python -m sim verify`.

The production path (`cpref.attention` over [`TorchComm`][cpref.comm.torch_dist.TorchComm]
on real processes, gloo on CPUs, NCCL on GPUs, HCCL on Ascend NPUs) is checked **rank by
rank** against the simulated cluster's FP64 ground truth:

```bash
python -m sim verify --backend gloo --nproc 2 --mode all --layout all --docs 100,250,38
```

starts 2 processes, runs every mode of `cpref.MODES` in every layout, forward and backward,
and prints one row per case and rank: the largest error of `out`, `dQ`, `dK`, `dV`, the
tolerance, the worst entry's share of it (`err/tol`: the verdict's own measure, at most 1 to pass), how
far the rank is from the oracle relative to the same attention without CP (`vs P=1`), the largest
error against the oracle, and pass/fail. The p2p zigzag fp32 rows, on this machine on 2026-12-07
(the test suite re-measures them: ratios to 0.05, errors to 25 %):

```text
mode  layout  dtype  pad  cp rank  dp   r       out        dq        dk        dv      tol  err/tol      vs P=1    oracle  result
p2p   zigzag  fp32   no    2    0   0   0  4.82e-07  1.32e-06  1.86e-06  2.06e-06  1.0e-05     0.09    1.16 <=2  2.06e-06  pass
p2p   zigzag  fp32   no    2    1   0   1  5.51e-07  7.73e-07  8.18e-07  5.14e-07  1.0e-05     0.05    1.00 <=2  8.18e-07  pass
```

(`rank` is the world rank, `dp` its CP group, `r` its rank in the group; the page
[Verify: every option](verify-reference.md#3-read-the-table-column-by-column)
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
pass). [Verify: every option](verify-reference.md#4-the-baseline-the-same-attention-without-cp)
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
cannot take it is skipped, with a note ([Verify: every option](verify-reference.md#7-masks-mask)).

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

It gets this rank's shards (`sharding.shard(x, rank)`) on the rank's device, requiring grad (not under
`--forward-only`),
and the batch's [`cpref.Sharding`][cpref.batch.sharding.Sharding] (the real and padded boundaries,
`sharding.cp_size` and `sharding.layout`), and returns this rank's output shard; the harness
backpropagates through it. `window` is the case's `(left, right)` (`(-1, -1)` without
`--window`), `options` holds the mode options (`a2a_size`) and, given, `softcap` and `chunk`;
`--kernel` applies to cpref only.
`--impl` may be repeated; `--impl cpref` is cpref itself. `tests/backends/verify_impls.py` has
a correct example (a `TorchComm` over the group, then `cpref.attention`) and wrong ones, and a
plain-torch CP attention with the bugs CP implementations have. Adapters of well-known
implementations ship in [`sim.tools.verify.peers`][sim.tools.verify.peers] (DeepSpeed-Ulysses);
[Verify your implementation](verify-your-implementation.md) walks through a run and an adapter;
[Verify: every option](verify-reference.md) reads the table column by column.
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

## The package

The command line ([`cli`][sim.tools.verify.cli]) makes the cases ([`cases`][sim.tools.verify.cases],
under a mask [`masks`][sim.tools.verify.masks]) and checks them before any process starts;
[`runner`][sim.tools.verify.runner] launches the processes, each running every case
([`rank`][sim.tools.verify.rank]) on the implementation [`impls`][sim.tools.verify.impls] loads
(adapters of other people's CP, `--peer`: [`peers`][sim.tools.verify.peers] for DeepSpeed-Ulysses,
[`peer_torch_ring`][sim.tools.verify.peer_torch_ring] for PyTorch's ring) and its run without CP
([`baselines`][sim.tools.verify.baselines]; a ring's sends to itself there are local copies,
[`loopback`][sim.tools.verify.loopback]), counting what each rank moves and computes as it
runs ([`wire`][sim.tools.verify.wire]); [`truth`][sim.tools.verify.truth] compares every rank
with the FP64 ground truth, [`table`][sim.tools.verify.table] prints it and the last line,
[`meter`][sim.tools.verify.meter] the progress. `--check-mask` runs [`probe`][sim.tools.verify.probe]
instead: which pairs each rank attends, against the mask's ([`probe_pairs`][sim.tools.verify.probe_pairs]).
"""

from __future__ import annotations

from sim.tools.verify.cli import cases_from_args, main, parse_args
from sim.tools.verify.runner import run

__all__ = ["run", "main", "parse_args", "cases_from_args"]
