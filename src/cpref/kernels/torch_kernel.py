r"""`TorchKernel`: the attention contract in plain PyTorch, blocked over query rows.

This is the portable kernel: it runs wherever torch runs (CPU, CUDA, ...) in float16,
bfloat16, float32 and float64, and it is written as explicit matrix products so that the
forward and backward passes can be read next to their formulas. Inputs are upcast once to
the *compute dtype* (float32, or float64 for float64 inputs); every sum accumulates there.

**Blocks instead of a $T \times T$ matrix.** Sequences are independent, so the kernel loops
over them, and within a sequence over blocks of $R$ query rows. Under bottom-right causal
masking query $x$ of a sequence with $n_q$ queries and $n_k$ keys sees key $y$ iff
$y \le x + \delta$ with $\delta = n_k - n_q$, so the rows $[a, b)$ of a block see at most the
key *prefix* $[0, b + \delta)$. Every row sees the keys $[0, a + \delta]$; only the last $R$
columns of the prefix form the triangle that needs a mask. Without `causal` every row sees
all $n_k$ keys. Either way a block's keys are one contiguous range, so the block's scores are
one batched matrix product and its softmax is *exact*: no online rescaling is needed.
$R$ is chosen so that a block's score matrix, $R \cdot n_b \cdot H_q$ elements for its $n_b$ keys,
stays under `max_block_elements`, and on a CPU under `CACHE_BLOCK_ELEMENTS` ($2^{20}$, 4 MiB in
float32) as well, unless that leaves fewer than `MIN_CACHE_ROWS` (16) rows: every elementwise pass
over a block (mask, maximum, `exp2`, sum; in the backward the same and $dS$) then reads it from
the cache rather than from memory.

Rows $x < -\delta$ see no key at all (more queries than keys). They are never computed:
their `out` stays 0, their `lse` stays $-\infty$ and their gradients stay 0, so no NaN can
appear.

**GQA without copies.** Tensors are laid out head-major once, `q` as $(H_{kv}, T, G, D)$
with $G = H_q / H_{kv}$, so a block of queries is a $(H_{kv}, R G, D)$ view whose $G$ query
heads all multiply the same $(H_{kv}, L, D)$ key block; K and V are never repeated.

**Base 2.** Since $e^x = 2^{x \log_2 e}$, the kernel works with logits in base 2,
$S_2 = s_2\, Q K^\top$ with $s_2 = s \log_2 e$, because `exp2` is much cheaper than `exp` on a
CPU (FlashAttention does the same on GPUs). The natural-log lse of the contract is
$\mathrm{lse} = \ln 2 \cdot \mathrm{lse}_2$.

**Forward**, for one block, with the row maximum $m$ for stability:

$$ S_2 = s_2\, Q K^\top, \quad m = \max_y S_{2,y}, \quad \tilde P = 2^{S_2 - m}, \quad
   \ell = \textstyle\sum_y \tilde P_y, \quad O = \tilde P V / \ell, \quad
   \mathrm{lse} = \ln 2\, (m + \log_2 \ell). $$

The lse is summed in float64 and rounded to float32 once: under CP a row's partial results
meet only through their lse (the ring's merge weights $\sigma(\mathrm{lse}_a - \mathrm{lse}_b)$), so
its rounding at $|\mathrm{lse}|\,\epsilon$ is the floor of a split row's error; two float32
roundings put the ring's output error at 2.2 times the unsplit call's with logits soft-capped at
50 and saturated (`tests/cp/test_variants_precision.py`, P = 4), one keeps it at 1.5.

**Backward** recomputes $P = 2^{S_2 - \mathrm{lse}_2}$ from the saved lse (which, under
context parallelism, is the lse of the *whole* row, not of this block) and, with
$\Delta = \mathrm{rowsum}(dO \circ O)$ computed once for all rows (FlashAttention-2,
Dao 2023, https://arxiv.org/abs/2307.08691):

$$ dV \leftarrow dV + P^\top dO, \quad dP = dO\, V^\top, \quad dS = P \circ (dP - \Delta), \quad
   dQ = s\, dS\, K, \quad dK \leftarrow dK + s\, dS^\top Q. $$

**Soft-capping.** With `softcap` $= c$ the logits are $c \tanh(S / c)$ before the mask; the block
holds $t = \tanh(S / c)$ and takes the factor $c \log_2 e$ in the pass that subtracts the row's
maximum (forward) or lse (backward), so the cap costs one `tanh` pass over the scores each way
(the backward three more: the slope and its product with $dS$). The backward keeps the slope $\partial (c \tanh(S/c)) / \partial S = 1 - t^2$ and
multiplies $dS$ by it before $dQ$ and $dK$. A $2\sigma(2y) - 1$ in place of `tanh` would be
faster but rounds the logits absolutely, to $c\,\epsilon$ rather than $|S|\,\epsilon$, which the
fp32 tolerance of the kernel tests does not take. The fused path has no soft-capping, so a
soft-capped call takes this explicit path; with `fast` (the default), float32 blocks on a CPU run
its elementwise steps as compiled loops, one per step of the table in
[Soft-capping, compiled][cpref.kernels.softcap_native] (an accurate vector `tanh`, fewer passes;
`bench/variants.py` times both), and `fast=False` keeps them in PyTorch, as written below.

With `full_rows=True` (the caller guarantees that each row's keys are all in this call) a
block holds whole rows, and $\Delta = \mathrm{rowsum}(P \circ dP)$ is computed from the
block's float32 probabilities instead of from the output, which the caller holds rounded to
the input dtype. In bf16 this keeps the gradient error at the level of the final rounding
whatever the logit scale; through `out` it grows with the scale (about 3x at 2.5 times
$D^{-1/2}$, beyond the bf16 tolerance of the test table, which holds at the default scale).

The score-sized buffers are allocated once per call and reused by every block. The block
list and the diagonal masks depend only on the sequence lengths, so they are built once per
[`Varlen`][cpref.kernels.contract.Varlen] (once per batch, not once per layer) and read from
its cache afterwards; the kernel never reads a device tensor back to the host.

**The fast path.** This explicit path is the reference. On a CPU, `TorchKernel()` runs the
same contract through PyTorch's fused attention instead
([`cpref.kernels.torch_fused`][cpref.kernels.torch_fused]: bottom-right causal blocks split
and merged by lse, one call per run of equal sequences, windows as tiles of their band), which
the tests check against this path and the oracle; `TorchKernel(fast=False)` always takes the explicit path.
"""

