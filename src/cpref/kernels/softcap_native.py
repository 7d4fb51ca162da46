r"""Soft-capping's elementwise passes, compiled: one loop each instead of PyTorch's chain of passes.

A soft-capped block of [`TorchKernel`][cpref.kernels.torch_kernel.TorchKernel] cannot take PyTorch's
fused attention (it has no cap), so it runs the explicit path: a matrix product writes the block's
scores, and elementwise passes read and write them again. Two costs make that path about 1.6 times the
uncapped step with PyTorch's passes (`bench/variants.py` times them beside these loops): PyTorch's CPU `tanh`, several
times slower than its `exp2` (the benchmark prints both per float), and the number of passes, each a
read and a write of the block:

| step | PyTorch passes | here |
|------|----------------|------|
| forward, after $S$: $t = \tanh(S/c)$, $m$, $2^{c \log_2 e\, t - m}$, $\ell$ | `tanh`, `amax`, `add`, `exp2`, `sum` | `cap_tanh`, `cap_softmax` (two loops over each row, in cache) |
| backward, after $S$: $t$, slope $1 - t^2$, $P = 2^{c \log_2 e\, t - \mathrm{lse}_2}$ | `tanh`, `fill`, `addcmul`, `add`, `exp2` | `cap_tanh` (with the slope), `cap_probs` |
| backward, after $dP$: $dS = P \circ (dP - \Delta) \circ (1 - t^2)$ | (`mul`, `sum`), `sub`, `mul`, `mul` | `cap_ds` |

The forward's row loop, after `cap_tanh` has squashed the block (the two others are alike):

```c
--8<-- "src/cpref/kernels/softcap_rows.c:softmax"
```

The loops are C (`softcap_rows.c`, beside this file), compiled on first use with the machine's C
compiler and loaded with `ctypes`; `tanhf` and `exp2f` are glibc's vector versions (libmvec, from
glibc 2.35: eight floats at a time with AVX2, within 1.5 ulp of FP64, tested), rows spread over
`torch.get_num_threads()` OpenMP threads (the libgomp PyTorch itself loaded, not a second one).
It is built without `-ffast-math`: masked scores are $-\infty$, and `exp2`$(-\infty) = 0$ and a
maximum that skips $-\infty$ must hold. The library is cached under `~/.cache/cpref` (or
`$XDG_CACHE_HOME/cpref`) by a hash of the source, the flags, the compiler and the CPU, written to
a side file and renamed into place, so that processes building it at once do not read a partial file.

**Where it cannot be built** (no C compiler, not Linux with glibc 2.35 or later, the build fails),
[`library`][cpref.kernels.softcap_native.library] says why and `TorchKernel` runs the same steps in
PyTorch passes: the same results to float32 rounding, more slowly. `TorchKernel(fast=False)` always
takes the PyTorch passes (the readable reference); the tests hold the two to each other and both to
the FP64 oracle. Only float32 blocks on a CPU take it (float64 blocks keep PyTorch's passes).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

__all__ = ["SOURCE", "FLAGS", "library", "usable", "cap_tanh", "cap_softmax", "cap_probs", "cap_ds"]

SOURCE = Path(__file__).with_name("softcap_rows.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC", "-Wl,-z,defs")  # defs: no symbol left
# to resolve at load time (a libmvec without some variant fails the build, not a call)
LIBS = ("-lmvec", "-lm")
_LOCK = threading.Lock()

_F = ctypes.POINTER(ctypes.c_float)
_SIGNATURES = {
    "cap_tanh": (_F, _F, ctypes.c_long, ctypes.c_int),
    "cap_softmax": (_F, ctypes.c_long, ctypes.c_long, ctypes.c_float, _F, _F, ctypes.c_int),
    "cap_probs": (_F, ctypes.c_long, ctypes.c_long, ctypes.c_float, _F, ctypes.c_int),
    "cap_ds": (_F, _F, _F, _F, ctypes.c_long, ctypes.c_long, ctypes.c_int),
}


@functools.cache
def library() -> tuple[ctypes.CDLL | None, str]:
    """`(lib, why)`: the compiled loops, built on first use and cached; `lib` None where they cannot be built, with
    `why` naming the reason (`why` is "built" or "cached" otherwise)."""
    with _LOCK:
        return _load()


def usable(t: torch.Tensor) -> bool:
    """Whether a block of `t`'s dtype and device takes the compiled loops: float32 on a CPU, where they built."""
    return t.dtype == torch.float32 and t.device.type == "cpu" and library()[0] is not None


