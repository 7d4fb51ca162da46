"""CP for inference: a KV cache spread over the ranks of a CP group, and decode over it, exact.

* [`cpref.infer.cache`][cpref.infer.cache]: `CacheLayout` (interleaved, vLLM's and SGLang's; contiguous) and
  `KVCache`, one rank's share of a layer's cache, which no rank ever holds whole;
* [`cpref.infer.prefill`][cpref.infer.prefill]: `prefill_attention`, a prompt sharded as for training attended
  forward only by any mode, and `write_prompt`, its keys and values moved into the cache layout (one all-to-all);
* [`cpref.infer.decode`][cpref.infer.decode]: `decode_attention`, a decode step's new queries attended to every
  rank's share and merged by lse (one all-gather), the new keys and values appended where the layout says.
"""

from cpref.infer.cache import CACHE_KINDS, CacheLayout, KVCache
from cpref.infer.decode import decode_attention
from cpref.infer.prefill import prefill_attention, write_prompt

__all__ = ["CACHE_KINDS", "CacheLayout", "KVCache", "decode_attention", "prefill_attention", "write_prompt"]
