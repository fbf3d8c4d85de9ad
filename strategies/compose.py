"""``compose``: any eviction strategy followed by any quantizer — the savings multiply.

Eviction and quantization attack different axes (how many tokens, how many bits per token), so their
savings multiply. Zhang et al. 2024, "Q-Hitter: A Better Token Oracle for Efficient LLM Inference via
Sparse-Quantized KV Cache" (MLSys 2024) showed that heavy-hitter eviction and low-bit storage stack when
the kept tokens are chosen well; this strategy makes any such pair a one-line configuration. Here:

* prefill: the eviction policy scores the *full-precision* prefix and picks the kept indices; only the
  kept K/V reach the quantizer's ``prefill``, so nothing evicted is ever quantized or held;
* decoding: strategies that evict while decoding (``streaming_llm``, ``h2o``, ``tova``, and ``knorm`` /
  ``random`` with ``decode_evict``) score the K/V the quantized store returns for the step and call its
  ``select_tokens(index)``; quantizers whose groups span tokens cannot do that and are refused up front.

``kv_bytes`` is measured from the quantized store's tensors (plus the policy's own state, e.g. H2O's
running sums), so e.g. SnapKV at 50% on int8 holds ~0.5 x 8.25/16 of the 16-bit cache.

Override example: ``strategy=compose strategy.evict=snapkv strategy.quantize=int4
strategy.evict_params.compression_ratio=0.5`` (other inner parameters: ``+strategy.evict_params.<key>=...``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvbench.strategies._eviction import EvictionStrategy
from kvbench.strategies.base import LayerStore, RunContext, Strategy, require
from kvbench.strategies.full import FullStore

from kvbench import strategies

QUANTIZER_FAMILIES = ("quantization", "baseline")


def _names(family: tuple[str, ...]) -> list[str]:
    return [n for n in strategies.available() if strategies.strategy_class(n).family in family]


def _params(value: Any, what: str) -> dict[str, Any]:
    require(value is None or isinstance(value, Mapping),
            f"compose.{what} must be a mapping of parameter names to values (got {value!r})")
    return dict(value or {})


def _non_default(built: Strategy, params: dict[str, Any]) -> dict[str, Any]:
    """``params`` without entries equal to the inner strategy's defaults, so equal configurations share a label
    (the YAML lists ``compression_ratio: null`` / ``budget_tokens: null`` only to make them overridable)."""
    # A value is a default if it equals the field's declared default or what a default instance resolves it to
    # (SnapKV's window left None takes its preset's value in __post_init__).
    declared = {f.name: f.default for f in dataclasses.fields(built)}  # type: ignore[arg-type]
    resolved = type(built)().params()
    return {k: v for k, v in params.items()
            if not any(k in defaults and defaults[k] == v for defaults in (declared, resolved))}


@dataclass
class Compose(Strategy):
    """Eviction (``evict``) in front of a quantizer (``quantize``); both built from their own parameters."""

    name = "compose"
    family = "composite"
    evict: str = "snapkv"
    evict_params: dict[str, Any] = field(default_factory=dict)
    quantize: str = "int8"
    quantize_params: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        evictors, quantizers = _names(("eviction",)), _names(QUANTIZER_FAMILIES)
        require(self.evict in evictors,
                f"compose.evict must be an eviction strategy; valid: {', '.join(evictors)} (got {self.evict!r})")
        require(self.quantize in quantizers,
                f"compose.quantize must be a quantizer; valid: {', '.join(quantizers)} (got {self.quantize!r})")
        self.evict_params = _params(self.evict_params, "evict_params")
        self.quantize_params = _params(self.quantize_params, "quantize_params")
        evict = strategies.build(self.evict, self.evict_params)
        assert isinstance(evict, EvictionStrategy)
        quant = strategies.build(self.quantize, self.quantize_params)
        if evict.evicts_during_decode():
            # Checked on an empty probe store: cheap, and fails at configuration time, not mid-run.
            probe = quant.new_layer(0, 1)
            require(type(probe).select_tokens is not LayerStore.select_tokens,
                    f"compose: {self.evict} evicts while decoding, which needs a quantizer that can drop single "
                    f"tokens (select_tokens); {self.quantize} cannot — pick another quantizer or evict")
        if getattr(evict, "rerotate", False):
            require(isinstance(quant.new_layer(0, 1), FullStore),
                    f"compose: {self.evict}.rerotate rotates full-precision keys; {self.quantize} stores them "
                    "quantized — use quantize=full or rerotate=false")
        self.evict_params = _non_default(evict, self.evict_params)
        self.quantize_params = _non_default(quant, self.quantize_params)
        self.evictor, self.quantizer = evict, quant

    @property
    def query_window(self) -> int | None:
        # The engine captures the prefix queries either side reads (None = all of them).
        windows = (self.evictor.query_window, self.quantizer.query_window)
        return None if None in windows else max(windows)  # type: ignore[type-var]

    def bind(self, context: RunContext) -> None:
        super().bind(context)
        self.evictor.bind(context)
        self.quantizer.bind(context)

    def new_layer(self, layer_idx: int, num_layers: int) -> LayerStore:
        inner = self.quantizer.new_layer(layer_idx, num_layers)
        return self.evictor.wrap(inner, layer_idx, num_layers, owner=self)
