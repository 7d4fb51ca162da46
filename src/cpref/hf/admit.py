"""Which Hugging Face models cpref runs, decided when the model is built.

`transformers` asks one method of every model it builds (or whose implementation
`set_attn_implementation` changes) whether its attention implementation can be used:
`PreTrainedModel._check_and_adjust_attn_implementation`. [`cpref.hf.register`][cpref.hf.register]
wraps it: where the answer is cpref's name, [`admit`][cpref.hf.admit.admit] refuses what would be
wrong under CP, naming the class and why, and installs the model-level checks of every forward
([`cpref.hf.guard`][cpref.hf.guard]). For every other name the method answers as `transformers`' own does.

Refused when the model is built:

1. a model whose attention layers do not hand the forward's keyword arguments on to the
   attention implementation (`transformers` marks it `_supports_attention_backend = False`:
   StableLm, and models that never call the interface): `cp=` would never reach them;
2. a head that reads a token by its index in the sequence (sequence classification, multiple
   choice, next-sentence prediction, question answering): under CP the index is the shard's;
3. a layer kind cpref does not run: any `layer_types` entry other than `full_attention`,
   `sliding_attention` and `chunked_attention` (Llama 4's; linear attention, convolutions,
   recurrences), and Llama 4's attention temperature tuning on its NoPE layers (it scales a
   query by its index in the tensor).

Logit soft-capping (Gemma 2), attention sinks (GPT-OSS's `sinks` parameter) and chunked layers
run: the layer hands them to `cpref.attention` ([`cpref.hf.layer`][cpref.hf.layer]).

Refused at the first forward (the layers exist then; every rank alike, before any
communication): a pooler that reads the shard's first token (BERT's: build the model with
`add_pooling_layer=False`).

**Loading on several threads.** `transformers`' `from_pretrained` turns weight tying off for its
duration by replacing `PreTrainedModel.tie_weights` on the class
(`transformers.initialization.no_tie_weights`) and putting back what it found. Two threads that
load at once (the ranks of the simulated cluster, each loading its replica) interleave: the
second saves the first's replacement and puts it back last, so tying stays off in the process,
and every model built after it has an output layer of its own instead of the tied embedding,
silently (its checkpoint's logits differ). `install` serializes `from_pretrained` and
`post_init` (where a model built directly ties its weights) with one lock.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

import torch

from cpref.base.errors import CPInputError
from cpref.hf.layer import NAMES

__all__ = ["install", "admit", "check_config", "check_bidirectional", "check_modules", "RUNS", "INDEXED_HEADS"]

RUNS = ("full_attention", "sliding_attention", "chunked_attention")  # the layer_types cpref runs
INDEXED_HEADS = ("ForSequenceClassification", "ForMultipleChoice", "ForNextSentencePrediction", "ForPreTraining",
                 "ForQuestionAnswering")  # fmt: skip
LOADING = threading.RLock()  # held by from_pretrained and post_init (the module docstring: loading on several threads)


def install(hook: Callable) -> None:
    """Wrap `PreTrainedModel._check_and_adjust_attn_implementation` once (imports `transformers`): a model given
    one of cpref's names is admitted, `hook` its forward pre-hook (`cpref.hf.guard.guard`); and serialize loading
    (the module docstring)."""
    from transformers import PreTrainedModel

    original = getattr(PreTrainedModel, "_check_and_adjust_attn_implementation", None)
    if original is None:
        import transformers

        raise ImportError(f"cpref.hf needs transformers' PreTrainedModel._check_and_adjust_attn_implementation, which "
                          f"transformers {transformers.__version__} lacks; use transformers 5 (tested: 5.24.0)")  # fmt: skip
    with LOADING:  # every rank of a simulated cluster may register at once
        if not getattr(original, "cpref", False):
            _wrap_check(PreTrainedModel, original, hook)
            _serialize_loading(PreTrainedModel)


def _serialize_loading(cls: Any) -> None:
    """`from_pretrained` and `post_init` of `cls` (`PreTrainedModel`) under `LOADING`."""
    load, post_init = cls.from_pretrained.__func__, cls.post_init

    @functools.wraps(load)
    def from_pretrained(klass, *args: Any, **kwargs: Any):
        with LOADING:
            return load(klass, *args, **kwargs)

    @functools.wraps(post_init)
    def locked_post_init(self, *args: Any, **kwargs: Any):
        with LOADING:
            return post_init(self, *args, **kwargs)

    cls.from_pretrained, cls.post_init = classmethod(from_pretrained), locked_post_init


def _wrap_check(cls: Any, original: Callable, hook: Callable) -> None:
    """`cls._check_and_adjust_attn_implementation` that admits (`admit`) the models given one of cpref's names."""

    @functools.wraps(original)
    def checked(self, *args: Any, **kwargs: Any) -> str:
        chosen = original(self, *args, **kwargs)
        if chosen in NAMES:
            admit(self, hook)
        return chosen

    checked.cpref = True
    cls._check_and_adjust_attn_implementation = checked


