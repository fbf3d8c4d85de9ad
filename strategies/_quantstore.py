"""Shared machinery of the grouped quantization stores (``int8``, ``int4``, ``int2``, ``bfp``).

A :class:`QuantizedStore` holds K and V as two independent streams (:class:`Stream`): a quantized chunk
(a :class:`kvbench.quantizers.TokenChunk`, held as a few pieces, see :class:`ChunkList`) of the oldest
tokens followed by a full-precision residual of the newest. Each stream has a flush policy
``(keep, multiple)``: whenever the residual holds more than ``keep`` tokens, the oldest multiple of
``multiple`` tokens beyond the ``keep`` most recent ones are quantized and appended to the chunk.

* int8 / bfp (token-wise groups): ``(0, 1)`` — every token is quantized on arrival;
  int8 ``axis=channel``: ``(0, G)``.
* KIVI (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache";
  ``jy-yuan/KIVI`` ``models/llama_kivi.py``): keys ``(0, R)`` — the last ``T mod R`` keys stay exact and
  are quantized all at once when ``R`` have gathered — and values ``(R, 1)`` — a rolling window of exactly
  the ``R`` newest values, the oldest quantized one token at a time. During decoding KIVI attends to the
  new token(s) before flushing, so the step's own tokens are read exactly (``attend_before_flush``).

Attention (``QuantizedStore.attend``, what ``attn_implementation="kvbench"`` calls) reads the stored codes block
by block (``kvbench.blockattn``): a step holds the codes plus one decoded block, never a dense copy.

Working copy (harness scratch, not part of the format), kept only for dense readers: SDPA or eager attention
(``engine.attention=sdpa``, the GPU default) get dense K/V from ``append``, and re-decoding the whole chunk for
them at every step is an artefact of emulating the format in PyTorch. Unless the run context sets
``working_copy=False``, the first such read makes each stream a :class:`WorkingCopy` — the decoded chunk
followed by the residual, grown in place — and from then on a step writes only its new and newly flushed rows.
Decoding is element-wise, so a row decoded on its own is bit-identical to the same row decoded with the whole chunk.
``tensors()`` (and so ``kv_bytes``) never includes it; ``scratch_tensors()`` reports it.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from kvbench.strategies.base import LayerCapture, LayerStore, Strategy, held_bytes, require

import kvbench.blockattn as blockattn
from kvbench.blockattn import Dense
from kvbench.errors import KVBenchError
from kvbench.quantizers import TokenChunk, gather_tokens, quantize_asymmetric

GROUP_SIZES = (8, 16, 32, 64, 128, 256)
#: Slots a :class:`ChunkList` tail reserves, and the most tokens an append may have to be written into one (a
#: decode step's, or a few speculative ones'; never a prefill's or a question's, so a store measured after its
#: prefill holds exactly its tokens). Held, so counted, as ``full``'s reserve is: at most 31 spare token slots per
#: stream and layer while decoding.
TAIL_TOKENS = 32
TAIL_APPEND = 8
KIVI_LAYOUTS = ("kivi", "window")


def channel_group(group_size: int, head_dim: int, what: str) -> int:
    """Group size along channels: a group never spans heads, so one wider than the head is clipped to it."""
    g = min(group_size, head_dim)
    if head_dim % g:
        raise KVBenchError(f"{what}={group_size} must divide head_dim={head_dim}")
    return g


def working_copy_enabled(strategy: Any) -> bool:
    """The bound run's ``working_copy`` flag; a store used outside the engine (no context) keeps one."""
    context = getattr(strategy, "context", None)
    return True if context is None else bool(getattr(context, "working_copy", True))


