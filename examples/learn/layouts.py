"""Learn CP, page 6: how the contiguous and zigzag layouts share causal work, and
a packed (THD) batch.

Run from the repository root: `.venv/bin/python -m examples.learn.layouts`.
"""

# --8<-- [start:work]
import cpref

P = 4
# the figure's batch: two documents of 24 and 16 tokens, packed in one stream
cu_seqlens = [0, 24, 40]
for layout in ("contiguous", "zigzag"):
    sharding = cpref.Sharding(cu_seqlens, cp_size=P, layout=layout)
    chunks = [[(start, end) for _, start, end in sharding.local_chunks(r)]
              for r in range(P)]
    # visible (query, key) scores per rank
    work = [sharding.attention_work(r, exact=True) for r in range(P)]
    print(f"{layout}: rank 0 holds tokens {chunks[0]}")
    print(f"{layout}: rank 3 holds tokens {chunks[3]}")
    print(f"{layout}: scores per rank {work}, "
          f"slowest / mean = {max(work) * P / sum(work):.2f}")
# --8<-- [end:work]

# --8<-- [start:packed]
# A packed batch: two documents of 20 and 9 tokens in one stream, attention reset
# at each end (EOD).
# pads each to a multiple of 2P
sharding = cpref.Sharding.eod_padded([0, 20, 29], cp_size=P, layout="zigzag")
print("real boundaries", sharding.cu_seqlens,
      "padded", sharding.cu_seqlens_padded)
print("rank 0 holds (document, start, end):", sharding.local_chunks(0))
# position in its document, for RoPE
print("rank 0's positions:", sharding.positions(0).tolist())
# --8<-- [end:packed]
