"""`make test-npu`: the entry point of the Ascend NPU checks.

The NPU adapter (`npu_fusion_attention` behind the kernel contract, HCCL collectives) is a
later issue. For now this reports whether an Ascend NPU is usable here and exits 0, so the
target is safe to run anywhere. `torch_npu` is imported lazily: importing it fails on
machines without the CANN libraries.
"""

from __future__ import annotations

import importlib


def find_npu() -> tuple[bool, str]:
    """Return `(found, reason)`: whether torch_npu imports and sees at least one device."""
    try:
        torch_npu = importlib.import_module("torch_npu")
    except Exception as exc:  # ImportError, or a CANN library failing to load
        return False, f"torch_npu is not importable ({type(exc).__name__}: {exc})"
    import torch

    count = torch.npu.device_count() if hasattr(torch, "npu") else 0
    if count < 1:
        return False, f"torch_npu {getattr(torch_npu, '__version__', '?')} sees no device"
    return True, f"{count} Ascend NPU(s) with torch_npu {getattr(torch_npu, '__version__', '?')}"


def main() -> int:
    found, reason = find_npu()
    if not found:
        print(f"no Ascend NPU found: {reason}; skipping the NPU tests")
        return 0
    print(f"found {reason}; the NPU test suite arrives with the NPU adapter (not implemented yet)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
