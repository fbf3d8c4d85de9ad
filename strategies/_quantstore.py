"""Shared machinery of the grouped quantization stores (``int8``, ``int4``, ``int2``, ``bfp``).

A :class:`QuantizedStore` holds one quantized chunk per tensor (K and V, each a
:class:`kvbench.quantizers.TokenChunk` kept as a single contiguous chunk) followed by a full-precision
residual — the layout of KIVI (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for
KV Cache"). Tokens enter the residual; whenever it holds at least ``residual + multiple`` tokens the
oldest multiple of ``multiple`` tokens beyond the ``residual`` most recent ones are quantized and
appended to the chunk. So the ``residual`` most recent tokens always stay exact and the residual holds
between ``residual`` and ``residual + multiple - 1`` tokens once the cache is long enough.

``multiple`` is the token granularity of the encoding: 1 when every token is encoded on its own
(groups along channels), the group size when groups run along the token axis. With ``multiple == 1``
and ``residual == 0`` everything is quantized the moment it arrives.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbench.errors import KVBenchError
from kvbench.quantizers import TokenChunk, gather_tokens, quantize_asymmetric
from strategies.base import LayerCapture, LayerStore, Strategy, held_bytes, require

GROUP_SIZES = (8, 16, 32, 64, 128, 256)


def channel_group(group_size: int, head_dim: int, what: str) -> int:
    """Group size along channels: a group never spans heads, so one wider than the head is clipped to it."""
    g = min(group_size, head_dim)
    if head_dim % g:
        raise KVBenchError(f"{what}={group_size} must divide head_dim={head_dim}")
    return g


class QuantizedStore(LayerStore):
    """Quantized K/V chunks plus a full-precision residual of the most recent tokens."""

    def __init__(self, strategy: Strategy, layer_idx: int, num_layers: int, residual: int,
                 multiple: int) -> None:
        super().__init__(strategy, layer_idx, num_layers)
        self.residual = residual
        self.multiple = multiple
        self.qk: TokenChunk | None = None
        self.qv: TokenChunk | None = None
        self.rk: torch.Tensor | None = None
        self.rv: torch.Tensor | None = None
        self.dtype: torch.dtype | None = None

    @abstractmethod
    def encode_keys(self, x: torch.Tensor) -> TokenChunk:
        """Quantize ``x`` (a multiple of ``self.multiple`` tokens) in the strategy's key format."""

    @abstractmethod
    def encode_values(self, x: torch.Tensor) -> TokenChunk:
        """Quantize ``x`` (a multiple of ``self.multiple`` tokens) in the strategy's value format."""

    # -- ingestion ------------------------------------------------------------------------------------
    def _ingest(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.dtype = keys.dtype
        grown = self.rk is not None and self.rk.shape[-2] > 0
        rk = torch.cat([self.rk, keys], dim=-2) if grown else keys
        rv = torch.cat([self.rv, values], dim=-2) if grown else values
        t = rk.shape[-2]
        n = (t - self.residual) // self.multiple * self.multiple if t > self.residual else 0
        if n > 0:
            qk, qv = self.encode_keys(rk[..., :n, :]), self.encode_values(rv[..., :n, :])
            self.qk = qk if self.qk is None else self.qk.cat(qk)
            self.qv = qv if self.qv is None else self.qv.cat(qv)
        # A slice, or the caller's own tensor, would keep a larger (possibly shared prefill) buffer
        # alive and counted; copy the few residual tokens into storage of their own.
        self.rk = rk[..., n:, :].clone() if n > 0 or not grown else rk
        self.rv = rv[..., n:, :].clone() if n > 0 or not grown else rv

    def prefill(self, keys: torch.Tensor, values: torch.Tensor, capture: LayerCapture | None) -> None:
        self._ingest(keys, values)

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._ingest(keys, values)
        return self.materialize()

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All held tokens in the model dtype: one dequantization per tensor, one concatenation."""
        assert self.dtype is not None and self.rk is not None and self.rv is not None
        if self.qk is None or self.qv is None:
            return self.rk, self.rv
        k, v = self.qk.dequantize(self.dtype), self.qv.dequantize(self.dtype)
        if self.rk.shape[-2] == 0:
            return k, v
        return torch.cat([k, self.rk], dim=-2), torch.cat([v, self.rv], dim=-2)

    # -- eviction support ---------------------------------------------------------------------------
    def select_tokens(self, index: torch.Tensor) -> None:
        """Keep held tokens ``index`` ``[batch, kv_heads, n]``.

        Token-wise chunks with an empty residual drop tokens exactly (codes and scales are gathered).
        Otherwise groups span tokens (or kept tokens move between chunk and residual), so the kept
        tokens are dequantized and re-ingested: token groups are rebuilt from the survivors and the
        tokens that were already quantized take a second rounding.
        """
        if self.rk is None:
            raise KVBenchError("select_tokens before prefill")
        exact = (self.qk is not None and self.qv is not None and self.rk.shape[-2] == 0
                 and self.qk.tokenwise and self.qv.tokenwise)
        if exact:
            assert self.qk is not None and self.qv is not None
            self.qk, self.qv = self.qk.take(index), self.qv.take(index)
            return
        k, v = self.materialize()
        k, v = gather_tokens(k, index, -2), gather_tokens(v, index, -2)
        self.qk = self.qv = self.rk = self.rv = None
        self._ingest(k, v)

    # -- accounting ---------------------------------------------------------------------------------
    def tensors(self) -> Iterable[torch.Tensor]:
        chunks = [t for q in (self.qk, self.qv) if q is not None for t in q.tensors()]
        return chunks + [t for t in (self.rk, self.rv) if t is not None]

    def num_tokens(self) -> int:
        residual = 0 if self.rk is None else self.rk.shape[-2]
        return residual + (0 if self.qk is None else self.qk.num_tokens)

    def stats(self) -> dict[str, float]:
        """Measured bits per held K/V element (payload and metadata) and the quantized share of tokens."""
        if self.rk is None or self.num_tokens() == 0:
            return {}
        b, h, _, d = self.rk.shape
        elements = 2 * b * h * d * self.num_tokens()
        quantized = 0 if self.qk is None else self.qk.num_tokens
        return {"bits_per_element": 8 * held_bytes(self.tensors()) / elements,
                "quantized_fraction": quantized / self.num_tokens()}


class KiviStore(QuantizedStore):
    """KIVI: keys per channel (groups of G tokens), values per token (groups of G channels), b bits."""

    strategy: KiviStrategy

    def __init__(self, strategy: KiviStrategy, layer_idx: int, num_layers: int) -> None:
        super().__init__(strategy, layer_idx, num_layers, residual=strategy.residual_length,
                         multiple=strategy.group_size)

    def encode_keys(self, x: torch.Tensor) -> TokenChunk:
        return quantize_asymmetric(x, self.strategy.bits, self.strategy.group_size, "channel")

    def encode_values(self, x: torch.Tensor) -> TokenChunk:
        g = channel_group(self.strategy.group_size, x.shape[-1], f"{self.strategy.name}.group_size")
        return quantize_asymmetric(x, self.strategy.bits, g, "token")


@dataclass
class KiviStrategy(Strategy):
    """Parameters shared by ``int4`` and ``int2`` (KIVI's defaults: G = 32, R = 128)."""

    family = "quantization"
    bits: ClassVar[int]
    group_size: int = 32
    residual_length: int = 128

    def validate(self) -> None:
        require(self.group_size in GROUP_SIZES,
                f"{self.name}.group_size must be one of {', '.join(map(str, GROUP_SIZES))} "
                f"(got {self.group_size})")
        require(isinstance(self.residual_length, int) and self.residual_length >= 0,
                f"{self.name}.residual_length must be an integer >= 0 (got {self.residual_length})")

    def new_layer(self, layer_idx: int, num_layers: int) -> LayerStore:
        return KiviStore(self, layer_idx, num_layers)
