"""`KVBenchCache`: any kvbench strategy behind transformers' Cache API (5.x list-of-layers design).

Usable outside the harness::

    cache = KVBenchCache(strategies.build("int8"), model.config)
    with cache.attach(model):          # only needed by attention-aware strategies
        model.generate(input_ids, cache=cache, max_new_tokens=32)

Positions stay logical after eviction: ``get_seq_length`` reports every token processed (so RoPE
positions of new tokens are right), while ``get_mask_sizes`` reports the tokens physically held and
offsets them so the causal mask still lines up the new tokens with themselves.

Sliding-window layers (Gemma-2/3, Mistral with ``sliding_window``, Qwen2/3 ``layer_types``) are left to the
model, as kvpress leaves Gemma-3's (measurement spec, "Sliding-window layers"): they hold the dense last
``window - 1`` tokens, as transformers' ``DynamicSlidingWindowLayer`` does, whatever the strategy, and their
dense 16-bit reference is that window, not every token seen. Chunked layers (Llama-4) are held the same way.
A hybrid's linear-attention / state-space layers (Qwen3-Next, Jamba) keep transformers' own
``LinearAttentionLayer``: no strategy applies to their fixed-size state, which is counted apart from the KV
bytes (:meth:`KVBenchCache.state_bytes`, reported as ``stats["recurrent_state_bytes"]``).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DummyLayer, LinearAttentionLayer

from kvbench.arch import LayerKind, describe, layer_kinds, own_cache_class
from kvbench.attention import NAME as ATTENTION
from kvbench.attention import PendingKV, PendingRows, PendingStep
from kvbench.capture import QueryRecorder
from kvbench.errors import KVBenchError
from kvbench.strategies.base import LayerCapture, LayerStore, Strategy, held_bytes
from kvbench.strategies.full import FullStore

REFERENCE_BYTES_PER_ELEMENT = 2  # measurement spec §1: memory reduction is against a dense 16-bit cache


class WindowStore(FullStore):
    """A sliding-window layer's cache: dense K/V of the last ``window - 1`` tokens (what a query sees besides
    itself), in their own storage so the bytes counted are the window's."""

    def __init__(self, strategy: Strategy, layer_idx: int, num_layers: int, window: int) -> None:
        super().__init__(strategy, layer_idx, num_layers)
        self.keep = max(window - 1, 0)

    def _trim(self) -> None:
        if self.keys is not None and self.values is not None and self.keys.shape[-2] > self.keep:
            self.keys = self.keys[..., self.keys.shape[-2] - self.keep:, :].clone()
            self.values = self.values[..., self.values.shape[-2] - self.keep:, :].clone()

    def prefill(self, keys: torch.Tensor, values: torch.Tensor, capture: LayerCapture | None) -> None:
        super().prefill(keys, values, capture)
        self._trim()

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = super().append(keys, values)
        self._trim()
        return k, v  # this step attends to the held window plus the new tokens; the mask applies the window


