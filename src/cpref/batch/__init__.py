"""The batch description: which tokens a batch holds and which rank holds each.

Read in this order:

* [`cpref.batch.seqlens`][cpref.batch.seqlens]: real and padded document boundaries, validated
  once per batch (`Boundaries`);
* [`cpref.batch.layout`][cpref.batch.layout]: the THD data model and the four layouts
  (contiguous, zigzag, stream, balanced): which chunks of which document a rank holds, their
  positions, and the attention work each rank does;
* [`cpref.batch.balanced`][cpref.batch.balanced]: the balanced layout's plan;
* [`cpref.batch.sharding`][cpref.batch.sharding]: `Sharding`, the one object that says how a
  batch is split (boundaries, CP size, layout), shards and unshards tensors, and is what
  `cpref.attention` takes;
* [`cpref.batch.mask`][cpref.batch.mask]: `Mask`, which keys each query sees, as a union of
  slices of four kinds, normalised by [`cpref.batch.mask_union`][cpref.batch.mask_union];
* [`cpref.batch.cache`][cpref.batch.cache]: the batch cache, where everything derived from one
  batch's boundaries (every mode's per-rank plan) is kept.

It imports only [`cpref.base`][cpref.base].
"""
