"""Generate the site's pages at build time (a mkdocs-gen-files script; nothing here is committed).

1. Guide pages: each page's body IS a module's docstring, so the tutorial lives next to the
   code it explains. The summary line becomes the title, figures are appended, and a footer
   names the source file.
2. API reference: one page per module of `src/cpref` and `sim`, found by walking the files.
3. Source pages: every file of `src/cpref` and `sim`, highlighted (`docs/source_pages.py`);
   the "Source:" footers and the header's repository link point to them.
4. Figures: drawn with matplotlib from cpref itself (`docs/figures.py`).
5. `SUMMARY.md`: the navigation, read by mkdocs-literate-nav.

A module that fails to import fails the build: there is no silent skipping.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import io
import posixpath
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT / "src", ROOT):  # cpref from src/, sim from the repository root
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import mkdocs_gen_files  # noqa: E402
from mkdocs.structure.files import InclusionLevel  # noqa: E402

# The guide, in nav order: (page, nav title, module). Add a module with one line.
GUIDE = [
    ("layout.md", "Data model and layouts", "cpref.batch.layout"),
    ("balanced.md", "The balanced layout", "cpref.batch.balanced"),
    ("balanced-mask.md", "The balanced layout given a mask", "cpref.batch.balanced_mask"),
    ("oracle.md", "The FP64 oracle", "sim.oracle"),
    ("kernel-contract.md", "The attention kernel contract", "cpref.kernels.contract"),
    ("torch-kernel.md", "TorchKernel", "cpref.kernels.torch_kernel"),
    ("softcap-native.md", "Soft-capping, compiled", "cpref.kernels.softcap_native"),
    ("cuda-kernel.md", "CudaKernel (flash on CUDA)", "cpref.kernels.cuda_kernel"),
    ("npu-kernel.md", "NpuKernel (Ascend NPU)", "cpref.kernels.npu_kernel"),
    ("comm.md", "The collectives protocol", "cpref.comm.protocol"),
    ("cluster.md", "The simulated cluster", "sim.cluster.simcluster"),
    ("seqlens.md", "Real and padded boundaries", "cpref.batch.seqlens"),
    ("cache.md", "The batch cache", "cpref.batch.cache"),
    ("sharding.md", "Sharding a batch", "cpref.batch.sharding"),
    ("mask.md", "Masks as slices", "cpref.batch.mask"),
    ("mask-union.md", "The union of slices", "cpref.batch.mask_union"),
    ("metadata.md", "Load-balanced metadata", "cpref.modes.all_gather_plan"),
    ("all-gather-pieces.md", "All-gather over pieces", "cpref.modes.all_gather_pieces"),
    ("all-gather.md", "KV all-gather CP (MindSpeed RFC)", "cpref.modes.all_gather"),
    ("all-gather-overlap.md", "All-gather overlap", "cpref.modes.all_gather_overlap"),
    ("mask-plan.md", "Masks in the modes", "cpref.modes.mask_plan"),
    ("all-gather-mask.md", "All-gather under a mask", "cpref.modes.all_gather_mask"),
    ("merge.md", "Merging partial results", "cpref.kernels.merge"),
    ("ring-plan.md", "The ring's steps", "cpref.modes.ring_plan"),
    ("ring.md", "Ring attention (p2p)", "cpref.modes.ring"),
    ("ring-window.md", "The ring under a sliding window", "cpref.modes.ring_window"),
    ("ulysses.md", "Ulysses (a2a)", "cpref.modes.ulysses"),
    ("ulysses-split.md", "Ulysses for stream and balanced", "cpref.modes.ulysses_split"),
    ("ulysses-pipeline.md", "Ulysses in head groups", "cpref.modes.ulysses_pipeline"),
    ("hierarchical.md", "Hierarchical a2a+p2p", "cpref.modes.hierarchical"),
    ("hierarchical-split.md", "a2a+p2p for stream and balanced", "cpref.modes.hierarchical_split"),
    ("which-mode.md", "What each mode costs", "cpref.modes.costs"),
    ("mode-spec.md", "Modes that declare themselves", "cpref.modes.spec"),
    ("api.md", "The attention API", "cpref.api"),
    ("consistency.md", "Do the ranks agree?", "cpref.modes.consistency"),
    ("determinism.md", "Deterministic backward", "cpref.base.determinism"),
    ("data.md", "The data path and loss", "cpref.train.data"),
    ("models.md", "Models with CP", "cpref.models"),
    ("hf.md", "Hugging Face models", "cpref.hf"),
    ("hf-batch.md", "Hugging Face batches", "cpref.hf.batch"),
    ("hf-guard.md", "What every Hugging Face forward checks", "cpref.hf.guard"),
    ("hf-labels.md", "Labels under CP", "cpref.hf.labels"),
    ("hf-admit.md", "Which Hugging Face models run", "cpref.hf.admit"),
    ("training.md", "The training step", "cpref.train.training"),
    ("train.md", "Train a model with CP", "sim.tools.train"),
    ("checkpoint.md", "Checkpoints", "cpref.train.checkpoint"),
    ("checkpoint-files.md", "Where checkpoints live", "cpref.train.checkpoint_files"),
    ("checkpoint-meta.md", "What a checkpoint records", "cpref.train.checkpoint_meta"),
    ("checkpoint-swap.md", "A save a crash cannot lose", "cpref.train.checkpoint_swap"),
    ("checkpoint-lock.md", "One run saves at a time", "cpref.train.checkpoint_lock"),
    ("checkpoint-errors.md", "When a save fails", "cpref.train.checkpoint_errors"),
    ("torch-dist.md", "Collectives over torch.distributed", "cpref.comm.torch_dist"),
    ("backend-facts.md", "What each backend can do", "cpref.comm.capabilities"),
    ("verify.md", "Rank-by-rank verification", "sim.tools.verify"),
    ("performance.md", "Performance", "bench.report"),
    ("perf-kernel.md", "The kernel against SDPA", "bench.kernel"),
    ("perf-overhead.md", "The CP path at P = 1", "bench.overhead"),
    ("perf-scaling.md", "Strong scaling over gloo", "bench.scaling"),
    ("perf-memory.md", "Memory per rank", "bench.memory"),
    ("perf-all-gather.md", "All-gather balance, timed", "bench.all_gather"),
    ("perf-collectives.md", "Collectives or pairwise sends", "bench.collectives"),
    ("perf-window.md", "A sliding window on the fused path", "bench.window"),
    ("perf-layouts.md", "The layouts on packed batches", "bench.layouts"),
    ("perf-variants.md", "What the variants cost", "bench.variants"),
    ("perf-plan.md", "The planner at scale", "bench.plan"),
    ("perf-masks.md", "What a mask costs", "bench.masks"),
    ("planner.md", "The planner", "sim.plan.planner"),
    ("mode-study.md", "The modes from 8 to 1024 ranks", "sim.plan.study"),
    ("plan-scale.md", "Plans at scale", "sim.plan.scale"),
    ("plan-schedule.md", "A schedule at scale", "sim.plan.schedule"),
    ("plan-scale-window.md", "Irregular plans at scale", "sim.plan.scale_window"),
    ("plan-scale-split.md", "Split plans at scale (stream, balanced)", "sim.plan.scale_split"),
    ("sim-plan.md", "python -m sim plan", "sim.tools.plan"),
    ("plan-model.md", "The planner's time model", "sim.plan.model"),
    ("plan-profiles.md", "Hardware profiles", "sim.plan.profile"),
    ("plan-dry-run.md", "The dry run: a step counted", "sim.plan.dry"),
    ("plan-links.md", "Link levels", "sim.plan.links"),
    ("plan-calibrate.md", "Calibrating this machine", "sim.plan.calibrate"),
    ("plan-batches.md", "Sampled batches", "sim.plan.batches"),
]

# Figures of a guide page: page -> [(figure path, caption)], each placed where its marker line `{{ figure PATH }}`
# stands in the docstring, beside the paragraph that explains it; a figure without its marker fails the build. Each
# figure appears once. A caption is inline Markdown (it renders in <figcaption>); its alt text is the
# caption without backticks.
PAGE_FIGURES = {
    "mode-study.md": [
        ("figures/study_h100.png", "Eight H100s a node (NVLink inside, InfiniBand across): each mode's best candidate "
         "at every P, its step for one layer's forward and backward on a 128k-token packed batch, predicted by the "
         "planner when this site was built. Ringed: the winner; dotted: where the winner changes; dashed: every FLOP "
         "split evenly at the profile's peak."),
        ("figures/study_910b.png", "The same on eight Ascend 910Bs a node (HCCS inside, RoCE across)."),
        ("figures/study_whole_h100.png", "The H100s and the 8B-like heads again: each mode's best candidate over the "
         "layouts that keep documents whole (stream, balanced; solid) beside its best over contiguous or zigzag "
         "(dotted, from the first figure); dashed: every FLOP split evenly at the profile's peak."),
    ],
    "layout.md": [
        ("figures/layouts.png", "Which rank holds which chunk of each document (contiguous, zigzag), or which "
         "piece of the stream (stream: documents straddle ranks, none is padded), or which whole document or "
         "zigzag pair of a cut one (balanced)."),
        ("figures/work.png", "Causal attention work per rank under both metrics: zigzag makes every rank's work "
         "equal; stream is unbalanced like contiguous, over the whole batch at once."),
        ("figures/attention_mask.png",
         "The causal mask of a packed batch, each visible score coloured by the rank that computes it "
         "(the rank holding its query); black lines are document boundaries. Below each panel, every "
         "rank's work as the exact count of visible scores and as the block metric `sum(q_len * kv_len)`. "
         "Striped (token `t` on rank `t mod P`) is drawn for comparison only: cpref has no striped "
         "layout, so it has no block metric."),
    ],
    "hf-batch.md": [
        ("figures/hf_batch.png", "What `shard_batch` makes of a padded batch: each row's tokens a document, packed "
         "in row order and padded at its end for the layout; each rank keeps its zigzag chunks, and a document's last "
         "token takes no loss (it has no next token in its document)."),
    ],
    "all-gather.md": [
        ("figures/rank_major_index.png",
         "The gathered K/V stay rank-major; `kv_index` picks each query chunk's causal prefix in natural order."),
    ],
    "determinism.md": [
        ("figures/occurrence_layers.png",
         "The all-gather figure's rank 0: its `kv_index` entries (columns) and the buffer rows they add to, "
         "coloured by occurrence layer. With `deterministic=True` each layer is one `index_add_` over distinct rows."),
    ],
    "all-gather-overlap.md": [
        ("figures/overlap_schedule.png",
         "The schedule each rank ran in a real forward + backward on the simulated cluster with overlap=True, as its "
         "communicator and kernel logged it: every kernel call in order, as wide as the score entries it computed "
         "(causal over the keys held here, or unmasked over the gathered ones), and every collective from its post to "
         "its wait. The forward's all-gathers travel under the local call; the backward's under its first half, the "
         "reduce-scatters under its second."),
    ],
    "ring.md": [
        ("figures/ring_forward.png",
         "A real forward of `p2p` on the simulated cluster, step by step: each rank's queries (Q, in its colour) and "
         "the K/V block its kernel call computed on (in its owner's colour, identified from the call's keys); below, "
         "the running output and lse, a slot per rank filled once that rank's block is merged in. The arrows are the "
         "shifts between steps, identified from what each carried: every block moves one rank on, the last rank's "
         "back to rank 0."),
        ("figures/ring_backward.png",
         "The backward of the same run: the K/V blocks go round again, and each block's dK/dV accumulator travels "
         "with it, a slot per rank filled once that rank's share is in it (identified from the payload: the sum of "
         "exactly those ranks' shares). After the last step one more shift brings every accumulator home, holding "
         "all four shares. The inputs are float64 here, so an accumulator has its block's bytes; with bf16 inputs "
         "it is float32, twice as many."),
        ("figures/ring_schedule.png",
         "What each rank's kernel computed at each ring step of a real run on the simulated cluster: whose K/V "
         "block it held and how many scores it computed (identified from the kernel's inputs). Zigzag does the "
         "same work on every rank at every step; contiguous skips the blocks of later ranks."),
    ],
    "balanced-mask.md": [
        ("figures/balanced_mask.png",
         "A long-tailed pack of 24 documents under a prefix-LM (every document's prompt a random share of it) over "
         "`P = 4`: which rank holds which tokens in zigzag, in the causal balanced layout and in the layout balanced "
         "given the mask, and each rank's work under the mask, counted from the mask. Zigzag and the causal plan "
         "balance causal documents, whose rows cost their position; a prompt's rows all cost the whole prompt."),
    ],
    "balanced.md": [
        ("figures/balanced.png",
         "A long-tailed pack of 24 documents over `P = 4`: which rank holds which tokens in the zigzag layout "
         "(every document cut in 8 chunks, each padded to a multiple of 8) and in the balanced one (the few "
         "long documents cut in symmetric pairs, in the uneven shares that balance each rank's work, every other "
         "document whole on one rank), and each rank's causal work."),
    ],
    "ring-window.md": [
        ("figures/window_ring.png",
         "A real forward of `p2p` with `window=(3, 0)` on the simulated cluster. Above, the scores the window "
         "leaves, in the colour of the rank that computes them (grey: scores of the causal mask outside the "
         "window); the counts are the run's kernel calls'. Below, the keys each ring step received, in their "
         "owner's colour, read from every shift's payload; grey: the rest of the whole blocks the ring without a "
         "window sends. Contiguous sends one halo, the last 3 rows of each document's chunk, to the next rank; "
         "zigzag sends the front chunks' halos there too and the back chunks' straight to the rank before (3 ranks "
         "on, modulo 4): two shifts. A shift is as long on every rank as its longest halo (zero rows pad the "
         "rest); a row is 128 B (float64, `Hkv = 2`, `D = Dv = 4`)."),
    ],
    "ulysses-pipeline.md": [
        ("figures/ulysses_pipeline.png",
         "The schedule each rank ran in a real forward + backward on the simulated cluster with head_groups=2, as its "
         "communicator and kernel logged it: every kernel call in order, as wide as the score entries it computed over "
         "its heads, and every all-to-all that a call hid, from its post to its wait (those waited for at once, the "
         "first group's inputs and the last group's results, take no width here: nothing computes while they travel). "
         "Group 1's q, k and v travel under group 0's call, group 0's output under group 1's; the backward likewise "
         "with dout in and dq, dk, dv out."),
    ],
    "ulysses.md": [
        ("figures/ulysses_exchange.png",
         "Which rank holds which (token, head) of `q` before the all-to-all (its zigzag shard of every head) and "
         "after it (all tokens of one head), read from what each rank's kernel call received."),
    ],
    "train.md": [
        ("figures/parity.png",
         "Two real runs of `python -m sim train`, drawn when this site was built: the loss of each step at CP = 1 "
         "and at CP = 4 lie on top of each other; below, their relative difference."),
    ],
    "ulysses-split.md": [
        ("figures/split_balance.png",
         "Each rank's attention work in the split Ulysses on the packed mix, over the mean: the documents whose tokens "
         "span ranks exchanged alone (plain) and with the documents the balance adds (hatched); each rank's bar in its "
         "color. The counts are the plan's (`split_loads`), which the tests hold to the work of the kernels' calls."),
    ],
    "hierarchical-split.md": [
        ("figures/split_traffic.png",
         "A long-tailed pack of 24 documents under balanced over `P = 4`: each rank's own rows (documents it holds "
         "whole, attended at home with all heads) and shared rows (padded to the most any rank has), and the bytes "
         "each rank sends in `a2a` and `a2a+p2p` (a2a_size 2), split, against zigzag, where every row is exchanged; "
         "from a run on the simulated cluster."),
    ],
    "performance.md": [
        ("figures/bench_scaling.png",
         "From the last `make bench` (`bench/results/scaling.json`): the speedup of every mode at CP = 2 over gloo, in "
         "each layout, on each batch, against what two independent processes give on this machine (dashed) and the "
         "target, 0.95 of that (dotted): the efficiency against the machine."),
    ],
    "perf-kernel.md": [
        ("figures/bench_kernel.png",
         "From the last `make bench` (`bench/results/kernel.json`): each mix's forward + backward time of `TorchKernel`'s "
         "fast and explicit paths over SDPA called once per document; below the line is faster than SDPA, the dashed "
         "lines are the targets."),
    ],
    "perf-memory.md": [
        ("figures/bench_memory.png",
         "From the last `make bench` (`bench/results/memory.json`): the busiest rank's bytes saved for the backward, "
         "measured (dots) on the line of `mode_costs`' formula, and its peak of forward + backward, input shards "
         "included (squares), at P = 1, 2 and 4."),
    ],
    "perf-layouts.md": [
        ("figures/bench_bytes.png",
         "From the last `make bench` (`bench/results/layouts.json`): the bytes the busiest rank sends in each mode and "
         "layout on the lognormal pack (69 documents, 65,536 tokens), counted from the simulated cluster's trace."),
    ],
    "hierarchical.md": [
        ("figures/hierarchical_schedule.png",
         "A real run with `a2a_size = 2` at `P = 4`: each rank's kernel calls at the two ring steps, and whose "
         "a2a group's K/V they saw (identified from the kernel's inputs)."),
        ("figures/hierarchical_pipeline.png",
         "The same mode with head_groups=2, as each rank's communicator and kernel logged a real forward + backward: "
         "each head group's ring makes two calls (its two steps), and group 1's exchange inside the a2a group "
         "travels under group 0's ring, group 0's output under group 1's; the ring's own shifts, under its calls, "
         "are not drawn."),
    ],
}

# Hand-written pages (in docs/) placed around the generated guide pages.
GUIDE_FIRST = [("index.md", "What context parallelism is and why"), ("quickstart.md", "Quickstart"),
               ("your-model.md", "Use cpref with your model")]
GUIDE_LAST = [("variants.md", "Attention variants: sinks, soft-capping, chunks"),
              ("verify-your-implementation.md", "Verify your implementation"),
              ("verify-reference.md", "Verify: every option, what it checks and counts"),
              ("field-bugs.md", "The bugs CP users hit"),
              ("glossary.md", "Glossary"), ("references.md", "References")]
# The Learn CP path (hand-written, docs/learn/): the order a learner needs, each page short, a figure at its top,
# runnable code, and links into the reference pages below for the precise story.
LEARN = [
    ("learn/problem.md", "1. Why a split sequence needs communication"),
    ("learn/collectives.md", "2. Collectives in one page"),
    ("learn/all-gather.md", "3. All-gather: every rank gets every key"),
    ("learn/merge.md", "4. Merging partial attention: the lse"),
    ("learn/ring.md", "5. The ring, forward and backward"),
    ("learn/layouts.md", "6. Zigzag and packed documents"),
    ("learn/ulysses.md", "7. Ulysses: trade tokens for heads"),
    ("learn/hierarchy.md", "8. The hierarchy: Ulysses inside, ring across"),
    ("learn/when-cp-pays.md", "9. When CP pays"),
    ("learn/which-mode.md", "10. Which mode?"),
    ("learn/beside-dp-tp-pp.md", "11. CP beside DP, TP and PP"),
    ("learn/masks.md", "12. Masks under CP"),
]

# Figures of the hand-written pages (`docs/learn_figures.py`, drawn from real runs): page -> [(figure path, caption)],
# each placed where its marker `{{ figure PATH }}` stands. A Learn page opens with its figure: its marker stands
# before the page's first section and after at most `TOP_WORDS` words.
HAND_FIGURES = {
    "variants.md": [
        ("figures/chunked_ring.png",
         "A real forward of `p2p` with `chunk=10` on the simulated cluster. Above, the scores the chunks leave, in "
         "the colour of the rank that computes them (grey: scores of the causal mask the chunks drop); the counts are "
         "the run's kernel calls'. Below, the keys each shift carried, in their owner's colour, read from the "
         "payloads; grey: the whole blocks the ring without the chunks sends. A shift is as long on every rank as its "
         "longest payload; a row is 128 B (float64, `Hkv = 2`, `D = Dv = 4`)."),
    ],
    "index.md": [
        ("figures/learn/movement.png",
         "One forward + backward of every mode on 4 simulated ranks (bf16), read from the cluster's trace: an arrow "
         "from rank i to rank j is as wide as the bytes of i's data that reached j (an all-gather's input reaches every "
         "rank, a reduce-scatter's or all-to-all's chunk j reaches rank j, a shift the next rank)."),
    ],
    "learn/problem.md": [
        ("figures/learn/problem.png",
         "Left: the causal mask of one document split over 4 ranks; each visible score in the colour of the rank "
         "holding its key, faint where that is the query's own rank. Right: each rank's output against the FP64 "
         "oracle, attending alone and with CP (the page's example, run when this site was built)."),
    ],
    "learn/collectives.md": [
        ("figures/learn/collectives.png",
         "The page's example, run on 4 simulated ranks: each rank's input and what the collective returned to it, "
         "coloured by the rank the data came from; the bytes are the trace's."),
    ],
    "learn/merge.md": [
        ("figures/learn/merge.png",
         "Query 0 of the page's example. Above: the softmax each half of the keys gets from its own kernel call. "
         "Below: the same weights, each block's times exp(lse of the block - merged lse), and (dots) "
         "the weights of one call over all 16 keys."),
    ],
    "learn/all-gather.md": [
        ("figures/learn/all_gather.png",
         "A forward + backward of `all_gather` on 4 simulated ranks: the keys each rank holds, the keys it holds after "
         "the all-gathers, and (full colour) those its kernel call read, identified from the call's inputs."),
    ],
    "learn/ring.md": [
        ("figures/learn/ring.gif",
         "One forward + backward of `p2p` on 4 simulated ranks, one document in the contiguous layout, step by "
         "step: the block each rank holds (\"skipped\" where none of its queries sees those keys), and the scores "
         "computed at this step (full colour, in the colour of the key's rank) and before (faint)."),
        ("figures/learn/ring_frames.png",
         "The same run, every rank at every step: the block it held (identified from its kernel calls and from the "
         "payloads it sent) and, in the backward, how many ranks' nonzero shares the block's dK/dV accumulator held "
         "when it moved on (each accumulator checked against the sum of the shares of the ranks it has passed)."),
    ],
    "learn/layouts.md": [
        ("figures/learn/layouts.png",
         "A packed batch of two documents over 4 ranks. Above: the causal mask with attention reset at the document "
         "boundary, each score in the colour of the rank that computes it. Below: each rank's scores, counted from "
         "its kernel calls in a real ring forward."),
    ],
    "learn/ulysses.md": [
        ("figures/learn/ulysses.png",
         "A real `a2a` forward on 4 simulated ranks: which rank holds each (token, head) of `q` before the "
         "all-to-all (its shard) and after it (read from what its kernel call was given)."),
    ],
    "learn/hierarchy.md": [
        ("figures/learn/hierarchy.png",
         "A real `a2a+p2p` forward on 4 simulated ranks: the keys and heads each rank's kernel saw at each ring "
         "step, in the colour of the rank that held each key before the exchange."),
    ],
    "learn/when-cp-pays.md": [
        ("figures/learn/pays_memory.png",
         "The activations a Llama-3-8B-like model (32 layers, Hq = 32, Hkv = 8, D = 128, h = 4096, F = 14336, bf16) "
         "keeps for its backward on one rank, against sequence length: on one device (and with every layer "
         "recomputed) and at CP = 2 to 16. Attention's share is cpref's cost model's (`mode_costs(...).saved_bytes`), "
         "the rest of a layer 2(4h + 4F) bytes a token; the line is the h100-sxm profile's 80 GB."),
        ("figures/learn/pays_timeline.png",
         "Above: rank 0's forward and backward in every mode, 128k tokens at P = 16 on two H100 nodes, each mode's "
         "own code dry-run on meta tensors and timed by the planner's two clocks with the h100-sxm profile. Below: "
         "the overlap condition, a zigzag ring step's kernel time against its K/V block's transfer by block size, on "
         "the h100-sxm profile and on this machine's measured one; the dots are the crossovers."),
        ("figures/learn/pays_where.png",
         "The planner's predicted forward + backward step (h100-sxm, bf16) against one device's step divided by P, "
         "for packed short documents, sliding windows and the number of K/V heads: the zigzag ring at P = 8 (one "
         "node) and P = 16 (two nodes), and the planner's best candidate at P = 16."),
    ],
    "learn/beside-dp-tp-pp.md": [
        ("figures/learn/grid.png",
         "Ranks on two nodes, coloured by CP group. (a) cpref's DP x CP training as one real step on the simulated "
         "cluster ran it: each CP group's ring shifts stay inside its node, and the all-reduces of the one DP x CP "
         "group are all that crosses between nodes. (b) TP laid beside it: the TP groups drawn by this page (cpref "
         "has no TP), the CP groups from cpref's own `topology` on each TP shard's ranks."),
    ],
    "learn/which-mode.md": [
        ("figures/learn/which_mode.png",
         "Forward + backward bytes per rank and layer for the reference layers of [What each mode costs](../which-mode.md): "
         "lines from cpref's cost model, dots measured on the simulated cluster at a small size and scaled (the "
         "figure's build checks that they are equal)."),
    ],
    "learn/masks.md": [
        ("figures/learn/mask_kinds.png",
         "One slice of each kind over fewer queries than keys (above) and more (below), from "
         "`Mask.from_slices(...).dense()`: `causal` is aligned at the bottom-right corner, `inv_causal` at the "
         "top-left."),
        ("figures/learn/mask_slices.png",
         "The page's masks over a small packed batch, as `.slices` gives them: every pair coloured by the kind "
         "of the normalised slice that shows it, each slice outlined."),
        ("figures/learn/mask_balance.png",
         "Each rank's pairs under each mask over the mean, contiguous and zigzag, counted from the mask's slices (the "
         "page's example; the tests hold them to the pairs the kernel computed in a real run)."),
        ("figures/learn/mask_traffic.png",
         "The bytes the busiest rank sent in one forward + backward of each mode under each mask, read from the "
         "simulated cluster's trace (the page's example), with every document cut over every rank (zigzag) and "
         "documents kept whole but at the cuts (stream)."),
    ],
}
TOP_WORDS = 60


# The navigation: sections a reader walks in order, each a list of the pages above (every page in exactly one):
# first the Learn path, then the reference (how to use cpref, each mode's precise story, what makes it
# trustworthy, backends, models), and the internals last, in a section of their own.
SECTIONS = [
    ("Start", ["index.md", "quickstart.md"]),
    ("Learn CP", [page for page, _ in LEARN]),
    ("Use cpref", ["your-model.md", "api.md", "variants.md", "layout.md", "sharding.md", "balanced.md", "balanced-mask.md", "mask.md", "data.md",
                   "which-mode.md"]),
    ("Plan a run", ["planner.md", "mode-study.md", "sim-plan.md", "plan-model.md", "plan-profiles.md", "plan-dry-run.md",
                    "plan-scale.md", "plan-schedule.md", "plan-scale-window.md", "plan-scale-split.md", "plan-links.md",
                    "plan-calibrate.md", "plan-batches.md"]),
    ("The modes", ["merge.md", "all-gather.md", "metadata.md", "all-gather-overlap.md", "ring.md", "ring-window.md",
                   "ulysses.md", "ulysses-split.md", "ulysses-pipeline.md", "hierarchical.md", "hierarchical-split.md",
                   "mask-plan.md", "all-gather-mask.md"]),
    ("Verify and trust", ["oracle.md", "cluster.md", "verify.md", "verify-your-implementation.md", "verify-reference.md", "consistency.md",
                          "determinism.md", "field-bugs.md"]),
    ("Backends and kernels", ["comm.md", "torch-dist.md", "backend-facts.md", "kernel-contract.md", "torch-kernel.md",
                              "softcap-native.md", "cuda-kernel.md", "npu-kernel.md"]),
    ("Models and training", ["models.md", "hf.md", "hf-batch.md", "hf-guard.md", "hf-labels.md", "hf-admit.md", "training.md", "train.md",
                             "checkpoint.md"]),
    ("Performance", ["performance.md", "perf-kernel.md", "perf-overhead.md", "perf-scaling.md", "perf-memory.md",
                     "perf-all-gather.md", "perf-collectives.md", "perf-window.md", "perf-layouts.md", "perf-variants.md",
                     "perf-plan.md", "perf-masks.md"]),
    ("Internals", ["seqlens.md", "mask-union.md", "cache.md", "mode-spec.md", "ring-plan.md", "all-gather-pieces.md", "checkpoint-files.md",
                   "checkpoint-meta.md", "checkpoint-swap.md", "checkpoint-lock.md", "checkpoint-errors.md"]),
    ("Reference", ["glossary.md", "references.md"]),
]  # fmt: skip


def sections_nav() -> list[str]:
    """The guide's part of SUMMARY.md, by `SECTIONS`; raises unless every guide page is in exactly one section."""
    titles = {page: title for page, title in written(GUIDE_FIRST) + written(LEARN) + written(GUIDE_LAST)}
    titles |= {page: title for page, title, _ in GUIDE}
    placed = [page for _, pages in SECTIONS for page in pages]
    if sorted(placed) != sorted(titles):
        extra, missing = sorted(set(placed) - set(titles)), sorted(set(titles) - set(placed))
        twice = sorted({p for p in placed if placed.count(p) > 1})
        raise RuntimeError(f"SECTIONS must hold every guide page once: unknown {extra}, missing {missing}, twice {twice}")
    nav = []
    for section, pages in SECTIONS:
        nav.append(f"* {section}")
        nav += [f"    * [{titles[page]}]({page})" for page in pages]
    return nav


