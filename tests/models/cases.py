"""Shared pieces of the model tests: tiny configs, packed batches, runs at CP = 1 and on the simulated cluster."""

from __future__ import annotations

import torch

import cpref
from cpref.batch.seqlens import CuSeqlens
from cpref.models import CausalLM, CPContext, ModelConfig
from sim import SimCluster

FAMILIES = ("gpt2", "llama", "qwen3")
VOCAB = 64
# hidden 32, 4 query heads; LLaMA and Qwen3 with GQA (2 kv heads), Qwen3 with head_dim != hidden / heads
SIZES = {
    "gpt2": dict(num_heads=4, max_positions=64),
    "llama": dict(num_heads=4, num_kv_heads=2, mlp_size=48),
    "qwen3": dict(num_heads=4, num_kv_heads=2, head_dim=12, mlp_size=48),
}

# Sliding windows (each layer's `left`: left + 1 keys, None: a full layer) on the tiny models, shorter than the
# test documents: Qwen3 with a full then a sliding layer (the order of its max_window_layers), and Mistral's
# architecture (LLaMA, every layer sliding).
WINDOWED = {"qwen3-window": ("qwen3", (None, 3)), "mistral": ("llama", (3, 3))}
# The modes that take a window (`cpref.MODES[mode].windows`)
WINDOW_MODES = [mode for mode, spec in cpref.MODES.items() if spec.windows]


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


def windowed_model(name: str, **kw) -> CausalLM:
    """`tiny_model` of a `WINDOWED` case: its family, with its layer windows."""
    family, windows = WINDOWED[name]
    return tiny_model(family, layer_windows=windows, **kw)


def packed(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`(cu_seqlens, tokens)` of random documents of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    return cu, torch.randint(0, VOCAB, (int(cu[-1]),), generator=g)


def whole(model: CausalLM, tokens: torch.Tensor, cu: torch.Tensor, cu_padded: CuSeqlens | None = None):
    """CP = 1 logits `(T, V)` of a packed stream (padded if `cu_padded` is given)."""
    cp = CPContext.single(cu, cu_padded)
    with torch.no_grad():
        return model(tokens, cp.sharding.positions(0), cp)  # positions inside each (padded) document


def options(mode: str, P: int) -> dict:
    """The mode's own options at CP size `P`, as the mode declares them (the hierarchical mode's a2a group size)."""
    return cpref.MODES[mode].example_options(P)


def forward_on_rank(model, tokens, cu, comm, *, mode, layout, **opts) -> tuple[torch.Tensor, cpref.Sharding]:
    """One rank's `(logits (T_l, V), sharding)`: pad and slice with the data path, then the model."""
    b = cpref.get_batch_on_this_cp_rank({"tokens": tokens, "labels": tokens}, cu, cp_size=comm.size, rank=comm.rank,
                                        layout=layout)  # fmt: skip
    cp = CPContext(comm=comm, sharding=b["sharding"], mode=mode, options=opts)
    with torch.no_grad():
        return model(b["tokens"], b["position_ids"], cp), b["sharding"]


def run_cp(model, tokens, cu, *, P, mode, layout) -> list[tuple[torch.Tensor, cpref.Sharding]]:
    """Every rank's `forward_on_rank` on a simulated cluster of `P` ranks."""
    return SimCluster(P).run(lambda comm: forward_on_rank(model, tokens, cu, comm, mode=mode, layout=layout,
                                                          **options(mode, P)))  # fmt: skip


def assert_hf_parity(results, want, what: str) -> None:
    """Every rank's `(logits, loss, grads, sharding)` of a Hugging Face model under CP against `want`, the same
    model's `(logits, loss, grads)` without CP: the real rows' logits, the loss summed over the ranks, every
    parameter's gradient summed over the ranks (a rank that never reached a parameter, an image tower without its
    image, counts 0), each within float32's tolerance."""
    from tests.helpers import assert_close

    want_logits, want_loss, want_grads = want
    sharding = results[0][3]
    logits = sharding.unpad(sharding.unshard([r[0] for r in results]))  # (T, V), the real rows
    assert_close(logits, want_logits, torch.float32, msg=f"{what}: logits")
    assert_close(sum(r[1] for r in results), want_loss, torch.float32, msg=f"{what}: loss")
    for n, g in want_grads.items():
        got = sum(r[2][n] if r[2][n] is not None else torch.zeros_like(g) for r in results)
        assert_close(got, g, torch.float32, msg=f"{what}: gradient of {n}")
