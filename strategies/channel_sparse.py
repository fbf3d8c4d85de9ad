"""``channel_sparse``: channel-level sparse encoding of the cache, in two modes.

``mode=prune`` — ThinK (Xu et al. 2024, "ThinK: Thinner Key Cache by Query-Driven Pruning", §3.2;
``SalesforceAIResearch/ThinK`` ``ThinK_flash/src/kv_pruning_utils.py``): key channels differ widely in
how much they contribute to q·k. Channel ``c`` of a KV head is scored by ``||Q[:, c] K[:, c]^T||_F =
||Q[:, c]|| * ||K[:, c]||``, with ``Q`` the post-RoPE queries of the strategy's own last ``window``
prefill positions pooled over the GQA query heads sharing that KV head (as kvpress's ``ThinKPress``),
and the ``floor((1 - keep_ratio) * D)`` lowest-scoring channels are pruned from the prefill's keys
except the ``recent_window`` most recent ones, which stay whole, as in ThinK. Decoded tokens are not
pruned either (ThinK's reference appends them to the unpruned part); ``prune_decoded=true`` prunes
them too, keeping only the ``recent_window`` newest keys whole (``recent_window=0, prune_decoded=true``
is kvbench's earlier every-token pruning). Held: kept channel ids, the kept key columns of pruned
tokens, the whole keys of unpruned ones, dense values. At attention the kept columns are scattered
back into zeros, which is exactly pruning those channels from q·k. Bits per element for a long
prefix: ``16 * (keep_ratio + 1) / 2`` (12 at 0.5).

``mode=outlier`` — dense-and-sparse by channel, in the spirit of KVQuant's outlier isolation (Hooper
et al. 2024) and of KIVI's channel-outlier observation (Liu et al. 2024): per KV head, the
``outlier_ratio`` fraction of channels with the largest prefill magnitude is kept in 16 bits, and the
remaining channels of each token are quantized together (one asymmetric group per token, float16
scale and zero point) at ``outlier_bits``. With the outliers out, a per-token group no longer spends
its range on them. Applied to keys and values alike; decoded tokens reuse the prefill's channel split.
Bits per element: ``(k * 16 + (D - k) * b + 32) / D`` — 5.25 at D = 64, k = 4, b = 4.

Both modes encode tokens independently, so tokens can be dropped exactly. ``stats()`` reports
``kept_fraction`` (prune: key channels kept; outlier: channels held in 16 bits).

Attention reads the store as it is held (``LayerStore.attend``, :mod:`kvbench.blockattn`): in prune mode the
query's kept channels meet the pruned keys' kept columns (the dropped channels contribute nothing, so no
zero-filled copy is made); in outlier mode the query, permuted once, meets the 16-bit channels and one decoded
block of the low-bit ones, and the values' two parts are scattered back into channel order per block. Only a
dense read (``append``: SDPA or eager attention, long passes) makes the working copy (harness scratch, unless
the run context sets ``working_copy=False``), so later dense reads decode only their new tokens (see
``strategies/_quantstore.py``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from kvbench.strategies._quantstore import ChunkList, WorkingCopy, working_copy_enabled
from kvbench.strategies.base import LayerCapture, LayerStore, Strategy, held_bytes, require

from kvbench import blockattn
from kvbench.errors import KVBenchError
from kvbench.quantizers import AsymmetricQuant, check_finite, gather_tokens, quantize_asymmetric

MODES = ("prune", "outlier")
OUTLIER_BITS = (4, 8)
INDEX_DTYPE = torch.int16  # channel ids are < head_dim; int16 keeps the (token-independent) index small


def kept_channels(head_dim: int, keep_ratio: float) -> int:
    """Channels kept per KV head: ThinK prunes ``int(D * pruning_ratio)``; at least one is kept."""
    pruned = int(head_dim * (1 - keep_ratio) + 1e-6)  # the epsilon absorbs 1 - r landing an ulp low
    return max(1, head_dim - pruned)


def think_scores(queries: torch.Tensor, keys: torch.Tensor, window: int) -> torch.Tensor:
    """ThinK's channel score ``||Q[:, c]|| * ||K[:, c]||`` per KV head, ``[b, kv_heads, D]`` float32.

    ``queries`` ``[b, q_heads, w, D]`` are in position order, so the last ``window`` of them are the
    strategy's own observation window whatever wider window the engine captured for a co-run strategy.
    """
    b, h, _, d = keys.shape
    q = queries[..., -window:, :].float()
    q = q.reshape(b, h, q.shape[1] // h * q.shape[2], d)  # query heads of one KV head are contiguous
    return q.norm(dim=-2) * keys.float().norm(dim=-2)


def _expand(idx: torch.Tensor, tokens: int) -> torch.Tensor:
    """``[b, h, c]`` channel ids as a gather/scatter index for ``[b, h, tokens, c]``."""
    return idx.long().unsqueeze(-2).expand(*idx.shape[:-1], tokens, idx.shape[-1])


@dataclass
class _Rows:
    """Consecutive tokens of one tensor as held: outlier mode's 16-bit channels (``dense``) and low-bit codes of
    the others (``rest``), or prune mode's dense values (``rest`` None). A piece of a ``ChunkList``, so a decode
    step adds a piece instead of copying everything held (a concatenation would double the tensor for a moment,
    the largest temporary of the step)."""

    dense: torch.Tensor
    rest: AsymmetricQuant | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.dense.shape[-2])

    def cat(self, other: _Rows) -> _Rows:
        rest = None if self.rest is None or other.rest is None else self.rest.cat(other.rest)
        return _Rows(torch.cat([self.dense, other.dense], dim=-2), rest)  # type: ignore[arg-type]

    def take(self, index: torch.Tensor) -> _Rows:
        rest = None if self.rest is None else self.rest.take(index)
        return _Rows(gather_tokens(self.dense, index, -2), rest)  # type: ignore[arg-type]

    def tensors(self) -> list[torch.Tensor]:
        return [self.dense, *([] if self.rest is None else self.rest.tensors())]


class _OutlierSplit:
    """One tensor (K or V) as 16-bit outlier channels plus per-token low-bit codes of the other channels."""

    def __init__(self, x: torch.Tensor, ratio: float, bits: int, working: bool) -> None:
        d = x.shape[-1]
        per_byte = 8 // bits
        # At least one byte of codes is left, and the packed codes need whole bytes per token.
        k = min(math.ceil(ratio * d), d - per_byte)
        k += (d - k) % per_byte
        self.k, self.bits, self.dtype = k, bits, x.dtype
        magnitude = x.abs().amax(dim=-2).float()  # [b, h, d]
        # Outliers first (largest magnitude), then the rest: one permutation serves both directions.
        self.perm = torch.argsort(magnitude, dim=-1, descending=True, stable=True).to(INDEX_DTYPE)
        self.rows = ChunkList()
        self.working = working
        self.work: WorkingCopy | None = None  # made by the first dense read (dequantize)
        self._q: torch.Tensor | None = None
        self.add(x)

    def add(self, x: torch.Tensor) -> None:
        check_finite(x)
        xp = torch.gather(x, -1, _expand(self.perm, x.shape[-2]))
        # Copies, not views: a view would keep the whole permuted tensor alive.
        rows = _Rows(xp[..., :self.k].clone(memory_format=torch.contiguous_format),
                     quantize_asymmetric(xp[..., self.k:], self.bits, xp.shape[-1] - self.k, "token"))
        self.rows.append(rows)  # type: ignore[arg-type]
        if self.work is not None:
            self.work.append(self._decode(rows))

    def _decode(self, rows: _Rows) -> torch.Tensor:
        assert rows.rest is not None
        combined = torch.cat([rows.dense.to(self.dtype), rows.rest.dequantize(self.dtype)], dim=-1)
        return torch.empty_like(combined).scatter_(-1, _expand(self.perm, combined.shape[-2]), combined)

    def dequantize(self) -> torch.Tensor:
        rows = self.rows.merged()
        assert rows is not None
        if self.work is None and self.working:
            self.work = WorkingCopy()
            self.work.append(self._decode(rows))  # type: ignore[arg-type]
        if self.work is not None:
            return self.work.view()
        return self._decode(rows)  # type: ignore[arg-type]

    @property
    def num_tokens(self) -> int:
        return self.rows.num_tokens

    def parts(self) -> list[blockattn.Part]:
        """The held pieces as parts of a ``blockattn.TokenRun``, read without a dense copy."""
        return [_OutlierPart(self, rows) for rows in self.rows.pieces]  # type: ignore[misc]

    def permuted(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[b, h, m, d]`` in stored channel order (outliers first); one gather per query, not per block."""
        if self._q is not x:
            self._q, self._qp = x, torch.gather(x, -1, _expand(self.perm, x.shape[-2]))
        return self._qp

    def take(self, index: torch.Tensor) -> None:
        rows = self.rows.merged()
        assert rows is not None
        self.rows.set(rows.take(index))  # type: ignore[arg-type, attr-defined]
        if self.work is not None:
            self.work.replace(gather_tokens(self.work.view(), index, -2))

    def tensors(self) -> list[torch.Tensor]:
        return [self.perm, *self.rows.tensors()]