def written(pages: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The hand-written pages, every one of which must exist in docs/."""
    missing = [page for page, _ in pages if not (ROOT / "docs" / page).exists()]
    if missing:
        raise RuntimeError(f"hand-written pages missing from docs/: {sorted(missing)}")
    return list(pages)


# The packages walked for the API reference: (directory, dotted prefix).
REFERENCE_PACKAGES = [(ROOT / "src" / "cpref", "cpref"), (ROOT / "sim", "sim")]


def _load_docs_module(name: str):
    """`docs/<name>.py` as `docs.<name>` (the repository root is first on the path, so no installed `docs` shadows it)."""
    return importlib.import_module(f"docs.{name}")


SOURCES = _load_docs_module("source_pages")
DOCSTRINGS = _load_docs_module("docstring_examples")


SNIPPET = re.compile(r'^--8<-- "[^"]+\.py(:[\w-]+)?"\s*$')


def fence_python_snippets(lines: list[str]) -> list[str]:
    """Wrap a bare `--8<-- "file.py:region"` line (outside any fence) in a Python code fence.

    pymdownx.snippets pastes the region's text verbatim; without a fence it would be read as
    Markdown. Docstrings may write the snippet line bare or already fenced; both render as code.
    """
    out, in_fence = [], False
    for line in lines:
        if line.lstrip().startswith(("```", "~~~")):
            in_fence = not in_fence
        if not in_fence and SNIPPET.match(line):
            out += ["```python", line, "```"]
        else:
            out.append(line)
    return out


def figure_html(path: str, caption: str) -> str:
    """A figure with its caption; the caption is inline Markdown, its alt text is plain."""
    alt = caption.replace("`", "")
    return (f'<figure markdown="span">\n  ![{alt}]({path})\n'
            f'  <figcaption markdown="span">{caption}</figcaption>\n</figure>')


def bench_results(text: str) -> str:
    """A guide page's `{{ results NAME }}` markers (a benchmark's page), each replaced by the last run `make bench` kept
    of benchmark NAME (`bench.report.last_run`: where and when it ran, its tables, the markers of its figures); raises
    unless every benchmark of `bench.all.BENCHMARKS` shows its last run on exactly one guide page."""
    report = importlib.import_module("bench.report")  # imported here: it reads the kept results, and times a kernel
    report.check_shown({name: importlib.import_module(name).__doc__ or "" for _, _, name in GUIDE})
    return report.fill_results(text)


def guide_page(module_name: str, figures: list[tuple[str, str]], tables=(), doc_path: str = "") -> str:
    """A module's docstring as a page: summary line as `# title`, a benchmark's last run at its marker, figures at
    their markers, tables, source footer."""
    module = importlib.import_module(module_name)  # an import error fails the build
    if not module.__doc__:
        raise RuntimeError(f"{module_name} has no module docstring, but the guide's page is its docstring")
    lines = bench_results(inspect.cleandoc(module.__doc__)).splitlines()
    if not lines[0].startswith("#"):
        lines[0] = "# " + lines[0].strip().rstrip(".")
    lines = DOCSTRINGS.fence_examples(fence_python_snippets(lines))
    # An autorefs anchor, so that `[cpref.comm.protocol][]` in any docstring links to this page: the
    # module's reference page lists its members only.
    lines.insert(1, f"\n[](){{#{module_name}}}")
    # Every figure goes where its marker `{{ figure PATH }}` stands, alone on a line of the docstring (indented inside
    # a block), beside the paragraph that explains it: a figure without its marker, or with two, fails the build.
    for path, caption in figures:
        marker = f"{{{{ figure {path} }}}}"
        at = [i for i, line in enumerate(lines) if line.strip() == marker]
        if len(at) != 1:
            raise RuntimeError(f"{module_name} (page {doc_path}): figure {path} needs its marker line `{marker}` "
                               f"exactly once in the docstring, beside the paragraph that explains it; found {len(at)}")
        indent = lines[at[0]][: len(lines[at[0]]) - len(lines[at[0]].lstrip())]
        lines[at[0]] = "\n".join(indent + line for line in figure_html(path, caption).splitlines())
    text = "\n".join(lines)
    if "{{ figure" in text:
        raise RuntimeError(f"{module_name} (page {doc_path}): a figure marker names no figure of the page (PAGE_FIGURES): "
                           f"{text[text.index('{{ figure'):][:80]}")  # fmt: skip
    parts = [text]
    for title, table in tables:
        parts += [f"## {title}", table()]
    parts.append(f"---\n\nSource: {SOURCES.link_from(doc_path, Path(module.__file__).resolve())}")
    return "\n\n".join(parts) + "\n"


def reference_modules() -> list[tuple[str, Path]]:
    """Every public module of the reference packages: (dotted name, file), packages first."""
    found = []
    for directory, prefix in REFERENCE_PACKAGES:
        for file in sorted(directory.rglob("*.py")):
            parts = list(file.relative_to(directory).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            if any(p.startswith("_") for p in parts):
                continue  # private modules, and __main__
            found.append((".".join([prefix, *parts]), file))
    return sorted(found, key=lambda item: (item[0].split(".")[0] != "cpref", item[0]))


def public_names(file: Path) -> list[str] | None:
    """The module's `__all__`, read statically (no import), or None if it has none."""
    for node in ast.parse(file.read_text()).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                return list(ast.literal_eval(node.value))
    return None


