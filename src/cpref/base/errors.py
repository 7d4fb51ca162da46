"""cpref's error types: bad input, and a training step that diverged.

`CPInputError` is both a `ValueError` (what Python code expects for a bad argument) and an
`AssertionError` (what the MindSpeed RFC specifies for its metadata interface), so callers
written against either convention catch it. It is raised before any of a mode's
communication, from checks that every rank evaluates on the same values, so all ranks fail
alike; where one rank's own inputs fail, the ranks' comparison tells the others, which raise
too (see [`cpref.modes.consistency`][cpref.modes.consistency]).
"""

__all__ = ["CPInputError", "PeerInputError", "NonFiniteStepError"]


class CPInputError(ValueError, AssertionError):
    """Invalid input to a cpref function; the message names the value and the fix."""


class PeerInputError(CPInputError):
    """Another rank's input failed validation, and this rank raises too, so that none waits in a collective.

    The rank whose own input failed raises a plain `CPInputError` naming it: that one is the root cause.
    """


class NonFiniteStepError(ArithmeticError):
    """A training step's loss or gradient norm is not finite: the step is not taken.

    Every rank reads the same all-reduced loss and norm, so every rank raises alike; the weights and the optimizer
    state stay those of the last finite step, and no checkpoint of the diverged step is written. The message names
    the step, both values and what to change.
    """