from __future__ import annotations

import math
from typing import Iterator, NamedTuple

import torch

from cpref.base.errors import CPInputError
from cpref.kernels import softcap_native as native_cap
from cpref.kernels.contract import Varlen, check_softcap, check_window, compute_dtype
from cpref.kernels.torch_checks import check_inputs
from cpref.kernels.torch_fused import fused_available, fused_backward, fused_forward

__all__ = ["TorchKernel"]

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
CACHE_BLOCK_ELEMENTS = 2**20  # on a CPU, a block's scores (4 MiB in float32) stay in a last-level cache
MIN_CACHE_ROWS = 16  # ... but not fewer query rows than this: thinner blocks starve the matrix products


class _Block(NamedTuple):
    """One block of work: query rows, the key range they may see, and the diagonal mask."""

    rows: slice  # query tokens [a, b) of the packed stream
    keys: slice  # key tokens [lo, hi) of the packed stream
    mask: torch.Tensor | None  # (R, 1, M) True where hidden, over the last M keys of the block; None: no mask


def _heads_major(x: torch.Tensor, hkv: int, dtype: torch.dtype) -> torch.Tensor:
    """Copy token-major `(T, Hkv*G, X)` into a contiguous head-major `(Hkv, T*G, X)` in `dtype`."""
    t, h, d = x.shape
    out = torch.empty((hkv, t, h // hkv, d), dtype=dtype, device=x.device)  # (Hkv, T, G, X)
    out.copy_(x.reshape(t, hkv, h // hkv, d).transpose(0, 1))  # (T, Hkv, G, X) -> (Hkv, T, G, X)
    return out.view(hkv, t * (h // hkv), d)  # (Hkv, T*G, X)


def _store(dst: torch.Tensor, src: torch.Tensor, hkv: int) -> None:
    """Write a head-major block `src (Hkv, R*G, ...)` into token-major `dst (R, Hkv*G, ...)`."""
    r, rest = dst.shape[0], dst.shape[2:]
    src = src.view(hkv, r, -1, *rest).transpose(0, 1)  # (Hkv, R, G, ...) -> (R, Hkv, G, ...)
    dst.view(r, hkv, -1, *rest).copy_(src)  # (R, Hq, ...) as (R, Hkv, G, ...)


def _take(buf: torch.Tensor, *shape: int) -> torch.Tensor:
    """The first `prod(shape)` elements of the flat workspace `buf`, viewed as `shape`."""
    return buf[: math.prod(shape)].view(shape)


def _logits(qb: torch.Tensor, kb: torch.Tensor, blk: _Block, s2: float, buf: torch.Tensor, softcap: float | None = None,
            slope_buf: torch.Tensor | None = None, native: bool = False) -> torch.Tensor:  # fmt: skip
    """Masked base-2 logits `S2 = s2 Q K^T` of one block, `(Hkv, R*G, L)`, written into `buf`.

    Soft-capped, the block holds `t = tanh(s Q K^T / c)` instead (the capped logits are `S2 = c log2(e) t`; the caller
    scales `t` in the pass that subtracts the row's maximum or lse), and the slope `1 - t^2` is kept in `slope_buf`
    where one is given; `native`: by the compiled loop (`cpref.kernels.softcap_native`).
    """
    hkv, n = qb.shape[0], kb.shape[1]
    s = _take(buf, hkv, qb.shape[1], n)  # (Hkv, R*G, L)
    if softcap is None:
        # S2 = s2 Q K^T
        torch.baddbmm(s, qb, kb.transpose(1, 2), beta=0, alpha=s2, out=s)  # (Hkv, R*G, D) x (Hkv, D, L)
    else:
        # t = tanh(s Q K^T / c)  (s2 = s log2(e))
        torch.baddbmm(s, qb, kb.transpose(1, 2), beta=0, alpha=s2 / (LOG2E * softcap), out=s)
        if native:
            # t = tanh(.) and 1 - t^2 in one loop
            native_cap.cap_tanh(s, None if slope_buf is None else _take(slope_buf, *s.shape))
        else:
            s.tanh_()
        if slope_buf is not None and not native:
            # 1 - t^2, before the mask: finite on every key
            _take(slope_buf, *s.shape).fill_(1.0).addcmul_(s, s, value=-1.0)  # (Hkv, R*G, L)
    if blk.mask is not None:
        # -inf where row j does not see key t: causal hides only among the last R keys, a window among all
        rows, cols = blk.mask.shape[0], blk.mask.shape[2]
        s.view(hkv, rows, -1, n)[..., n - cols :].masked_fill_(blk.mask, float("-inf"))  # (Hkv, R, G, M)
    return s


def _forward_block(
    qb: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, blk: _Block, s2: float, buf: torch.Tensor,
    softcap: float | None = None,
    native: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(O (Hkv, R*G, Dv), lse (Hkv, R*G))` of one block; `buf` holds its scores."""
    # 1) S2 = s2 Q K^T, masked (soft-capped: t, S2 = c log2(e) t)
    s = _logits(qb, kb, blk, s2, buf, softcap, native=native)  # (Hkv, R*G, L)
    # 2) m = max_y S2_y; 3) P~ = 2^(S2 - m), in place; l = sum_y P~_y
    if softcap is None:
        m = s.amax(dim=-1, keepdim=True)  # (Hkv, R*G, 1)
        p = s.sub_(m).exp2_()  # (Hkv, R*G, L)
        el = p.sum(dim=-1, keepdim=True)  # (Hkv, R*G, 1)
    elif native:
        # the same three steps in one loop over each row
        p, (m, el) = s, native_cap.cap_softmax(s, softcap * LOG2E)  # (Hkv, R*G, L), (Hkv, R*G, 1) twice
    else:
        # m = c log2(e) max_y t_y; S2 - m = c log2(e) t - m in one pass
        m = s.amax(dim=-1, keepdim=True).mul_(softcap * LOG2E)  # (Hkv, R*G, 1)
        p = torch.add(m.neg(), s, alpha=softcap * LOG2E, out=s).exp2_()  # (Hkv, R*G, L)
        el = p.sum(dim=-1, keepdim=True)  # (Hkv, R*G, 1)
    # 4) O = P~ V / l
    o = torch.bmm(p, vb).div_(el)  # (Hkv, R*G, L) x (Hkv, L, Dv) -> (Hkv, R*G, Dv)
    # 5) lse = ln2 (m + log2 l), in float64, rounded once
    lse = m.double().add_(el.log2_()).mul_(LN2).to(m.dtype)  # (Hkv, R*G, 1)
    return o, lse.squeeze(-1)


def _backward_block(
    qb: torch.Tensor,
    kb: torch.Tensor,
    vb: torch.Tensor,
    dob: torch.Tensor,
    lse2b: torch.Tensor,
    deltab: torch.Tensor | None,
    blk: _Block,
    s2: float,
    scale: float,
    bufs: list[torch.Tensor],
    softcap: float | None = None,
    native: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(dQ (Hkv, R*G, D), dK (Hkv, L, D), dV (Hkv, L, Dv))` of one block.

    `bufs` are the flat workspaces for `(S, dP, dK, dV)` (and, soft-capped, the slope `1 - t^2`); `dK` and `dV` live
    in them. `deltab` None: the block holds whole rows, Delta = rowsum(P o dP).
    """
    hkv, n = kb.shape[0], kb.shape[1]
    # 1) P = 2^(S2 - lse2), recomputed in place (soft-capped: S2 = c log2(e) t, the slope 1 - t^2 kept)
    if softcap is None:
        p = _logits(qb, kb, blk, s2, bufs[0]).sub_(lse2b).exp2_()  # (Hkv, R*G, L)
    else:
        t = _logits(qb, kb, blk, s2, bufs[0], softcap, bufs[4], native)  # (Hkv, R*G, L)
        if native:
            p = native_cap.cap_probs(t, softcap * LOG2E, lse2b)  # (Hkv, R*G, L)
        else:
            p = torch.add(lse2b.neg(), t, alpha=softcap * LOG2E, out=t).exp2_()  # (Hkv, R*G, L)
    # 2) dV = P^T dO
    dv = torch.bmm(p.transpose(1, 2), dob, out=_take(bufs[3], hkv, n, dob.shape[2]))  # (Hkv, L, R*G) x (Hkv, R*G, Dv)
    # 3) dP = dO V^T
    dp = torch.bmm(dob, vb.transpose(1, 2), out=_take(bufs[1], *p.shape))  # (Hkv, R*G, Dv) x (Hkv, Dv, L)
    # 4) dS = P o (dP - Delta), in place; whole rows: Delta = rowsum(P o dP), in float32
    if native:
        # soft-capped: dS = P o (dP - Delta) o (1 - t^2), Delta too, in one loop over each row
        ds = native_cap.cap_ds(dp, p, _take(bufs[4], *dp.shape), deltab)  # (Hkv, R*G, L)
    else:
        if deltab is None:
            deltab = (p * dp).sum(-1, keepdim=True)  # (Hkv, R*G, 1)
        ds = dp.sub_(deltab).mul_(p)  # (Hkv, R*G, L)
        if softcap is not None:
            # d(c tanh(S / c)) / dS = 1 - t^2
            ds.mul_(_take(bufs[4], *ds.shape))
    # 5) dQ = s dS K
    dq = torch.bmm(ds, kb).mul_(scale)  # (Hkv, R*G, L) x (Hkv, L, D) -> (Hkv, R*G, D)
    # 6) dK = s dS^T Q
    dk = _take(bufs[2], hkv, n, qb.shape[2])  # (Hkv, L, D)
    torch.baddbmm(dk, ds.transpose(1, 2), qb, beta=0, alpha=scale, out=dk)  # (Hkv, L, R*G) x (Hkv, R*G, D)
    return dq, dk, dv


class TorchKernel:
    """The attention contract in explicit, blocked PyTorch; see the module docstring.

    Args:
        block_size: at most this many query rows per block of the explicit path (None: only
            the budget decides).
        max_block_elements: memory budget of one block, in elements of the compute dtype:
            query rows are chosen so that `rows * kv_len * Hq` stays under it (at least one
            row). Forward holds one such buffer, backward two (three soft-capped). The default
            `2**24` is 64 MiB per float32 buffer; on a CPU the blocks are cache-sized within it
            (`CACHE_BLOCK_ELEMENTS`). The fast path's blocks are the fused op's tiles, taken only
            when the budget holds one per thread (`torch_fused.FUSED_TILE_ELEMENTS`).
        fast: on a CPU, run the fused path (`cpref.kernels.torch_fused`), and soft-capped
            calls' elementwise steps as compiled loops (`cpref.kernels.softcap_native`);
            `False`: always the explicit path in PyTorch, the readable reference.

    Raises:
        CPInputError: if `block_size` or `max_block_elements` is not a positive int, or
            `fast` not a bool.

    Examples:
        >>> import torch
        >>> from cpref.kernels import Varlen
        >>> q = k = v = torch.randn(6, 2, 4)
        >>> out, lse = TorchKernel().forward(q, k, v, Varlen([0, 2, 6]), causal=True, scale=0.5)
        >>> out.shape, lse.shape
        (torch.Size([6, 2, 4]), torch.Size([6, 2]))
    """

    deterministic = True  # no atomics: every sum is in program order, on every device (cpref.base.determinism)
    variants = frozenset({"softcap"})  # what it computes beyond the contract's plain attention (cpref.kernels.contract)

    def __init__(self, block_size: int | None = None, max_block_elements: int = 2**24, fast: bool = True) -> None:
        for name, value in (("block_size", block_size), ("max_block_elements", max_block_elements)):
            if value is None and name == "block_size":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CPInputError(f"{name}={value!r} must be a positive int" + (", or None" if name == "block_size" else ""))
        if not isinstance(fast, bool):
            raise CPInputError(f"fast={fast!r} must be True (the fused path on a CPU) or False (the explicit path)")
        self.block_size = block_size
        self.max_block_elements = max_block_elements
        self.fast = fast

    def __repr__(self) -> str:
        return f"TorchKernel(block_size={self.block_size}, max_block_elements={self.max_block_elements}, fast={self.fast})"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        seqs: Varlen,
        *,
        causal: bool,
        scale: float,
        window: tuple[int, int] = (-1, -1),
        out_dtype: torch.dtype | None = None,
        softcap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return `(out (T, Hq, Dv), lse (T, Hq))`; see `AttentionKernel.forward`."""
        check_inputs(q, k, v, seqs)
        window, softcap = check_window(window, causal), check_softcap(softcap)
        if self._fused(q) and softcap is None:
            return fused_forward(q, k, v, seqs, causal=causal, scale=scale, window=window, out_dtype=out_dtype)
        hkv, g, cdt = k.shape[1], q.shape[1] // k.shape[1], compute_dtype(q.dtype)
        blocks, size = self._blocks(q, seqs, causal, window)
        # 1) head-major operands in the compute dtype, one score buffer for every block
        qh, kh, vh = (_heads_major(x, hkv, cdt) for x in (q, k, v))  # (Hkv, T*G, D), (Hkv, T', D|Dv)
        buf = torch.empty(size, dtype=cdt, device=q.device)  # scores of a block
        native = softcap is not None and self.fast and native_cap.usable(buf)  # the compiled loops
        # 2) rows that see no key keep out = 0 and lse = -inf
        out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2], dtype=out_dtype or q.dtype)  # (T, Hq, Dv)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=cdt, device=q.device)  # (T, Hq)
        # 3) one exact softmax per block
        for blk in blocks:
            qb = qh[:, blk.rows.start * g : blk.rows.stop * g]  # (Hkv, R*G, D)
            o_b, lse_b = _forward_block(qb, kh[:, blk.keys], vh[:, blk.keys], blk, scale * LOG2E, buf, softcap, native)
            _store(out[blk.rows], o_b, hkv)  # (R, Hq, Dv)
            _store(lse[blk.rows], lse_b, hkv)  # (R, Hq)
        return out, lse

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        seqs: Varlen,
        *,
        causal: bool,
        scale: float,
        window: tuple[int, int] = (-1, -1),
        full_rows: bool = False,
        grad_dtype: torch.dtype | None = None,
        softcap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return `(dq, dk, dv)` shaped like `(q, k, v)`; see `AttentionKernel.backward`."""
        check_inputs(q, k, v, seqs)
        window, softcap = check_window(window, causal), check_softcap(softcap)
        if self._fused(q) and softcap is None:
            return fused_backward(
                dout, q, k, v, out, lse, seqs, causal=causal, scale=scale, window=window, full_rows=full_rows,
                grad_dtype=grad_dtype,
            )
        hkv, g, cdt = k.shape[1], q.shape[1] // k.shape[1], compute_dtype(q.dtype)
        blocks, size = self._blocks(q, seqs, causal, window)
        # 1) head-major operands; Delta = rowsum(dO o O) once for all rows (unless rows are whole); lse2 = lse / ln2
        qh, kh, vh, doh = (_heads_major(x, hkv, cdt) for x in (q, k, v, dout))  # (Hkv, T*G|T', .)
        delta = None if full_rows else _heads_major((dout.to(cdt) * out.to(cdt)).sum(-1, keepdim=True), hkv, cdt)
        lse2 = _heads_major(lse.unsqueeze(-1), hkv, cdt).mul_(LOG2E)  # (Hkv, T*G, 1)
        sizes = (size, size, k.numel(), v.numel(), size if softcap else 0)  # S, dP, dK, dV of a block; 1 - t^2
        bufs = [torch.empty(n, dtype=cdt, device=q.device) for n in sizes]
        native = softcap is not None and self.fast and native_cap.usable(bufs[0])  # the compiled loops
        # 2) rows that see no key keep zero gradients
        dq = torch.zeros(q.shape, dtype=grad_dtype or q.dtype, device=q.device)  # (T, Hq, D)
        dk, dv = torch.zeros_like(kh), torch.zeros_like(vh)  # (Hkv, T', D), (Hkv, T', Dv)
        # 3) per block: dQ of its rows, dK and dV accumulated over its key range
        for blk in blocks:
            tok = slice(blk.rows.start * g, blk.rows.stop * g)  # block rows in the (Hkv, T*G, .) layout
            dq_b, dk_b, dv_b = _backward_block(
                qh[:, tok], kh[:, blk.keys], vh[:, blk.keys], doh[:, tok], lse2[:, tok],
                None if delta is None else delta[:, tok],
                blk, scale * LOG2E, scale, bufs, softcap, native,
            )  # fmt: skip
            _store(dq[blk.rows], dq_b, hkv)  # (R, Hq, D)
            dk[:, blk.keys] += dk_b  # (Hkv, L, D)
            dv[:, blk.keys] += dv_b  # (Hkv, L, Dv)
        # 4) back to token-major, in the input dtypes (or grad_dtype)
        return dq, dk.transpose(0, 1).to(grad_dtype or k.dtype), dv.transpose(0, 1).to(grad_dtype or v.dtype)  # (T', Hkv, .)

    def _fused(self, q: torch.Tensor) -> bool:
        """Whether the call takes the fused CPU path: with `fast`, on a CPU, within the budget; windows and
        shifts included (the path tiles their bands, `cpref.kernels.torch_fused_plan`)."""
        return self.fast and fused_available(q.device, self.max_block_elements)

    def _blocks(self, q: torch.Tensor, seqs: Varlen, causal: bool, window: tuple[int, int]) -> tuple[list[_Block], int]:
        """The blocks of every sequence and the largest buffer size.

        The block list depends only on `seqs`, the mask, the head count, the budget and the
        device, so it is built once per `Varlen` and cached there.
        """
        key = ("TorchKernel.blocks", self.block_size, self.max_block_elements, q.shape[1], bool(causal), window, str(q.device))
        return seqs.cached(key, lambda: self._plan(seqs, q.shape[1], bool(causal), window, q.device))

    def _plan(self, seqs: Varlen, hq: int, causal: bool, window: tuple[int, int], device) -> tuple[list[_Block], int]:
        if window == (-1, -1) and seqs.bottom_right:
            return self._plan_triangles(seqs, hq, causal, device)
        blocks, size = [], 0
        for i, (q0, q1, k0, _k1) in enumerate(seqs.pairs()):
            seen = [seqs.visible(i, x, causal, window) for x in range(q1 - q0)]  # [lo, hi) of every row
            rows_seeing = [x for x, (lo, hi) in enumerate(seen) if hi > lo]  # an interval: lo and hi never decrease
            if not rows_seeing:
                continue
            first, last = rows_seeing[0], rows_seeing[-1] + 1
            span = max(hi - lo for lo, hi in seen[first:last])  # keys of the widest row
            rows = max(1, min(self._budget_rows(span * hq, device), self.block_size or last))
            while rows > 1 and rows * (span + rows - 1) * hq > self.max_block_elements:  # R rows see at most span + R - 1 keys
                rows -= 1
            for a in range(first, last, rows):
                b = min(a + rows, last)
                lo, hi = seen[a][0], seen[b - 1][1]  # the block's keys: from its first row's first to its last row's last
                if all(seen[x] == (lo, hi) for x in range(a, b)):
                    mask = None
                else:
                    y = torch.arange(lo, hi, device=device)  # (M,) keys of the block
                    bounds = torch.tensor(seen[a:b], device=device)  # (R, 2)
                    mask = ((y[None, :] < bounds[:, :1]) | (y[None, :] >= bounds[:, 1:])).unsqueeze(1)  # (R, 1, M)
                blocks.append(_Block(slice(q0 + a, q0 + b), slice(k0 + lo, k0 + hi), mask))
                size = max(size, (b - a) * hq * (hi - lo))
        return blocks, size

    def _budget_rows(self, row_elements: int, device: torch.device) -> int:
        """Query rows per block for rows of `row_elements` scores: within `max_block_elements`, and on a CPU within
        `CACHE_BLOCK_ELEMENTS` too (but at least `MIN_CACHE_ROWS`), so that a block's elementwise passes read it from
        the cache."""
        rows = self.max_block_elements // row_elements
        if device.type == "cpu":
            rows = min(rows, max(MIN_CACHE_ROWS, CACHE_BLOCK_ELEMENTS // row_elements))
        return rows

    def _plan_triangles(self, seqs: Varlen, hq: int, causal: bool, device: torch.device) -> tuple[list[_Block], int]:
        masks: dict[int, torch.Tensor] = {}
        blocks, size = [], 0
        for q0, q1, k0, k1 in seqs.pairs():
            budget_rows = self._budget_rows(max(1, (k1 - k0) * hq), device)
            rows = max(1, min(budget_rows, self.block_size or budget_rows))
            for a, b, hi in _sequence_blocks(q1 - q0, k1 - k0, rows, causal):
                if causal and b - a not in masks:
                    hidden = torch.ones(b - a, b - a, dtype=torch.bool, device=device).triu_(1)  # (R, R)
                    masks[b - a] = hidden.unsqueeze(1)  # (R, 1, R)
                mask = masks[b - a] if causal else None
                blocks.append(_Block(slice(q0 + a, q0 + b), slice(k0, k0 + hi), mask))
                size = max(size, (b - a) * hq * hi)
        return blocks, size


def _sequence_blocks(n_q: int, n_k: int, rows: int, causal: bool) -> Iterator[tuple[int, int, int]]:
    """Yield `(a, b, hi)`: query rows `[a, b)` of one sequence see keys `[0, hi)` of it."""
    # query x sees key y iff y <= x + delta (causal); rows x < -delta see nothing
    delta = n_k - n_q
    first = max(0, -delta) if causal else (0 if n_k > 0 else n_q)
    for a in range(first, n_q, rows):
        b = min(a + rows, n_q)
        yield a, b, (b + delta if causal else n_k)
