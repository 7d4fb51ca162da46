"""Argument checks shared by every public function: one place, one wording.

Each check returns the value in its canonical Python type or raises
[`CPInputError`][cpref.base.errors.CPInputError] naming the argument, the value it got and what to
pass instead. They only look at Python values, never at tensor contents, so every rank of a
CP group reaches the same verdict without communicating.

NumPy scalars are accepted where they mean the same thing (`np.int64(2)` is the int 2,
`np.float32(0.125)` the float 0.125); `bool` is never taken for a number (`True` is not a CP
size), and only real booleans are taken for booleans (`bool("False")` is `True`).
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any, Sequence

import torch

from cpref.base.errors import CPInputError

__all__ = ["as_int", "as_bool", "as_choice", "as_scale", "as_fill", "missing_members", "host_ints"]


def _show(value: Any) -> str:
    """`repr` of a value, with its type when the repr could hide it (`'2'` vs `2`)."""
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def as_int(name: str, value: Any, *, lo: int | None = None, hi: int | None = None) -> int:
    """`value` as an int in `[lo, hi)`; ints and NumPy integers pass, bools, floats and strings do not.

    Examples:
        >>> as_int("rank", 1, lo=0, hi=2)
        1
        >>> as_int("cp_size", 2.0, lo=1)
        Traceback (most recent call last):
        ...
        cpref.base.errors.CPInputError: cp_size must be an int, got 2.0 (float); pass 2
    """
    if isinstance(value, bool) or getattr(value, "dtype", None) == torch.bool or not _is_integer(value):
        hint = f"; pass {int(value)}" if isinstance(value, float) and math.isfinite(value) and value == int(value) else ""
        raise CPInputError(f"{name} must be an int, got {_show(value)}{hint}")
    n = operator.index(value)
    if (lo is not None and n < lo) or (hi is not None and n >= hi):
        rng = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'})"
        raise CPInputError(f"{name}={n} is outside {rng}")
    return n


def _is_integer(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dim() == 0 and not value.is_floating_point() and not value.is_complex()
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def as_bool(name: str, value: Any) -> bool:
    """`value` as a bool; only `True`, `False` (and NumPy's bools) pass.

    Examples:
        >>> as_bool("causal", "False")
        Traceback (most recent call last):
        ...
        cpref.base.errors.CPInputError: causal must be True or False, got 'False' (str)
    """
    if isinstance(value, bool):
        return value
    if type(value).__module__ == "numpy" and type(value).__name__ == "bool_":
        return bool(value)
    raise CPInputError(f"{name} must be True or False, got {_show(value)}")


def as_choice(name: str, value: Any, choices: Sequence[str]) -> str:
    """`value` if it is one of the strings `choices`."""
    if not isinstance(value, str) or value not in choices:
        raise CPInputError(f"unknown {name} {_show(value)}; choose one of {sorted(choices)}")
    return value


def as_scale(value: Any, compute: torch.dtype) -> float:
    """The softmax scale as a float that is positive, finite and normal in `compute`, the dtype the
    logits are computed in (the kernel contract's `compute_dtype` of the inputs).

    `None` is not handled here (the caller substitutes `D ** -0.5`).
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise CPInputError(f"softmax_scale must be None or a positive number, got {_show(value)}")
    try:
        scale = float(value)
    except OverflowError:
        digits = len(str(abs(int(value))))
        raise CPInputError(f"softmax_scale (an int of {digits} digits) overflows a float; pass a scale such as D ** -0.5") from None
    info = torch.finfo(compute)
    if not (math.isfinite(scale) and scale > 0):
        raise CPInputError(f"softmax_scale must be None or a positive finite number, got {scale!r}")
    if not info.tiny <= scale <= info.max:
        raise CPInputError(
            f"softmax_scale={scale:.3g} is outside the normal range of {compute} "
            f"[{info.tiny:.3g}, {info.max:.3g}], where the logits are computed; pass a scale such as D ** -0.5"
        )
    return scale


def as_fill(name: str, value: Any, dtype: torch.dtype) -> int | float:
    """`value` as a Python number, if a tensor of `dtype` holds it as it is: an int in the integer range of `dtype`
    (a bool dtype: 0, 1, True or False), or a real number within the finite range of a floating
    `dtype` (`inf` and `nan` pass). torch would wrap `-1` to 255 in `uint8`, and raise its own error for
    300 in `uint8` or `1e6` in `float16`.

    Examples:
        >>> as_fill("value", -1, torch.uint8)
        Traceback (most recent call last):
        ...
        cpref.base.errors.CPInputError: value=-1 does not fit torch.uint8, whose values are the integers in [0, 255]; pass a value in that range (or another dtype)
    """
    exact = dtype.is_floating_point or dtype.is_complex
    if not isinstance(value, numbers.Real):
        raise CPInputError(f"{name} must be a number that {dtype} holds, got {_show(value)}")
    try:
        number = operator.index(value) if isinstance(value, numbers.Integral) else float(value)
    except OverflowError:  # a real beyond every float
        number = None
    if not exact and isinstance(number, float) and not number.is_integer():  # 2.5, inf, nan
        raise CPInputError(f"{name} must be an integer for {dtype}, got {_show(value)}")
    if dtype == torch.bool:
        lo, hi, what = 0, 1, "0 and 1 (False and True)"
    elif exact:
        info = torch.finfo(dtype)
        lo, hi, what = info.min, info.max, f"the numbers in [{info.min:.6g}, {info.max:.6g}], inf and nan"
    else:
        info = torch.iinfo(dtype)
        lo, hi, what = info.min, info.max, f"the integers in [{info.min}, {info.max}]"
    special = isinstance(number, float) and not math.isfinite(number)  # inf or nan, in a floating dtype
    if number is None or (not special and not lo <= number <= hi):
        raise CPInputError(f"{name}={value!r:.40} does not fit {dtype}, whose values are {what}; pass a value in that "
                           "range (or another dtype)")  # fmt: skip
    return float(number) if exact else int(number)


def missing_members(obj: Any, protocol: type) -> list[str]:
    """The members of `protocol` that `obj` lacks (all of them for a class instead of an instance).

    Looked up with `hasattr`, so an object that forwards to another through `__getattr__`
    conforms on every Python: `isinstance` against a runtime-checkable protocol looks members
    up statically from Python 3.12 on, and would refuse such a wrapper there only.

    Examples:
        >>> from cpref.comm.protocol import Collectives, SingleRank
        >>> missing_members(SingleRank(), Collectives)
        []
        >>> missing_members(object(), Collectives)[:3]
        ['all_gather', 'all_gather_async', 'all_reduce']
    """
    names = sorted({*getattr(protocol, "__annotations__", {}), *(n for n in vars(protocol) if not n.startswith("_"))})
    if isinstance(obj, type):
        return names
    return [name for name in names if not hasattr(obj, name)]


def host_ints(value: Any, name: str = "cu_seqlens", fix: str | None = None) -> list[int]:
    """Boundaries as a list of host ints, from a 1-D integer tensor or a flat sequence of ints
    (`fix`: what the error says to pass instead, default document boundaries).

    Raises:
        CPInputError: for None, strings, nested or non-integer entries, float/bool/complex
            tensors and tensors that are not 1-D, naming the offending entry.
    """
    fix = fix or "pass document boundaries like [0, 8, 20]: a list of ints or a 1-D integer tensor"
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise CPInputError(f"{name} must be a 1-D integer tensor, got shape {tuple(value.shape)} dtype {value.dtype}; {fix}")
        if value.device.type == "meta":
            raise CPInputError(f"{name} is on the meta device, which holds no values; pass the boundaries on the CPU "
                               "(or the device of the batch)")  # fmt: skip
        return [int(x) for x in value.tolist()]
    if value is None or isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise CPInputError(f"{name} is {type(value).__name__} {value!r:.40}; {fix}")
    out = []
    for i, x in enumerate(value):
        if isinstance(x, bool) or isinstance(x, (torch.Tensor, Sequence)):
            raise CPInputError(f"{name}[{i}] is {x!r:.40} ({type(x).__name__}); {fix}")
        try:
            out.append(operator.index(x))
        except TypeError:
            raise CPInputError(f"{name}[{i}] is {x!r:.40} ({type(x).__name__}), not an int; {fix}") from None
    return out
