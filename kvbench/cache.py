"""`KVBenchCache`: any kvbench strategy behind transformers' Cache API (5.x list-of-layers design).

Usable outside the harness::

    cache = KVBenchCache(strategies.build("int8"), model.config)
    with cache.attach(model):          # only needed by attention-aware strategies
        model.generate(input_ids, cache=cache, max_new_tokens=32)

Positions stay logical after eviction: ``get_seq_length`` reports every token processed (so RoPE
positions of new tokens are right), while ``get_mask_sizes`` reports the tokens physically held and
offsets them so the causal mask still lines up the new tokens with themselves.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvbench.capture import QueryRecorder
from strategies.base import LayerCapture, LayerStore, Strategy, held_bytes

REFERENCE_BYTES_PER_ELEMENT = 2  # spec v1: memory reduction is against a dense 16-bit cache


class KVBenchLayer(CacheLayerMixin):
    """Adapter from transformers' layer protocol to a kvbench :class:`LayerStore`."""

    is_sliding = False
    is_croppable = False

    def __init__(self, store: LayerStore) -> None:
        super().__init__()
        self.store = store
        self.seen_tokens = 0
        self.kv_shape: tuple[int, int, int] | None = None  # batch, kv_heads, head_dim

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        b, h, _, d = key_states.shape
        self.kv_shape = (b, h, d)
        self.is_initialized = True

    def load(self, keys: torch.Tensor, values: torch.Tensor, capture: LayerCapture | None) -> None:
        """Build this layer from a captured full-attention prefill (the engine's shared-prefill path)."""
        self.lazy_initialization(keys, values)
        self.store.capture = capture
        self.store.prefill(keys, values, capture)
        self.seen_tokens = keys.shape[-2]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.seen_tokens == 0:
            # The prefill itself attends exactly; the strategy compresses what is stored for later steps.
            self.store.prefill(key_states, value_states, self.store.capture)
            self.seen_tokens = key_states.shape[-2]
            return key_states, value_states
        self.seen_tokens += key_states.shape[-2]
        return self.store.append(key_states, value_states)

    def get_seq_length(self) -> int:
        return self.seen_tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        held = self.store.num_tokens() if self.seen_tokens else 0
        return held + query_length, self.seen_tokens - held

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.store = self.store.strategy.new_layer(self.store.layer_idx, self.store.num_layers)
        self.seen_tokens = 0
        self.is_initialized = False

    def offload(self) -> None:  # stores manage their own placement (see the tiered strategy)
        return None

    def prefetch(self) -> None:
        return None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise ValueError("kvbench caches hold one sequence per batch row; beam search is not supported")


class KVBenchCache(Cache):
    """A transformers ``Cache`` whose layers are a strategy's stores."""

    def __init__(self, strategy: Strategy, config: Any) -> None:
        n = int(config.num_hidden_layers)
        self.strategy = strategy
        self.config = config
        super().__init__(layers=[KVBenchLayer(strategy.new_layer(i, n)) for i in range(n)])

    # -- building from a shared prefill ---------------------------------------------------------
    @classmethod
    def from_capture(cls, strategy: Strategy, config: Any, keys: list[torch.Tensor], values: list[torch.Tensor],
                     captures: list[LayerCapture] | None = None) -> KVBenchCache:
        cache = cls(strategy, config)
        for i, layer in enumerate(cache.layers):
            layer.load(keys[i], values[i], None if captures is None else captures[i])
        return cache

    # -- use inside a normal forward / generate ------------------------------------------------
    @contextmanager
    def attach(self, model: torch.nn.Module) -> Iterator[QueryRecorder]:
        """Feed each layer store the queries of every forward (needed by attention-aware strategies)."""
        with QueryRecorder(model, self.strategy.query_window) as rec:
            for layer, cap in zip(self.layers, rec.captures, strict=True):
                layer.store.capture = cap
            yield rec

    # -- measurement --------------------------------------------------------------------------
    def kv_bytes(self) -> int:
        """Bytes of every tensor the cache holds, from tensor storage (spec v1 ``kv_bytes``)."""
        return held_bytes(t for layer in self.layers for t in layer.store.tensors())

    def seen_tokens(self) -> int:
        return self.layers[0].seen_tokens if self.layers else 0

    def kv_bytes_fp16(self) -> int:
        """The same tokens as a dense 16-bit cache (spec v1 ``kv_bytes_fp16``)."""
        total = 0
        for layer in self.layers:
            if layer.kv_shape is None:
                continue
            b, h, d = layer.kv_shape
            total += 2 * b * h * d * layer.seen_tokens * REFERENCE_BYTES_PER_ELEMENT
        return total

    def held_tokens(self) -> list[int]:
        return [layer.store.num_tokens() for layer in self.layers]

    def stats(self) -> dict[str, float]:
        """Strategy-specific figures averaged over layers."""
        acc: dict[str, float] = {}
        for layer in self.layers:
            for k, v in layer.store.stats().items():
                acc[k] = acc.get(k, 0.0) + float(v)
        return {k: v / len(self.layers) for k, v in acc.items()}
