r"""The FP64 oracle: the definition of correct attention.

Every kernel and every context-parallel algorithm in cpref is tested against this file. It
is written to be *obviously* right, not fast: it builds the full $T \times T$ mask of a
packed stream, computes every score in float64, and lets autograd differentiate it. Nothing
here is blocked, fused, merged or rescaled, so there is nothing to get subtly wrong.

**Packed self-attention (THD).** A stream of $T$ tokens holds $N$ documents cut by
`cu_seqlens` $= [\mathrm{cu}_0 = 0, \mathrm{cu}_1, \dots, \mathrm{cu}_N = T]$. Token $x$ has document
$\mathrm{doc}(x) = i$ for $\mathrm{cu}_i \le x < \mathrm{cu}_{i+1}$ and position $\mathrm{pos}(x) = x - \mathrm{cu}_i$.
Query token $x$ sees key token $y$ iff

$$ M_{xy} = [\mathrm{doc}(x) = \mathrm{doc}(y)] \wedge
   \big(\neg\,\mathrm{causal} \vee \mathrm{pos}(y) \le \mathrm{pos}(x)\big). $$

**Sliding windows.** With `window` $= (\ell, r)$ (the FlashAttention convention, $-1$ for no
bound on that side) query $x$ sees only the keys of its document within $\ell$ positions
before and $r$ after it:

$$ M^{(\ell, r)}_{xy} = M_{xy} \wedge \big(\ell < 0 \vee \mathrm{pos}(y) \ge \mathrm{pos}(x) - \ell\big)
   \qquad \wedge \big(r < 0 \vee \mathrm{pos}(y) \le \mathrm{pos}(x) + r\big) . $$

`causal=True` is $r = 0$; a causal window of $w + 1$ keys is `causal=True, window=(w, 0)`.

**Chunked attention** (Llama 4's chunked layers). With `chunk` $= C$ a query sees only the keys of
its own chunk of $C$ positions of its document (positions counted from the document's start, as
the model's RoPE positions are):

$$ M^{C}_{xy} = M_{xy} \wedge \lfloor \mathrm{pos}(y) / C \rfloor = \lfloor \mathrm{pos}(x) / C \rfloor . $$

**Masks given as slices** (`cpref.Mask`). A mask is a union of slices $(q_0, q_1, k_0, k_1,
\text{kind})$ over the global token indices; with $i = x - q_0$, $j = y - k_0$, $L_q = q_1 - q_0$,
$L_k = k_1 - k_0$, the slice shows $(x, y)$ iff $q_0 \le x < q_1$, $k_0 \le y < k_1$ and

$$ \text{full: always}; \quad \text{causal: } j \le i + L_k - L_q; \quad
   \text{inv\_causal: } j \ge i; \quad \text{bi\_causal: both} , $$

and $M_{xy}$ is true iff some slice shows $(x, y)$ (`slice_mask`, the definition read pair by pair,
which cpref's normalisation of a mask is tested against). `attention(..., mask=M)` takes any
$(T, T)$ boolean `M` in place of the documents' mask. A row that sees no key gives $o = 0$ and
$\mathrm{lse} = -\infty$ (with sinks, $\mathrm{lse} = s_h$) and zero gradients.

**GQA.** With $H_q$ query heads and $H_{kv}$ key/value heads, $G = H_q / H_{kv}$ query heads
share one key/value head: query head $h$ reads key/value head $\lfloor h / G \rfloor$.

**Attention.** With scale $s$ (default $D^{-1/2}$), for every query head $h$:

$$ S_{hxy} = s\, q_{xh} \cdot k_{y,\lfloor h/G \rfloor}, \qquad
   \mathrm{lse}_{xh} = \log \sum_{y : M_{xy}} e^{S_{hxy}}, $$

$$ o_{xh} = \sum_{y : M_{xy}} e^{S_{hxy} - \mathrm{lse}_{xh}}\, v_{y,\lfloor h/G \rfloor}. $$

The log-sum-exp uses the natural log and is what context-parallel algorithms need to merge
partial results. In self-attention every token sees itself, so no row is empty.

**Logit soft-capping** (Gemma 2). With `softcap` $= c > 0$ every score is squashed before the
mask and the softmax: $S_{hxy} \to c \tanh(S_{hxy} / c)$, so no logit exceeds $c$ in size.

**Learnable sinks** (GPT-OSS). With `sinks` $= (s_h)$, one logit per query head, every row's
softmax gets one more term in its denominator, which carries no value:

$$ \mathrm{lse}_{xh} = \log \Big( e^{s_h} + \sum_{y : M_{xy}} e^{S_{hxy}} \Big), \qquad
   o_{xh} = \sum_{y : M_{xy}} e^{S_{hxy} - \mathrm{lse}_{xh}}\, v_{y,\lfloor h/G \rfloor} , $$

so a row that sees no key has $\mathrm{lse} = s_h$ and $o = 0$, and the sinks are a parameter with a
gradient, $\partial L / \partial s_h = -\sum_x e^{s_h - \mathrm{lse}_{xh}} \sum_d dO_{xhd}\, o_{xhd}$,
which autograd gives here.

**Gradients.** `forward_backward` runs the same formula under autograd, so the oracle's
gradients are autograd's gradients of the definition above.
"""

