"""Where the verifier finds the attention it checks: `--impl` and `--baseline` as a module or a file.

`--impl package.module:function` imports the module (it must be importable: on `sys.path`, or
`PYTHONPATH=...`); `--impl path/to/file.py:function` loads the file itself, under a module name
of its own, so a script in any folder can be checked without installing it or editing the path:

```
python -m sim verify --impl ./my_ring.py:attention --mode p2p --docs 4096
```

A path is told from a module by its `.py` (or a `/`); every process of the launch loads it the
same way. What fails is said in one line before any process starts: a file that is not there
(with the path tried), a module that does not import (with Python's reason), a name it does not
have, or something that is not a function.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

__all__ = ["load_impl", "takes_mask", "takes", "Peer", "PEERS", "peer_name"]

EXAMPLE = "tests.backends.verify_impls:cpref_over_group or ./my_attention.py:attention"


@dataclass(frozen=True)
class Peer:
    """An adapter of someone else's CP that cpref ships, by the name `--peer` takes.

    Attributes:
        impl: the adapter, as `--impl` names it.
        modes: the cpref modes of the same family: the ground truth is the simulated cluster's run of the same inputs
            in these (every mode's truth is the same attention; the name only labels what it is compared with).
        layouts: how it shards a batch, as cpref's layouts describe it (its default `--layout`).
        docs: its default `--docs`; one document for a peer that takes no document boundaries.
        about: what it wraps, for `--help`.
    """

    impl: str
    modes: tuple[str, ...]
    layouts: tuple[str, ...]
    docs: tuple[int, ...]
    about: str


PEERS = {
    "deepspeed-ulysses": Peer("sim.tools.verify.peers:deepspeed_ulysses", ("a2a",), ("stream",), (1000, 3000, 500),
                              "DeepSpeed's DistributedAttention over SDPA, on packed batches"),
    "torch-ring": Peer("sim.tools.verify.peer_torch_ring:attention", ("p2p",), ("contiguous", "zigzag"), (1024,),
                       "PyTorch's own ring attention (_templated_ring_attention and its backward), one document"),
}  # fmt: skip


def peer_name(impl: str) -> str:
    """The `--peer` name of an adapter spec, or the spec itself: how a table labels an implementation."""
    return next((name for name, peer in PEERS.items() if peer.impl == impl), impl)


def load_impl(spec: str, flag: str = "--impl") -> Callable[..., torch.Tensor]:
    """The function `spec` names: `"package.module:function"` or `"path/to/file.py:function"` (`flag`: the option
    that named it, for the error).

    Raises:
        ValueError: if `spec` is not of either form, the file is not there, the module does not import, or the name is
            missing or not callable; naming what was tried and the fix.

    Examples:
        >>> load_impl("sim.tools.verify.baselines:eager").__name__
        'eager'
        >>> try:
        ...     load_impl("no_such_dir/ring.py:attention")
        ... except ValueError as refused:
        ...     print(str(refused).split(" (looked")[0])
        --impl 'no_such_dir/ring.py:attention': no file no_such_dir/ring.py
    """
    where, _, name = spec.rpartition(":")
    if not where or not name or not name.isidentifier():
        raise ValueError(f"{flag} {spec!r}: expected package.module:function or path/to/file.py:function, e.g. {EXAMPLE}")
    try:
        module = _from_file(where, spec, flag) if where.endswith(".py") or "/" in where else importlib.import_module(where)
    except ImportError as exc:
        hint = "; a file is named by its path ending in .py" if "." in where and not where.endswith(".py") else ""
        raise ValueError(f"{flag} {spec!r}: {type(exc).__name__}: {exc} (is the package on sys.path? run from its folder "
                         f"or set PYTHONPATH{hint})") from exc  # fmt: skip
    fn = getattr(module, name, None)
    if fn is None:
        raise ValueError(f"{flag} {spec!r}: {where} has no {name!r}")
    if not callable(fn):
        raise ValueError(f"{flag} {spec!r} is a {type(fn).__name__}, not a function")
    return fn


def _from_file(where: str, spec: str, flag: str) -> Any:
    """The module of the file `where`, loaded once per process under a name made of its absolute path."""
    path = Path(where).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"{flag} {spec!r}: no file {where} (looked for {path}); give the path of a .py file, relative "
                         "to the current folder or absolute")  # fmt: skip
    name = "sim_verify_impl_" + hashlib.blake2b(str(path).encode(), digest_size=6).hexdigest()
    if name in sys.modules:
        return sys.modules[name]
    spec_ = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec_)
    sys.modules[name] = module  # before it runs: dataclasses and pickling look the module up by name
    try:
        spec_.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def takes(fn: Callable[..., Any], name: str) -> bool:
    """Whether `fn` can be called with the keyword `name`: a parameter of that name, or `**kwargs` (where it has no
    signature to read, the call itself will tell).

    Examples:
        >>> takes(lambda q, *, rotate="allgather": q, "rotate"), takes(lambda q, *, rotate="allgather": q, "ring")
        (True, False)
    """
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return any(p.kind == inspect.Parameter.VAR_KEYWORD or (p.name == name and p.kind in named) for p in params)


def takes_mask(fn: Callable[..., Any]) -> bool:
    """Whether `fn` can be called with `mask=` (`takes(fn, "mask")`).

    Examples:
        >>> takes_mask(lambda q, k, v, sharding, *, process_group, mode, causal, window: q)
        False
        >>> takes_mask(lambda q, k, v, sharding, *, process_group, **options: q)
        True
    """
    return takes(fn, "mask")