def reference_page(name: str, file: Path, guide: dict[str, tuple[str, str]], doc_path: str) -> str:
    """`::: name` for mkdocstrings; a module with a guide page shows its members only."""
    parts = [f"# `{name}`"]
    names = public_names(file)
    if name in guide and names:  # a module or package whose docstring is a guide page: its members
        page, title = guide[name]
        up = "../" * doc_path.count("/")  # back to the site root, where the guide pages live
        parts.append(f"The module docstring is the guide page [{title}]({up}{page}). Public API:")
        parts += [f"::: {name}.{member}" for member in names]
    elif file.name == "__init__.py":
        # A package's docstring is a mini-guide; its names are documented in their own modules.
        parts.append(f"::: {name}\n    options:\n      show_root_heading: false\n      members: false")
    else:
        parts.append(f"::: {name}\n    options:\n      show_root_heading: false")
    parts.append(f"Source: {SOURCES.link_from(doc_path, file)}")
    return "\n\n".join(parts) + "\n"


def quickstart_page() -> str:
    """`docs/quickstart.md` with the example's output and the demo's (simulated parts) filled in."""
    import contextlib
    import runpy

    demo = importlib.import_module("sim.tools.demo")
    outputs = {}
    for name, run in (("quickstart_output", lambda: runpy.run_module("examples.quickstart", run_name="__main__")),
                      ("demo_output", lambda: (demo.part1_layouts(demo._cu(demo.LENGTHS)),
                                               demo.part2_modes(demo._cu(demo.LENGTHS), list(demo.cpref.LAYOUTS))))):  # fmt: skip
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            run()
        outputs[name] = buf.getvalue().rstrip()
    page = (ROOT / "docs" / "quickstart.md").read_text()
    for name, text in outputs.items():
        page = page.replace("{{ " + name + " }}", text)
    if "{{" in page:
        raise RuntimeError("docs/quickstart.md has a placeholder the build does not fill")
    return page


