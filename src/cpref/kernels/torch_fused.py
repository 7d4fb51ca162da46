r"""The fast path of `TorchKernel`: PyTorch's fused CPU attention, one call per run of equal sequences.

The explicit path of [`TorchKernel`][cpref.kernels.torch_kernel.TorchKernel] writes every
block's scores to memory and reads them back in each elementwise step. PyTorch's fused CPU
attention (`torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`, the kernel behind
`F.scaled_dot_product_attention` on a CPU) computes the same softmax tile by tile, keeping
each tile in cache (the online softmax of FlashAttention), and returns the log-sum-exp with
the output; its backward recomputes the probabilities from that lse. It is the same
mathematics as the explicit path, in fewer memory passes. This module wraps it so that every
guarantee of the [kernel contract][cpref.kernels.contract] holds:

**Bottom-right causal.** The op's causal mask is *top-left*: query $x$ sees key $y \le x$. For a
square block the two alignments agree. A sequence with $n_q < n_k$ queries is split into its
keys $[0, \delta)$, $\delta = n_k - n_q$, which every query sees (no mask), and the square
$[\delta, n_k)$ with a causal mask; the two partial results are merged by their lse
(see [Merging partial results][cpref.kernels.merge]), both finite since row $x$ sees key $0$ in
the first and key $\delta + x$ in the second:

$$ \mathrm{lse} = \log\left(e^{\mathrm{lse}_a} + e^{\mathrm{lse}_b}\right), \qquad
   O = e^{\mathrm{lse}_a - \mathrm{lse}}\, O_a + e^{\mathrm{lse}_b - \mathrm{lse}}\, O_b
     = \sigma(\mathrm{lse}_a - \mathrm{lse}_b)\, O_a + \sigma(\mathrm{lse}_b - \mathrm{lse}_a)\, O_b . $$

The weights are taken in the second form, from the difference of the two lse, not from the
merged lse, which float32 rounds to a step of $2^{-10}$ at logits of $10^4$: at such logits the
first form put that rounding into every output of the row (four to nine times the error of the
unsplit call, inputs x100).

With $n_q > n_k$ the first $n_q - n_k$ rows see no key: they are never computed (`out` 0,
`lse` $-\infty$, zero gradients) and the last $n_k$ rows form a causal square. The backward
calls the op's backward on each part with the *merged* `(out, lse)`, which is exactly what a
part's share of a longer row needs: $P = e^{S - \mathrm{lse}}$ and
$\Delta = \mathrm{rowsum}(dO \circ O)$ of the whole row. dQ sums over the parts, each part
owns its keys' dK and dV.

**One call per run of equal sequences.** Sequences of one shape whose starts are equally
spaced in both streams (a run of equal documents, or the alternating chunks of the all-gather
plan) are one strided `(B, H, S, D)` view of the packed tensors, made with `unfold`, no copy:
256 documents of 32 tokens are one call, not 256. When one call covers both streams in order
(one document, or a run of equal ones), the op's outputs, laid out token-major, already are
the packed `out`, `lse` and gradients, and are returned as views.

**Sliding windows.** The op takes an additive mask (0 or $-\infty$ on each logit, in
the compute dtype; it takes no boolean one), but computes every score of its call, masked or
not. A windowed call is therefore cut into tiles of $R$ rows, each over only the keys
of its band ([the plan][cpref.kernels.torch_fused_plan]): a mask-free middle that all its rows
see, and masked edges at most $R$ keys wide, merged into it by lse as above, so that the work is
$T (w + R)$ for a band of $w$ keys rather than $T^2 / 2$. Each row lies in one tile, so the
backward gives each part the merged `(out, lse)` as above; neighbouring tiles share keys, so
their dK and dV are added up, in passes over every $s$-th part of a run, whose keys are disjoint.

**Shifts.** A causal call with explicit shifts and no window (the ring over pieces makes them)
needs no mask: its rows that see a growing prefix are a bottom-right causal block, and its rows
that see every key one unmasked part ([the plan][cpref.kernels.torch_fused_plan]); the two share
keys, whose dK and dV are added up.

**MQA.** The op reads key head `h // G` itself (GQA and MQA without copies), except in the
backward with one K/V head: there the op recomputes some logits one ulp away from those of
its forward (PyTorch 2.13 on a CPU, at query lengths such as 5 to 11 or 37 to 39; not seen
with two or more K/V heads), and one ulp of a float32 logit of $10^6$ is an error of up to
28 % in the probability $e^{S - \mathrm{lse}}$. With the one head broadcast over the $H_q$
query heads as a stride-0 view (no copy) forward and backward agree; dK and dV then come out
per query head and are summed in float32.

**The rest of the contract.** The op needs $D_v = D$, so for $D_v < D$ (MLA) V, and in the
backward dO and O, are zero-padded to $D$; the padded columns of O and dV are 0 and $\Delta$ is
unchanged. float16/bfloat16 inputs are upcast once to float32, as in the explicit path, so
`out_dtype` and `grad_dtype` receive float32 accumulators. With `full_rows` in
float16/bfloat16, $\Delta$ must not come from the rounded `out`; the backward then recomputes
the float32 output (one more forward) and passes that to the op. A row's `lse` may hold more
than the call's keys (a learnable sink, [`cpref.kernels.sinks`][cpref.kernels.sinks]): the
recomputed output, normalized over the call's keys alone, is then scaled by
$e^{\mathrm{lse}_\text{call} - \mathrm{lse}}$, the share of the row's softmax the keys hold.

**Memory.** The op keeps its scores in tiles of at most $256 \times 512$ per thread (one in the
forward, two in the backward) whatever the length; everything else is $O(T)$ (with a window,
the op's dK and dV of a run's tiles, $(w + R) / R$ times the keys, and masks of at most
$R \times 2R$ per kind of tile). A
`max_block_elements` below one tile per thread selects the explicit path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpref.kernels.contract import NO_WINDOW, Varlen, compute_dtype
from cpref.kernels.merge import merge_partial
from cpref.kernels.torch_fused_plan import Run, is_plain, is_shifted, plan_band_runs, plan_runs, plan_shifted_runs

__all__ = ["FUSED_TILE_ELEMENTS", "fused_available", "fused_forward", "fused_backward"]

# The op's largest score tile per thread: 256 query rows x 512 keys (PyTorch's q/kv split sizes).
FUSED_TILE_ELEMENTS = 256 * 512


def _op(name: str):
    """`torch.ops.aten.<name>`, or None where this torch lacks it."""
    try:
        return getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return None


_FORWARD = _op("_scaled_dot_product_flash_attention_for_cpu")
_BACKWARD = _op("_scaled_dot_product_flash_attention_for_cpu_backward")


def fused_available(device: torch.device, max_block_elements: int) -> bool:
    """Whether the fused path applies: on the CPU, with the op, and a budget of one tile per thread."""
    has_op = _FORWARD is not None and _BACKWARD is not None
    return has_op and device.type == "cpu" and max_block_elements >= FUSED_TILE_ELEMENTS * torch.get_num_threads()


def _view(x: torch.Tensor, start: int, step: int, count: int, n: int) -> torch.Tensor:
    """`count` windows of `n` rows, `step` apart, of a token-major `x`: `(T, H[, X]) -> (B, H, n[, X])`."""
    if step == 0:  # the same rows every time (a band's tiles that all see its every key): a stride-0 batch
        return x[start : start + n].expand(count, *x[start : start + n].shape).transpose(1, 2)  # (B, H, n[, X])
    w = x[start : start + (count - 1) * step + n].unfold(0, n, step)  # (B, H, X, n) or (B, H, n)
    return w.permute(0, 1, 3, 2) if x.dim() == 3 else w  # (B, H, n, X)


def _queries(x: torch.Tensor, run: Run) -> torch.Tensor:
    return _view(x, run.q0, run.q_step, run.count, run.rows)


def _keys(x: torch.Tensor, run: Run) -> torch.Tensor:
    return _view(x, run.k0, run.k_step, run.count, run.keys)


def _prepared(x: torch.Tensor, dtype: torch.dtype, dim: int | None = None) -> torch.Tensor:
    """`x` in the compute dtype, unit stride in its last dim, zero-padded to `dim` columns.

    The op reads rows and heads at any stride, so a column slice such as the `K` half of a
    packed `(T, H, D + Dv)` K/V block is passed as it is, without a copy.
    """
    x = x.to(dtype)  # no copy for an input already in `dtype`
    x = x if x.stride(-1) == 1 else x.contiguous()  # (T, H, X), unit stride in X
    return x if dim is None or x.shape[-1] == dim else F.pad(x, (0, dim - x.shape[-1]))  # (T, H, dim)


def _narrow(x: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """The first `dim` columns of `x` in `dtype`, contiguous (no copy when nothing changes)."""
    return x[..., :dim].to(dtype, memory_format=torch.contiguous_format)


def _runs(seqs: Varlen, causal: bool, window: tuple[int, int] = NO_WINDOW) -> list[Run]:
    """The plan of `seqs` (`cpref.kernels.torch_fused_plan`), made once per `Varlen`, mask and window."""
    if is_plain(seqs, causal, window):
        return seqs.cached(("TorchKernel.fused_runs", bool(causal)), lambda: plan_runs(seqs, bool(causal)))
    if is_shifted(seqs, causal, window):
        return seqs.cached(("TorchKernel.fused_shifted_runs",), lambda: plan_shifted_runs(seqs))
    return seqs.cached(("TorchKernel.fused_band_runs", bool(causal), window), lambda: plan_band_runs(seqs, bool(causal), window))


def _unreached(seqs: Varlen, causal: bool, rows: int, stream: str, window: tuple[int, int] = NO_WINDOW) -> list[tuple[int, int]]:
    """Row ranges `[a, b)` of the query (`stream="q"`) or key (`"k"`) stream that no fused call writes.

    Every other query row of `out`, `lse`, `dq` is written by exactly one call (a merged part
    adds to rows an earlier part wrote), so only these are filled: 0, and `lse` = -inf. So are
    the keys of a plain plan; a band's keys are shared by its tiles and added up from zero.
    """

    def build() -> list[tuple[int, int]]:  # host integers only: no tensor, no device
        reached = sorted(
            (first + i * step, first + i * step + n)
            for run in _runs(seqs, causal, window) if stream == "k" or not run.merge
            for first, step, n in [(run.k0, run.k_step, run.keys) if stream == "k" else (run.q0, run.q_step, run.rows)]
            for i in range(run.count)
        )  # fmt: skip
        gaps, end = [], 0
        for a, b in [*reached, (rows, rows)]:
            if a > end:
                gaps.append((end, a))
            end = max(end, b)
        return gaps

    return seqs.cached(("TorchKernel.fused_unreached", bool(causal), window, stream, rows), build)


def _mask(seqs: Varlen, run: Run, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """The op's keyword for a band part's mask: `attn_mask (1, 1, rows, keys)`, 0 where a row sees a key and
    -inf elsewhere (the op adds it to the logits; it takes no bool mask); none (`{}`) for a part without one."""
    if run.seen is None:
        return {}

    def build() -> torch.Tensor:
        y = torch.arange(run.keys, device=device)  # (M,) the part's keys
        bounds = torch.tensor(run.seen, device=device)  # (R, 2) each row's [lo, hi) among them
        hidden = (y[None, :] < bounds[:, :1]) | (y[None, :] >= bounds[:, 1:])  # (R, M)
        return torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))[None, None]

    return {"attn_mask": seqs.cached(("TorchKernel.fused_mask", run.seen, dtype, str(device)), build)}


def _add_keys(x: torch.Tensor, run: Run, grads: torch.Tensor) -> None:
    """`x[keys of part i] += grads[i]` for a band run `(B, H, n_k, D)`, whose parts' keys overlap (neighbouring
    tiles share keys): in `s` passes over every `s`-th part, whose keys do not."""
    s = run.count if run.k_step == 0 else min(run.count, -(-run.keys // run.k_step))
    for j in range(s):
        n = len(range(j, run.count, s))
        _view(x, run.k0 + j * run.k_step, max(1, s * run.k_step), n, run.keys).add_(grads[j::s])  # (n, H, n_k, D)


def _whole(runs: list[Run], tokens: int, keys: int) -> bool:
    """Whether one call covers both streams, in order (one document, or a run of equal ones)."""
    if len(runs) != 1:
        return False
    r = runs[0]
    in_order = r.count == 1 or (r.q_step, r.k_step) == (r.rows, r.keys)
    return in_order and (r.q0, r.k0, r.count * r.rows, r.count * r.keys) == (0, 0, tokens, keys)


def _packed(x: torch.Tensor) -> torch.Tensor:
    """The op's output `(B, H, S[, X])`, laid out token-major in memory, as the packed `(B S, H[, X])` (a view)."""
    return x.transpose(1, 2).reshape(-1, *x.shape[1:2], *x.shape[3:])  # (B, S, H[, X]) -> (T, H[, X])