class _OutlierPart:
    """A piece of an outlier split, read one block at a time: the permuted query's first ``k`` channels meet
    the 16-bit channels and its others one decoded block of codes; a block's weighted values are scattered
    back into channel order."""

    def __init__(self, split: _OutlierSplit, rows: _Rows) -> None:
        self.split, self.rows = split, rows
        self.num_tokens = rows.num_tokens

    def scores(self, q: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        k, rest = self.split.k, self.rows.rest
        assert rest is not None
        qp = self.split.permuted(q)
        s = torch.matmul(qp[..., :k], self.rows.dense[..., start:stop, :].to(q.dtype).transpose(-1, -2))
        return s.add_(torch.matmul(qp[..., k:], rest.decode(q.dtype, start, stop).transpose(-1, -2)))

    def weighted(self, p: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        rest = self.rows.rest
        assert rest is not None
        out = torch.cat([torch.matmul(p, self.rows.dense[..., start:stop, :].to(p.dtype)),
                         torch.matmul(p, rest.decode(p.dtype, start, stop))], dim=-1)
        return torch.empty_like(out).scatter_(-1, _expand(self.split.perm, out.shape[-2]), out)


class _KeptColumns:
    """Pruned keys as a part of a ``blockattn.TokenRun``: the query's kept channels times the kept columns, which
    is the zero-filled key's product without the zeros (ThinK's pruned q·k)."""

    def __init__(self, kept: torch.Tensor, keys: torch.Tensor) -> None:
        self.kept, self.keys = kept, keys
        self._q: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.keys.shape[-2])

    def scores(self, q: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        if self._q is not q:
            self._q, self._qk = q, torch.gather(q, -1, _expand(self.kept, q.shape[-2]))
        return torch.matmul(self._qk, self.keys[..., start:stop, :].to(q.dtype).transpose(-1, -2))

    def weighted(self, p: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        raise TypeError("pruned key columns are keys; values are held dense")


class ChannelSparseStore(LayerStore):
    """Prune: kept key columns of pruned tokens + whole keys of the others + dense values.
    Outlier: a :class:`_OutlierSplit` for K and for V."""

    strategy: ChannelSparse

    def __init__(self, strategy: ChannelSparse, layer_idx: int, num_layers: int) -> None:
        super().__init__(strategy, layer_idx, num_layers)
        self.dtype: torch.dtype | None = None
        self.head_dim = 0
        self.working = True
        # prune mode: held keys are [pruned tokens (kept columns) | whole tokens], in order
        self.kept: torch.Tensor | None = None  # [b, h, k] kept key channel ids, ascending
        self.keys: torch.Tensor | None = None  # [b, h, Tp, k]
        self.whole: torch.Tensor | None = None  # [b, h, Tw, D]: the recent window (and decoded tokens)
        self.vals = ChunkList()  # dense values [b, h, T, D], as pieces (_Rows)
        self.work: WorkingCopy | None = None  # keys as attention reads them
        # outlier mode
        self.ko: _OutlierSplit | None = None
        self.vo: _OutlierSplit | None = None

    def _select_channels(self, keys: torch.Tensor) -> torch.Tensor:
        """ThinK's query-driven channel score over the strategy's own window, pooled over each query group."""
        cap = self.capture
        if cap is None or cap.queries is None:
            raise KVBenchError(
                "channel_sparse mode=prune scores key channels with captured queries: build the cache with "
                "KVBenchCache.from_capture(..., captures) or inside cache.attach(model)")
        score = think_scores(cap.queries, keys, self.strategy.window)
        k = kept_channels(keys.shape[-1], self.strategy.keep_ratio)
        return torch.topk(score, k, dim=-1).indices.sort(dim=-1).values.to(INDEX_DTYPE)

    def _scatter(self, pruned: torch.Tensor) -> torch.Tensor:
        """Kept columns back into zeros: exactly the pruned channels removed from q·k."""
        assert self.kept is not None
        b, h, t, _ = pruned.shape
        full = pruned.new_zeros(b, h, t, self.head_dim)
        return full.scatter_(-1, _expand(self.kept, t), pruned)

    def _prune_oldest(self) -> None:
        """Prune the whole keys beyond the ``recent_window`` newest."""
        assert self.whole is not None and self.keys is not None and self.kept is not None
        n = self.whole.shape[-2] - self.strategy.recent_window
        if n <= 0:
            return
        start = self.keys.shape[-2]
        cut = torch.gather(self.whole[..., :n, :], -1, _expand(self.kept, n))
        self.keys = cut if start == 0 else torch.cat([self.keys, cut], dim=-2)
        # A copy, not a slice: a slice would keep the whole tensor (maybe the shared prefill) alive.
        self.whole = self.whole[..., n:, :].clone(memory_format=torch.contiguous_format)
        if self.work is not None:
            self.work.write(start, self._scatter(cut))

    def _ingest(self, keys: torch.Tensor, values: torch.Tensor, prefill: bool) -> None:
        self.dtype, self.head_dim = keys.dtype, keys.shape[-1]
        if keys.shape[-2] == 0 and not self.vals.pieces and self.ko is None:
            return  # no tokens to choose channels on yet: the first ones to arrive decide
        if self.ko is None and not self.vals.pieces:
            self.working = working_copy_enabled(self.strategy)
        if self.strategy.mode == "outlier":
            if self.ko is None or self.vo is None:
                s = self.strategy
                self.ko = _OutlierSplit(keys, s.outlier_ratio, s.outlier_bits, self.working)
                self.vo = _OutlierSplit(values, s.outlier_ratio, s.outlier_bits, self.working)
            else:
                self.ko.add(keys)
                self.vo.add(values)
            return
        if self.kept is None:
            self.kept = self._select_channels(keys)  # ThinK scores every prefill key, the recent ones too
            self.keys = keys.new_empty(*keys.shape[:2], 0, self.kept.shape[-1])
        assert self.keys is not None
        whole = self.whole is not None and self.whole.shape[-2] > 0
        self.whole = torch.cat([self.whole, keys], dim=-2) if whole else keys  # type: ignore[list-item]
        if self.work is not None:
            self.work.append(keys)
        if prefill or self.strategy.prune_decoded:
            self._prune_oldest()
        if self.whole is keys:
            self.whole = keys.clone(memory_format=torch.contiguous_format)
        # Copy the dense values: holding the caller's tensor could pin a shared prefill buffer.
        self.vals.append(_Rows(values.clone(memory_format=torch.contiguous_format)))  # type: ignore[arg-type]

    def prefill(self, keys: torch.Tensor, values: torch.Tensor, capture: LayerCapture | None) -> None:
        if capture is not None:
            self.capture = capture
        self._ingest(keys, values, prefill=True)

    def _prune_keys(self) -> torch.Tensor:
        assert self.keys is not None and self.whole is not None
        if self.work is None and self.working:  # the first dense read makes the working copy
            self.work = WorkingCopy()
            self.work.append(torch.cat([self._scatter(self.keys), self.whole], dim=-2))
        if self.work is not None:
            return self.work.view()
        return torch.cat([self._scatter(self.keys), self.whole], dim=-2)

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._ingest(keys, values, prefill=False)
        if self.ko is not None and self.vo is not None:
            return self.ko.dequantize(), self.vo.dequantize()
        return self._prune_keys(), self._values()

    def _values(self) -> torch.Tensor:
        rows = self.vals.merged()
        assert rows is not None
        return rows.dense  # type: ignore[attr-defined]

    def attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
               scaling: float, softcap: float | None = None) -> torch.Tensor:
        """``LayerStore.attend`` over the held encoding (see the module docstring): no dense copy of the keys."""
        self._ingest(keys, values, prefill=False)
        heads = keys.shape[1]
        if self.ko is not None and self.vo is not None:
            kparts, vparts = self.ko.parts(), self.vo.parts()
        elif self.vals.pieces:
            assert self.keys is not None and self.whole is not None and self.kept is not None
            kparts = [_KeptColumns(self.kept, self.keys), blockattn.Dense(self.whole)]
            vparts = [blockattn.Dense(rows.dense) for rows in self.vals.pieces]  # type: ignore[attr-defined]
        else:  # nothing held and nothing new
            kparts, vparts = [], []
        return blockattn.attend(query, blockattn.TokenRun(kparts, heads), blockattn.TokenRun(vparts, heads), mask,
                                scaling, softcap)

    def select_tokens(self, index: torch.Tensor) -> None:
        """Exact: every token is encoded on its own in both modes.

        Prune mode: as in the quantized stores, each head keeps its first ``m`` kept pruned tokens
        (``m`` the smallest count over heads) pruned; its other kept pruned tokens join the whole keys
        as the zero-filled keys attention saw, so tensors stay dense and nothing changes value.
        """
        if self.ko is not None and self.vo is not None:
            self.ko.take(index)
            self.vo.take(index)
            return
        if self.keys is None or not self.vals.pieces or self.whole is None:
            return
        index = index.to(device=self.whole.device, dtype=torch.long)
        pruned = self.keys.shape[-2]
        m = int((index < pruned).sum(-1).min()) if index.numel() else 0
        spill = index[..., m:]
        if bool((spill < pruned).any()):
            whole = gather_tokens(self._prune_keys(), spill, -2)
        else:
            whole = gather_tokens(self.whole, spill - pruned, -2)
        if self.work is not None:
            self.work.replace(gather_tokens(self.work.view(), index, -2))
        self.keys = gather_tokens(self.keys, index[..., :m], -2)
        self.whole = whole
        self.vals.set(_Rows(gather_tokens(self._values(), index, -2)))  # type: ignore[arg-type]

    def tensors(self) -> Iterable[torch.Tensor]:
        if self.ko is not None and self.vo is not None:
            return self.ko.tensors() + self.vo.tensors()
        return [*(t for t in (self.kept, self.keys, self.whole) if t is not None), *self.vals.tensors()]

    def scratch_tensors(self) -> Iterable[torch.Tensor]:
        works = [self.work] + [s.work for s in (self.ko, self.vo) if s is not None]
        return [t for w in works if w is not None for t in w.tensors()]

    def num_tokens(self) -> int:
        if self.ko is not None:
            return self.ko.num_tokens
        return self.vals.num_tokens

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
        out = {"kept_fraction": kept / self.head_dim,
               "bits_per_element": 8 * held_bytes(self.tensors()) / elements}
        if self.keys is not None:
            out["pruned_token_fraction"] = self.keys.shape[-2] / t
        return out


@dataclass
class ChannelSparse(Strategy):
    """ThinK query-driven key-channel pruning, or 16-bit outlier channels with low-bit rest."""

    name = "channel_sparse"
    family = "quantization"
    mode: str = "prune"
    keep_ratio: float = 0.5
    window: int = 32
    recent_window: int = 32
    prune_decoded: bool = False
    outlier_ratio: float = 0.0625
    outlier_bits: int = 4

    @property
    def query_window(self) -> int | None:  # type: ignore[override]
        # Only prune mode reads queries; outlier mode spares the engine the capture.
        return self.window if self.mode == "prune" else 0

    def validate(self) -> None:
        require(self.mode in MODES,
                f"channel_sparse.mode must be one of {', '.join(MODES)} (got {self.mode!r})")
        require(0 < self.keep_ratio <= 1,
                f"channel_sparse.keep_ratio must be in (0, 1] (got {self.keep_ratio})")
        require(isinstance(self.window, int) and self.window >= 1,
                f"channel_sparse.window must be an integer >= 1 (got {self.window})")
        require(isinstance(self.recent_window, int) and self.recent_window >= 0,
                f"channel_sparse.recent_window must be an integer >= 0 (got {self.recent_window})")
        require(isinstance(self.prune_decoded, bool),
                f"channel_sparse.prune_decoded must be true or false (got {self.prune_decoded!r})")
        require(0 <= self.outlier_ratio < 1,
                f"channel_sparse.outlier_ratio must be in [0, 1) (got {self.outlier_ratio})")
        require(self.outlier_bits in OUTLIER_BITS,
                f"channel_sparse.outlier_bits must be one of {', '.join(map(str, OUTLIER_BITS))} "
                f"(got {self.outlier_bits})")

    def new_layer(self, layer_idx: int, num_layers: int) -> LayerStore:
        return ChannelSparseStore(self, layer_idx, num_layers)

    @classmethod
    def reference(cls, keys: torch.Tensor, values: torch.Tensor, capture: LayerCapture | None = None,
                  **params: Any) -> dict[str, Any] | None:
        """ThinK's prefill (``SalesforceAIResearch/ThinK`` ``ThinK_flash/src/kv_pruning_utils.py``,
        ``key_pruner_query_driven``): the keys attention reads next. ``None`` for outlier mode (no reference).

        Written from the reference, not from the store: score = mean over the last ``window`` queries of
        ``q_c**2`` (averaged over a KV head's query group, as kvpress's ``ThinKPress`` does for GQA) times
        the mean over all prefill keys of ``k_c**2``; the ``int(D * (1 - keep_ratio))`` lowest channels
        are zeroed in every key but the last ``recent_window``.
        """
        p = cls(**params)
        if p.mode != "prune" or capture is None or capture.queries is None:
            return None
        b, h, t, d = keys.shape
        q = capture.queries[..., -p.window:, :].float()
        q_energy = q.pow(2).mean(dim=2).view(b, h, -1, d).mean(dim=2)
        score = q_energy * keys.float().pow(2).mean(dim=2)
        pruned = torch.topk(score, d - kept_channels(d, p.keep_ratio), dim=-1, largest=False).indices
        keep = torch.ones(b, h, d, dtype=torch.bool, device=keys.device).scatter_(-1, pruned, False)
        cut = max(t - p.recent_window, 0)
        pruned_keys = keys[..., :cut, :].masked_fill(~keep[:, :, None, :], 0)
        return {"keys": torch.cat([pruned_keys, keys[..., cut:, :]], dim=-2), "values": values,
                "kept_channels": keep,
                "source": "SalesforceAIResearch/ThinK ThinK_flash/src/kv_pruning_utils.py (key_pruner_query_driven)"}
