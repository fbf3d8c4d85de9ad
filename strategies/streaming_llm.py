"""``streaming_llm``: attention sinks plus a window of the most recent tokens.

Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks" (ICLR 2024): softmax attention
parks surplus mass on the first few tokens whatever they say, so dropping them breaks a model, while
keeping them plus a rolling window of recent tokens keeps perplexity stable over unbounded streams.

Here the ``sink_tokens`` first tokens and the most recent ``budget - sink_tokens`` are kept — the same
positions on every layer and head, no scores and no queries needed. The budget holds during decoding
too: after every step the oldest non-sink token leaves, as in the paper's rolling cache. With a budget
smaller than the sinks, the sinks shrink so the newest token always stays.

Positions. By default kept keys keep the rotation of their original positions (as kvpress's
``StreamingLLMPress``, which compresses the prefill only). The paper's code (``mit-han-lab/streaming-llm``,
``enable_streaming_llm`` / ``pos_shift``) instead rotates keys by their position *in the cache*, so the
distances a query sees never exceed the cache size. ``rerotate = true`` reproduces that: after every
selection each held key is re-rotated (RoPE, the model's ``inv_freq``) to ``slot + evicted``, where ``slot``
is its index in the cache and ``evicted`` the tokens dropped so far — since the model still rotates a new
query at its true position ``p``, the query-key distance is then ``cache slot of the query - slot``, exactly
the reference's. Needs the model (``bind``), a full-precision inner store (not ``compose``) and RoPE over the
whole head dimension; sinks are re-rotated by one position per evicting step, in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvbench.strategies._eviction import EvictingStore, EvictionPolicy, EvictionStrategy, require_bool, require_int
from kvbench.strategies.base import LayerCapture, LayerStore, Strategy
from kvbench.strategies.full import FullStore

from kvbench.errors import KVBenchError


class _SinksAndWindow(EvictionPolicy):
    strategy: StreamingLLM

    def protected(self, keep: int) -> tuple[int, int]:
        sinks = min(self.strategy.sink_tokens, max(keep - 1, 0))
        return sinks, keep - sinks


def rope_inv_freq(model: object) -> torch.Tensor:
    """The rotary embedding's ``inv_freq`` of a transformers model (or a kvbench model wrapping one)."""
    module = getattr(model, "model", model) if hasattr(model, "tokenizer") else model
    for sub in getattr(module, "modules", lambda: [])():
        if isinstance(getattr(sub, "inv_freq", None), torch.Tensor):
            return sub.inv_freq
    raise KVBenchError("streaming_llm.rerotate needs a model with rotary position embeddings (inv_freq)")


def rotate(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Keys ``[B, H, N, D]`` rotated by ``delta`` ``[B, H, N]`` more positions (RoPE, rotate-half layout)."""
    angles = delta.to(torch.float32)[..., None] * inv_freq.to(keys.device, torch.float32)  # [B, H, N, D/2]
    cos, sin = torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)
    k = keys.float()
    half = k.shape[-1] // 2
    rotated_half = torch.cat([-k[..., half:], k[..., :half]], dim=-1)
    return (k * cos + rotated_half * sin).to(keys.dtype)


class _RerotatingStore(EvictingStore):
    """Sinks + window whose keys are rotated to their cache positions after every selection.

    After each realignment held key ``j`` is rotated to ``j + seen - held``, so that is all the state needed.
    """

    _index: torch.Tensor | None = None

    def _choose(self, scores, shape, keep, device):  # type: ignore[no-untyped-def]
        self._index = super()._choose(scores, shape, keep, device)
        return self._index

    def _inv_freq(self, head_dim: int) -> torch.Tensor:
        context = getattr(self.evict, "context", None)
        if context is None or context.model is None:
            raise KVBenchError("streaming_llm.rerotate needs the model's rotary embedding: call "
                               "strategy.bind(RunContext(model=...)) before building the cache")
        inv_freq = rope_inv_freq(context.model)
        if 2 * inv_freq.numel() != head_dim:
            raise KVBenchError(f"streaming_llm.rerotate supports RoPE over the whole head (head_dim={head_dim}, "
                               f"rotary dim={2 * inv_freq.numel()}); use rerotate=false")
        return inv_freq

    def _realign(self, rotation: torch.Tensor) -> None:
        """Rotate held keys from positions ``rotation`` ``[B, H, held]`` to ``slot + seen - held``."""
        inner = self.inner
        assert isinstance(inner, FullStore) and inner.keys is not None
        held = inner.keys.shape[-2]
        delta = torch.arange(held, device=rotation.device) + (self.seen - held) - rotation
        if bool((delta != 0).any()):
            # A new tensor, never in place: this step's attention may still read the old one.
            inner.keys = rotate(inner.keys, delta, self._inv_freq(inner.keys.shape[-1]))

    def prefill(self, keys: torch.Tensor, values: torch.Tensor, capture: LayerCapture | None) -> None:
        super().prefill(keys, values, capture)
        assert self._index is not None
        self._realign(self._index)  # prefix keys start at their original positions

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, h, n_new, _ = keys.shape
        held, offset = self.num_tokens(), self.seen - self.num_tokens()
        # Held keys sit at slot + offset; the new ones at their true positions, which continue that run.
        before = (torch.arange(held + n_new, device=keys.device) + offset).expand(b, h, held + n_new)
        self._index = None
        out = super().append(keys, values)
        self._realign(before if self._index is None else torch.gather(before, -1, self._index))
        return out

    def compact(self) -> None:
        raise KVBenchError("streaming_llm.rerotate does not support chunked prefill (engine.prefill=chunked); "
                           "use rerotate=false or a single prefill")


@dataclass
class StreamingLLM(EvictionStrategy):
    """Attention sinks + recent window, at prefill and after every decode step.

    Defaults follow the paper and kvpress (4 sinks, original key positions); ``rerotate = true`` moves keys
    to their cache positions as the paper's code does.
    """

    name = "streaming_llm"
    sink_tokens: int = 4
    rerotate: bool = False  # true: keys rotated to their cache positions (mit-han-lab/streaming-llm)

    def validate(self) -> None:
        super().validate()
        require_int(self.sink_tokens, 0, "streaming_llm.sink_tokens")
        require_bool(self.rerotate, "streaming_llm.rerotate")

    def evicts_during_decode(self) -> bool:
        return True

    def policy(self, layer_idx: int, num_layers: int) -> EvictionPolicy:
        return _SinksAndWindow(self, layer_idx, num_layers)

    def wrap(self, inner: LayerStore, layer_idx: int, num_layers: int,
             owner: Strategy | None = None) -> EvictingStore:
        if not self.rerotate:
            return super().wrap(inner, layer_idx, num_layers, owner)
        if not isinstance(inner, FullStore):
            raise KVBenchError("streaming_llm.rerotate rotates full-precision keys; it cannot be composed "
                               "with a quantizer (use rerotate=false)")
        return _RerotatingStore(owner or self, layer_idx, num_layers, inner, self.policy(layer_idx, num_layers))