class KVBenchLayer(CacheLayerMixin):
    """Adapter from transformers' layer protocol to a kvbench :class:`LayerStore`.

    ``kind`` is the layer's attention type; a sliding layer with ``windowed`` holds a :class:`WindowStore`
    instead of the strategy's store (``windowed=False`` keeps every token: the shared capture, or a window at
    least as long as the sequence, ``tokens``, which then bounds nothing). ``shared``: another layer attends over
    this layer's K/V (Gemma-3n's and Gemma-4's ``kv_sharing_modes`` ``store``), so each step returns the K/V the
    store holds, read by both layers, instead of letting the store attend once.
    """

    is_croppable = False

    def __init__(self, store: LayerStore, kind: LayerKind | None = None, windowed: bool = True,
                 config: Any = None, shared: bool = False, tokens: int | None = None) -> None:
        super().__init__()
        self.config = config  # the model's: its attention implementation decides how a step reads the store
        self.kind = kind or LayerKind()
        self.is_sliding = self.kind.sliding  # transformers sizes the sliding mask from the first such layer
        self.windowed = windowed and self.kind.bounds(tokens)
        # A window ruled out by ``tokens`` holds every token; past its length it would bound after all.
        self.limit = self.kind.window - 1 if windowed and self.kind.sliding and not self.windowed else None
        self.shared = shared
        self.strategy = store.strategy
        if self.windowed:
            assert self.kind.window is not None
            store = WindowStore(store.strategy, store.layer_idx, store.num_layers, self.kind.window)
        self.store = store
        self.seen_tokens = 0
        self.kv_shape: tuple[int, int, int] | None = None  # batch, kv_heads, head_dim
        self.value_dim = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        b, h, _, d = key_states.shape
        self.kv_shape = (b, h, d)
        self.value_dim = value_states.shape[-1]  # MLA: the shared rotary key (values slot) is narrower
        self.is_initialized = True

    def load(self, keys: torch.Tensor, values: torch.Tensor, capture: LayerCapture | None) -> None:
        """Build this layer from a captured full-attention prefill (the engine's shared-prefill path)."""
        self.lazy_initialization(keys, values)
        self.store.capture = capture
        self.store.prefill(keys, values, capture)
        self.seen_tokens = keys.shape[-2]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.step(key_states, value_states)
        return PendingKV.wrap(out) if isinstance(out, PendingStep) else out

    def step(self, key_states: torch.Tensor, value_states: torch.Tensor) -> PendingStep | tuple[torch.Tensor,
                                                                                                  torch.Tensor]:
        """:meth:`update`'s work: the K/V attention reads, or the step deferred to kvbench's attention
        (``RowsLayer`` gathers its rows' steps without wrapping each)."""
        key_states, value_states = _own(key_states), _own(value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.seen_tokens == 0:
            # The prefill itself attends exactly; the strategy compresses what is stored for later steps.
            self.store.prefill(key_states, value_states, self.store.capture)
            self.seen_tokens = key_states.shape[-2]
            return key_states, value_states
        self.seen_tokens += key_states.shape[-2]
        if self.limit is not None and self.seen_tokens > self.limit:
            raise KVBenchError(f"layer {self.store.layer_idx}: {self.seen_tokens} tokens outgrew the "
                               f"{self.kind.window}-token window this cache was built to hold whole "
                               "(KVBenchCache tokens=...)")
        if getattr(self.config, "_attn_implementation", None) == ATTENTION and not self.shared:
            # Deferred to kvbench's attention, which lets the store attend over its own storage
            # (``LayerStore.attend``); anything else touching these K/V gets what ``append`` returns.
            return PendingStep(self.store, key_states, value_states)
        return self.store.append(key_states, value_states)

    def get_seq_length(self) -> int:
        return self.seen_tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        held = self.store.num_tokens() if self.seen_tokens else 0
        return held + query_length, self.seen_tokens - held

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        n, i = self.store.num_layers, self.store.layer_idx
        self.store = WindowStore(self.strategy, i, n, self.kind.window or 0) if self.windowed \
            else self.strategy.new_layer(i, n)
        self.seen_tokens = 0
        self.is_initialized = False

    def offload(self) -> None:  # stores manage their own placement (see the tiered strategy)
        return None

    def prefetch(self) -> None:
        return None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise ValueError("kvbench caches hold one sequence per batch row; beam search is not supported")


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t`` in storage of its own. A view into a larger buffer (Phi-3's values are a slice of its fused qkv
    projection) would keep the whole buffer alive in the cache, and be counted whole by ``kv_bytes``."""
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()


class KVBenchCache(Cache):
    """A transformers ``Cache`` whose layers are a strategy's stores.

    A model that accepts only its own cache class (MiniMax's ``MiniMaxCache``, whose lightning-attention state
    goes through ``get_linear_cache`` / ``set_linear_cache``) gets an instance of a subclass that is also that
    class (:func:`kvbench.arch.own_cache_class`); the state is kept in the layer's ``LinearAttentionLayer``, like
    any hybrid's.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> KVBenchCache:
        config = args[1] if len(args) > 1 else kwargs.get("config")  # absent when copy.deepcopy rebuilds one
        own = None if config is None else own_cache_class(config)
        if own is None or issubclass(cls, own):
            return super().__new__(cls)
        return super().__new__(_with_own_cache(cls, own))

    def __init__(self, strategy: Strategy, config: Any, windows: bool = True, tokens: int | None = None) -> None:
        """``windows=False``: sliding-window layers keep every token too (the engine's shared capture, from
        which each strategy's cache, windowed, is built). ``tokens``: the most tokens the cache will see
        (context, question and answer), when known: a window at least that long bounds nothing, so its layer
        is the strategy's like a global one (Mistral's 4,096-token window over a 512-token context)."""
        kinds = layer_kinds(config)
        n = len(kinds)
        self.strategy = strategy
        self.config = config
        self.tokens = tokens
        sharing = list(getattr(config, "kv_sharing_modes", None) or [None] * n)
        Cache.__init__(self, layers=[  # not super(): a model's own cache class (MiniMax) may follow in the MRO
            LinearAttentionLayer() if kinds[i].recurrent  # a hybrid's state: the model's own
            else KVBenchLayer(strategy.new_layer(i, n), kinds[i], windows, config, sharing[i] == "store", tokens)
            if kinds[i].kv else DummyLayer()  # no cache: an MLP layer, or one reading another layer's K/V
            for i in range(n)])

    @property
    def kv_layers(self) -> list[KVBenchLayer]:
        """The attention layers, whose K/V the strategy holds (all layers but a hybrid's recurrent ones)."""
        return [layer for layer in self.layers if isinstance(layer, KVBenchLayer)]

    # -- building from a shared prefill ---------------------------------------------------------
    @classmethod
    def from_capture(cls, strategy: Strategy, config: Any, keys: list[torch.Tensor], values: list[torch.Tensor],
                     captures: list[LayerCapture] | None = None, states: dict[int, Any] | None = None,
                     tokens: int | None = None) -> KVBenchCache:
        """``keys``/``values``: per layer (``None`` at a hybrid's recurrent layers, whose captured
        ``LinearAttentionLayer`` in ``states`` is copied: decoding updates it in place); ``captures``: per
        attention layer, in order; ``tokens`` as in the constructor."""
        cache = cls(strategy, config, tokens=tokens)
        caps = iter(captures) if captures is not None else None
        for i, layer in enumerate(cache.layers):
            if isinstance(layer, KVBenchLayer):
                layer.load(keys[i], values[i], None if caps is None else next(caps))
            else:
                cache.layers[i] = copy.deepcopy((states or {})[i])
        return cache

    # -- use inside a normal forward / generate ------------------------------------------------
    @contextmanager
    def attach(self, model: torch.nn.Module) -> Iterator[QueryRecorder]:
        """Feed each layer store the queries of every forward (needed by attention-aware strategies), once
        ``model`` passed the CLI's model check (:func:`kvbench.arch.describe`)."""
        describe(model, [self.strategy])
        with QueryRecorder(model, self.strategy.query_window) as rec:
            for layer, cap in zip(self.kv_layers, rec.captures, strict=True):
                layer.store.capture = cap
            yield rec

    # -- measurement --------------------------------------------------------------------------
    def kv_bytes(self) -> int:
        """Bytes of every tensor the cache holds, from tensor storage (measurement spec §1 ``kv_bytes``)."""
        return held_bytes(t for layer in self.kv_layers for t in layer.store.tensors())

    def state_bytes(self) -> int:
        """Bytes of a hybrid's recurrent state (its linear-attention / state-space layers' conv and recurrent
        tensors): memory the model really holds beside the KV cache, the same whatever the strategy."""
        return held_bytes(t for layer in self.layers if isinstance(layer, LinearAttentionLayer)
                          for states in (layer.conv_states, layer.recurrent_states)
                          for t in states.values() if t is not None)

    def seen_tokens(self) -> int:
        kv = self.kv_layers
        return kv[0].seen_tokens if kv else 0

    def kv_bytes_fp16(self) -> int:
        """The same tokens as a dense 16-bit cache (measurement spec §1 ``kv_bytes_fp16``): every token seen by a
        global layer, at most ``window - 1`` by a sliding-window layer (what a dense sliding cache holds)."""
        return self._dense_bytes(lambda layer: REFERENCE_BYTES_PER_ELEMENT)

    def kv_bytes_dense(self) -> int:
        """The same tokens as the dense cache the model itself keeps, in its own K/V dtype (spec §1
        ``kv_bytes_dense``, the reference of ``memory_reduction``): on a 16-bit model it equals
        :meth:`kv_bytes_fp16`; on a float32 model it is twice that, so ``full`` saves 0%, not −100%."""
        return self._dense_bytes(lambda layer: torch.empty((), dtype=layer.dtype).element_size())

    def _dense_bytes(self, element_size: Any) -> int:
        total = 0
        for layer in self.kv_layers:
            if layer.kv_shape is None:
                continue
            b, h, d = layer.kv_shape
            tokens = layer.seen_tokens
            if layer.kind.sliding and layer.kind.window is not None:
                tokens = min(tokens, max(layer.kind.window - 1, 0))
            total += b * h * (d + layer.value_dim) * tokens * element_size(layer)
        return total

    def held_tokens(self) -> list[int]:
        return [layer.store.num_tokens() for layer in self.kv_layers]

    def scratch_bytes(self) -> int:
        """Bytes of the stores' working copies (e.g. a dequantized prefix kept so decoding need not
        re-dequantize it every step): real memory, but not part of ``kv_bytes``, the compressed cache."""
        return held_bytes(t for layer in self.kv_layers
                          for t in getattr(layer.store, "scratch_tensors", lambda: ())())

    def stats(self) -> dict[str, float]:
        """Strategy-specific figures averaged over the layers the strategy holds (not the sliding windows),
        plus ``window_layers``, the number of sliding-window layers left to the model, when there are any."""
        acc: dict[str, float] = {}
        kv = self.kv_layers
        own = [layer for layer in kv if not layer.windowed]
        for layer in own:
            for k, v in layer.store.stats().items():
                acc[k] = acc.get(k, 0.0) + float(v)
        out = {k: v / len(own) for k, v in acc.items()}
        if len(own) < len(kv):
            out["window_layers"] = float(len(kv) - len(own))
        if any(isinstance(layer, LinearAttentionLayer) for layer in self.layers):  # a hybrid's state, beside kv_bytes
            out["recurrent_state_bytes"] = float(self.state_bytes())
        return out


_WITH_OWN: dict[tuple[type, type], type] = {}


def _with_own_cache(cls: type, own: type) -> type:
    """``cls`` that is also ``own`` (MiniMax's cache class): its linear-attention state in kvbench's layers."""
    if (cls, own) not in _WITH_OWN:
        def set_linear_cache(self: KVBenchCache, layer_idx: int, state: torch.Tensor) -> None:
            self.layers[layer_idx].recurrent_states[0] = state

        def get_linear_cache(self: KVBenchCache, layer_idx: int) -> torch.Tensor | None:
            return self.layers[layer_idx].recurrent_states[0]

        _WITH_OWN[cls, own] = type(f"{cls.__name__}As{own.__name__}", (cls, own), {
            "__module__": __name__, "set_linear_cache": set_linear_cache, "get_linear_cache": get_linear_cache,
            "__len__": Cache.__len__})
    return _WITH_OWN[cls, own]


# -- several samples in one forward ----------------------------------------------------------------------
class RowsLayer(CacheLayerMixin):
    """One layer of a :class:`RowsCache`: each batch row is appended to its own sample's store, and the rows'
    K/V are returned left-padded to a common width for one batched attention call."""

    is_sliding = False
    is_croppable = False

    def __init__(self, rows: list[KVBenchLayer], owner: RowsCache) -> None:
        super().__init__()
        self.rows = rows
        self.owner = owner
        self.capture: LayerCapture | None = None  # the batched query capture, set by ``RowsCache.attach``
        self.is_initialized = True

    def held(self) -> list[int]:
        """Tokens held, before this step's append, by each active row."""
        return [self.rows[r].store.num_tokens() if self.rows[r].seen_tokens else 0 for r in self.owner.active]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None  # each row's layer initializes itself

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        width = key_states.shape[-2]
        steps: list[PendingStep | tuple[torch.Tensor, torch.Tensor]] = []
        # The rows as views in one call each (a decode step indexes R rows per layer otherwise).
        krows, vrows = key_states.split(1), value_states.split(1)
        for i, (r, n) in enumerate(zip(self.owner.active, self.owner.lengths, strict=True)):
            layer = self.rows[r]
            if self.capture is not None and self.capture.queries is not None:
                layer.store.capture = _row_capture(self.capture, i, n)
            k, v = krows[i], vrows[i]
            if n != width:  # left padding: the row's own tokens are its last n
                k, v = k.narrow(2, width - n, n), v.narrow(2, width - n, n)
            # Cloned: a store that keeps the new tokens must not keep (and count) the whole batch's buffer.
            steps.append(layer.step(k.clone(), v.clone()))
        if all(isinstance(s, PendingStep) for s in steps):  # every row's store attends over its own storage
            return PendingKV.wrap(PendingRows(steps, key_states, value_states, _left_pad))  # type: ignore[arg-type]
        kv = [s.resolve() if isinstance(s, PendingStep) else s for s in steps]
        return _left_pad([k for k, _ in kv]), _left_pad([v for _, v in kv])

    def get_seq_length(self) -> int:
        return max(self.rows[r].seen_tokens for r in self.owner.active)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return max(self.held()) + query_length, 0  # the real mask comes from ``RowsCache.mask``

    def get_max_length(self) -> int:
        return -1

    def offload(self) -> None:
        return None

    def prefetch(self) -> None:
        return None


class RowsCache(Cache):
    """Several samples' :class:`KVBenchCache` s (same strategy) behind one batched forward.

    Every row keeps its own batch-1 stores, so budgets, quantization groups, eviction scores and byte
    accounting are exactly those of the sample evaluated alone; only the model's matmuls are batched.
    Rows may take different numbers of new tokens per forward: the input is left-padded, padding tokens
    never reach a store, and :meth:`masks` gives each layer a per-row mask over that row's held + new tokens.
    ``active`` (row indices) and ``lengths`` (real new tokens per active row) describe the next forward.
    """

    def __init__(self, caches: list[KVBenchCache]) -> None:
        if len(caches) > 1 and len(caches[0].kv_layers) < len(caches[0].layers):
            raise KVBenchError("engine.batch_size > 1 is not supported for models with layers holding no K/V of "
                               "their own (hybrids' recurrent layers, MLP-only or shared-KV layers); use "
                               "engine.batch_size=1")
        if len(caches) > 1 and any(layer.kind.sliding for layer in caches[0].layers):
            raise KVBenchError("engine.batch_size > 1 is not supported for models with sliding-window layers "
                               "(the per-row masks do not apply the window yet); use engine.batch_size=1")
        self.caches = caches
        self.strategy = caches[0].strategy
        self.active: list[int] = list(range(len(caches)))
        self.lengths: list[int] = [0] * len(caches)
        n = len(caches[0].layers)
        super().__init__(layers=[RowsLayer([c.layers[i] for c in caches], self) for i in range(n)])
        # The last mask built and what it was built from: the layers of one forward whose rows hold the same
        # tokens (every layer of a store that evicts nothing) share it instead of building it once per layer.
        self._mask: tuple[tuple, torch.Tensor | None] | None = None

    def seen(self, row: int) -> int:
        return self.caches[row].seen_tokens()

    def mask(self, layer_idx: int, query_length: int, device: torch.device) -> torch.Tensor | None:
        """Boolean attention mask ``[rows, 1, query_length, width]`` for the rows' left-padded K/V."""
        held = self.layers[layer_idx].held()
        total = [h + n for h, n in zip(held, self.lengths, strict=True)]
        width = max(total)
        if query_length == 1 and min(total) == width:
            return None  # one new token per row, no padding: every column is visible
        key = (tuple(held), tuple(self.lengths), query_length, device)
        if self._mask is not None and self._mask[0] == key:
            return self._mask[1]
        q = torch.arange(query_length, device=device)[:, None]
        cols = torch.arange(width, device=device)[None, :]
        rows = []
        for h, n in zip(held, self.lengths, strict=True):
            first = width - h - n  # the row's first real column
            # held columns: visible to every query; new columns: causal, right-aligned with the queries
            m = (cols >= first) & (cols <= width - query_length + q)
            m[: query_length - n, width - 1] = True  # padding queries see one column: no all-masked softmax
            rows.append(m)
        mask = torch.stack(rows)[:, None]
        self._mask = (key, mask)
        return mask

    @contextmanager
    def masks(self, model: torch.nn.Module) -> Iterator[None]:
        """Replace the model-built attention mask by :meth:`mask` in every attention layer of ``model``."""
        from kvbench.capture import attention_modules

        def hook(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict] | None:
            if kwargs.get("cache", kwargs.get("past_key_values")) is not self:
                return None  # another forward inside this one (quant_recompute rebuilding K/V from token ids)
            hidden = args[0] if args else kwargs["hidden_states"]
            kwargs["attention_mask"] = self.mask(module.layer_idx, hidden.shape[1], hidden.device)
            return args, kwargs

        handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in attention_modules(model)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    @contextmanager
    def attach(self, model: torch.nn.Module) -> Iterator[QueryRecorder]:
        """Record the batch's queries; each row's store reads its own row of them (see ``RowsLayer.update``)."""
        with QueryRecorder(model, self.strategy.query_window) as rec:
            for layer, cap in zip(self.layers, rec.captures, strict=True):
                layer.capture = cap
            try:
                yield rec
            finally:
                for layer in self.layers:
                    layer.capture = None


def _row_capture(cap: LayerCapture, i: int, n: int) -> LayerCapture:
    """Row ``i`` of a batched capture, without the left padding: its last ``min(window, n)`` queries."""
    assert cap.queries is not None
    m = min(cap.queries.shape[-2], n)
    pos = cap.positions
    if pos is not None:
        pos = (pos[i:i + 1] if pos.shape[0] > 1 else pos)[..., pos.shape[-1] - m:]
    return LayerCapture(cap.layer_idx, cap.num_kv_groups, cap.scaling,
                        queries=cap.queries[i:i + 1, :, cap.queries.shape[-2] - m:], positions=pos, sinks=cap.sinks)


def _left_pad(rows: list[torch.Tensor]) -> torch.Tensor:
    """``[1, H, n_i, D]`` tensors as one ``[rows, H, max n, D]`` tensor, each right-aligned (zeros before)."""
    width = max(t.shape[-2] for t in rows)
    if all(t.shape[-2] == width for t in rows):
        return torch.cat(rows, dim=0)
    out = rows[0].new_zeros(len(rows), rows[0].shape[1], width, rows[0].shape[-1])
    for i, t in enumerate(rows):
        out[i, :, width - t.shape[-2]:] = t[0]
    return out
