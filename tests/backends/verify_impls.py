"""Implementations to put under `python -m sim verify --impl tests.backends.verify_impls:<name>`.

Each has cpref's signature with the process group in place of `comm`:
`fn(q, k, v, sharding, *, process_group, mode, causal, window, **options)`, `sharding` the batch's `cpref.Sharding`.

* `cpref_over_group`: a correct one (a `TorchComm` over the group, then `cpref.attention`);
* `biased_on_rank_1`: a deliberately wrong one (rank 1's output is off by 0.1);
* `off_within_tolerance_on_rank_1`: wrong by less than the fixed tolerance, but about ten times
  the kernel's own error: only the `vs P=1` column catches it;
* `drops_window`: wrong under a sliding window (it runs without the window it was given);
* under `--mask`: `ignores_mask`, wrong (it takes `mask=` and runs causal documents instead: accelerate #4177's
  mask silently replaced by `is_causal=True`), `takes_no_mask` (no `mask` parameter: skipped), and
  `blockwise_masked`, `blockwise` with each block's visibility read from `mask.slices` (`visible`);
* `stream_ulysses` (`examples.stream_ulysses`): a correct peer, a DeepSpeed-style Ulysses over the
  stream layout, and `stream_ulysses_without_eod_reset`, the same attending across documents (causal over
  the whole stream, the bug of a packed batch run without its boundaries);
* `raises_on_rank_1`, `killed_mid_collective`, `mismatched_causal`: faults the harness must
  turn into a clear report instead of a hang;
* `wrong_shape_on_rank_1`, `detached_q`, `detached_q_without_cp`, `local_detached_q`: results the table must
  report in a row's note (an output that is not the rank's shard, an input without a gradient, a baseline
  without one) instead of ending the run;
* `blockwise`: a plain-torch CP attention (K/V gathered, attended block by block with scores `q @ k^T` in the
  input dtype, merged by lse in float32), exact as CP but rounding as most implementations do; and the bugs CP
  implementations have, one each: `blockwise_bf16_merge`, `blockwise_wrong_lse`, `blockwise_off_by_one`,
  `blockwise_no_dk_reduction`, `blockwise_stale_kv`; `raises_without_cp` (it refuses one rank, so its baseline is
  the fallback) with the same bugs (`raises_without_cp_bf16_merge`, ...), and `local_blockwise`, its local
  attention for `--baseline`.
"""

from __future__ import annotations

import functools
import os
import signal

import torch
import torch.distributed as dist

import cpref
import examples.stream_ulysses
from cpref.comm import TorchComm

_COMMS: dict[int, TorchComm] = {}


def _comm(process_group) -> TorchComm:
    """One `TorchComm` per group, kept (cpref checks the ranks' arguments once per batch and communicator)."""
    if id(process_group) not in _COMMS:
        _COMMS[id(process_group)] = TorchComm(process_group)
    return _COMMS[id(process_group)]


def cpref_over_group(q, k, v, sharding, *, process_group, **kwargs) -> torch.Tensor:
    """Correct: cpref.attention over a TorchComm of the group."""
    return cpref.attention(q, k, v, sharding, comm=_comm(process_group), **kwargs)


def stream_ulysses(q, k, v, sharding, *, process_group, **kwargs) -> torch.Tensor:
    """Correct: the peer of `examples.stream_ulysses`."""
    return examples.stream_ulysses.attention(q, k, v, sharding, process_group=process_group, **kwargs)


def stream_ulysses_without_eod_reset(q, k, v, sharding, *, process_group, **kwargs) -> torch.Tensor:
    """Wrong on packed batches: the peer told the stream is one document (no EOD reset between documents)."""
    one = cpref.Sharding([0, sharding.total], cp_size=sharding.cp_size, layout="stream")
    return examples.stream_ulysses.attention(q, k, v, one, process_group=process_group, **kwargs)


def biased_on_rank_1(q, k, v, sharding, *, process_group, **kwargs) -> torch.Tensor:
    """Wrong: rank 1 adds 0.1 to its output; no gradient changes, so only rank 1's `out` may fail."""
    out = cpref_over_group(q, k, v, sharding, process_group=process_group, **kwargs)
    return out + 0.1 if _comm(process_group).rank == 1 else out


