"""yunchang ships no adapter in `sim.tools.verify.peers`: on the CPU none of its layers runs forward and backward.

Each line of the page's table (docs/verify-reference.md, section 6.1) is run here on a gloo world of this
one process, while yunchang is installed (skipped with the reason otherwise): should one start to run, this fails,
and the adapter is due.
"""

from __future__ import annotations

import pytest
import torch

FLASH, EFFICIENT = "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention"
MATH_BACKWARD = "Not implemented backward for PyTorch attention types"
# (layer, ring_impl_type, attn_type) -> what it raises on the CPU: (exception, message, built or run forward / backward)
YUNCHANG = {("LongContextAttention", ring, attn): why for ring in ("basic", "zigzag") for attn, why in (
    ("FA", (AssertionError, "FlashAttention is not available", "forward")),
    ("TORCH_FLASH", (NotImplementedError, FLASH, "forward")),
    ("TORCH_EFFICIENT", (NotImplementedError, EFFICIENT, "forward")),
    ("TORCH_MATH", (RuntimeError, MATH_BACKWARD, "backward")))}  # fmt: skip
YUNCHANG.update({("LongContextAttention", "basic_pytorch", attn): (NotImplementedError, FLASH, "forward")
                 for attn in ("FA", "TORCH_MATH", "TORCH_FLASH", "TORCH_EFFICIENT")})  # fmt: skip
YUNCHANG.update({("UlyssesAttention", None, attn): (NotImplementedError, FLASH, "forward")
                 for attn in ("TORCH_MATH", "TORCH_FLASH", "TORCH_EFFICIENT")})  # fmt: skip
YUNCHANG[("UlyssesAttention", None, "FA")] = (AssertionError, "FlashAttention is not available", "forward")


@pytest.fixture(scope="module")
def yunchang_world(tmp_path_factory):
    """yunchang's process groups over a gloo world of this one process (Ulysses and ring degree 1)."""
    yunchang = pytest.importorskip("yunchang", reason="yunchang is not installed (pip install -e '.[dev]' installs it)")
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path_factory.mktemp("yunchang") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yunchang.set_seq_parallel_pg(1, 1, 0, 1)
        yield yunchang
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("layer, ring, attn", list(YUNCHANG), ids=str)
def test_yunchang_does_not_run_on_the_cpu_for_the_reason_the_docs_give(yunchang_world, layer, ring, attn):
    """sim.tools.verify.peers ships no yunchang adapter: on the CPU none of its layers runs forward and backward, each
    for the reason in `YUNCHANG` (and the page's table). Should a later yunchang or PyTorch run there, this fails, and
    the adapter is due."""
    from yunchang.kernels import AttnType

    exc, message, stage = YUNCHANG[(layer, ring, attn)]
    options = {} if ring is None else {"ring_impl_type": ring}
    build = lambda: getattr(yunchang_world, layer)(attn_type=AttnType[attn], **options)  # noqa: E731
    q = torch.randn(1, 16, 2, 8, requires_grad=True)  # (batch, T, H, D): one sequence, no document boundaries
    if stage == "backward":
        out = build()(q, q, q, causal=True)  # the forward runs
        with pytest.raises(exc, match=message):
            out.sum().backward()
    else:  # building the layer (UlyssesAttention with FA) or its forward
        with pytest.raises(exc, match=message):
            build()(q, q, q, causal=True)


def test_yunchangs_math_backend_returns_no_lse_and_its_packed_ring_needs_flash_attn(yunchang_world):
    """TORCH_MATH's forward runs on the CPU but its lse is zeros, which a ring of more than one rank merges its
    blocks by; the packed (varlen) ring calls flash-attn's kernel, absent without the package."""
    from yunchang.kernels.attention import pytorch_attn_forward

    q = torch.randn(1, 16, 2, 8)
    out, lse = pytorch_attn_forward(q, q, q, causal=True, op_type="math")
    assert out.shape == q.shape and not lse.any()
    cu = torch.tensor([0, 6, 16], dtype=torch.int32)
    with pytest.raises(AssertionError, match="FlashAttention is not available"):
        yunchang_world.ring_flash_attn_varlen_func(q[0], q[0], q[0], cu, 10, causal=True)
