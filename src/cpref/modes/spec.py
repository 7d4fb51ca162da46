"""What a mode says about itself: `ModeSpec`, declared at the end of the mode's own file.

A CP mode is one file. Its last lines declare everything the rest of cpref needs to know
about it, as a torchtitan model declares its spec; the hierarchical mode's, with its one
option:

--8<-- "src/cpref/modes/hierarchical.py:declaration"

[`cpref.api`][cpref.api] collects every `MODE` of the modules of `cpref.modes` into
`cpref.MODES`, and everything else reads the declaration: `cpref.attention` validates the
mode's options with their parsers and calls its check before any communication, refuses a
backend that lacks one of its collectives, and runs it;
[`cpref.api.mode_costs`][cpref.api.mode_costs] and the docs' tables ask it for its costs; the
tools, tests and benchmarks ask it for the options to run with at a CP size
([`example_options`][cpref.modes.spec.ModeSpec.example_options]).

## Adding an option, or a mode

An option is one more `Option(name, default, parse, doc)` in the mode's `options`, read in its
`run` (or plan, or costs) as `call.options[name]`, already parsed: `cpref.attention` accepts
it for that mode and refuses it, by name, for every other; `CPContext` and the training
config accept it; this page lists it. A new mode is one new file in `cpref/modes/` that ends
with its `MODE` (the test suite checks that each mode file does, and that no generic module
compares a mode's or an option's name).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from cpref.base.errors import CPInputError
from cpref.modes.call import CPCall
from cpref.modes.costs import ModeCosts

__all__ = ["Option", "ModeSpec"]


@dataclass(frozen=True)
class Option:
    """A keyword option of one mode.

    Attributes:
        name: the keyword, as passed to `cpref.attention`.
        default: the value when it is not given (or given as None).
        parse: `parse(value) -> value`, validated (raises `CPInputError` naming the option).
        doc: one line for the docs: what it does.
        example: `example(P) -> value` to run with at CP size `P` when none is chosen (the demo,
            the tools, the tests and the benchmarks); None: the default.
    """

    name: str
    default: Any
    parse: Callable[[Any], Any]
    doc: str
    example: Callable[[int], Any] | None = None


def no_sizes(call: CPCall) -> Mapping[str, Any]:
    """The `sizes` of a mode whose costs depend on no amount of its plan: none."""
    return {}


@dataclass(frozen=True)
class ModeSpec:
    """One CP mode, as it declares itself.

    Attributes:
        name: the mode's key in `cpref.MODES` (`mode=` of `cpref.attention`).
        order: where it stands in `cpref.MODES` and the docs' tables (the simplest first).
        run: `run(q, k, v, call, comm) -> out` for a validated `CPCall`.
        plan: `plan(call) -> plan`: this rank's cached plan for the call (what `run` uses).
        collectives: the collectives it calls (checked against the backend's limits).
        costs: `costs(P=, local_tokens=, heads=, dtype=, selected_kv_rows=, halo_sizes=, gathered_rows=,
            window=, **options) -> ModeCosts`: the per-rank traffic, collectives and saved bytes of one layer
            (`cpref.modes.costs`); `halo_sizes`: a ring's rows per step when it sends only what is read (its plan's
            `halo.sizes`); `gathered_rows`: the rows each rank all-gathers when it gathers only what others
            read (the all-gather plan's `gathered_rows`; None: the whole shard); `window`: the call's
            `(left, right)` sliding window (`(-1, -1)`: none).
        sizes: `sizes(call) -> {name: value}`: the amounts of `costs` that depend on the batch
            (`selected_kv_rows`, `halo_sizes`, `gathered_rows`), read from the plan this rank runs for
            the call, so that [`call_costs`][cpref.modes.spec.ModeSpec.call_costs] states what the mode does.
        options: its keyword options.
        check: its own validation of a `CPCall` (e.g. head counts), before any communication.
        windows: whether it takes a sliding window (`cpref.attention(..., window=)`); one that
            does not is refused by name, before any communication.
        variants: the attention variants it runs beyond soft-capping, which every mode runs (its kernel calls are
            capped): `"chunk"`, `"sinks"`; a call with another is refused by name, before any communication.
    """

    name: str
    order: int
    run: Callable[..., torch.Tensor]
    plan: Callable[[CPCall], Any]
    collectives: frozenset[str]
    costs: Callable[..., ModeCosts]
    sizes: Callable[[CPCall], Mapping[str, Any]] = no_sizes
    options: tuple[Option, ...] = ()
    check: Callable[[CPCall], None] | None = None
    windows: bool = False
    variants: frozenset[str] = frozenset()

    def defaults(self) -> dict[str, Any]:
        """`{name: default}` of its options."""
        return {o.name: o.default for o in self.options}

    def example_options(self, P: int) -> dict[str, Any]:
        """The options to run it with at CP size `P` when the caller chose none (e.g. `a2a_size`)."""
        return {o.name: o.example(P) for o in self.options if o.example is not None}

    def parse_options(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """Every option of the mode, parsed: the given value, or the default where it is absent or None.

        Raises:
            CPInputError: for a value its parser refuses (a name it does not know is the caller's to report).
        """
        return {o.name: o.parse(given[o.name]) if given.get(o.name) is not None else o.default for o in self.options}

    def mode_costs(self, *, P: int, local_tokens: int, heads: tuple[int, int, int, int], dtype: torch.dtype,
                   selected_kv_rows: int | None = None, halo_sizes: tuple[int, ...] | None = None,
                   gathered_rows: int | None = None, window: tuple[int, int] = (-1, -1), **options: Any) -> ModeCosts:  # fmt: skip
        """Its per-rank costs of one layer, with `options` parsed as `cpref.attention` parses them
        (an option given as None is absent, as there)."""
        unknown = sorted(name for name, value in options.items() if value is not None and name not in self.defaults())
        if unknown:
            raise CPInputError(f"mode {self.name!r} has no option {unknown[0]!r}; its options: {[o.name for o in self.options]}")
        return self.costs(P=P, local_tokens=local_tokens, heads=heads, dtype=dtype, selected_kv_rows=selected_kv_rows,
                          halo_sizes=halo_sizes, gathered_rows=gathered_rows, window=tuple(window),
                          **self.parse_options(options))  # fmt: skip

    def call_costs(self, call: CPCall) -> ModeCosts:
        """Its costs on `call.rank` for one validated call: the formulas of `costs`, with the batch's amounts
        read from the plan the mode runs (`sizes`), not computed a second time."""
        sizes = {"selected_kv_rows": None, "halo_sizes": None, "gathered_rows": None, **self.sizes(call)}
        return self.costs(P=call.P, local_tokens=call.local_tokens, heads=call.heads, dtype=call.dtype,
                          window=call.window, **sizes, **call.options)  # fmt: skip