# rank 1's output is scaled by 1 + this: 16 and 4 machine epsilons, inside rtol = 1e-5 (fp32) and 3.5e-2 (bf16,
# GQA), and about ten times the error of the kernel without CP
WITHIN_TOLERANCE = {torch.float32: 2.0**-19, torch.bfloat16: 2.0**-5}


def off_within_tolerance_on_rank_1(q, k, v, sharding, *, process_group, **kwargs) -> torch.Tensor:
    """Subtly wrong: rank 1's output is off by `WITHIN_TOLERANCE` relative; the gradients are untouched."""
    out = cpref_over_group(q, k, v, sharding, process_group=process_group, **kwargs)
    if _comm(process_group).rank != 1:
        return out
    return out + (out * WITHIN_TOLERANCE[out.dtype]).detach()


def drops_window(q, k, v, sharding, *, process_group, window, **kwargs) -> torch.Tensor:
    """Wrong under a window: calls cpref.attention without it (plain causal or full attention)."""
    return cpref_over_group(q, k, v, sharding, process_group=process_group, **kwargs)


def ignores_mask(q, k, v, sharding, *, process_group, mask=None, **kwargs) -> torch.Tensor:
    """Wrong under a mask: takes `mask=` and calls cpref.attention without it, causal documents instead (accelerate
    #4177: a mask silently replaced by `is_causal=True`)."""
    return cpref_over_group(q, k, v, sharding, process_group=process_group, **kwargs)


def takes_no_mask(q, k, v, sharding, *, process_group, mode, causal, window) -> torch.Tensor:
    """Right without a mask, and no `mask` parameter (nor `**options`): `--mask` skips it."""
    return cpref_over_group(q, k, v, sharding, process_group=process_group, mode=mode, causal=causal, window=window)


def drops_variants(q, k, v, sharding, *, process_group, softcap=None, chunk=None, sinks=None, **kwargs) -> torch.Tensor:
    """Wrong with soft-capping, chunks or sinks: calls cpref.attention without them (TE's CP paths hard-code no cap,
    and TE's p2p ignored the sink: its gradient exactly 0)."""
    return cpref_over_group(q, k, v, sharding, process_group=process_group, **kwargs)


def wrong_shape_on_rank_1(q, k, v, sharding, *, process_group, **kwargs) -> torch.Tensor:
    """Wrong: rank 1 returns its output one row short (rank 0's is right); no rank can run the backward."""
    out = cpref_over_group(q, k, v, sharding, process_group=process_group, **kwargs)
    return out[:-1] if _comm(process_group).rank == 1 else out


def detached_q(q, k, v, sharding, *, process_group, **kwargs) -> torch.Tensor:
    """Wrong: attends a detached `q`, so that `q` gets no gradient (on one rank or many, CP or not)."""
    return cpref_over_group(q.detach(), k, v, sharding, process_group=process_group, **kwargs)


def detached_q_without_cp(q, k, v, sharding, *, process_group, **kwargs) -> torch.Tensor:
    """Wrong at CP size 1 only: right on a group of several ranks, `detached_q` on one (its `vs P=1` has no baseline)."""
    one = dist.get_world_size(process_group) == 1
    return cpref_over_group(q.detach() if one else q, k, v, sharding, process_group=process_group, **kwargs)


def local_detached_q(q, k, v, sharding, **kwargs) -> torch.Tensor:
    """`local_blockwise` on a detached `q` (for `--baseline`): a local attention that gives `q` no gradient."""
    return local_blockwise(q.detach(), k, v, sharding, **kwargs)


def raises_on_rank_1(q, k, v, sharding, *, process_group, **kwargs) -> torch.Tensor:
    """Fault: rank 1 raises before any collective, rank 0 waits for it in the first one."""
    if _comm(process_group).rank == 1:
        raise ValueError("rank 1 rejects its input")
    return cpref_over_group(q, k, v, sharding, process_group=process_group, **kwargs)


class _DiesInAllGather(TorchComm):
    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        if self.rank == 1:  # killed inside the collective that rank 0 is waiting in
            os.kill(os.getpid(), signal.SIGKILL)
        return super().all_gather(x)


def killed_mid_collective(q, k, v, sharding, *, process_group, **kwargs) -> torch.Tensor:
    """Fault: rank 1's process is killed (SIGKILL) inside cpref's first all-gather."""
    return cpref.attention(q, k, v, sharding, comm=_DiesInAllGather(process_group), **kwargs)