class WorkingCopy:
    """Scratch ``[b, h, T, d]`` tensor of what attention reads, grown in place with spare capacity.

    Appending ``n`` tokens copies ``n`` rows (plus an amortised O(1) per token when the buffer grows by a
    quarter), so a decode step no longer costs O(context) copies.
    """

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self.n = 0

    def _reserve(self, like: torch.Tensor, total: int) -> None:
        if self.buf is not None and self.buf.shape[-2] >= total:
            return
        b, h, _, d = like.shape
        new = like.new_empty(b, h, total + max(64, total // 4), d)
        if self.buf is not None and self.n:
            new[..., :self.n, :].copy_(self.buf[..., :self.n, :])
        self.buf = new

    def append(self, x: torch.Tensor) -> None:
        m = x.shape[-2]
        self._reserve(x, self.n + m)
        assert self.buf is not None
        self.buf[..., self.n:self.n + m, :].copy_(x)
        self.n += m

    def write(self, start: int, x: torch.Tensor) -> None:
        assert self.buf is not None
        self.buf[..., start:start + x.shape[-2], :].copy_(x)

    def replace(self, x: torch.Tensor) -> None:
        """Start over from ``x`` (after tokens were dropped)."""
        self.buf, self.n = None, 0
        self.append(x)

    def view(self) -> torch.Tensor:
        assert self.buf is not None
        return self.buf[..., :self.n, :]

    def tensors(self) -> list[torch.Tensor]:
        return [] if self.buf is None else [self.buf]


class ChunkList:
    """A quantized chunk held as a few pieces along tokens, merged like a binary counter (a piece is merged
    into its predecessor once it is as long, up to one attention block of tokens): appending costs amortised
    O(log B) copies per token instead of the O(T) of concatenating onto one chunk, with T / B + O(log B) pieces.
    :meth:`merged` makes one chunk where one is needed.

    A decode step's few tokens (at most :data:`TAIL_APPEND` of a format with an entry per token in every field,
    :meth:`kvbench.quantizers.TokenChunk.tokenwise`) are written into a *tail*: a chunk of :data:`TAIL_TOKENS`
    slots reserved at once, whose filled view is the last piece. A step then copies its token's fields into the
    next slot instead of making a piece of its own, merging pieces and describing each new one to the kernel
    (most of a quantized store's append, ``results/perf/step_profile.md``). The reserve is held, so it is counted
    where bytes are (as ``full``'s reserve is); every other piece holds exactly its tokens: a full tail is an
    ordinary piece, and one left part-filled when a larger piece arrives is copied to its exact size first.
    """

    def __init__(self) -> None:
        self._pieces: list[TokenChunk] = []
        # Token count per piece, kept beside them: asked for several times per decode step and stream, a
        # chunk's own count is a tensor-shape lookup each time.
        self.lengths: list[int] = []
        # The tail's whole reserve (a chunk of TAIL_TOKENS slots) while one is being filled; pieces[-1] is its view.
        self._tail: TokenChunk | None = None
        # Whether pieces[-1] is cut to the tail's filled slots: a step that grows the tail leaves the cut (four
        # tensor views, about 9 us) to the first reader of ``pieces``; attention reads the reserve up to its
        # filled slots instead (:meth:`read_parts`), so a decode step of quantized stores cuts none.
        self._cut = True

    @property
    def pieces(self) -> list[TokenChunk]:
        """The pieces in token order, each holding exactly its tokens (an open tail as the view of its filled slots)."""
        if not self._cut:
            assert self._tail is not None
            self._pieces[-1] = self._tail.head(self.lengths[-1])
            self._cut = True
        return self._pieces

    @pieces.setter
    def pieces(self, pieces: list[TokenChunk]) -> None:
        self._pieces, self._cut = pieces, True

    def read_parts(self) -> list[Any]:
        """The pieces as attention reads them (``blockattn`` parts): an open tail as :class:`FilledTail`, its
        reserve read up to its filled slots, rather than a view cut to them at every step."""
        if self._cut:
            return list(self._pieces)
        assert self._tail is not None
        return [*self._pieces[:-1], FilledTail(self._tail, self.lengths[-1])]

    def append(self, piece: TokenChunk) -> None:
        m = piece.num_tokens
        tokenwise = getattr(piece, "tokenwise", None)
        # Never a list's first piece (a prefill, however short): what a store holds after it is its tokens.
        small = m <= TAIL_APPEND and bool(self._pieces) and tokenwise is not None and tokenwise()
        if self._tail is not None:
            if small and type(piece) is type(self._tail) and self.lengths[-1] + m <= TAIL_TOKENS:
                self._write(piece)
                return
            self.seal()
        if small:
            self._tail = _reserve(piece, TAIL_TOKENS)
            self.pieces.append(piece)  # replaced by the tail's view in _write
            self.lengths.append(0)
            self._write(piece)
            return
        self.pieces.append(piece)
        self.lengths.append(m)
        self._merge()

    def _write(self, piece: TokenChunk) -> None:
        """``piece``'s tokens into the tail's next slots."""
        n, m = self.lengths[-1], piece.num_tokens
        for f, d in type(piece).TOKEN_DIMS.items():
            getattr(self._tail, f).narrow(d, n, m).copy_(getattr(piece, f))
        self._grow(m)

    def write(self, x: torch.Tensor) -> bool:
        """Encode a decode step's tokens ``x`` straight into the open tail's next slots where its format can
        (:meth:`kvbench.quantizers.TokenChunk.write`: the codes encoding ``x`` as a piece gives, without the piece
        and its copy); ``False``, with nothing written, otherwise (no tail open, no room, more tokens than
        :meth:`append` writes into a tail, or a format that cannot): the pieces stay those :meth:`append` makes."""
        tail, m = self._tail, x.shape[-2]
        if tail is None or m > TAIL_APPEND or self.lengths[-1] + m > TAIL_TOKENS \
                or not tail.write(x, self.lengths[-1]):
            return False
        self._grow(m)
        return True

    @staticmethod
    def write_rows(lists: Sequence[ChunkList], xs: Sequence[torch.Tensor]) -> bool:
        """:meth:`write` of ``xs[r]`` into ``lists[r]`` for a batch's rows (each its own sequence's), in one call
        where every list has an open tail with room and their format writes a batch at once
        (:meth:`kvbench.quantizers.TokenChunk.write_rows`); ``False``, with nothing written, otherwise."""
        m = xs[0].shape[-2]
        if m > TAIL_APPEND:
            return False
        tails = []
        for chunks in lists:
            if chunks._tail is None or chunks.lengths[-1] + m > TAIL_TOKENS:
                return False
            tails.append(chunks._tail)
        if not type(tails[0]).write_rows(tails, xs, [chunks.lengths[-1] for chunks in lists]):
            return False
        for chunks in lists:
            chunks._grow(m)
        return True

    def _grow(self, m: int) -> None:
        """``m`` more of the tail's slots filled: its view grows; a tail filled up becomes an ordinary piece."""
        assert self._tail is not None
        n = self.lengths[-1] + m
        self.lengths[-1] = n
        self._cut = False
        if n == TAIL_TOKENS:
            self.pieces  # noqa: B018 -- cut now: the full tail becomes an ordinary piece
            self._tail = None
            self._merge()

    def seal(self) -> None:
        """End the tail, if any: its filled slots as a piece in storage of their own (the reserve is freed)."""
        if self._tail is None:
            return
        n = self.lengths[-1]
        self.pieces[-1] = self.pieces[-1].narrow(0, n)
        self._tail = None
        self._merge()

    def _merge(self) -> None:
        # Pieces stop merging at one attention block: a merge copies both pieces, and a copy of the whole chunk
        # would be a step's largest temporary (the decode working set, ``kvbench.workingset``).
        cap = max(blockattn.BLOCK_TOKENS, 1)
        while len(self.pieces) >= 2 and self.lengths[-2] <= self.lengths[-1] \
                and self.lengths[-2] + self.lengths[-1] <= cap:
            last = self.pieces.pop()
            self.pieces[-1] = self.pieces[-1].cat(last)
            n = self.lengths.pop()  # popped first: `x[-1] += x.pop()` would read the popped entry
            self.lengths[-1] += n

    def merged(self) -> TokenChunk | None:
        if len(self.pieces) > 1:
            whole = self.pieces[0]
            for piece in self.pieces[1:]:
                whole = whole.cat(piece)
            self.set(whole)
        else:
            self.seal()
        return self.pieces[0] if self.pieces else None

    def set(self, chunk: TokenChunk | None) -> None:
        self.pieces = [] if chunk is None else [chunk]
        self.lengths = [] if chunk is None else [chunk.num_tokens]
        self._tail = None

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def spare(self) -> int:
        """Token slots reserved past the held tokens (an open tail's empty ones)."""
        return 0 if self._tail is None else TAIL_TOKENS - self.lengths[-1]

    def tensors(self) -> list[torch.Tensor]:
        return [t for p in self.pieces for t in p.tensors()]


class FilledTail:
    """A :class:`ChunkList`'s open tail as attention reads it (a ``blockattn`` part): its reserve's first
    ``num_tokens`` tokens. The kernel reads the reserve's description up to them (``kvbench.fused.Fused.upto``);
    the blocks read the view cut to them, made once where they are asked."""

    __slots__ = ("chunk", "num_tokens", "_view")

    def __init__(self, chunk: TokenChunk, tokens: int) -> None:
        self.chunk, self.num_tokens = chunk, tokens
        self._view: TokenChunk | None = None

    def view(self) -> TokenChunk:
        if self._view is None:
            self._view = self.chunk.head(self.num_tokens)
        return self._view

    def fused(self) -> Any:
        whole = self.chunk.fused()
        return None if whole is None or whole.tg not in (0, 1) else whole.upto(self.num_tokens)

    def scores(self, q: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        return self.view().scores(q, start, stop)

    def weighted(self, p: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        return self.view().weighted(p, start, stop)


def _reserve(piece: TokenChunk, tokens: int) -> TokenChunk:
    """An empty chunk like ``piece`` with room for ``tokens`` tokens in every per-token field."""
    def room(t: torch.Tensor, d: int) -> torch.Tensor:
        shape = list(t.shape)
        shape[d] = tokens
        return t.new_empty(shape)
    return replace(piece, **{f: room(getattr(piece, f), d) for f, d in type(piece).TOKEN_DIMS.items()})


class Stream:
    """One tensor (K or V): a quantized chunk of the oldest tokens, an exact residual, an optional working copy.

    ``token_wise``: ``encode`` quantizes every token on its own (groups within a token), so a token's codes do
    not depend on which tokens it is encoded with. Such a stream with a residual window (``keep > 0``) encodes
    its whole residual in one batch when a small flush comes due and serves the next flushes from that batch
    (:meth:`_oldest`): a decode step then slices one token's codes and decoded rows instead of running the
    quantizer's and dequantizer's few dozen small ops on it (KIVI's value window flushes a token per step
    and layer). The batch is harness scratch: the chunk still holds exactly the flushed tokens, each piece in
    storage of its own, bit for bit what encoding them one by one gives.
    """

    def __init__(self, encode: Callable[[torch.Tensor], TokenChunk], keep: int, multiple: int,
                 working: bool, offset: int = 0, token_wise: bool = False, writes: bool = False) -> None:
        self.encode, self.keep, self.multiple = encode, keep, multiple
        self.offset = offset  # working-copy rows before this stream's tokens (a caller-managed prefix)
        self.token_wise = token_wise
        # ``encode`` is what its chunks' own ``write`` gives (QuantizedStore.tail_writes): a token pushed while a
        # tail is open is encoded where it is kept (ChunkList.write).
        self.writes = writes
        self.chunks = ChunkList()
        self.r: torch.Tensor | None = None
        self.dtype: torch.dtype | None = None
        # Allowed to keep a working copy; it is only made once something reads the stream densely
        # (:meth:`materialize`: SDPA or eager attention, a batch of rows); ``attend`` reads the codes instead.
        self.working = working
        self.work: WorkingCopy | None = None
        # Flushed tokens' decoded rows, written to the working copy at the next step: until then it holds the
        # exact values the current step attends to.
        self._pending: list[tuple[int, torch.Tensor]] = []
        # (codes, decoded rows) of the residual's tokens at the time they were encoded as one batch (with a
        # working copy only: without one, the stream is the plain reference the tests compare with), and how
        # many of them have been flushed since: batch token `_used` is residual token 0.
        self._batch: tuple[TokenChunk, torch.Tensor] | None = None
        self._used = 0

    @property
    def q(self) -> TokenChunk | None:
        """The quantized tokens as one chunk (merging the pieces)."""
        return self.chunks.merged()

    @q.setter
    def q(self, chunk: TokenChunk | None) -> None:
        self.chunks.set(chunk)

    @property
    def quantized(self) -> int:
        return self.chunks.num_tokens

    def num_tokens(self) -> int:
        return self.quantized + (0 if self.r is None else self.r.shape[-2])

    def _settle(self) -> None:
        if self.work is not None:
            for start, rows in self._pending:
                self.work.write(self.offset + start, rows)
        self._pending = []

    def ingest(self, x: torch.Tensor, attend_first: bool) -> torch.Tensor | None:
        """Add ``x``; with ``attend_first`` return what attention reads before the flush (else after it)."""
        self.add(x)
        out = self.materialize() if attend_first else None
        self.flush(defer=attend_first)
        self.own(x)
        return out

    def push(self, x: torch.Tensor) -> None:
        """:meth:`add` then :meth:`flush`. A stream that quantizes every token on arrival (``(0, 1)``), holds no
        residual and keeps no working copy encodes ``x`` straight into its chunk: the same codes, without the
        residual's concatenation, slices and empty remainder (a decode step's share of a quantized store's time)."""
        if self.keep or self.multiple != 1 or self.work is not None or self.r is None or self.r.shape[-2]:
            self.add(x)
            self.flush()
            return
        self._settle()
        self.dtype = x.dtype
        if not (self.writes and self.chunks.write(x)):
            self.chunks.append(self.encode(x))

    def _direct(self) -> bool:
        """Whether :meth:`push` encodes straight into the chunk list (every token on arrival, no residual held,
        no working copy, a format whose chunks write in place)."""
        return self.writes and not (self.keep or self.multiple != 1 or self.work is not None or self.r is None
                                    or self.r.shape[-2])

    @staticmethod
    def push_rows(streams: Sequence[Stream], xs: Sequence[torch.Tensor]) -> None:
        """:meth:`push` of ``xs[r]`` into ``streams[r]`` for a decode step's rows (each its own sequence's stream):
        where every stream encodes straight into an open tail, one call encodes every row's tokens
        (:meth:`ChunkList.write_rows`: the same codes as each row's own push); otherwise each row pushes."""
        if len(streams) > 1 and all(s._direct() for s in streams) \
                and ChunkList.write_rows([s.chunks for s in streams], xs):
            for s, x in zip(streams, xs, strict=True):
                s._settle()
                s.dtype = x.dtype
            return
        for s, x in zip(streams, xs, strict=True):
            s.push(x)

    def add(self, x: torch.Tensor) -> None:
        """Append ``x`` to the residual, quantizing nothing yet (:meth:`flush` does)."""
        self._settle()
        self.dtype = x.dtype
        if self.work is not None:
            self.work.append(x)
        self.r = torch.cat([self.r, x], dim=-2) if self.r is not None and self.r.shape[-2] else x

    def own(self, x: torch.Tensor) -> None:
        """After :meth:`add` (and any flush): never hold the caller's ``x`` itself."""
        if self.r is x:
            # The caller's tensor may be a view of a larger (possibly shared prefill) buffer, which
            # holding would keep alive and count; the residual gets storage of its own.
            self.r = x.clone(memory_format=torch.contiguous_format)

    def parts(self) -> list[Any]:
        """The held tokens as parts attention reads block by block (``kvbench.blockattn``): the quantized
        pieces, then the exact residual."""
        assert self.r is not None
        return [*self.chunks.pieces, Dense(self.r)]

    def run(self, heads: int) -> blockattn.TokenRun:
        """:meth:`parts` as the run attention reads (an open tail as :meth:`ChunkList.read_parts` gives it), with
        the token counts the chunk list keeps."""
        assert self.r is not None
        return blockattn.TokenRun([*self.chunks.read_parts(), Dense(self.r)], heads,
                                  [*self.chunks.lengths, self.r.shape[-2]])

    def flush(self, defer: bool = False) -> bool:
        """Quantize the oldest multiple of ``multiple`` tokens beyond the ``keep`` most recent ones."""
        assert self.r is not None and self.dtype is not None
        t = self.r.shape[-2]
        n = (t - self.keep) // self.multiple * self.multiple if t > self.keep else 0
        if n <= 0:
            return False
        start = self.quantized
        piece, rows = self._oldest(n)
        self.chunks.append(piece)
        # A copy, not a slice: a slice would keep the whole pre-flush buffer alive (nothing left: a new
        # empty tensor, which is all a copy of nothing is, without the copy's dispatch).
        rest = self.r[..., n:, :]
        self.r = rest.clone(memory_format=torch.contiguous_format) if t > n else self.r.new_empty(rest.shape)
        if self.work is not None:
            assert rows is not None
            if defer:
                self._pending.append((start, rows))
            else:
                self.work.write(self.offset + start, rows)
        return True

    def _oldest(self, n: int) -> tuple[TokenChunk, torch.Tensor | None]:
        """The residual's ``n`` oldest tokens encoded, and (with a working copy) decoded into the model dtype."""
        assert self.r is not None and self.dtype is not None
        if not self.working or not (self.token_wise and n <= self.keep):
            piece = self.encode(self.r[..., :n, :])
            return piece, None if self.work is None else piece.dequantize(self.dtype)
        if self._batch is None or self._used + n > self._batch[0].num_tokens:
            self._batch, self._used = (self.encode(self.r), None), 0  # every residual token, each on its own
        codes, decoded = self._batch
        if decoded is None and self.work is not None:  # decoded rows only for a working copy
            decoded = codes.dequantize(self.dtype)
            self._batch = (codes, decoded)
        i, self._used = self._used, self._used + n
        return codes.narrow(i, n), None if decoded is None else decoded[..., i:i + n, :]

    def materialize(self) -> torch.Tensor:
        """All held tokens in the model dtype: the working copy, or one dequantization and one concatenation."""
        assert self.r is not None and self.dtype is not None
        if self.work is None and self.working:
            # First dense read: the working copy starts from one decoding of everything held (after
            # ``offset`` rows its owner fills, e.g. quant_recompute's recomputed segment).
            b, h, _, d = self.r.shape
            self.work = WorkingCopy()
            if self.offset:
                self.work.append(self.r.new_zeros(b, h, self.offset, d))
            self.work.append(self._decoded())
        if self.work is not None:
            return self.work.view()
        return self._decoded()

    def _decoded(self) -> torch.Tensor:
        assert self.r is not None and self.dtype is not None
        if not self.chunks.pieces:
            return self.r
        # Piece by piece: merging here would make the held layout (and, for ragged groups, its bytes)
        # depend on whether a working copy is kept.
        parts = [p.dequantize(self.dtype) for p in self.chunks.pieces]
        if self.r.shape[-2]:
            parts.append(self.r)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)

    def select(self, index: torch.Tensor) -> None:
        """Keep held tokens ``index`` exactly (see :meth:`QuantizedStore.select_tokens`)."""
        assert self.r is not None and self.offset == 0
        self._settle()
        self._batch = None  # the residual is rebuilt below: batch positions no longer match its tokens
        quantized = self.quantized
        m = int((index < quantized).sum(-1).min()) if index.numel() else 0
        spill = index[..., m:]
        if bool((spill < quantized).any()):
            r = gather_tokens(self.materialize(), spill, -2)  # spilled tokens keep the values attention saw
        else:
            r = gather_tokens(self.r, spill - quantized, -2)
        if self.work is not None:
            self.work.replace(gather_tokens(self.work.view(), index, -2))
        q = self.q
        if q is not None:
            self.q = q.take(index[..., :m]) if m else None
        self.r = r
        self.flush()

    def tensors(self) -> list[torch.Tensor]:
        return self.chunks.tensors() + ([] if self.r is None else [self.r])

    def scratch_tensors(self) -> list[torch.Tensor]:
        """Harness scratch, never counted as held: the working copy and the encoded residual batch."""
        codes, decoded = self._batch or (None, None)
        work = [] if self.work is None else self.work.tensors()
        return work + ([] if codes is None else codes.tensors()) + ([] if decoded is None else [decoded])


class StreamViews:
    """Read-only views of a store's key and value :class:`Stream` s (tests, stats and subclasses read them by
    these names); mixed into every store that keeps its K/V as two streams ``ks`` and ``vs``."""

    ks: Stream | None
    vs: Stream | None

    @property
    def qk(self) -> TokenChunk | None:
        return None if self.ks is None else self.ks.q

    @property
    def qv(self) -> TokenChunk | None:
        return None if self.vs is None else self.vs.q

    def scratch_tensors(self) -> Iterable[torch.Tensor]:
        """Both streams' harness scratch (working copies, encoded residual batches), never counted as held."""
        return [t for s in (self.ks, self.vs) if s is not None for t in s.scratch_tensors()]


class QuantizedStore(StreamViews, LayerStore):
    """Quantized K/V chunks plus full-precision residuals, one :class:`Stream` per tensor."""

    #: Whether a decode step attends to its own tokens before they are flushed (KIVI) or after.
    attend_before_flush = False
    #: Whether ``encode_values`` quantizes each token on its own (see :class:`Stream`). Only a value window
    #: (KIVI's) flushes a few tokens at a time past a residual; keys either flush whole channel groups or
    #: quantize on arrival, where there is nothing to encode ahead.
    token_wise_values = False
    #: Whether ``encode_keys`` and ``encode_values`` give exactly what their chunks' ``TokenChunk.write`` writes,
    #: so that a decode step's token is encoded straight into the open tail (``Stream.push``).
    tail_writes = False

    def __init__(self, strategy: Strategy, layer_idx: int, num_layers: int, residual: int, multiple: int,
                 value_policy: tuple[int, int] | None = None) -> None:
        super().__init__(strategy, layer_idx, num_layers)
        self.key_policy = (residual, multiple)
        self.value_policy = value_policy or self.key_policy
        self.ks: Stream | None = None
        self.vs: Stream | None = None

    @abstractmethod
    def encode_keys(self, x: torch.Tensor) -> TokenChunk:
        """Quantize ``x`` (a multiple of the key flush unit) in the strategy's key format."""

    @abstractmethod
    def encode_values(self, x: torch.Tensor) -> TokenChunk:
        """Quantize ``x`` (a multiple of the value flush unit) in the strategy's value format."""

    def _streams(self) -> tuple[Stream, Stream]:
        if self.ks is None or self.vs is None:
            working = working_copy_enabled(self.strategy)
            self.ks = Stream(self.encode_keys, *self.key_policy, working, writes=self.tail_writes)
            self.vs = Stream(self.encode_values, *self.value_policy, working, token_wise=self.token_wise_values,
                             writes=self.tail_writes)
        return self.ks, self.vs

    @property
    def rk(self) -> torch.Tensor | None:
        return None if self.ks is None else self.ks.r

    @property
    def rv(self) -> torch.Tensor | None:
        return None if self.vs is None else self.vs.r

    @property
    def dtype(self) -> torch.dtype | None:
        return None if self.ks is None else self.ks.dtype

    def prefill(self, keys: torch.Tensor, values: torch.Tensor, capture: LayerCapture | None) -> None:
        ks, vs = self._streams()
        ks.ingest(keys, attend_first=False)
        vs.ingest(values, attend_first=False)

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ks, vs = self._streams()
        first = self.attend_before_flush
        k, v = ks.ingest(keys, attend_first=first), vs.ingest(values, attend_first=first)
        if first:
            assert k is not None and v is not None
            return k, v
        return self.materialize()

    def attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
               scaling: float, softcap: float | None = None) -> torch.Tensor:
        """``LayerStore.attend`` over the codes: each block of the quantized pieces is decoded (or its scales
        folded into the products) only while attention reads it, the residual read as it is."""
        ks, vs = self._take(keys, values)
        out = blockattn.attend(query, ks.run(keys.shape[1]), vs.run(keys.shape[1]), mask, scaling, softcap)
        self._taken(keys, values)
        return out

    @classmethod
    def attend_rows(cls, stores: Sequence[LayerStore], query: torch.Tensor, keys: Sequence[torch.Tensor],
                    values: Sequence[torch.Tensor], scaling: float, softcap: float | None = None) -> torch.Tensor:
        """``LayerStore.attend_rows``: every row's new tokens stored, then every row's codes read in one kernel
        call (``blockattn.attend_rows``; a decode step of many sequences otherwise pays a call and its Python per
        row and layer), then each row's step finished as :meth:`attend` finishes it. Where the one call does not
        apply (a softcap, a reader without it), blockattn reads each row on its own."""
        if cls.attend is not QuantizedStore.attend or cls._take is not QuantizedStore._take:
            # a subclass's own step: each row takes it
            return super().attend_rows(stores, query, keys, values, scaling, softcap)
        rows: list[QuantizedStore] = list(stores)  # type: ignore[arg-type]
        pushed = not any(s.attend_before_flush for s in rows)
        if pushed:  # every row's step pushes its tokens (``_take``): all rows' at once where their format can
            streams = [s._streams() for s in rows]
            Stream.push_rows([ks for ks, _ in streams], keys)
            Stream.push_rows([vs for _, vs in streams], values)
        runs = []
        for s, k, v in zip(rows, keys, values, strict=True):
            ks, vs = s._streams() if pushed else s._take(k, v)
            runs.append((ks.run(k.shape[1]), vs.run(k.shape[1])))
        out = blockattn.attend_rows(query, runs, scaling, softcap)
        for s, k, v in zip(rows, keys, values, strict=True):
            s._taken(k, v)
        return out

    def _take(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[Stream, Stream]:
        """A step's first half: its new tokens stored where attention reads them."""
        ks, vs = self._streams()
        for s, x in ((ks, keys), (vs, values)):
            if self.attend_before_flush:
                s.add(x)
            else:
                s.push(x)
        return ks, vs

    def _taken(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """A step's second half, once attention has read: KIVI's own tokens (read exactly) quantized now, and the
        caller's tensors never held."""
        assert self.ks is not None and self.vs is not None
        for s, x in ((self.ks, keys), (self.vs, values)):
            if self.attend_before_flush:
                s.flush()
            s.own(x)

    def compact(self) -> None:
        """After a chunk of a chunked prefill: no reserved slots held (see :class:`ChunkList`)."""
        for s in (self.ks, self.vs):
            if s is not None:
                s.chunks.seal()

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All held tokens in the model dtype."""
        if self.ks is None or self.vs is None:
            raise KVBenchError("materialize before prefill")
        return self.ks.materialize(), self.vs.materialize()

    # -- eviction support ---------------------------------------------------------------------------
    def select_tokens(self, index: torch.Tensor) -> None:
        """Keep held tokens ``index`` (``[batch, kv_heads, n]``, ascending per head), exactly.

        Every chunk drops tokens without re-encoding (token-wise formats gather codes and scales;
        channel-axis groups become ragged through the chunk's ``group_index``). Heads may keep
        different numbers of quantized tokens, but tensors must stay dense, so each head keeps its
        first ``m`` kept quantized tokens in the chunk (``m`` the smallest count over heads) and the
        rest of its kept tokens — its extra quantized ones, as their dequantized values, and its kept
        residual ones — form the new residual, in order. Only if that residual has grown past the
        flush policy are its oldest tokens quantized again, as on any append. K and V are handled
        independently (KIVI's keys and values have different residuals).
        """
        if self.ks is None or self.vs is None or self.ks.r is None:
            raise KVBenchError("select_tokens before prefill")
        index = index.to(device=self.ks.r.device, dtype=torch.long)
        self.ks.select(index)
        self.vs.select(index)

    # -- accounting ---------------------------------------------------------------------------------
    def tensors(self) -> Iterable[torch.Tensor]:
        return [t for s in (self.ks, self.vs) if s is not None for t in s.tensors()]

    def num_tokens(self) -> int:
        return 0 if self.ks is None else self.ks.num_tokens()

    def stats(self) -> dict[str, float]:
        """Measured bits per held K/V element (payload and metadata) and the quantized share of K/V tokens."""
        if self.ks is None or self.vs is None or self.ks.r is None or self.num_tokens() == 0:
            return {}
        b, h, _, d = self.ks.r.shape
        elements = 2 * b * h * d * self.num_tokens()
        quantized = self.ks.quantized + self.vs.quantized
        return {"bits_per_element": 8 * held_bytes(self.tensors()) / elements,
                "quantized_fraction": quantized / (2 * self.num_tokens())}


def key_flush_unit(residual: int, group: int) -> int:
    """KIVI flushes keys R at a time (its code asserts R mod G = 0); kvbench rounds R up to whole groups of G
    so any R works (R = 0: one group at a time)."""
    return max(1, -(-residual // group)) * group


class KiviStore(QuantizedStore):
    """KIVI: keys per channel (groups of G tokens), values per token (groups of G channels), b bits."""

    strategy: KiviStrategy
    token_wise_values = True

    def __init__(self, strategy: KiviStrategy, layer_idx: int, num_layers: int) -> None:
        r, g = strategy.residual_length, strategy.group_size
        if strategy.residual_layout == "kivi":
            # Keys: the last T mod R exact, flushed R at a time; values: exactly the R newest exact.
            super().__init__(strategy, layer_idx, num_layers, residual=0, multiple=key_flush_unit(r, g),
                             value_policy=(r, 1))
            self.attend_before_flush = True
        else:
            super().__init__(strategy, layer_idx, num_layers, residual=r, multiple=g)

    def encode_keys(self, x: torch.Tensor) -> TokenChunk:
        return quantize_asymmetric(x, self.strategy.bits, self.strategy.group_size, "channel")

    def encode_values(self, x: torch.Tensor) -> TokenChunk:
        g = channel_group(self.strategy.group_size, x.shape[-1], f"{self.strategy.name}.group_size")
        return quantize_asymmetric(x, self.strategy.bits, g, "token")


@dataclass
class KiviStrategy(Strategy):
    """Parameters shared by ``int4`` and ``int2`` (KIVI's defaults: G = 32, R = 128, KIVI's residual layout).

    ``residual_layout``: ``kivi`` (default) is the reference's: the last ``T mod R`` keys and the ``R``
    newest values exact, the step's own tokens attended before they are quantized (an R that is not a
    multiple of G, which KIVI refuses, flushes keys in units of R rounded up to whole groups); ``window`` is
    kvbench's earlier layout: between ``R`` and ``R + G - 1`` newest tokens of both K and V exact,
    rolling a group at a time.
    """

    family = "quantization"
    bits: ClassVar[int]
    group_size: int = 32
    residual_length: int = 128
    residual_layout: str = "kivi"

    def validate(self) -> None:
        require(self.group_size in GROUP_SIZES,
                f"{self.name}.group_size must be one of {', '.join(map(str, GROUP_SIZES))} "
                f"(got {self.group_size})")
        require(isinstance(self.residual_length, int) and self.residual_length >= 0,
                f"{self.name}.residual_length must be an integer >= 0 (got {self.residual_length})")
        require(self.residual_layout in KIVI_LAYOUTS,
                f"{self.name}.residual_layout must be one of {', '.join(KIVI_LAYOUTS)} "
                f"(got {self.residual_layout!r})")

    def new_layer(self, layer_idx: int, num_layers: int) -> LayerStore:
        return KiviStore(self, layer_idx, num_layers)

    @classmethod
    def reference(cls, keys: torch.Tensor, values: torch.Tensor, capture: LayerCapture | None = None,
                  **params: Any) -> dict[str, Any]:
        """KIVI's prefill (``jy-yuan/KIVI`` ``models/llama_kivi.py``): what attention reads next and the bytes held.

        Written from the reference, not from :class:`KiviStore`: keys ``[:T - T mod R]`` quantized per
        channel in groups of G tokens, the rest exact; values ``[:T - R]`` quantized per token in groups
        of G channels, the last R exact; float16 scale and zero point per group; codes at ``bits`` bits.
        """
        p = cls(**params)
        t, (b, h, _, d) = keys.shape[-2], keys.shape
        r, g, bits = p.residual_length, p.group_size, cls.bits
        gv = min(g, d)
        nk = t - t % key_flush_unit(r, g)
        nv = max(t - r, 0)

        def part(x: torch.Tensor, n: int, group: int, axis: str) -> torch.Tensor:
            if n == 0:
                return x
            q = quantize_asymmetric(x[..., :n, :], bits, group, axis).dequantize(x.dtype)
            return torch.cat([q, x[..., n:, :]], dim=-2)

        exact = keys.element_size()
        key_bytes = nk * d * bits // 8 + (nk // g) * d * 2 * 2 + (t - nk) * d * exact
        value_bytes = nv * d * bits // 8 + nv * (d // gv) * 2 * 2 + (t - nv) * d * exact
        return {"keys": part(keys, nk, g, "channel"), "values": part(values, nv, gv, "token"),
                "exact_keys": t - nk, "exact_values": t - nv, "kv_bytes": b * h * (key_bytes + value_bytes),
                "source": "jy-yuan/KIVI models/llama_kivi.py (prefill and decode of LlamaAttention_KIVI)"}
