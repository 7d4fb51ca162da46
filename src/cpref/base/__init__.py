"""The base every other part of cpref stands on: its error type, argument checks and determinism.

* [`cpref.base.errors`][cpref.base.errors]: `CPInputError` (bad input, named with the fix) and the
  errors that say another rank refused;
* [`cpref.base.checks`][cpref.base.checks]: the argument checks every public function runs before
  any communication (`as_int`, `as_choice`, ...);
* [`cpref.base.determinism`][cpref.base.determinism]: the backward's race-free row sums
  (`add_rows`) behind `deterministic=True`.

Nothing here imports another part of cpref.
"""