def admit(model: torch.nn.Module, hook: Callable) -> None:
    """Refuse a model cpref cannot run (the module docstring's list), else install `hook`, its forward checks."""
    what = type(model).__name__
    if not getattr(type(model), "_supports_attention_backend", False):
        raise CPInputError(f"{what} cannot run attn_implementation='cpref': its attention layers do not hand the "
                           "forward's keyword arguments on to the attention implementation (transformers marks the "
                           "class _supports_attention_backend = False), so cp= would never reach them; use a model "
                           "class that supports the attention interface")  # fmt: skip
    head = next((h for h in INDEXED_HEADS if what.endswith(h)), None)
    if head is not None:
        raise CPInputError(f"{what} cannot run attn_implementation='cpref': its head ({head}) reads tokens by their "
                           "index in the sequence, which under CP is the index in this rank's shard; use the base "
                           "model or a per-token head (causal or masked LM, token classification)")  # fmt: skip
    check_config(model.config, what)
    vision = getattr(model.config, "vision_config", None)
    if vision is not None and getattr(vision, "_attn_implementation", None) in NAMES:
        raise CPInputError(f"{what}: its vision tower would run attn_implementation='cpref', but under CP every rank runs "
                           "it on whole images (cpref.hf.masks); build the model with attn_implementation="
                           "{'text_config': 'cpref', 'vision_config': 'sdpa', '': 'cpref'}")  # fmt: skip
    if not getattr(model, "_cpref_guarded", False):
        model.register_forward_pre_hook(hook, with_kwargs=True)
        model._cpref_guarded = True


def _configs(config: Any):
    """`config` and its sub-configs (a composite model's text and vision configs), depth first."""
    yield config
    for key in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, key, None)
        if sub is not None and sub is not config:
            yield from _configs(sub)


def check_config(config: Any, what: str) -> None:
    """Refuse the layer kinds and settings of `config` that cpref does not run (the module docstring's item 3)."""
    for c in _configs(config):
        kinds = list(getattr(c, "layer_types", None) or [])
        other = sorted({kind for kind in kinds if kind not in RUNS})
        if other:
            layers = {kind: [i for i, k in enumerate(kinds) if k == kind] for kind in other}
            shown = "; ".join(f"{kind!r} (layers {', '.join(map(str, ids))})" for kind, ids in layers.items())
            raise CPInputError(f"{what}: layer_types holds layer kinds cpref does not run: {shown}; cpref runs "
                               f"{' and '.join(RUNS)} layers, so computing these would give other results")  # fmt: skip
        nope = [i for i, rope in enumerate(getattr(c, "no_rope_layers", None) or []) if not rope]
        if getattr(c, "attn_temperature_tuning", False) and nope:
            raise CPInputError(f"{what}: attention temperature tuning (attn_temperature_tuning=True, on the NoPE layers "
                               f"{nope}) scales each query by its index in the tensor, which under CP is the index in "
                               "this rank's shard; set attn_temperature_tuning=False")  # fmt: skip


def check_bidirectional(config: Any, what: str) -> None:
    """Refuse `use_bidirectional_attention` where cpref does not build the model's mask (`cpref.hf.masks`): at the
    forward of the outermost model (a PaliGemma's Gemma text model is built with it, and is run as PaliGemma's)."""
    top = getattr(config, "model_type", None)
    for c in _configs(config):
        if getattr(c, "use_bidirectional_attention", False) and top != "paligemma" and not c.model_type == top == "gemma3_text":
            raise CPInputError(f"{what}: use_bidirectional_attention=True on a {c.model_type} config: cpref runs it for "
                               "Gemma 3 text models (gemma3_text) and PaliGemma only, whose masks it builds "
                               "(cpref.hf.masks); set use_bidirectional_attention=False")  # fmt: skip


def check_modules(model: torch.nn.Module) -> None:
    """Refuse the layers of a built model that cpref does not run (the module docstring's last paragraph)."""
    what = type(model).__name__
    for name, _ in model.named_modules():
        if name.rsplit(".", 1)[-1] == "pooler":
            raise CPInputError(f"{what}: its pooler ({name}) reads the first token of the sequence, which under CP is "
                               "the first of this rank's shard; build the model with add_pooling_layer=False")  # fmt: skip