PLACEHOLDER = re.compile(r"\{\{ (?:output (?P<output>[\w/.-]+\.py)|figure (?P<figure>[\w/.-]+)|(?P<name>\w+)) \}\}")


def filled_pages() -> list[str]:
    """The hand-written pages whose placeholders the build fills (`hand_page`): the home page, "Verify your
    implementation" (its first example's output), the Learn path and every page with figures of its own
    (`HAND_FIGURES`); `tests/docs/test_placeholders.py` holds every page with a
    placeholder to this list."""
    return list(dict.fromkeys(["index.md", "verify-your-implementation.md", "verify-reference.md", *(page for page, _ in LEARN), *HAND_FIGURES]))


def hand_page(page: str) -> str:
    """A hand-written page with its placeholders filled: `{{ figure PATH }}` (a figure of `HAND_FIGURES`, linked
    relative to the page), `{{ output examples/learn/x.py }}` (what the example prints, run now) and `{{ name }}`
    (`docs/learn_text.py`'s `TEXT[name]()`). A Learn page must open with its first figure (`TOP_WORDS`)."""
    text, figures = (ROOT / "docs" / page).read_text(), dict(HAND_FIGURES.get(page, []))
    learn_text = _load_docs_module("learn_text")
    placed = []

    def fill(match: re.Match) -> str:
        if match["output"]:
            return learn_text.output(match["output"])
        if match["figure"]:
            if match["figure"] not in figures:
                raise RuntimeError(f"{page}: the marker {match[0]} names no figure of HAND_FIGURES[{page!r}]")
            placed.append(match["figure"])
            return figure_html(posixpath.relpath(match["figure"], posixpath.dirname(page) or "."), figures[match["figure"]])
        if match["name"] not in learn_text.TEXT:
            raise RuntimeError(f"{page}: {match[0]} names nothing in docs/learn_text.py's TEXT")
        return learn_text.TEXT[match["name"]]()

    if page.startswith("learn/"):
        first = text.find("{{ figure ")
        before = text[: max(first, 0)].split("\n", 1)[-1]  # after the title line
        if first < 0 or "\n## " in before or len(before.split()) > TOP_WORDS:
            raise RuntimeError(f"{page}: a Learn page opens with its figure, within {TOP_WORDS} words of its title")
    filled = PLACEHOLDER.sub(fill, text)
    if sorted(placed) != sorted(figures):
        raise RuntimeError(f"{page}: every figure of HAND_FIGURES once: placed {placed}, listed {sorted(figures)}")
    if "{{" in filled:
        raise RuntimeError(f"{page}: a placeholder the build does not fill: {filled[filled.index('{{'):][:60]}")
    return filled


