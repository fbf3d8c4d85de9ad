"""kvbench: a benchmarking harness for KV-cache optimisation in LLM inference."""

from typing import Any

__version__ = "0.1.0"
SPEC_VERSION = "1.2"


def generate(model: Any, tokenizer: Any, context: str, question: str, strategy: str = "snapkv",
             max_new_tokens: int = 32, **params: Any) -> str:
    """Compress ``context`` with ``strategy``, then answer ``question`` (:func:`kvbench.pipeline.generate`;
    imported on first use so ``import kvbench`` stays light)."""
    from kvbench.pipeline import generate as run

    return run(model, tokenizer, context, question, strategy, max_new_tokens, **params)
