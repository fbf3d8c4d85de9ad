"""The strategy interface: a `Strategy` (validated parameters) makes one `LayerStore` per model layer.

A layer store is what actually holds a layer's keys and values — compressed, evicted, tiered or
exact. It has four duties, modelled on transformers' cache-layer interface but with the storage
format left entirely to the strategy:

* ``prefill(keys, values, capture)`` — take the full-precision K/V of the compressed prefix (and,
  for attention-aware strategies, the captured queries) and store them in the strategy's format;
* ``append(keys, values)`` — store newly processed tokens and return the K/V that this step's
  attention must see: exactly ``num_tokens()`` (before the call) plus the new tokens, in order;
* ``tensors()`` — every tensor the store holds, for byte accounting from real storage;
* ``num_tokens()`` — tokens physically held;
* ``scratch_tensors()`` (optional) — harness scratch that is not part of the cache format, e.g. a
  dequantized working copy kept so emulated quantization does not re-decode an immutable prefix every
  step. Reported apart from ``tensors()``, which alone defines ``kv_bytes``.

Stores must never modify the tensors handed to ``prefill``: one captured prefill is shared by every
strategy in a run.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

import kvbench.blockattn as blockattn
from kvbench.capture import LayerCapture
from kvbench.errors import KVBenchError

FAMILIES = ("baseline", "quantization", "eviction", "tiered", "recompute", "composite", "reference")


class LayerStore(ABC):
    """One layer's cache in a strategy's own storage format."""

    def __init__(self, strategy: Strategy, layer_idx: int, num_layers: int) -> None:
        self.strategy = strategy
        self.layer_idx = layer_idx
        self.num_layers = num_layers
        self.capture: LayerCapture | None = None

    @abstractmethod
    def prefill(self, keys: torch.Tensor, values: torch.Tensor, capture: LayerCapture | None) -> None:
        """Store the compressed prefix. ``keys``/``values``: ``[batch, kv_heads, tokens, head_dim]``."""

    @abstractmethod
    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new tokens; return the K/V the current attention step reads (held + new, in order)."""

    @abstractmethod
    def tensors(self) -> Iterable[torch.Tensor]:
        """Every tensor held (payload, scales, zero points, indices, full-precision windows)."""

    @abstractmethod
    def num_tokens(self) -> int:
        """Tokens physically held."""

    def attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
               scaling: float, softcap: float | None = None) -> torch.Tensor:
        """Store this step's new ``keys``/``values`` and return the attention of ``query`` over the held tokens
        plus the new ones: ``query`` ``[b, q_heads, q, d]`` -> ``[b, q_heads, q, d]``; ``mask`` (boolean or
        additive, ``[b, 1 or q_heads, q, held + new]``, or None), ``scaling`` and ``softcap`` as in eager attention.

        The one way attention reads a store (``attn_implementation="kvbench"``, short queries; a batch of
        sequences' stores read together is :meth:`attend_rows`, the same step for several rows). The default
        attends block by block (:func:`kvbench.blockattn.attend`) over what :meth:`append` returns; a store that
        keeps its tokens compressed overrides it to read its own storage block by block (its parts as
        ``blockattn.TokenRun`` s, and the same function), so a step never holds a dense copy of the cache."""
        k, v = self.append(keys, values)
        heads = k.shape[1]
        return blockattn.attend(query, blockattn.TokenRun([blockattn.Dense(k)], heads),
                                blockattn.TokenRun([blockattn.Dense(v)], heads), mask, scaling, softcap)

    @classmethod
    def attend_rows(cls, stores: Sequence[LayerStore], query: torch.Tensor, keys: Sequence[torch.Tensor],
                    values: Sequence[torch.Tensor], scaling: float, softcap: float | None = None) -> torch.Tensor:
        """:meth:`attend` for several sequences decoding together (a batch of rows, ``kvbench.cache.RowsCache``),
        each row with a store of its own, all of this class: row ``r`` stores ``keys[r]`` / ``values[r]`` (``[1,
        kv_heads, new, d]``) in ``stores[r]`` and attends with ``query[r]`` over all its tokens, unmasked. Returns
        ``[rows, q_heads, q, d]``, each row what :meth:`attend` gives for it alone. The default is just that, row by
        row, but for stores that keep this class's :meth:`attend` (what :meth:`append` returns, read as it is:
        ``full``'s), whose rows are read in one kernel call (``blockattn.attend_rows``) where it applies, as a store
        that reads its own storage does when it overrides this too (``QuantizedStore``)."""
        if cls.attend is LayerStore.attend:
            runs = []
            for s, k, v in zip(stores, keys, values, strict=True):
                kk, vv = s.append(k, v)
                runs.append((blockattn.TokenRun([blockattn.Dense(kk)], kk.shape[1]),
                             blockattn.TokenRun([blockattn.Dense(vv)], vv.shape[1])))
            return blockattn.attend_rows(query, runs, scaling, softcap)
        return torch.cat([s.attend(query[r:r + 1], keys[r], values[r], None, scaling, softcap)
                          for r, s in enumerate(stores)], dim=0)

    def scratch_tensors(self) -> Iterable[torch.Tensor]:
        """Harness scratch held besides the cache itself (never counted in ``kv_bytes``); none by default."""
        return ()

    def stats(self) -> dict[str, float]:
        """Strategy-specific figures for the record (kept fraction, bytes per tier, ...)."""
        return {}

    def compact(self) -> None:
        """Optional: called by chunked prefill after each chunk to bring the store back within its budget
        (eviction strategies re-score with the chunk's queries). Stores that compress on append need nothing."""

    def select_tokens(self, index: torch.Tensor) -> None:
        """Optional: keep only held tokens ``index`` (``[batch, kv_heads, n]``, ascending) and free the rest.

        Stores that can drop single tokens implement it so eviction policies can be stacked on them
        (see ``compose``); stores that cannot (e.g. groups spanning tokens) leave it raising.
        """
        raise KVBenchError(f"{type(self).__name__} cannot drop individual tokens")


