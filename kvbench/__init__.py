"""kvbench: a benchmarking harness for KV-cache optimisation in LLM inference."""

from pathlib import Path
from typing import Any

# In a checkout, strategies/ sits beside kvbench/ (as conf/ does) and is this package's `kvbench.strategies`; a
# built wheel installs it inside (pyproject's package-dir). Searching the checkout root for submodules finds it
# without an install; the only other folders there without an __init__.py are not Python packages.
_ROOT = Path(__file__).resolve().parent.parent
if not (Path(__file__).resolve().parent / "strategies").is_dir() and (_ROOT / "strategies" / "base.py").is_file():
    __path__.append(str(_ROOT))  # noqa: F821 (a package's own __path__)

__version__ = "0.1.0"
SPEC_VERSION = "1.2"


def generate(model: Any, tokenizer: Any, context: str, question: str, strategy: str = "snapkv",
             max_new_tokens: int = 32, **params: Any) -> str:
    """Compress ``context`` with ``strategy``, then answer ``question`` (:func:`kvbench.pipeline.generate`;
    imported on first use so ``import kvbench`` stays light)."""
    from kvbench.pipeline import generate as run

    return run(model, tokenizer, context, question, strategy, max_new_tokens, **params)