def fused_forward(q, k, v, seqs: Varlen, *, causal: bool, scale: float, window=NO_WINDOW, out_dtype=None, padded: bool = False):
    """`(out (T, Hq, Dv), lse (T, Hq))` through the fused op; `padded`: keep out in the compute dtype, D wide."""
    cdt, d, dv = compute_dtype(q.dtype), q.shape[2], v.shape[2]
    qc, kc, vc = _prepared(q, cdt), _prepared(k, cdt), _prepared(v, cdt, d)  # (T, Hq, D), (T', Hkv, D) x 2
    runs = _runs(seqs, causal, window)

    def attend(run: Run) -> tuple[torch.Tensor, torch.Tensor]:  # (B, Hq, n, D), (B, Hq, n)
        mask = _mask(seqs, run, cdt, q.device)
        return _FORWARD(_queries(qc, run), _keys(kc, run), _keys(vc, run), 0.0, run.causal, scale=scale, **mask)

    if _whole(runs, q.shape[0], k.shape[0]):  # one call: its outputs are the packed tensors, no copy
        out, lse = map(_packed, attend(runs[0]))
        return (out, lse) if padded else (_narrow(out, dv, out_dtype or q.dtype), lse)
    out = q.new_empty((q.shape[0], q.shape[1], d), dtype=cdt)  # (T, Hq, D)
    lse = q.new_empty(q.shape[:2], dtype=cdt)  # (T, Hq)
    for a, b in _unreached(seqs, causal, q.shape[0], "q", window):  # rows that see no key: out = 0, lse = -inf
        out[a:b], lse[a:b] = 0.0, float("-inf")
    for run in runs:
        o_r, lse_r = attend(run)
        if run.merge:
            merge_partial(_queries(out, run), _queries(lse, run), o_r, lse_r)  # (B, H, n, D), (B, H, n)
        else:
            _queries(out, run).copy_(o_r)  # (B, Hq, n, D)
            _queries(lse, run).copy_(lse_r)  # (B, Hq, n)
    if padded:
        return out, lse
    return _narrow(out, dv, out_dtype or q.dtype), lse  # (T, Hq, Dv)


