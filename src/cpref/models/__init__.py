r"""Models with CP: GPT-2, LLaMA, Qwen3 and Mistral on packed documents.

`cpref.models` holds small decoder-only language models whose attention is
[`cpref.attention`][cpref.api.attention], so that the same model code trains at any CP size,
in any mode and layout, and at CP = 1 without communication. They load Hugging Face
checkpoints of the three families and of Mistral (LLaMA with sliding windows) and then give
the logits of `GPT2LMHeadModel`, `LlamaForCausalLM`, `Qwen3ForCausalLM` and
`MistralForCausalLM`.

```python
# given: tokens, position_ids, cp, path; this rank's tokens and positions, a CPContext, a checkpoint's directory
from cpref.models import CausalLM, CPContext, ModelConfig, load_pretrained

config = ModelConfig(family="llama", vocab_size=32000, hidden_size=512, num_layers=8, num_heads=8,
                     num_kv_heads=2, mlp_size=1408)
model = CausalLM(config, seed=0)  # random weights, the same on every rank
model = load_pretrained(path)  # or: a Hugging Face checkpoint (the directory save_pretrained wrote)
logits = model(tokens, position_ids, cp)  # (T_l,), (T_l,), CPContext -> (T_l, V)
```

## Three families, one skeleton

Every model is embeddings, `L` pre-norm blocks, a final norm and the output projection. A
block is the same code in every family; the config's family chooses its pieces
(`cpref.models.config.FAMILIES`):

--8<-- "src/cpref/models/model.py:block"

| | GPT-2 | LLaMA | Qwen3 |
| --- | --- | --- | --- |
| positions | learned table, added to the embeddings | RoPE on q, k | RoPE on q, k |
| norm | LayerNorm (with bias) | RMSNorm | RMSNorm |
| MLP | GELU (tanh), `E -> 4E -> E` | SwiGLU | SwiGLU |
| heads | MHA (`Hkv = Hq`) | GQA (`Hkv` divides `Hq`) | GQA |
| `head_dim` | `E / Hq` | `E / Hq` (or set) | set in the config (e.g. 128), may differ from `E / Hq` |
| per-head q/k norm | no | no | RMSNorm over `D`, before RoPE |
| biases | every projection and norm | none by default (`attention_bias`, `mlp_bias`) | none by default (`attention_bias`) |
| output projection | tied to the embedding | `lm_head` unless tied | `lm_head` unless tied (small models tie) |

The model's forward embeds the tokens, adds GPT-2's learned positions or computes RoPE's
rotations once for all layers, and runs the blocks:

--8<-- "src/cpref/models/model.py:forward"

The attention of every family is the same few lines; only the optional q/k norm and RoPE
differ:

--8<-- "src/cpref/models/attention.py:attention"

With RoPE ([`cpref.models.rope`][cpref.models.rope]) dims $i$ and $i + D/2$ of a query or key
at position $p$ are rotated by the angle $p\,\theta^{-2i/D}$, so a score depends on the
positions only through $p_q - p_k$.

## Sliding windows

Any family's layers may attend in a sliding window, one per layer:
`ModelConfig(..., layer_windows=(None, 4095))` keeps layer 0 full and lets the query at
position $p$ of a document see only its keys $p - 4095 .. p$ in layer 1 (4096 keys, itself
included: Hugging Face's `sliding_window = 4096`). Each layer passes its own
`window=(left, 0)` to `cp.attention`; the mask stays inside each document. Mistral slides in
every layer, Qwen3 checkpoints may mix (`layer_types`). At CP = 1 and under CP in a mode
that takes a window (`cpref.MODES[mode].windows`) such a model runs as any other; another
mode refuses it by name before any communication. Without `layer_windows` every layer
attends over its whole document (causal).

## Where positions come from under CP

Positions are an **input**, not something the model derives from a token's index: under CP
a rank's tokens are pieces of every document, in the layout's order, so index and position
part ways. The caller passes each token's position inside its document, restarting at 0 at
every document, from the same sharding that cut the tokens: [`Sharding.positions`][cpref.batch.sharding.Sharding.positions]
or the `position_ids` of [`cpref.get_batch_on_this_cp_rank`][cpref.train.data.get_batch_on_this_cp_rank].
With zigzag over two ranks, a document of 8 tokens is cut in four chunks, and rank 0 holds the
first and the last:

```python
>>> import cpref
>>> [cpref.Sharding([0, 8], cp_size=2, layout="zigzag").positions(r).tolist() for r in range(2)]
[[0, 1, 6, 7], [2, 3, 4, 5]]

```

RoPE rotates each token by its own position, and GPT-2 looks its position up in the learned
table, so every token is embedded exactly as in the unsharded model; attention
(`cpref.attention`, given the batch's sharding and with it the document boundaries) then sees whole documents, and never
across one. Packing is therefore invisible too: the logits of a document are the same alone
or packed with others.

## Why the model holds no CP state

The CP group, the batch's sharding (boundaries, layout) and the mode are passed to every forward as
one frozen [`CPContext`][cpref.models.context.CPContext]; the model stores none of it, and
nothing else does either (the batch cache of [`cpref.batch.cache`][cpref.batch.cache] is keyed by the
batch and by every CP argument). Users of other CP systems have hit a process-wide global
(the head counts, the group) set by one model silently corrupting a second model in the same
process, e.g. an evaluation model beside the training one. Without state, two models with
different CP settings and head counts, or one model under two settings, interleave freely,
and a checkpoint of the model's weights is the same at every CP size.

The whole path at CP = 2, on the simulated cluster: every rank pads and slices the packed
batch, runs the model on its shard, and the shards put back together are the logits at
CP = 1:

```python
>>> import torch, sim
>>> from cpref.models import CausalLM, CPContext, ModelConfig
>>> model = CausalLM(ModelConfig(family="qwen3", vocab_size=64, hidden_size=32, num_layers=2,
...                              num_heads=4, num_kv_heads=2, head_dim=16)).double()
>>> cu = torch.tensor([0, 5, 16])  # two documents, of 5 and 11 tokens
>>> tokens = torch.arange(16) * 7 % 64
>>> single = CPContext.single(cu)
>>> whole = model(tokens, single.sharding.positions(0), single)
>>> def forward_on_rank(comm):
...     b = cpref.get_batch_on_this_cp_rank({"tokens": tokens, "labels": tokens}, cu, cp_size=comm.size,
...                                         rank=comm.rank, layout="zigzag")
...     cp = CPContext(comm=comm, sharding=b["sharding"], mode="p2p")
...     return model(b["tokens"], b["position_ids"], cp), b["sharding"]
>>> shards = sim.SimCluster(2).run(forward_on_rank)
>>> sharding = shards[0][1]  # every rank's is equal: the same batch, P and layout
>>> padded = sharding.unshard([logits for logits, _ in shards])
>>> torch.allclose(sharding.unpad(padded), whole, rtol=0, atol=1e-10)
True

```

## Hugging Face checkpoints

[`load_pretrained(directory)`][cpref.models.model.load_pretrained] reads what
`save_pretrained` writes: `config.json` ([`ModelConfig.from_hf`][cpref.models.config.ModelConfig.from_hf]
reads the sliding windows of Qwen3 and Mistral into `layer_windows`, and refuses by name what
these models do not implement: RoPE scaling, other activations, other attention kinds) and `model.safetensors` or `pytorch_model.bin`
([`cpref.models.hf_weights`][cpref.models.hf_weights] maps the names, transposes GPT-2's
`Conv1D` weights and lists any key that does not fit). `model.load_hf_state_dict(sd)` loads
a state dict already in memory. `transformers` itself is never imported: the tests use it to
check the logits against Hugging Face's models, in fp32 within 1e-5.
"""

from cpref.models.config import FAMILIES, Family, ModelConfig
from cpref.models.context import CPContext
from cpref.models.hf_weights import convert_hf_state_dict, read_hf_weights
from cpref.models.model import Block, CausalLM, load_pretrained

__all__ = [
    "ModelConfig",
    "Family",
    "FAMILIES",
    "CPContext",
    "CausalLM",
    "Block",
    "load_pretrained",
    "read_hf_weights",
    "convert_hf_state_dict",
]
