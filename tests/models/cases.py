"""Shared pieces of the model tests: tiny configs, packed batches, runs at CP = 1 and on the simulated cluster."""

from __future__ import annotations

import torch

import cpref
from cpref.models import CausalLM, CPContext, ModelConfig
from cpref.modes.hierarchical import example_a2a_size
from sim import SimCluster

FAMILIES = ("gpt2", "llama", "qwen3")
VOCAB = 64
# hidden 32, 4 query heads; LLaMA and Qwen3 with GQA (2 kv heads), Qwen3 with head_dim != hidden / heads
SIZES = {
    "gpt2": dict(num_heads=4, max_positions=64),
    "llama": dict(num_heads=4, num_kv_heads=2, mlp_size=48),
    "qwen3": dict(num_heads=4, num_kv_heads=2, head_dim=12, mlp_size=48),
}


def tiny_config(family: str, **overrides) -> ModelConfig:
    """A 2-layer model of width 32 whose weights (init_std 0.2) make every layer matter."""
    kw = dict(family=family, vocab_size=VOCAB, hidden_size=32, num_layers=2, init_std=0.2, **SIZES[family])
    kw.update(overrides)
    return ModelConfig(**kw)


def tiny_model(family: str, *, seed: int = 0, dtype=torch.float64, **overrides) -> CausalLM:
    """`tiny_config`'s model, random norm weights and biases as well, in `dtype`, eval mode."""
    model = CausalLM(tiny_config(family, **overrides), seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model.to(dtype).eval()


def packed(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`(cu_seqlens, tokens)` of random documents of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    return cu, torch.randint(0, VOCAB, (int(cu[-1]),), generator=g)


def whole(model: CausalLM, tokens: torch.Tensor, cu: torch.Tensor, cu_padded: torch.Tensor | None = None):
    """CP = 1 logits `(T, V)` of a packed stream (padded if `cu_padded` is given)."""
    pos = cpref.positions(cu if cu_padded is None else cu_padded, cp_size=1, rank=0, layout="contiguous")
    with torch.no_grad():
        return model(tokens, pos, CPContext.single(cu, cu_padded))


def options(mode: str, P: int) -> dict:
    """The mode's own option: the hierarchical mode's a2a group size."""
    return {"a2a_size": example_a2a_size(P)} if mode == "a2a+p2p" else {}


def forward_on_rank(model, tokens, cu, comm, *, mode, layout, **opts) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's `(logits (T_l, V), cu_seqlens_padded)`: pad and slice with the data path, then the model."""
    b = cpref.get_batch_on_this_cp_rank({"tokens": tokens, "labels": tokens}, cu, cp_size=comm.size, rank=comm.rank,
                                        layout=layout)  # fmt: skip
    cp = CPContext(comm=comm, cu_seqlens=b["cu_seqlens"], cu_seqlens_padded=b["cu_seqlens_padded"], mode=mode,
                   layout=layout, options=opts)  # fmt: skip
    with torch.no_grad():
        return model(b["tokens"], b["position_ids"], cp), b["cu_seqlens_padded"]


def run_cp(model, tokens, cu, *, P, mode, layout) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every rank's `forward_on_rank` on a simulated cluster of `P` ranks."""
    return SimCluster(P).run(lambda comm: forward_on_rank(model, tokens, cu, comm, mode=mode, layout=layout,
                                                          **options(mode, P)))  # fmt: skip