def save_figure(path: str, drawn, figures) -> bytes:
    """A drawn figure as PNG bytes, checked; a `.gif` path's frames (a list of figures) as a looping animation."""
    frames = drawn if isinstance(drawn, list) else [drawn]
    images = []
    for fig in frames:
        figures.check_readable(fig, path)  # raises if a label would show below 10 pt, or a panel is empty
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=figures.DPI)
        figures.plt.close(fig)
        images.append(buf.getvalue())
    if not path.endswith(".gif"):
        assert len(images) == 1, f"{path}: one figure, or a .gif of frames"
        return images[0]
    from PIL import Image

    pictures = [Image.open(io.BytesIO(png)).convert("RGB") for png in images]
    out = io.BytesIO()
    pictures[0].save(out, format="GIF", save_all=True, append_images=pictures[1:], duration=GIF_FRAME_MS, loop=0,
                     optimize=True)  # fmt: skip
    return out.getvalue()


GIF_FRAME_MS = 1800  # how long an animation shows each frame


def main() -> None:
    # 0) The quickstart, with outputs produced now.
    with mkdocs_gen_files.open("quickstart.md", "w") as f:
        f.write(quickstart_page())
    # 0b) The home page, the Learn path and every hand page with figures: figures placed, numbers computed now.
    for page in filled_pages():
        with mkdocs_gen_files.open(page, "w") as f:
            f.write(hand_page(page))

    # 1) Guide pages, with their measured tables.
    tables = _load_docs_module("tables").TABLES
    for page, _title, module_name in GUIDE:
        with mkdocs_gen_files.open(page, "w") as f:
            f.write(guide_page(module_name, PAGE_FIGURES.get(page, []), tables.get(page, []), page))

    # 2) API reference.
    guide = {module_name: (page, title) for page, title, module_name in GUIDE}
    reference = []  # (dotted name, doc path, file)
    for name, file in reference_modules():
        # cpref.batch.layout -> reference/cpref/layout.md; the package cpref -> reference/cpref/index.md
        stem = "/".join(name.split("."))
        doc_path = f"reference/{stem}/index.md" if file.name == "__init__.py" else f"reference/{stem}.md"
        with mkdocs_gen_files.open(doc_path, "w") as f:
            f.write(reference_page(name, file, guide, doc_path))
        reference.append((name, doc_path, file))

    # 3) Source pages, linked from the footers above and from the header.
    for file in SOURCES.source_files():
        with mkdocs_gen_files.open(SOURCES.page_of(file), "w") as f:
            f.write(SOURCES.source_page(file))
    with mkdocs_gen_files.open(SOURCES.INDEX, "w") as f:
        f.write(SOURCES.index_page({file: (name, path) for name, path, file in reference}))

    # 4) Figures, each checked for labels readable at the column width and for empty panels.
    figures = _load_docs_module("figures")
    drawn = {**figures.FIGURES, **_load_docs_module("mode_figures").FIGURES, **_load_docs_module("train_figures").FIGURES,
             **_load_docs_module("bench_figures").FIGURES, **_load_docs_module("learn_figures").FIGURES,
             **_load_docs_module("plan_figures").FIGURES, **_load_docs_module("learn_masks").FIGURES,
             **_load_docs_module("balanced_mask_figure").FIGURES}
    used = [path for entries in (*PAGE_FIGURES.values(), *HAND_FIGURES.values()) for path, _ in entries]
    if sorted(used) != sorted(drawn):
        raise RuntimeError(f"every figure must appear exactly once: drawn {sorted(drawn)}, used {sorted(used)}")
    for path, draw in drawn.items():
        with mkdocs_gen_files.open(path, "wb") as f:
            f.write(save_figure(path, draw(), figures))

    # 5) Navigation.
    nav = sections_nav()
    nav.append("* API reference")
    for package in ("cpref", "sim"):
        nav.append(f"    * {package}")
        nav += [f"        * [{name}]({path})" for name, path, _ in reference if name.split(".")[0] == package]
    with mkdocs_gen_files.open("SUMMARY.md", "w") as f:
        f.write("\n".join(nav) + "\n")
    # literate-nav reads SUMMARY.md; it is not a page of the site.
    summary = mkdocs_gen_files.FilesEditor.current().files.get_file_from_path("SUMMARY.md")
    summary.inclusion = InclusionLevel.EXCLUDED


main()