@dataclass
class RunContext:
    """What the engine knows about the current run and sample, for strategies that need more than K/V.

    ``hardware`` is a :class:`kvbench.hardware.HardwareProfile`; ``prefix_ids`` are the token ids of
    the compressed prefix (``[batch, tokens]``), e.g. for strategies that recompute K/V instead of
    storing it. ``working_copy``: quantized stores may keep a dequantized working copy of what can no
    longer change (reported by ``LayerStore.scratch_tensors()``); ``False`` measures the true peak of the
    format alone, re-decoding every step.
    """

    model: Any = None
    hardware: Any = None
    prefix_ids: torch.Tensor | None = None
    device: str = "cpu"
    working_copy: bool = True


class Strategy(ABC):
    """A named, parameterised way of holding the KV cache. Subclasses are dataclasses of their parameters."""

    name: ClassVar[str]
    family: ClassVar[str]
    #: Whether a built cache is plain tensors that a deep copy duplicates independently (questions sharing one
    #: compressed context are answered from copies); False makes the engine rebuild the cache per pass.
    cache_copyable: ClassVar[bool] = True
    #: Chooses what to keep from attention scores ("attention-guided management" in the claim check).
    attention_guided: ClassVar[bool] = False
    #: Its stores give keys and values one shape (one buffer layout for both): a multi-head latent attention
    #: cache, whose values slot holds a rotary key narrower than the latent, is refused (kvbench.arch).
    same_kv_width: ClassVar[bool] = False

    @property
    def query_window(self) -> int | None:
        """How many of the last prefill queries per layer this instance reads (0: none, None: all).

        A property of the instance, derived from its parameters (SnapKV's ``window_size``, ``compose``'s
        inner strategies), so two instances of one class never share or overwrite each other's window.
        """
        return 0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise :class:`KVBenchError` for bad parameter values."""

    def __deepcopy__(self, memo: dict[int, Any]) -> Strategy:
        # A strategy is configuration plus the bound run (and through it the model), not cache state: copies
        # of a cache (``kvbench.engine.clone_cache``) share it instead of copying the model with it.
        return self

    def bind(self, context: RunContext) -> None:
        """Called by the engine before each sample's caches are built; stores read ``strategy.context``."""
        self.context = context

    @abstractmethod
    def new_layer(self, layer_idx: int, num_layers: int) -> LayerStore:
        """A fresh, empty store for one layer."""

    def params(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    def label(self) -> str:
        """Name plus parameters, stable across runs (used as the table and leaderboard key)."""
        p = self.params()
        return self.name if not p else f"{self.name}(" + ",".join(f"{k}={v}" for k, v in sorted(p.items())) + ")"


def require(condition: bool, message: str) -> None:
    """Parameter validation helper: one-line :class:`KVBenchError` when ``condition`` is false."""
    if not condition:
        raise KVBenchError(message)


def held_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` — what the process actually holds for them."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        seen[(str(t.device), storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())
