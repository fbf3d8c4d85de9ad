"""``channel_sparse``: channel-level sparse encoding of the cache, in two modes.

``mode=prune`` — ThinK (Xu et al. 2024, "ThinK: Thinner Key Cache by Query-Driven Pruning"): key
channels differ widely in how much they contribute to q·k. Channel ``c`` of a KV head is scored by
``||Q[:, c]|| * ||K[:, c]||``, with ``Q`` the post-RoPE queries of the last ``window`` prefill positions
pooled over the GQA query heads sharing that KV head, and only the top ``keep_ratio`` fraction of key
channels is stored (kept channel ids + the kept key columns; values stay dense). At attention the
kept columns are scattered back into zeros, which is exactly pruning those channels from q·k. The same
channels are kept for decoded tokens. Bits per element: ``16 * (keep_ratio + 1) / 2`` (12 at 0.5).

``mode=outlier`` — dense-and-sparse by channel, in the spirit of KVQuant's outlier isolation (Hooper
et al. 2024) and of KIVI's channel-outlier observation (Liu et al. 2024): per KV head, the
``outlier_ratio`` fraction of channels with the largest prefill magnitude is kept in 16 bits, and the
remaining channels of each token are quantized together (one asymmetric group per token, float16
scale and zero point) at ``outlier_bits``. With the outliers out, a per-token group no longer spends
its range on them. Applied to keys and values alike; decoded tokens reuse the prefill's channel split.
Bits per element: ``(k * 16 + (D - k) * b + 32) / D`` — 5.25 at D = 64, k = 4, b = 4.

Both modes encode tokens independently, so tokens can be dropped exactly. ``stats()`` reports
``kept_fraction`` (prune: key channels kept; outlier: channels held in 16 bits).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kvbench.errors import KVBenchError
from kvbench.quantizers import AsymmetricQuant, check_finite, gather_tokens, quantize_asymmetric
from strategies.base import LayerCapture, LayerStore, Strategy, held_bytes, require

MODES = ("prune", "outlier")
OUTLIER_BITS = (4, 8)
INDEX_DTYPE = torch.int16  # channel ids are < head_dim; int16 keeps the (token-independent) index small


def _expand(idx: torch.Tensor, tokens: int) -> torch.Tensor:
    """``[b, h, c]`` channel ids as a gather/scatter index for ``[b, h, tokens, c]``."""
    return idx.long().unsqueeze(-2).expand(*idx.shape[:-1], tokens, idx.shape[-1])


class _OutlierSplit:
    """One tensor (K or V) as 16-bit outlier channels plus per-token low-bit codes of the other channels."""

    def __init__(self, x: torch.Tensor, ratio: float, bits: int) -> None:
        d = x.shape[-1]
        per_byte = 8 // bits
        # At least one byte of codes is left, and the packed codes need whole bytes per token.
        k = min(math.ceil(ratio * d), d - per_byte)
        k += (d - k) % per_byte
        self.k, self.bits = k, bits
        magnitude = x.abs().amax(dim=-2).float()  # [b, h, d]
        # Outliers first (largest magnitude), then the rest: one permutation serves both directions.
        self.perm = torch.argsort(magnitude, dim=-1, descending=True, stable=True).to(INDEX_DTYPE)
        self.dense: torch.Tensor | None = None
        self.rest: AsymmetricQuant | None = None
        self.add(x)

    def add(self, x: torch.Tensor) -> None:
        check_finite(x)
        xp = torch.gather(x, -1, _expand(self.perm, x.shape[-2]))
        # Copies, not views: a view would keep the whole permuted tensor alive.
        dense = xp[..., :self.k].clone(memory_format=torch.contiguous_format)
        rest = quantize_asymmetric(xp[..., self.k:], self.bits, xp.shape[-1] - self.k, "token")
        if self.dense is None or self.rest is None:
            self.dense, self.rest = dense, rest
        else:
            self.dense = torch.cat([self.dense, dense], dim=-2)
            self.rest = self.rest.cat(rest)  # type: ignore[assignment]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        assert self.dense is not None and self.rest is not None
        combined = torch.cat([self.dense.to(dtype), self.rest.dequantize(dtype)], dim=-1)
        return torch.empty_like(combined).scatter_(-1, _expand(self.perm, combined.shape[-2]), combined)

    def take(self, index: torch.Tensor) -> None:
        assert self.dense is not None and self.rest is not None
        self.dense = gather_tokens(self.dense, index, -2)
        self.rest = self.rest.take(index)  # type: ignore[assignment]

    def tensors(self) -> list[torch.Tensor]:
        assert self.dense is not None and self.rest is not None
        return [self.perm, self.dense, *self.rest.tensors()]


class ChannelSparseStore(LayerStore):
    """Prune: kept key columns + dense values. Outlier: a :class:`_OutlierSplit` for K and for V."""

    strategy: ChannelSparse

    def __init__(self, strategy: ChannelSparse, layer_idx: int, num_layers: int) -> None:
        super().__init__(strategy, layer_idx, num_layers)
        self.dtype: torch.dtype | None = None
        self.head_dim = 0
        # prune mode
        self.kept: torch.Tensor | None = None  # [b, h, k] kept key channel ids, ascending
        self.keys: torch.Tensor | None = None  # [b, h, T, k]
        self.values: torch.Tensor | None = None  # [b, h, T, D]
        # outlier mode
        self.ko: _OutlierSplit | None = None
        self.vo: _OutlierSplit | None = None

    def _select_channels(self, keys: torch.Tensor) -> torch.Tensor:
        """ThinK's query-driven channel score, pooled over each KV head's query group."""
        cap = self.capture
        if cap is None or cap.queries is None:
            raise KVBenchError(
                "channel_sparse mode=prune scores key channels with captured queries: build the cache with "
                "KVBenchCache.from_capture(..., captures) or inside cache.attach(model)")
        b, h, _, d = keys.shape
        q = cap.queries.float()
        q = q.reshape(b, h, q.shape[1] // h * q.shape[2], d)  # query heads of one KV head are contiguous
        score = q.norm(dim=-2) * keys.float().norm(dim=-2)  # [b, h, d]
        k = max(1, round(self.strategy.keep_ratio * d))
        return torch.topk(score, k, dim=-1).indices.sort(dim=-1).values.to(INDEX_DTYPE)

    def _ingest(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.dtype, self.head_dim = keys.dtype, keys.shape[-1]
        if keys.shape[-2] == 0 and self.keys is None and self.ko is None:
            return  # no tokens to choose channels on yet: the first ones to arrive decide
        if self.strategy.mode == "outlier":
            if self.ko is None or self.vo is None:
                s = self.strategy
                self.ko = _OutlierSplit(keys, s.outlier_ratio, s.outlier_bits)
                self.vo = _OutlierSplit(values, s.outlier_ratio, s.outlier_bits)
            else:
                self.ko.add(keys)
                self.vo.add(values)
            return
        if self.kept is None:
            self.kept = self._select_channels(keys)
        kept = torch.gather(keys, -1, _expand(self.kept, keys.shape[-2]))
        if self.keys is None or self.values is None:
            # Copy the dense values: holding the caller's tensor could pin a shared prefill buffer.
            self.keys, self.values = kept, values.clone(memory_format=torch.contiguous_format)
        else:
            self.keys = torch.cat([self.keys, kept], dim=-2)
            self.values = torch.cat([self.values, values], dim=-2)

    def prefill(self, keys: torch.Tensor, values: torch.Tensor, capture: LayerCapture | None) -> None:
        if capture is not None:
            self.capture = capture
        self._ingest(keys, values)

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._ingest(keys, values)
        assert self.dtype is not None
        if self.ko is not None and self.vo is not None:
            return self.ko.dequantize(self.dtype), self.vo.dequantize(self.dtype)
        assert self.keys is not None and self.kept is not None and self.values is not None
        b, h, t, _ = self.keys.shape
        full = self.keys.new_zeros(b, h, t, self.head_dim)
        return full.scatter_(-1, _expand(self.kept, t), self.keys), self.values

    def select_tokens(self, index: torch.Tensor) -> None:
        """Exact: every token is encoded on its own in both modes."""
        if self.ko is not None and self.vo is not None:
            self.ko.take(index)
            self.vo.take(index)
        elif self.keys is not None and self.values is not None:
            self.keys = gather_tokens(self.keys, index, -2)
            self.values = gather_tokens(self.values, index, -2)

    def tensors(self) -> Iterable[torch.Tensor]:
        if self.ko is not None and self.vo is not None:
            return self.ko.tensors() + self.vo.tensors()
        return [t for t in (self.kept, self.keys, self.values) if t is not None]

    def num_tokens(self) -> int:
        if self.ko is not None and self.ko.dense is not None:
            return self.ko.dense.shape[-2]
        return 0 if self.keys is None else self.keys.shape[-2]

    def stats(self) -> dict[str, float]:
        t = self.num_tokens()
        if t == 0:
            return {}
        if self.ko is not None:
            kept = self.ko.k
            shape = self.ko.perm.shape
        else:
            assert self.kept is not None
            kept, shape = self.kept.shape[-1], self.kept.shape
        elements = 2 * shape[0] * shape[1] * self.head_dim * t
        return {"kept_fraction": kept / self.head_dim,
                "bits_per_element": 8 * held_bytes(self.tensors()) / elements}


@dataclass
class ChannelSparse(Strategy):
    """ThinK query-driven key-channel pruning, or 16-bit outlier channels with low-bit rest."""

    name = "channel_sparse"
    family = "quantization"
    mode: str = "prune"
    keep_ratio: float = 0.5
    window: int = 32
    outlier_ratio: float = 0.0625
    outlier_bits: int = 4

    @property
    def query_window(self) -> int | None:
        # Only prune mode reads queries; outlier mode spares the engine the capture.
        return self.window if self.mode == "prune" else 0

    def validate(self) -> None:
        require(self.mode in MODES,
                f"channel_sparse.mode must be one of {', '.join(MODES)} (got {self.mode!r})")
        require(0 < self.keep_ratio <= 1,
                f"channel_sparse.keep_ratio must be in (0, 1] (got {self.keep_ratio})")
        require(isinstance(self.window, int) and self.window >= 1,
                f"channel_sparse.window must be an integer >= 1 (got {self.window})")
        require(0 <= self.outlier_ratio < 1,
                f"channel_sparse.outlier_ratio must be in [0, 1) (got {self.outlier_ratio})")
        require(self.outlier_bits in OUTLIER_BITS,
                f"channel_sparse.outlier_bits must be one of {', '.join(map(str, OUTLIER_BITS))} "
                f"(got {self.outlier_bits})")

    def new_layer(self, layer_idx: int, num_layers: int) -> LayerStore:
        return ChannelSparseStore(self, layer_idx, num_layers)
