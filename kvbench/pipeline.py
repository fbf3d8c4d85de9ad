"""One call for the common case, as kvpress's pipeline offers it: compress a context, then answer a question.

    import kvbench
    answer = kvbench.generate(model, tokenizer, context, question, strategy="snapkv", compression_ratio=0.5)

This is the query-agnostic setting (kvpress's; ``task.query_aware=false`` in the harness): the context is
prefilled into a :class:`kvbench.cache.KVBenchCache` and compressed without seeing the question, then the
question is fed and the answer decoded greedily through ``model.generate``. Strategy parameters are checked
and defaulted exactly as ``python -m kvbench strategy=<name> strategy.<param>=...`` does
(:func:`kvbench.config.strategy_params`). The four lines it stands for::

    strategy = strategies.build("snapkv", {"compression_ratio": 0.5})
    cache = KVBenchCache(strategy, model.config)
    with cache.attach(model):   # attention-scored strategies (snapkv, h2o, ...) read the queries through it
        model.generate(ids, cache=cache, max_new_tokens=32)
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from kvbench.cache import KVBenchCache


def _ids(tokenizer: Any, text: str, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def generate(model: Any, tokenizer: Any, context: str, question: str, strategy: str = "snapkv",
             max_new_tokens: int = 32, **params: Any) -> str:
    """The model's greedy answer to ``question`` after ``context`` was compressed by ``strategy``
    (``params``: its parameters, e.g. ``compression_ratio=0.75``). Raw text in, raw text out: apply a chat
    template to ``context``/``question`` first if the model expects one."""
    from kvbench import strategies
    from kvbench.arch import describe, nothing_to_compress
    from kvbench.config import strategy_params

    built = strategies.build(strategy, strategy_params(strategy, params))
    describe(model, [built])  # the CLI's model check, with its line: nothing is compressed silently wrong
    device = next(model.parameters()).device
    ctx = torch.tensor([_ids(tokenizer, context, True)], device=device)
    ask = torch.tensor([_ids(tokenizer, question, False)], device=device)
    tokens = ctx.shape[1] + ask.shape[1] + max_new_tokens  # the most this cache sees: a longer window bounds nothing
    note = nothing_to_compress(model.config, [strategy], tokens)
    if note:
        warnings.warn(note, stacklevel=2)
    cache = KVBenchCache(built, model.config, tokens=tokens)
    with torch.inference_mode(), cache.attach(model):
        model(input_ids=ctx, cache=cache, use_cache=True)  # compressed here, before the question is seen
        out = model.generate(input_ids=torch.cat([ctx, ask], dim=1), cache=cache, max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=getattr(tokenizer, "pad_token_id", None))
    return tokenizer.decode(out[0, ctx.shape[1] + ask.shape[1]:].tolist(), skip_special_tokens=True)
