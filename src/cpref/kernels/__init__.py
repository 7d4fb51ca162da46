"""Attention kernels behind one contract (see `cpref.kernels.contract`).

* [`TorchKernel`][cpref.kernels.torch_kernel.TorchKernel]: plain PyTorch, any device and float dtype.
* [`CudaKernel`][cpref.kernels.cuda_kernel.CudaKernel]: PyTorch's flash attention on CUDA, the explicit
  path where flash cannot go; the default for CUDA tensors (`default_kernel`).
* [`NpuKernel`][cpref.kernels.npu_kernel.NpuKernel]: `torch_npu.npu_fusion_attention` on an
  Ascend NPU; importing it is free, `torch_npu` is imported only when one is constructed.
"""

from cpref.kernels.contract import AttentionKernel, Varlen, check_heads, compute_dtype
from cpref.kernels.cuda_kernel import CudaKernel, default_kernel
from cpref.kernels.npu_kernel import NpuKernel
from cpref.kernels.torch_kernel import TorchKernel

__all__ = ["AttentionKernel", "CudaKernel", "NpuKernel", "TorchKernel", "Varlen", "check_heads", "compute_dtype", "default_kernel"]
