r"""Batches sampled from a document-length distribution, for a planner that sizes a run rather than one batch.

A training run packs documents of many lengths; which mode wins depends on the mix. `sample`
draws documents from a distribution until a batch holds `tokens` tokens (the last document cut to
fit, as a packer cuts it), `batches` times, from a seeded generator: the same arguments give the
same batches everywhere. The planner then predicts each candidate on every batch and ranks by the
mean step ([`plan`][sim.plan.planner.plan] with `batches=`).

Distributions, written `NAME:ARGS`:

| spec | a document's length |
| --- | --- |
| `lognormal:M,S` | $\lceil e^{\ln M + S z} \rceil$, $z \sim N(0, 1)$: median $M$ tokens, spread $S$ |
| `uniform:A,B` | an integer in $[A, B]$, each as likely |
| `fixed:N` | $N$ |

Example:
    >>> sample("uniform:100,300", tokens=1000, batches=2, seed=0)
    [[198, 294, 207, 110, 166, 25], [224, 203, 300, 177, 96]]
"""

from __future__ import annotations

import math
import random

from cpref.base.errors import CPInputError

__all__ = ["sample", "DISTRIBUTIONS"]

DISTRIBUTIONS = {"lognormal": 2, "uniform": 2, "fixed": 1}  # name -> its number of arguments


def _draw(name: str, args: list[float], rng: random.Random) -> int:
    if name == "lognormal":
        return max(1, math.ceil(math.exp(math.log(args[0]) + args[1] * rng.gauss(0.0, 1.0))))
    if name == "uniform":
        return rng.randint(int(args[0]), int(args[1]))
    return int(args[0])


def sample(spec: str, *, tokens: int, batches: int = 1, seed: int = 0) -> list[list[int]]:
    """`batches` batches of `tokens` tokens each, documents drawn from `spec` (module docstring).

    Raises:
        CPInputError: for an unknown distribution, the wrong number of arguments, a non-positive one (or
            `uniform:A,B` with `A > B`), or `tokens`/`batches` not a positive int, naming the value.
    """
    name, _, rest = str(spec).partition(":")
    if name not in DISTRIBUTIONS:
        raise CPInputError(f"unknown distribution {spec!r}: give one of lognormal:MEDIAN,SPREAD, uniform:LO,HI, fixed:N")
    try:
        args = [float(a) for a in rest.split(",")] if rest else []
    except ValueError:
        args = []
    if len(args) != DISTRIBUTIONS[name] or not all(math.isfinite(a) and a > 0 for a in args):
        raise CPInputError(f"distribution {spec!r}: {name} takes {DISTRIBUTIONS[name]} positive number(s) after the colon")
    if name == "uniform" and args[0] > args[1]:
        raise CPInputError(f"distribution {spec!r}: uniform:LO,HI needs LO <= HI")
    for what, value in (("tokens", tokens), ("batches", batches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CPInputError(f"{what}={value!r}: give a positive int")
    rng, out = random.Random(seed), []
    for _ in range(batches):
        batch, left = [], tokens
        while left:
            n = min(left, _draw(name, args, rng))
            batch.append(n)
            left -= n
        out.append(batch)
    return out