def mismatched_causal(q, k, v, sharding, *, process_group, causal, **kwargs) -> torch.Tensor:
    """Fault: rank 1 passes the other mask; cpref's rank check raises the same error on every rank."""
    comm = _comm(process_group)
    return cpref.attention(q, k, v, sharding, comm=comm, causal=causal != (comm.rank == 1), **kwargs)


# ---- a plain-torch CP attention, exact but rounding as most do, and the bugs CP implementations have --------------
class _GatherKV(torch.autograd.Function):
    """Every rank's block, stacked `(P, T_l, ...)`; backward: the gradient of each block summed over the ranks
    (an all-reduce, then this rank's), or with `reduce=False` only this rank's own use of its block (the bug)."""

    @staticmethod
    def forward(ctx, x, group, reduce: bool):
        ctx.group, ctx.reduce = group, reduce
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if ctx.reduce:
            dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None, None


def _visible(sharding, r: int, s: int, causal: bool, window, ahead: int) -> torch.Tensor:
    """`(T_l, T_l)`: which of rank s's keys rank r's queries see (same document, real key, causal, the window);
    `ahead` keys past the diagonal are visible too in another rank's block (the off-by-one bug)."""
    ends = torch.tensor(sharding.cu_seqlens_padded[1:])
    doc = lambda t: torch.bucketize(sharding.global_index(t), ends, right=True)  # noqa: E731  (T_l,)
    real = sharding.shard(sharding.pad(torch.ones(sharding.cu_seqlens[-1], dtype=torch.bool), value=False), s)
    qp, kp = sharding.positions(r)[:, None], sharding.positions(s)[None, :]
    seen = (doc(r)[:, None] == doc(s)[None, :]) & real[None, :]
    right = (ahead if s != r else 0) if causal else window[1]
    if right >= 0:
        seen &= kp <= qp + right
    if window[0] >= 0:
        seen &= kp >= qp - window[0]
    return seen


def blockwise(q, k, v, sharding, *, process_group, causal, window, bug=None, **kwargs) -> torch.Tensor:
    """K/V gathered, then attended block by block (one block per source rank), each block's scores `q @ k^T`
    computed in the input dtype (as plain-torch implementations do), its softmax and the merge of the blocks'
    outputs by their lse in float32: exact as CP. `bug`: `"bf16 merge"` carries every block's output and lse, and
    the running merge, in the input dtype (a ring that merges in bf16 across its steps), `"wrong lse"` merges by
    the larger lse instead of their log-sum-exp, `"off by one"` lets a query see one key past the diagonal in
    another rank's block, `"no dk reduction"` drops the reduction of dK/dV over the ranks, `"stale kv"` attends
    its own K/V where the next rank's should be."""
    group = process_group
    P, r = dist.get_world_size(group), dist.get_rank(group)
    K, V = (_GatherKV.apply(x, group, bug != "no dk reduction") for x in (k, v))  # (P, T_l, Hkv, X)
    blocks = []
    for s in range(P):
        ks, vs = (k, v) if bug == "stale kv" and s == (r + 1) % P else (K[s], V[s])
        blocks.append((ks, vs, _visible(sharding, r, s, causal, window, 1 if bug == "off by one" else 0)))
    return _merge_blocks(q, blocks, bug)


def _merge_blocks(q, blocks, bug=None) -> torch.Tensor:
    """`blockwise`'s local part: every `(k, v, seen)` block attended in turn, merged by lse (see `blockwise`)."""
    dtype, out, lse = q.dtype, None, None
    for k_b, v_b, seen in blocks:
        G, scale = q.shape[1] // k_b.shape[1], q.shape[-1] ** -0.5
        ks, vs = (x.repeat_interleave(G, dim=1) for x in (k_b, v_b))  # (T_k, Hq, X)
        scores = torch.einsum("qhd,khd->hqk", q, ks).float() * scale  # q @ k^T in the input dtype
        scores = scores.masked_fill(~seen.to(q.device), float("-inf"))  # (Hq, T_l, T_k)
        b_lse = torch.logsumexp(scores, dim=-1)  # (Hq, T_l), -inf for a row that sees no key here
        p = torch.exp(scores - torch.where(b_lse.isfinite(), b_lse, 0.0)[..., None])
        b_out = torch.einsum("hqk,khd->qhd", p, vs.float())  # (T_l, Hq, Dv)
        if bug == "bf16 merge":  # the block's partial result carried in the input dtype, as its kernel returns it
            b_out, b_lse = b_out.to(dtype).float(), b_lse.to(dtype).float()
        if out is None:
            out, lse = b_out, b_lse
            continue
        new = torch.maximum(lse, b_lse) if bug == "wrong lse" else torch.logaddexp(lse, b_lse)
        ok = new.isfinite()
        w, w_b = (torch.where(ok, torch.exp(x - torch.where(ok, new, 0.0)), 0.0).T[..., None] for x in (lse, b_lse))
        out, lse = out * w + b_out * w_b, new
        if bug == "bf16 merge":  # and the running merge too
            out, lse = out.to(dtype).float(), lse.to(dtype).float()
    return out.to(dtype)