from __future__ import annotations

import torch

__all__ = ["attention", "forward_backward", "visibility_mask", "slice_mask"]


# atol = rtol per dtype against this oracle, as the issues state them (the MindSpeed RFC's and
# TransformerEngine's figures): the tests, `sim verify` and the NPU checks all read them here
TOL = {torch.float16: 5e-3, torch.bfloat16: 2.5e-2, torch.float32: 1e-5, torch.float64: 1e-10}
TOL_BF16_GQA = 3.5e-2  # bf16 with Hkv < Hq: each key's gradient sums G query heads


def visibility_mask(cu_seqlens: torch.Tensor, *, causal: bool = True, window: tuple[int, int] = (-1, -1),
                    chunk: int | None = None) -> torch.Tensor:  # fmt: skip
    """The `(T, T)` boolean mask `M`: `M[x, y]` is True iff query `x` sees key `y`.

    Args:
        cu_seqlens: document boundaries with a leading 0, shape `(N + 1,)`.
        causal: whether a token sees only earlier positions of its own document.
        window: `(left, right)`: the most positions before and after its own a token sees
            (-1: no bound).
        chunk: `C`: a token sees only the positions of its own chunk of `C` (None: no chunks).

    Returns:
        A bool tensor of shape `(T, T)` on the CPU.
    """
    lengths = torch.diff(cu_seqlens.cpu().long())  # (N,)
    doc = torch.repeat_interleave(torch.arange(len(lengths)), lengths)  # (T,)
    starts = cu_seqlens.cpu().long()[:-1][doc]  # (T,)
    pos = torch.arange(len(doc)) - starts  # (T,)
    # M_xy = [doc(x) = doc(y)]
    mask = doc[:, None] == doc[None, :]  # (T, T)
    if causal:
        # ... and pos(y) <= pos(x)
        mask &= pos[None, :] <= pos[:, None]  # (T, T)
    left, right = window
    if left >= 0:
        # ... and pos(y) >= pos(x) - left
        mask &= pos[None, :] >= pos[:, None] - left  # (T, T)
    if right >= 0:
        # ... and pos(y) <= pos(x) + right
        mask &= pos[None, :] <= pos[:, None] + right  # (T, T)
    if chunk is not None:
        # ... and floor(pos(y) / C) = floor(pos(x) / C)
        mask &= (pos[None, :] // chunk) == (pos[:, None] // chunk)  # (T, T)
    return mask


def slice_mask(slices, total: int) -> torch.Tensor:
    """The `(T, T)` boolean mask of a union of slices `(q0, q1, k0, k1, kind)`, from the kinds' definitions.

    Examples:
        >>> slice_mask([(0, 3, 0, 3, "causal"), (1, 3, 1, 3, "full")], 3).int()
        tensor([[1, 0, 0],
                [1, 1, 1],
                [1, 1, 1]], dtype=torch.int32)
    """
    x, y = torch.arange(total)[:, None], torch.arange(total)[None, :]  # (T, 1), (1, T)
    mask = torch.zeros(total, total, dtype=torch.bool)
    for q0, q1, k0, k1, kind in slices:
        i, j = x - q0, y - k0  # local indices
        shows = (q0 <= x) & (x < q1) & (k0 <= y) & (y < k1)  # (T, T): inside the rectangle
        if kind in ("causal", "bi_causal"):
            shows &= j <= i + (k1 - k0) - (q1 - q0)
        if kind in ("inv_causal", "bi_causal"):
            shows &= j >= i
        if kind not in ("full", "causal", "inv_causal", "bi_causal"):
            raise ValueError(f"unknown kind {kind!r}")
        mask |= shows
    return mask


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    chunk: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense float64 attention over a packed stream: the definition of correct.

    Args:
        q: queries, shape `(T, Hq, D)`, any float dtype.
        k: keys, shape `(T, Hkv, D)`, with `Hq % Hkv == 0`.
        v: values, shape `(T, Hkv, Dv)`.
        cu_seqlens: document boundaries with a leading 0 and `cu_seqlens[-1] == T`.
        causal: whether a token sees only earlier positions of its own document.
        scale: logit scale; `D ** -0.5` when None.
        window: `(left, right)` sliding window (see the module docstring); `(-1, -1)`: none.
        chunk: chunked attention's `C` (None: none).
        softcap: logit soft-capping's `c` (None: none).
        sinks: `(Hq,)` sink logits (None: none).
        mask: a `(T, T)` boolean mask in place of the documents' (`cu_seqlens`, `causal`, `window` and `chunk`
            then unused); None: the documents'.

    Returns:
        `(out, lse)`: `out` of shape `(T, Hq, Dv)` and `lse` of shape `(T, Hq)`, both
        float64. Differentiable with respect to `q`, `k`, `v` (and `sinks`).

    Examples:
        >>> import torch
        >>> q = k = v = torch.randn(5, 2, 4)
        >>> out, lse = attention(q, k, v, torch.tensor([0, 2, 5]))
        >>> out.shape, lse.shape
        (torch.Size([5, 2, 4]), torch.Size([5, 2]))
    """
    hq, d = q.shape[1], q.shape[2]
    group = hq // k.shape[1]
    scale = d**-0.5 if scale is None else scale
    # 1) upcast, and give every query head its own copy of its key/value head
    q64 = q.double()  # (T, Hq, D)
    k64 = k.double().repeat_interleave(group, dim=1)  # (T, Hkv, D) -> (T, Hq, D)
    v64 = v.double().repeat_interleave(group, dim=1)  # (T, Hkv, Dv) -> (T, Hq, Dv)
    # 2) S_hxy = s q_xh . k_yh, masked to -inf where token x does not see token y
    scores = scale * torch.einsum("xhd,yhd->hxy", q64, k64)  # (Hq, T, T)
    if softcap is not None:
        # S -> c tanh(S / c), before the mask
        scores = softcap * torch.tanh(scores / softcap)  # (Hq, T, T)
    if mask is None:
        mask = visibility_mask(cu_seqlens, causal=causal, window=window, chunk=chunk)  # (T, T)
    mask = mask.to(q.device)
    empty = ~mask.any(dim=1)  # (T,): rows that see no key
    scores = scores.masked_fill(~mask, float("-inf"))  # (Hq, T, T)
    if sinks is None and bool(empty.any()):
        # a row that sees no key: scores of 0 (finite, so no NaN reaches autograd), then no weight below
        scores = scores.masked_fill(empty[None, :, None], 0.0)  # (Hq, T, T)
    if sinks is not None:
        # one more logit per row, s_h, with no value: a column of the softmax that is dropped after it
        sink = sinks.double()[:, None, None].expand(-1, scores.shape[1], 1)  # (Hq, T, 1)
        scores = torch.cat([scores, sink], dim=-1)  # (Hq, T, T + 1)
    # 3) lse_xh = log sum_y exp(S_hxy)  (with the sink: log(e^s_h + sum_y exp(S_hxy)))
    lse = torch.logsumexp(scores, dim=-1).transpose(0, 1)  # (Hq, T) -> (T, Hq)
    # 4) o_xh = sum_y softmax_y(S_hxy) v_yh
    probs = torch.softmax(scores, dim=-1)[..., : k64.shape[0]]  # (Hq, T, T): the sink's column carries no value
    if sinks is None and bool(empty.any()):  # a row that sees no key: o = 0, lse = -inf
        probs = probs * mask  # (Hq, T, T)
        lse = lse.masked_fill(empty[:, None], float("-inf"))  # (T, Hq)
    out = torch.einsum("hxy,yhd->xhd", probs, v64)  # (T, Hq, Dv)
    return out, lse


def forward_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    dout: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    chunk: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """`attention` and its gradients for the upstream gradient `dout`, all in float64.

    Args:
        q: queries `(T, Hq, D)`, as for `attention`.
        k: keys `(T, Hkv, D)`.
        v: values `(T, Hkv, Dv)`.
        cu_seqlens: document boundaries with a leading 0.
        dout: gradient of the loss with respect to `out`, shape `(T, Hq, Dv)`.
        causal: as for `attention`.
        scale: as for `attention`.
        window: as for `attention`.
        chunk: as for `attention`.
        softcap: as for `attention`.
        sinks: as for `attention`; given, their gradient is returned too.
        mask: as for `attention`.

    Returns:
        `(out, lse, dq, dk, dv)`, all float64 and detached; `dq, dk, dv` are shaped like
        `q, k, v`; with `sinks`, `(out, lse, dq, dk, dv, dsinks)`, `dsinks` of shape `(Hq,)`.
    """
    # 1) float64 leaves, so autograd's gradients are float64 too
    leaves = [x.detach().double().requires_grad_(True) for x in (q, k, v, *(() if sinks is None else (sinks,)))]
    with torch.enable_grad():
        out, lse = attention(*leaves[:3], cu_seqlens, causal=causal, scale=scale, window=window, chunk=chunk,
                             softcap=softcap, sinks=None if sinks is None else leaves[3], mask=mask)  # fmt: skip
        # 2) dq, dk, dv (, dsinks) = d<out, dout>/d(q, k, v (, sinks))
        grads = torch.autograd.grad(out, leaves, grad_outputs=dout.double())
    return (out.detach(), lse.detach(), *grads)
