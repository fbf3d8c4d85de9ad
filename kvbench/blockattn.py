"""Attention that reads a cache block by block, combined with an online softmax: what ``LayerStore.attend`` runs.

A short query (a decode step, a question pass) attends to a cache of thousands of tokens. A store that keeps
its tokens compressed need not decode them all into a dense copy first: attention reads one block of
:data:`BLOCK_TOKENS` tokens at a time, each block's keys giving its scores and its values the block's weighted
sum, and the blocks are merged with the running maximum and denominator of an online softmax (Milakov &
Gimelshein 2018, "Online normalizer calculation for softmax"; the split-KV decoding of flash-decoding, Dao et
al. 2023). So the live memory of a step is the stored bytes plus one block's temporaries, never a dense copy.

A cache is read through two :class:`TokenRun` s, one for keys and one for values (their storage may be cut into
pieces at different tokens, as KIVI's are). A run is a sequence of *parts* in token order; a part is anything
with ``num_tokens`` and the two block reads:

* ``scores(q, start, stop)`` — ``q`` ``[b, kv_heads, m, d]`` (the ``m = group * q_len`` query rows of each KV
  head, in :func:`kvbench.attention.compute_dtype`) times the part's keys ``start:stop``: ``[b, kv_heads, m, n]``;
* ``weighted(p, start, stop)`` — probabilities ``[b, kv_heads, m, n]`` times the part's values ``start:stop``:
  ``[b, kv_heads, m, d]``.

:class:`Dense` is a plain ``[b, kv_heads, tokens, d]`` tensor; quantized chunks (``kvbench.quantizers``) are
parts too, and each decodes only the block asked for or folds its scales into the products (KIVI, Liu et al.
2024: a per-token scale multiplies a token's score or probability, a per-tensor scale the whole product).

Semantics are :func:`kvbench.attention.kvbench_attention_forward`'s: the mask (boolean or additive,
``[.., 1 or q_heads, q, kv]``) covers every token the runs hold, ``scaling`` and ``softcap`` as in eager
attention, softmax in float32. Only the order of the float32 sums differs from one softmax over all tokens.
A short query (decode steps: up to ``kvbench.fused.MAX_ROWS`` query rows per KV head) over parts that describe
themselves to it goes to the fused C++ reader (:mod:`kvbench.fused`): every row decoded once and used at once,
dense stores included, so a compressed store and ``full`` are timed on the same reader and differ only in what
they store. Otherwise (longer queries, no compiler) a cache held as one dense tensor of the query's dtype
(``full``, an eviction strategy's kept tokens) goes to PyTorch's SDPA kernel exactly as transformers calls it (its
output bit for bit), and anything else is read block by block here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

import kvbench.fused as fused

#: Tokens per block. A block's temporaries (its keys or values in float32, its scores) are the only memory a
#: step adds to the stored bytes; at 1024 tokens of 3 KV heads of 64 channels, 0.8 MB per block.
BLOCK_TOKENS = 1024


class Part(Protocol):
    """A run of tokens stored in one format (see the module docstring)."""

    @property
    def num_tokens(self) -> int: ...

    def scores(self, q: torch.Tensor, start: int, stop: int) -> torch.Tensor: ...

    def weighted(self, p: torch.Tensor, start: int, stop: int) -> torch.Tensor: ...


class Dense:
    """Dense keys or values ``[b, kv_heads, tokens, d]`` in any dtype: each block is cast to the query's dtype."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    @property
    def num_tokens(self) -> int:
        return int(self.x.shape[-2])

    def scores(self, q: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        return torch.matmul(q, self.x[..., start:stop, :].to(q.dtype).transpose(-1, -2))

    def weighted(self, p: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        return torch.matmul(p, self.x[..., start:stop, :].to(p.dtype))

    def fused(self) -> fused.Fused | None:
        return fused.dense(self.x)


class TokenRun:
    """Parts in token order, read as one sequence of tokens; ``heads``: the KV heads every part holds."""

    def __init__(self, parts: Sequence[Part], heads: int, lengths: Sequence[int] | None = None) -> None:
        """``lengths``: the parts' token counts where the caller keeps them (else each part is asked: a shape
        lookup or more per part, two runs per layer and decode step)."""
        self.heads = heads
        self.parts: list[Part] = []
        self.starts: list[int] = []
        n = 0
        for i, p in enumerate(parts):
            m = p.num_tokens if lengths is None else lengths[i]
            if m:
                self.parts.append(p)
                self.starts.append(n)
                n += m
        self.num_tokens = n

    def _overlaps(self, start: int, stop: int) -> list[tuple[Part, int, int, int]]:
        """(part, its first token, start, stop within the part) of every part the tokens ``start:stop`` touch."""
        out = []
        for part, first in zip(self.parts, self.starts, strict=True):
            lo, hi = max(start, first), min(stop, first + part.num_tokens)
            if lo < hi:
                out.append((part, lo - start, lo - first, hi - first))
        return out

    def fused(self) -> list[fused.Fused] | None:
        """Every part as the fused kernel reads it, or ``None`` when one part has no such description."""
        out = []
        for part in self.parts:
            f = getattr(part, "fused", None)
            desc = None if f is None else f()
            if desc is None:
                return None
            out.append(desc)
        return out

    def scores(self, q: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        pieces = [part.scores(q, a, b) for part, _, a, b in self._overlaps(start, stop)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)

    def weighted(self, p: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        out: torch.Tensor | None = None
        for part, at, a, b in self._overlaps(start, stop):
            y = part.weighted(p[..., at:at + b - a], a, b)
            out = y if out is None else out.add_(y)
        assert out is not None
        return out


def block_bytes(kv_heads: int, head_dim: int, rows: int, batch: int = 1, block: int = BLOCK_TOKENS) -> int:
    """Upper bound on the temporaries one block adds: a float32 block of keys or values and the codes it is
    decoded from (at most as large again), its scores, probabilities and their products (``rows`` query rows
    per KV head), and the float32 accumulator. What the working-set test allows beyond the stored bytes."""
    decoded = 2 * batch * kv_heads * block * head_dim * 4
    scores = 4 * batch * kv_heads * rows * block * 4
    acc = 3 * batch * kv_heads * rows * head_dim * 4
    return decoded + scores + acc


def attend(query: torch.Tensor, keys: TokenRun, values: TokenRun, mask: torch.Tensor | None,
           scaling: float, softcap: float | None = None, block: int | None = None) -> torch.Tensor:
    """Attention of ``query`` ``[b, q_heads, q, d]`` over the tokens of ``keys``/``values``, block by block.

    Returns ``[b, q_heads, q, dv]`` in the query's dtype, ``dv`` the values' width (``d`` but where value heads
    are narrower than query/key heads: MiMo-V2-Flash's 192/128). ``mask``: ``None`` (every token visible to every
    query), boolean (True = visible) or additive, broadcastable as ``[b, 1 or q_heads, q, tokens]``.
    """
    block = block or BLOCK_TOKENS
    b, hq, q, d = query.shape
    n = keys.num_tokens
    assert values.num_tokens == n, (keys.num_tokens, values.num_tokens)
    hkv = keys.heads
    g = hq // hkv
    work = compute_dtype(query)
    qg = query.reshape(b, hkv, g * q, d).to(work)
    m = None if mask is None else grouped_mask(mask, hkv, g)  # [.., hkv or 1, g or 1, q, n]
    if softcap is None and g * q <= fused.MAX_ROWS:
        # A short query over parts the kernel reads (every store's, dense or coded): one pass, no dense copy.
        fk, fv = keys.fused(), values.fused()
        if fk is not None and fv is not None:
            out = fused.attend(qg, fk, fv, m, q, scaling)
            if out is not None:
                return _out(out, query, b, hq, q, d)
    dense = _one_dense(keys, values, query.dtype)
    if dense is not None and softcap is None:
        # Nothing to decode: PyTorch's fused SDPA kernel reads the tensor in blocks itself, and is transformers'
        # own SDPA path, so an uncompressed store gives SDPA's output bit for bit here.
        return _sdpa(query, *dense, mask, scaling)
    run_max = run_sum = acc = None
    for start in range(0, n, block):
        stop = min(start + block, n)
        s = keys.scores(qg, start, stop).float().mul_(scaling).view(b, hkv, g, q, stop - start)
        if softcap is not None:
            s = torch.tanh(s.div_(softcap)).mul_(softcap)
        if m is not None:
            mb = m[..., start:stop]
            if mb.dtype == torch.bool:
                s.masked_fill_(~mb, float("-inf"))
            else:
                s.add_(mb)
        s = s.view(b, hkv, g * q, stop - start)
        if start == 0 and stop == n:  # one block: the plain softmax
            p = torch.softmax(s, dim=-1)
            return _out(values.weighted(p.to(work), 0, n), query, b, hq, q, d)
        top = s.amax(dim=-1, keepdim=True)
        new_max = top if run_max is None else torch.maximum(run_max, top)
        # A row every token so far is masked from keeps max -inf; exp(-inf - 0) = 0 keeps its sums at 0.
        safe = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
        p = torch.exp(s.sub_(safe))
        part = values.weighted(p.to(work), start, stop).float()
        if run_max is None:
            run_sum, acc = p.sum(dim=-1, keepdim=True), part
        else:
            assert run_sum is not None and acc is not None
            corr = torch.exp(run_max - safe)
            run_sum = run_sum.mul_(corr).add_(p.sum(dim=-1, keepdim=True))
            acc = acc.mul_(corr).add_(part)
        run_max = new_max
    if acc is None:  # no tokens at all
        return query.new_zeros(b, hq, q, d)
    assert run_sum is not None
    return _out(acc.div_(run_sum), query, b, hq, q, d)


def attend_rows(query: torch.Tensor, runs: Sequence[tuple[TokenRun, TokenRun]], scaling: float,
                softcap: float | None = None) -> torch.Tensor:
    """Several sequences' decode step: ``query`` ``[rows, q_heads, q, d]``, row ``r`` attending (unmasked) over the
    tokens of ``runs[r]`` (its keys and values). Every row is read in one kernel call where it applies
    (:func:`kvbench.fused.attend_rows`: no softcap, every part described, a reader with that call), else each row by
    :func:`attend`; either way row ``r`` of the result is :func:`attend`'s for that row alone, bit for bit."""
    r, hq, q, d = query.shape
    hkv = runs[0][0].heads
    g = hq // hkv
    out = None
    if softcap is None and query.is_cpu and g * q <= fused.MAX_ROWS and all(k.heads == hkv for k, _ in runs):
        keys, values = [], []
        for k, v in runs:
            fk, fv = k.fused(), v.fused()
            if fk is None or fv is None:
                break
            keys.append(fk)
            values.append(fv)
        else:
            out = fused.attend_rows(query.reshape(r, hkv, g * q, d).to(compute_dtype(query)), keys, values, q,
                                    scaling)
    if out is None:
        return torch.cat([attend(query[i:i + 1], k, v, None, scaling, softcap) for i, (k, v) in enumerate(runs)])
    return _out(out, query, r, hq, q, d)


def _sdpa(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          scaling: float) -> torch.Tensor:
    """SDPA as transformers' ``sdpa_attention_forward`` calls it for grouped queries, without its ``repeat_kv``
    copy: one query token's heads are packed along the query axis of their KV head (transformers' ``pack_gqa``),
    longer queries use SDPA's own grouped mode."""
    b, hq, q, d = query.shape
    g = hq // k.shape[1]
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(query.dtype)
    if g > 1 and q == 1 and mask is not None:
        if mask.dim() == 4 and mask.shape[1] != 1:
            mask = mask.reshape(mask.shape[0], hq // g, g, mask.shape[-1])
        out = torch.nn.functional.scaled_dot_product_attention(query.reshape(b, hq // g, g, d), k, v,
                                                               attn_mask=mask, scale=scaling)
        return out.reshape(b, hq, 1, v.shape[-1])
    return torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scaling,
                                                            enable_gqa=g > 1)


def _one_dense(keys: TokenRun, values: TokenRun, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The keys and values as two tensors of ``dtype`` when each run is one :class:`Dense` part of it."""
    if len(keys.parts) != 1 or len(values.parts) != 1:
        return None
    k, v = keys.parts[0], values.parts[0]
    if not (isinstance(k, Dense) and isinstance(v, Dense) and k.x.dtype == v.x.dtype == dtype):
        return None
    return k.x, v.x


def _out(o: torch.Tensor, query: torch.Tensor, b: int, hq: int, q: int, d: int) -> torch.Tensor:
    # The values' width, not the query's (MiMo-V2-Flash: 192-wide query/key heads, 128-wide value heads).
    return o.to(query.dtype).reshape(b, hq, q, o.shape[-1])


def compute_dtype(query: torch.Tensor) -> torch.dtype:
    """float32 on CPU (see ``kvbench.attention``'s docstring), the model's dtype elsewhere."""
    return torch.float32 if query.is_cpu else query.dtype


def grouped_mask(mask: torch.Tensor, hkv: int, g: int) -> torch.Tensor:
    """A mask ``[.., heads (1 or q_heads), q, kv]`` (or ``[q, kv]``) viewed as ``[.., hkv, g, q, kv]``."""
    while mask.dim() < 4:
        mask = mask[None]
    mb, mh, mq, mk = mask.shape
    return mask.view(mb, 1, 1, mq, mk) if mh == 1 else mask.view(mb, hkv, g, mq, mk)