# --8<-- [start:visible]
def visible(mask, sharding) -> torch.Tensor:
    """`(T, T)` over the padded stream: whether query x sees key y, read from
    `mask.slices` (global indices of the real tokens; a slice's local indices
    i, j count from its q_start and k_start); padding sees nothing."""
    # (T,): each row's real token, -1 padding
    token = sharding.pad(torch.arange(sharding.cu_seqlens[-1]), value=-1)
    seen = torch.zeros(sharding.total, sharding.total, dtype=torch.bool)
    for q_start, q_end, k_start, k_end, kind in mask.slices:
        # (T, 1), (1, T): local indices in the slice
        i, j = token[:, None] - q_start, token[None, :] - k_start
        q_len, k_len = q_end - q_start, k_end - k_start
        inside = (i >= 0) & (i < q_len) & (j >= 0) & (j < k_len)  # (T, T)
        # below the diagonal through the bottom-right corner
        if kind in ("causal", "bi_causal"):
            inside &= j <= i + k_len - q_len
        # above the diagonal through the top-left corner
        if kind in ("inv_causal", "bi_causal"):
            inside &= j >= i
        seen |= inside  # the union: a pair two slices show counts once
    return seen
# --8<-- [end:visible]


def blockwise_masked(q, k, v, sharding, *, process_group, mask=None, **kwargs) -> torch.Tensor:
    """`blockwise` under `--mask`: rank r's queries see in rank s's block what `visible` shows (without a mask,
    `blockwise` itself)."""
    if mask is None:
        return blockwise(q, k, v, sharding, process_group=process_group, **kwargs)
    P, r = dist.get_world_size(process_group), dist.get_rank(process_group)
    K, V = (_GatherKV.apply(x, process_group, True) for x in (k, v))  # (P, T_l, Hkv, X)
    seen, rows = visible(mask, sharding), [sharding.global_index(s) for s in range(P)]  # (T, T), (T_l,) each
    return _merge_blocks(q, [(K[s], V[s], seen[rows[r]][:, rows[s]]) for s in range(P)])


def local_blockwise(q, k, v, sharding, *, causal, window, **kwargs) -> torch.Tensor:
    """`blockwise`'s local attention on one device (for `--baseline`): the whole batch as one block."""
    return _merge_blocks(q, [(k, v, _visible(sharding, 0, 0, causal, window, 0))])


def blockwise_bf16_merge(q, k, v, sharding, **kwargs):
    """Wrong in low precision: the blocks' outputs and lse, and their running merge, in the input dtype."""
    return blockwise(q, k, v, sharding, bug="bf16 merge", **kwargs)


def blockwise_wrong_lse(q, k, v, sharding, **kwargs):
    """Wrong: blocks merged by the larger of their lse, not by their log-sum-exp."""
    return blockwise(q, k, v, sharding, bug="wrong lse", **kwargs)


def blockwise_off_by_one(q, k, v, sharding, **kwargs):
    """Wrong: another rank's block lets a query see one key past its own position."""
    return blockwise(q, k, v, sharding, bug="off by one", **kwargs)


def blockwise_no_dk_reduction(q, k, v, sharding, **kwargs):
    """Wrong: dK/dV of the gathered blocks not summed over the ranks."""
    return blockwise(q, k, v, sharding, bug="no dk reduction", **kwargs)


def blockwise_stale_kv(q, k, v, sharding, **kwargs):
    """Wrong: the next rank's K/V block replaced by this rank's own."""
    return blockwise(q, k, v, sharding, bug="stale kv", **kwargs)


def raises_without_cp(q, k, v, sharding, *, process_group, **kwargs):
    """`blockwise`, refusing to run on one rank (as a ring that cannot send to itself): its baseline is the fallback."""
    if dist.get_world_size(process_group) == 1:
        raise RuntimeError("needs at least two ranks")
    return blockwise(q, k, v, sharding, process_group=process_group, **kwargs)