def _load() -> tuple[ctypes.CDLL | None, str]:
    cc = shutil.which("cc") or shutil.which("gcc")
    libc, version = platform.libc_ver()
    if platform.system() != "Linux" or libc != "glibc" or _version(version) < (2, 35):
        return None, f"needs Linux with glibc >= 2.35 (libmvec's tanhf), not {platform.system()} {libc} {version}"
    if cc is None:
        return None, "no C compiler (cc or gcc) on PATH"
    ident = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    key = hashlib.sha256(repr((SOURCE.read_bytes(), FLAGS, ident, platform.machine(), _cpu())).encode()).hexdigest()
    path, why = _cache_dir() / f"softcap_rows-{key[:16]}.so", "cached"
    if not path.exists():
        # 1) build beside, 2) rename into place: a process that finds `path` finds it whole
        side = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}")
        done = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(side), *LIBS], capture_output=True, text=True)
        if done.returncode != 0:
            side.unlink(missing_ok=True)
            return None, f"{cc} failed to build {SOURCE.name}: {done.stderr.strip()[-400:]}"
        os.replace(side, path)
        why = "built"
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as err:
        return None, f"{path} did not load: {err}"
    for name, args in _SIGNATURES.items():
        getattr(lib, name).argtypes, getattr(lib, name).restype = args, None
    return lib, why


def _cache_dir() -> Path:
    """`$XDG_CACHE_HOME/cpref` (`~/.cache/cpref`), or the temporary folder's `cpref` where that is not writable."""
    for base in (Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"), Path(tempfile.gettempdir())):
        try:
            (base / "cpref").mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(base / "cpref", os.W_OK):
            return base / "cpref"
    return Path(tempfile.mkdtemp(prefix="cpref-"))


def _version(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(".")[:2])
    except ValueError:
        return (0,)


def _cpu() -> str:
    """What the `-march=native` build depends on: the CPU's model and flags (Linux)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(sorted({x for x in lines if x.startswith(("model name", "flags"))}))


def _ptr(t: torch.Tensor):
    return ctypes.cast(t.data_ptr(), _F)


def _block(t: torch.Tensor, name: str, shape: torch.Size | None = None) -> tuple[int, int]:
    """`(rows, cols)` of a contiguous float32 CPU block of `shape` (any, where None), its last dim the columns."""
    if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"{name}: the compiled loops need contiguous float32 CPU blocks, got {t.dtype} on {t.device}, "
                         f"contiguous={t.is_contiguous()}")  # fmt: skip
    if shape is not None and t.shape != shape:
        raise ValueError(f"{name} {tuple(t.shape)} must have the scores' shape {tuple(shape)}")
    return t.numel() // max(1, t.shape[-1]), t.shape[-1]


def _per_row(x: torch.Tensor, name: str, rows: int) -> torch.Tensor:
    """One float32 per row, contiguous (`x` is often a slice of a longer run of tokens)."""
    x = x.contiguous()  # (..., 1)
    _block(x, name)
    if x.numel() != rows:
        raise ValueError(f"{name} has {x.numel()} rows, the block {rows}")
    return x


def cap_tanh(s: torch.Tensor, slope: torch.Tensor | None = None) -> torch.Tensor:
    """`s <- tanh(s)` in place; with `slope` (same shape) also `slope <- 1 - tanh(s)^2`. Returns `s`."""
    _block(s, "s")
    if slope is not None:
        _block(slope, "slope", s.shape)
    library()[0].cap_tanh(_ptr(s), None if slope is None else _ptr(slope), s.numel(), torch.get_num_threads())
    return s


def cap_softmax(t: torch.Tensor, b: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of `t (..., L)`: `m = b max t`, `t <- 2^(b t - m)` in place, `l = sum t`. Returns `(m, l)`, `(..., 1)`."""
    rows, cols = _block(t, "t")
    m, el = (t.new_empty(*t.shape[:-1], 1) for _ in range(2))  # (..., 1)
    library()[0].cap_softmax(_ptr(t), rows, cols, b, _ptr(m), _ptr(el), torch.get_num_threads())
    return m, el


def cap_probs(t: torch.Tensor, b: float, lse2: torch.Tensor) -> torch.Tensor:
    """Per row of `t (..., L)`: `t <- 2^(b t - lse2)` in place, `lse2 (..., 1)`. Returns `t`."""
    rows, cols = _block(t, "t")
    lse2 = _per_row(lse2, "lse2", rows)  # (..., 1)
    library()[0].cap_probs(_ptr(t), rows, cols, b, _ptr(lse2), torch.get_num_threads())
    return t


def cap_ds(dp: torch.Tensor, p: torch.Tensor, slope: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
    """`dp <- p o (dp - Delta) o slope` in place, `Delta = delta (..., 1)`, or `rowsum(p o dp)` where None. Returns `dp`."""
    rows, cols = _block(dp, "dp")
    _block(p, "p", dp.shape), _block(slope, "slope", dp.shape)
    delta = None if delta is None else _per_row(delta, "delta", rows)  # (..., 1)
    library()[0].cap_ds(_ptr(dp), _ptr(p), _ptr(slope), None if delta is None else _ptr(delta), rows, cols,
                        torch.get_num_threads())  # fmt: skip
    return dp
