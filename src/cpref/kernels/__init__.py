"""Attention kernels behind one contract (see `cpref.kernels.contract`)."""

from cpref.kernels.contract import AttentionKernel, Varlen, check_heads, compute_dtype
from cpref.kernels.torch_kernel import TorchKernel

__all__ = ["AttentionKernel", "TorchKernel", "Varlen", "check_heads", "compute_dtype"]