# the same bugs in the implementation that refuses one rank: raises_without_cp_bf16_merge, ..._stale_kv
BUGS = ("bf16 merge", "wrong lse", "off by one", "no dk reduction", "stale kv")
for _bug in BUGS:
    globals()["raises_without_cp_" + _bug.replace(" ", "_")] = functools.partial(raises_without_cp, bug=_bug)


def refuses_windows(q, k, v, sharding, *, process_group, window, **kwargs) -> torch.Tensor:
    """Right where it runs; a case with a window it refuses, before it communicates, on every rank alike."""
    if tuple(window) != (-1, -1):
        raise NotImplementedError("no sliding window (the adapter's attention has no window argument)")
    return cpref_over_group(q, k, v, sharding, process_group=process_group, window=window, **kwargs)


def refuses_on_rank_1(q, k, v, sharding, *, process_group, **kwargs) -> torch.Tensor:
    """Wrong: rank 1 refuses the case, rank 0 answers without communicating (the ranks disagree)."""
    if _comm(process_group).rank == 1:
        raise NotImplementedError("rank 1 alone")
    return q[..., : v.shape[-1]] * 1.0


def scaled(q, k, v, sharding, *, process_group, mode, causal, window, scale_output: float = 1.0) -> torch.Tensor:
    """Right at `scale_output=1.0` (`--impl-option scale_output=...`), wrong at any other; takes no other setting."""
    out = cpref_over_group(q, k, v, sharding, process_group=process_group, mode=mode, causal=causal, window=window)
    return out * scale_output


def no_backward(q, k, v, sharding, *, process_group, **kwargs) -> torch.Tensor:
    """Right, forward only: the output of a run under `torch.no_grad` (a peer with no backward, as FlexAttention on
    the CPU): it fails a normal run (the output does not require grad) and passes `--forward-only`."""
    with torch.no_grad():
        return cpref_over_group(q, k, v, sharding, process_group=process_group, **kwargs)


def ring_rotating(q, k, v, sharding, *, process_group, causal=True, **kwargs) -> torch.Tensor:
    """Right, forward only, an educational ring: every score, softmax and merge in the input dtype (bf16 stays
    bf16), P steps over one document, each rotating K and V to the next rank with `batch_isend_irecv`, the last
    bringing them home: at CP size 1 it sends to itself, which gloo refuses without `sim verify`'s loopback."""
    P, r = dist.get_world_size(process_group), dist.get_rank(process_group)
    g, scale = q.shape[1] // k.shape[1], q.shape[-1] ** -0.5
    here = sharding.global_index(r)  # (T_l,) positions of this rank's queries
    out = lse = None
    kv, owner = torch.cat([k, v], dim=-1).detach(), r  # (T_l, Hkv, D + Dv): the block in hand, and whose it is
    with torch.no_grad():
        for _ in range(P):
            kb, vb = (x.repeat_interleave(g, dim=1) for x in kv.split([k.shape[-1], v.shape[-1]], dim=-1))
            seen = sharding.global_index(owner)[None, :] <= here[:, None] if causal else torch.ones(len(here), len(kb), dtype=torch.bool)
            s = torch.einsum("qhd,khd->hqk", q, kb) * scale  # (Hq, T_l, T_l) in the dtype
            s = s.masked_fill(~seen, float("-inf"))
            lse_b = torch.logsumexp(s, dim=-1)  # (Hq, T_l)
            p = torch.where(seen, torch.exp(s - lse_b[..., None]), torch.zeros((), dtype=s.dtype))
            o_b = torch.einsum("hqk,khd->qhd", p, vb)  # (T_l, Hq, Dv)
            if out is None:
                out, lse = o_b, lse_b
            else:  # the merge by lse, in the dtype
                new = torch.logaddexp(lse, lse_b)
                out = out * torch.exp(lse - new).T[..., None] + o_b * torch.exp(lse_b - new).T[..., None]
                lse = new
            nxt = torch.empty_like(kv)
            ops = [dist.P2POp(dist.isend, kv, group=process_group, group_peer=(r + 1) % P),
                   dist.P2POp(dist.irecv, nxt, group=process_group, group_peer=(r - 1) % P)]  # fmt: skip
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            kv, owner = nxt, (owner - 1) % P
    return out
