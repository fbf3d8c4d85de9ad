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
        if self.rk is not None and self.rv is not None and self.rk.shape[-2] > 0:
            self.rk, self.rv = torch.cat([self.rk, keys], dim=-2), torch.cat([self.rv, values], dim=-2)
            self._flush()
            return
        self.rk, self.rv = keys, values
        if not self._flush():
            # The caller's tensor may be a view of a larger (possibly shared prefill) buffer, which
            # holding would keep alive and count; the few residual tokens get storage of their own.
            self.rk = keys.clone(memory_format=torch.contiguous_format)
            self.rv = values.clone(memory_format=torch.contiguous_format)

    def _flush(self) -> bool:
        """Quantize the oldest multiple of ``multiple`` tokens beyond the ``residual`` most recent ones."""
        assert self.rk is not None and self.rv is not None
        t = self.rk.shape[-2]
        n = (t - self.residual) // self.multiple * self.multiple if t > self.residual else 0
        if n <= 0:
            return False
        qk, qv = self.encode_keys(self.rk[..., :n, :]), self.encode_values(self.rv[..., :n, :])
        self.qk = qk if self.qk is None else self.qk.cat(qk)
        self.qv = qv if self.qv is None else self.qv.cat(qv)
        # Copies, not slices: a slice would keep the whole pre-flush buffer alive.
        self.rk = self.rk[..., n:, :].clone(memory_format=torch.contiguous_format)
        self.rv = self.rv[..., n:, :].clone(memory_format=torch.contiguous_format)
        return True

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
        """Keep held tokens ``index`` (``[batch, kv_heads, n]``, ascending per head), exactly.

        Every chunk drops tokens without re-encoding (token-wise formats gather codes and scales;
        channel-axis groups become ragged through the chunk's ``group_index``). Heads may keep
        different numbers of quantized tokens, but tensors must stay dense, so each head keeps its
        first ``m`` kept quantized tokens in the chunk (``m`` the smallest count over heads) and the
        rest of its kept tokens — its extra quantized ones, as their dequantized values, and its kept
        residual ones — form the new residual, in order. Only if that residual has grown past the
        window are its oldest tokens quantized again, as on any append.
        """
        if self.rk is None or self.rv is None:
            raise KVBenchError("select_tokens before prefill")
        index = index.to(device=self.rk.device, dtype=torch.long)
        quantized = 0 if self.qk is None else self.qk.num_tokens
        m = int((index < quantized).sum(-1).min()) if index.numel() else 0
        spill = index[..., m:]
        if bool((spill < quantized).any()):
            k, v = self.materialize()  # spilled quantized tokens keep exactly the values attention saw
            rk, rv = gather_tokens(k, spill, -2), gather_tokens(v, spill, -2)
        else:
            rk = gather_tokens(self.rk, spill - quantized, -2)
            rv = gather_tokens(self.rv, spill - quantized, -2)
        if self.qk is not None and self.qv is not None:
            keep = index[..., :m]
            self.qk, self.qv = (self.qk.take(keep), self.qv.take(keep)) if m else (None, None)
        self.rk, self.rv = rk, rv
        self._flush()

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