def fused_backward(dout, q, k, v, out, lse, seqs: Varlen, *, causal: bool, scale: float, window=NO_WINDOW,
                   full_rows: bool = False, grad_dtype=None):  # fmt: skip
    """`(dq, dk, dv)` through the fused op's backward; see the module docstring."""
    cdt, d, dv = compute_dtype(q.dtype), q.shape[2], v.shape[2]
    qc, kc, vc = _prepared(q, cdt), _prepared(k, cdt), _prepared(v, cdt, d)
    doc = _prepared(dout, cdt, d)  # (T, Hq, D)
    if full_rows and q.dtype != cdt:  # Delta from the float32 output, not from `out` rounded to the input dtype
        oc, own = fused_forward(q, k, v, seqs, causal=causal, scale=scale, window=window, padded=True)  # (T, Hq, D)
        # the row's lse may hold a sink beyond the call's keys: their share of the softmax, e^(own - lse)
        share = torch.where(torch.isneginf(own), 0.0, torch.exp(own - lse.to(cdt)))  # (T, Hq)
        oc = oc * share.unsqueeze(-1)
    else:
        oc = _prepared(out, cdt, d)  # (T, Hq, D)
    lse, runs = lse.to(cdt), _runs(seqs, causal, window)
    hq, mqa = q.shape[1], k.shape[1] == 1 < q.shape[1]  # one K/V head: broadcast it (see MQA above)

    def grads(run: Run) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # (B, Hq, n, D), (B, Hkv, n_k, D) x 2
        k_r, v_r = _keys(kc, run), _keys(vc, run)  # (B, Hkv, n_k, D)
        if mqa:
            k_r, v_r = k_r.expand(-1, hq, -1, -1), v_r.expand(-1, hq, -1, -1)  # (B, Hq, n_k, D), stride 0: no copy
        inputs = (_queries(doc, run), _queries(qc, run), k_r, v_r, _queries(oc, run), _queries(lse, run))
        dq_r, dk_r, dv_r = _BACKWARD(*inputs, 0.0, run.causal, scale=scale, **_mask(seqs, run, cdt, q.device))
        if mqa:  # every query head's share of the one K/V head, summed in float32
            dk_r, dv_r = dk_r.sum(1, keepdim=True), dv_r.sum(1, keepdim=True)  # (B, 1, n_k, D)
        return dq_r, dk_r, dv_r

    if _whole(runs, q.shape[0], k.shape[0]):  # one call: its gradients are the packed tensors, no copy
        dq, dk, dvp = map(_packed, grads(runs[0]))
        return _narrow(dq, d, grad_dtype or q.dtype), _narrow(dk, d, grad_dtype or k.dtype), _narrow(dvp, dv, grad_dtype or v.dtype)
    plain = is_plain(seqs, causal, window)  # every key in one part; a band's tiles (or a shifted call's two
    # parts of a sequence) share keys, added up from zero
    dq = qc.new_empty(qc.shape)  # (T, Hq, D)
    dk, dvp = ((x.new_empty if plain else x.new_zeros)(x.shape) for x in (kc, vc))  # (T', Hkv, D) x 2, contiguous
    for a, b in _unreached(seqs, causal, q.shape[0], "q", window):  # rows and keys no call reaches: zero gradients
        dq[a:b] = 0.0
    for a, b in _unreached(seqs, causal, k.shape[0], "k") if plain else ():
        dk[a:b], dvp[a:b] = 0.0, 0.0
    for run in runs:
        dq_r, dk_r, dv_r = grads(run)
        if run.merge:
            _queries(dq, run).add_(dq_r)  # (B, Hq, n, D): the second part of these rows
        else:
            _queries(dq, run).copy_(dq_r)
        if plain:
            _keys(dk, run).copy_(dk_r)  # (B, Hkv, n_k, D): every key belongs to one part
            _keys(dvp, run).copy_(dv_r)
        else:
            _add_keys(dk, run, dk_r)
            _add_keys(dvp, run, dv_r)
    return _narrow(dq, d, grad_dtype or q.dtype), _narrow(dk, d, grad_dtype or k.dtype), _narrow(dvp, dv, grad_dtype or v.dtype)
