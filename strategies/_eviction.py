"""Shared machinery of the eviction strategies: budgets, attention scores, GQA pooling, gathers of kept
tokens, and the store that enforces a budget at prefill and during decoding.

The short path: an eviction strategy that only scores tokens is a :class:`ScorerStrategy` with one method,
``score(keys, values, queries, capture)`` (higher = keep), like kvpress's ``ScorerPress`` (e.g. ``KnormPress``:
``-keys.norm(dim=-1)``); it inherits the budget pair, ``decode_evict`` and the store wiring (``knorm``,
``random``). Strategies that also protect tokens (sinks, recent windows) or keep running statistics write an
:class:`EvictionPolicy` instead (``snapkv``, ``h2o``, ``tova``, ``streaming_llm``).

An eviction strategy is a scoring *policy* (higher score = keep) plus a budget. :class:`EvictingStore` asks
the policy for scores, keeps the top tokens per (layer, KV head) — the same count for every head so the
cache stays a dense ``[batch, kv_heads, kept, head_dim]`` tensor — and hands the kept K/V to an inner store:
:class:`~strategies.full.FullStore` for the plain strategies, any quantizer's store for ``compose``.
Evicted tokens really leave memory: kept rows are gathered into new, smaller tensors (never masked).

Budgets. ``compression_ratio`` r is the fraction of tokens removed (kvpress's convention):
``keep(n) = max(1, n - floor(n * r))``; ``budget_tokens`` is an absolute cap (``min(n, budget_tokens)``).
The two are exclusive; with neither set the ratio is 0.5. Strategies that evict while decoding enforce
``keep(tokens seen so far)`` after every step: with a ratio the held fraction stays 1 - r, with a token
budget the cache is capped.

GQA pooling. Attention is computed per *query* head (softmax over that head's logits) and then averaged
over the ``num_kv_groups`` query heads that share a KV head, giving one score per (KV head, token). This is
the choice kvpress makes for its attention-based presses (it averages the per-query-head scores over the
group); the original SnapKV/H2O code repeats K/V per query head and so never faced the question.

Positions. Keys are stored post-RoPE, so a kept key keeps the rotation of its original position, and
``KVBenchCache.get_seq_length()`` counts every token ever processed, so new tokens get their true
positions. Held tokens stay in original order (kept indices are sorted), which the causal mask relies on.

Scores never need a full T x T attention matrix: observation-window strategies use a handful of queries,
and :func:`attention_column_sums` processes queries in chunks of 256 and skips keys a chunk cannot see.
"""

from __future__ import annotations

import copy
import math
import weakref
from abc import abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from kvbench.strategies.base import LayerCapture, LayerStore, RunContext, Strategy, require
from kvbench.strategies.full import FullStore
from torch import nn

from kvbench.errors import KVBenchError
from kvbench.quantizers import gather_tokens

QUERY_CHUNK = 256  # queries per block when summing attention over the whole prefix (H2O)


# -- budgets ------------------------------------------------------------------------------------------------
def keep_count(n: int, compression_ratio: float | None, budget_tokens: int | None) -> int:
    """Tokens kept out of ``n`` (see the module docstring): at most ``n``, at least one when ``n > 0``."""
    if n <= 0:
        return 0
    if budget_tokens is not None:
        return min(n, budget_tokens)
    assert compression_ratio is not None
    # The epsilon keeps e.g. 100 * 0.29 = 28.999... from flooring to 28.
    return max(1, n - math.floor(n * compression_ratio + 1e-9))


def check_budget(owner: str, compression_ratio: float | None, budget_tokens: int | None) -> None:
    """Validate an exclusive (``compression_ratio`` | ``budget_tokens``) pair for strategy ``owner``."""
    require(compression_ratio is None or budget_tokens is None,
            f"{owner}: set either compression_ratio or budget_tokens, not both (got {compression_ratio} and "
            f"{budget_tokens}); null the other")
    if compression_ratio is not None:
        require(isinstance(compression_ratio, (int, float)) and not isinstance(compression_ratio, bool)
                and 0.0 <= compression_ratio < 1.0,
                f"{owner}.compression_ratio must be a fraction removed in [0, 1) (got {compression_ratio!r})")
    if budget_tokens is not None:
        require_int(budget_tokens, 1, f"{owner}.budget_tokens")


def require_int(value: object, minimum: int, what: str) -> None:
    """``what`` (e.g. ``"snapkv.window_size"``) must be an integer >= ``minimum``."""
    require(isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
            f"{what} must be an integer >= {minimum} (got {value!r})")


def require_bool(value: object, what: str) -> None:
    require(isinstance(value, bool), f"{what} must be true or false (got {value!r})")


# -- tensor helpers -----------------------------------------------------------------------------------------
def select_keep(scores: torch.Tensor | None, shape: tuple[int, int, int], keep: int, sinks: int = 0,
                recent: int = 0, device: torch.device | str | None = None) -> torch.Tensor:
    """Sorted indices ``[B, H, keep]`` of the tokens to keep out of ``shape = (B, H, N)``.

    The first ``sinks`` and the last ``recent`` tokens are always kept (sinks first when the budget is too
    small for both); the rest of the budget goes to the highest ``scores`` (``[B, H or 1, N]``; one row
    shared by all heads when its head dimension is 1) among the tokens in between.
    """
    b, h, n = shape
    keep = min(keep, n)
    sinks = min(sinks, keep)
    recent = min(recent, keep - sinks)
    middle = keep - sinks - recent
    dev = scores.device if scores is not None else device
    parts = [torch.arange(sinks, device=dev).expand(b, h, sinks),
             torch.arange(n - recent, n, device=dev).expand(b, h, recent)]
    if middle:
        if scores is None:
            raise KVBenchError("this eviction policy has no scores to choose among unprotected tokens")
        top = scores[..., sinks:n - recent].float().topk(middle, dim=-1).indices + sinks
        parts.append(top.expand(b, h, middle))
    return torch.cat(parts, dim=-1).sort(dim=-1).values


def _grouped(queries: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[B, Hq, Q, D]`` -> ``[B, H, G, Q, D]``: query head ``h * G + g`` reads KV head ``h`` (repeat_kv)."""
    b, hq, q, d = queries.shape
    require(hq % kv_heads == 0, f"{hq} query heads cannot be grouped onto {kv_heads} KV heads")
    return queries.reshape(b, kv_heads, hq // kv_heads, q, d)


def attention_probs(queries: torch.Tensor, keys: torch.Tensor, scaling: float,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal softmax attention ``[B, H, G, Q, N]`` (float32) of the last Q positions' queries over ``keys``.

    Query ``i`` sits at key index ``N - Q + i`` and sees keys up to and including it. Meant for a few
    queries (observation windows, the current decode step); use :func:`attention_column_sums` for many.
    ``sinks`` (GPT-OSS, ``[q_heads]``): learned logits of an extra column that takes its share of the softmax
    and is dropped, as the model's own attention does.
    """
    n, nq = keys.shape[-2], queries.shape[-2]
    return _probs(_grouped(queries, keys.shape[1]).float(), keys.float(), scaling, first_pos=n - nq, sinks=sinks)


def attention_column_sums(queries: torch.Tensor, keys: torch.Tensor, scaling: float,
                          chunk: int = QUERY_CHUNK, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention each key receives, summed over the queries of the last Q positions: ``[B, H, G, N]`` fp32.

    Processes ``chunk`` queries at a time and only the keys a chunk can see, so memory stays
    ``chunk x N`` per head and the causal half of the work is skipped.
    """
    k = keys.float()
    n, nq = k.shape[-2], queries.shape[-2]
    grouped = _grouped(queries, k.shape[1])
    out = torch.zeros(*grouped.shape[:3], n, device=k.device)  # on the keys' device: it meets probs below
    for start in range(0, nq, chunk):  # blocks of queries, each one batched matmul (not a loop over tokens)
        stop = min(start + chunk, nq)
        visible = n - nq + stop  # keys up to the block's last query position
        block = grouped[:, :, :, start:stop].float()
        probs = _probs(block, k[:, :, :visible], scaling, first_pos=n - nq + start, sinks=sinks)
        out[..., :visible] += probs.sum(dim=-2)
    return out


def _probs(q: torch.Tensor, k: torch.Tensor, scaling: float, first_pos: int,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax of grouped queries ``[B, H, G, Q, D]`` at key indices ``first_pos..`` over ``[B, H, N, D]``."""
    b, h, g, nq, d = q.shape
    n = k.shape[-2]
    # One batched GEMM per KV head with its G query heads stacked: no K copy per query head.
    logits = torch.matmul(q.reshape(b, h, g * nq, d), k.transpose(-1, -2)).mul_(scaling).view(b, h, g, nq, n)
    # Keys before first_pos are in every query's past; only the trailing block needs the causal mask.
    block = logits[..., first_pos:]
    ar = torch.arange(max(n - first_pos, nq), device=q.device)
    block.masked_fill_(ar[: n - first_pos] > ar[:nq, None], float("-inf"))
    if sinks is not None:  # query head h * G + g has sink logit sinks[h * G + g]
        sink = sinks.float().to(logits.device).view(1, h, g, 1, 1).expand(b, h, g, nq, 1)
        return torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :n]
    return logits.softmax(dim=-1)


# -- policies and the store ----------------------------------------------------------------------------------
class EvictionPolicy:
    """One layer's token scoring for an eviction strategy (higher = keep).

    Stateless unless a subclass keeps running statistics (H2O's accumulated attention), in which case it
    gathers them in :meth:`on_select` and lists them in :meth:`tensors` so they count as held bytes.
    """

    def __init__(self, strategy: EvictionStrategy, layer_idx: int, num_layers: int) -> None:
        self.strategy = strategy
        self.layer_idx = layer_idx
        self.num_layers = num_layers

    @property
    def needs_queries(self) -> bool:
        """Whether scores read the captured queries (the store then checks they belong to the current step).

        Derived from the strategy's one declaration, ``query_window`` (0: reads none), never declared again.
        """
        return self.strategy.query_window != 0

    def protected(self, keep: int) -> tuple[int, int]:
        """``(sinks, recent)``: leading and trailing tokens kept regardless of score."""
        return 0, 0

    def queries_needed(self, n_new: int) -> int:
        """How many of the newest queries :meth:`decode_scores` reads after an append of ``n_new`` tokens."""
        return 1

    def prefill_scores(self, keys: torch.Tensor, values: torch.Tensor,
                       queries: torch.Tensor | None, capture: LayerCapture | None) -> torch.Tensor | None:
        """Scores ``[B, H or 1, T]`` for the prefix tokens (``None``: protected tokens decide alone)."""
        return None

    def decode_scores(self, keys: torch.Tensor, values: torch.Tensor, n_new: int,
                      queries: torch.Tensor | None, capture: LayerCapture | None) -> torch.Tensor | None:
        """Scores ``[B, H or 1, N]`` for held + new tokens after an append of ``n_new`` tokens."""
        return self.prefill_scores(keys, values, queries, capture)

    def on_select(self, index: torch.Tensor) -> None:
        """Keep running statistics aligned with the kept tokens ``[B, H, k]``."""

    def tensors(self) -> list[torch.Tensor]:
        return []


class EvictingStore(LayerStore):
    """A policy's top tokens held in an inner store, chosen at prefill and, if the policy's strategy evicts
    while decoding, again after every step.

    ``strategy`` is the owner that made the store (the eviction strategy itself, or ``compose``); budgets
    come from ``policy.strategy``.
    """

    def __init__(self, strategy: Strategy, layer_idx: int, num_layers: int, inner: LayerStore,
                 policy: EvictionPolicy) -> None:
        super().__init__(strategy, layer_idx, num_layers)
        self.inner = inner
        self.policy = policy
        self.evict = policy.strategy
        self.seen = 0
        self.prompt = 0  # tokens seen through the last multi-token forward (prefill, chunks, a question)
        self.decode_evicted = 0
        self._used: weakref.ref | None = None  # the last query tensor scored, to refuse stale captures
        # K/V of the last multi-token append, for compact(); single-token decode steps never keep them.
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None

    # Queries must come from the current forward: a cache used without `attach` would otherwise score the
    # new tokens with the prefill's queries and silently evict the wrong ones.
    def _queries(self, last_position: int, needed: int) -> torch.Tensor | None:
        if not self.policy.needs_queries:
            return None
        cap, name = self.capture, self.evict.name
        if cap is None or cap.queries is None:
            raise KVBenchError(f"{name} scores tokens by attention and needs queries: build the cache with "
                               "KVBenchCache.from_capture(..., captures) or run inside cache.attach(model)")
        q = cap.queries
        fresh = self._used is None or self._used() is not q
        if cap.positions is not None:
            fresh = fresh and int(cap.positions.reshape(-1)[-1]) == last_position
        if not fresh or q.shape[-2] < needed:
            raise KVBenchError(f"{name} evicts while decoding from the current step's queries, but none were "
                               "recorded for it: run the model inside `with cache.attach(model):`")
        self._used = weakref.ref(q)
        return q

    def _choose(self, scores: torch.Tensor | None, shape: tuple[int, int, int], keep: int,
                device: torch.device) -> torch.Tensor:
        index = select_keep(scores, shape, keep, *self.policy.protected(keep), device=device)
        self.policy.on_select(index)
        return index

    def prefill(self, keys: torch.Tensor, values: torch.Tensor, capture: LayerCapture | None) -> None:
        b, h, n, _ = keys.shape
        self.capture = capture
        self.seen = self.prompt = n
        keep = self.evict.prefill_keep(n, self.layer_idx, self.num_layers)
        scores = self.policy.prefill_scores(keys, values, self._queries(n - 1, 1), capture)
        index = self._choose(scores, (b, h, n), keep, keys.device)
        # gather copies: the shared captured prefill is never written to, and the kept rows are compact.
        self.inner.capture = capture
        self.inner.prefill(gather_tokens(keys, index, -2), gather_tokens(values, index, -2), capture)

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n_new = keys.shape[-2]
        self.seen += n_new
        if n_new > 1:
            self.prompt = self.seen
        self._pending = None
        k_all, v_all = self.inner.append(keys, values)  # this step attends to held + new, as the mask expects
        budget = self.evict.decode_budget(self.seen, self.layer_idx, self.num_layers, self.prompt)
        if budget is None:
            if n_new > 1 and not isinstance(self.inner, FullStore):
                self._pending = (k_all, v_all)
            return k_all, v_all
        b, h, n, _ = k_all.shape
        # Scored on every step, not only when over budget: running statistics (H2O) must see every query.
        queries = self._queries(self.seen - 1, self.policy.queries_needed(n_new))
        scores = self.policy.decode_scores(k_all, v_all, n_new, queries, self.capture)
        if n > budget:
            self.inner.select_tokens(self._choose(scores, (b, h, n), budget, k_all.device))
            self.decode_evicted += n - budget
        return k_all, v_all

    def attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
               scaling: float, softcap: float | None = None) -> torch.Tensor:
        """``LayerStore.attend``: a policy that chose its tokens at prefill and keeps every new one (no decode
        budget) lets the inner store attend over its own storage (a quantizer's codes, block by block); one that
        evicts while decoding scores the step's dense K/V, so it reads them through :meth:`append`."""
        n_new = keys.shape[-2]
        seen = self.seen + n_new
        prompt = seen if n_new > 1 else self.prompt
        if self.evict.decode_budget(seen, self.layer_idx, self.num_layers, prompt) is not None:
            return super().attend(query, keys, values, mask, scaling, softcap)
        self.seen, self.prompt, self._pending = seen, prompt, None
        return self.inner.attend(query, keys, values, mask, scaling, softcap)

    def compact(self) -> None:
        """Chunked prefill: after each chunk, evict back to the prefill budget, scored with its queries.

        Strategies that evict while decoding are already within budget after ``append``; the others let
        appended tokens accumulate, so this re-scores all held tokens as a prefill of ``seen`` tokens would.
        """
        keep = self.evict.prefill_keep(self.seen, self.layer_idx, self.num_layers)
        pending, self._pending = self._pending, None
        if self.num_tokens() <= keep:
            return
        inner = self.inner
        if isinstance(inner, FullStore) and inner.keys is not None and inner.values is not None:
            pending = (inner.keys, inner.values)
        if pending is None:
            raise KVBenchError(f"{self.strategy.name} compacts from the last multi-token chunk's K/V; "
                               "use a chunk of at least 2 tokens (engine.chunk_tokens >= 2)")
        k, v = pending
        scores = self.policy.prefill_scores(k, v, self._queries(self.seen - 1, 1), self.capture)
        self.inner.select_tokens(self._choose(scores, tuple(k.shape[:3]), keep, k.device))  # type: ignore[arg-type]

    def tensors(self) -> Iterable[torch.Tensor]:
        return [*self.inner.tensors(), *self.policy.tensors()]

    def num_tokens(self) -> int:
        return self.inner.num_tokens()

    def select_tokens(self, index: torch.Tensor) -> None:
        self.policy.on_select(index)
        self.inner.select_tokens(index)

    def stats(self) -> dict[str, float]:
        held = self.num_tokens()
        return {**self.inner.stats(), "kept_fraction": held / self.seen if self.seen else 1.0,
                "evicted_tokens": float(self.seen - held),
                "decode_evicted_tokens": float(self.decode_evicted)}


@dataclass
class EvictionStrategy(Strategy):
    """Base of the eviction strategies: the exclusive budget pair and the store wiring.

    Subclasses define :meth:`policy` and, if they evict while decoding, :meth:`evicts_during_decode`.
    """

    family = "eviction"
    compression_ratio: float | None = None
    budget_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.compression_ratio is None and self.budget_tokens is None:
            self.compression_ratio = 0.5
        super().__post_init__()

    def validate(self) -> None:
        check_budget(self.name, self.compression_ratio, self.budget_tokens)

    def prefill_keep(self, n: int, layer_idx: int, num_layers: int) -> int:
        """Tokens layer ``layer_idx`` keeps out of an ``n``-token prefix."""
        return keep_count(n, self.compression_ratio, self.budget_tokens)

    def evicts_during_decode(self) -> bool:
        return False

    def decode_budget(self, seen: int, layer_idx: int, num_layers: int, prompt: int | None = None) -> int | None:
        """Most tokens held after a step, ``seen`` tokens in; ``None`` lets new tokens accumulate.

        ``prompt`` is the number of tokens fed before decoding (through the last multi-token forward). With a
        ratio the budget grows with ``seen`` (the held fraction stays ``1 - r``) unless the strategy has
        ``fixed_cache = True``: then it stays at the prompt's budget, the papers' fixed-size cache (H2O, TOVA).
        """
        if not self.evicts_during_decode():
            return None
        fixed = getattr(self, "fixed_cache", False) and prompt is not None
        return keep_count(prompt if fixed else seen, self.compression_ratio, self.budget_tokens)

    def policy(self, layer_idx: int, num_layers: int) -> EvictionPolicy:
        return EvictionPolicy(self, layer_idx, num_layers)

    def wrap(self, inner: LayerStore, layer_idx: int, num_layers: int,
             owner: Strategy | None = None) -> EvictingStore:
        """This strategy's eviction in front of any store that drops tokens (``compose``: a quantizer's)."""
        return EvictingStore(owner or self, layer_idx, num_layers, inner, self.policy(layer_idx, num_layers))

    def new_layer(self, layer_idx: int, num_layers: int) -> LayerStore:
        return self.wrap(FullStore(self, layer_idx, num_layers), layer_idx, num_layers)


class _Scores(EvictionPolicy):
    """The policy of a :class:`ScorerStrategy`: its ``score``, called on the layer's own copy of the strategy."""

    def __init__(self, strategy: ScorerStrategy, layer_idx: int, num_layers: int) -> None:
        super().__init__(strategy, layer_idx, num_layers)
        # A shallow copy per layer store: a scorer may keep per-layer state on ``self`` (random's generator), as
        # kvpress's presses do, and it starts afresh with every cache built.
        self.scorer = copy.copy(strategy)
        self.scorer.layer_idx, self.scorer.num_layers = layer_idx, num_layers

    def prefill_scores(self, keys: torch.Tensor, values: torch.Tensor,
                       queries: torch.Tensor | None, capture: LayerCapture | None) -> torch.Tensor:
        return self.scorer.score(keys, values, queries, capture)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Scores:
        # The layer's scorer copy is cache state (random's generator stream goes on while decoding), so a copy
        # of the cache (kvbench.engine.clone_cache) gets its own; the bound run context stays shared.
        new = copy.copy(self)
        memo[id(self)] = new
        for key, value in vars(self).items():
            setattr(new, key, copy.deepcopy(value, memo))
        new.scorer = copy.copy(self.scorer)
        for key, value in vars(self.scorer).items():
            setattr(new.scorer, key, value if key == "context" else copy.deepcopy(value, memo))
        return new


@dataclass
class ScorerStrategy(EvictionStrategy):
    """An eviction strategy in one method: :meth:`score` ranks tokens, the top ``keep(n)`` per KV head stay.

    kvpress's ``ScorerPress`` in kvbench's terms. The budget pair (``compression_ratio`` | ``budget_tokens``)
    and ``decode_evict`` are inherited: with ``decode_evict = true`` the same score (over held + new tokens)
    enforces the budget after every decode step. A score that reads queries overrides ``query_window`` (how
    many of the last prefill queries it reads) — the one declaration the store derives its checks from.
    ``attention_guided = True`` when the score is built from attention (the claim check's "attention-guided").
    Parity: a ``reference`` classmethod next to it (see ``docs/checklists/strategy.md``) is picked up by
    ``tests/test_parity_eviction.py``.
    """

    decode_evict: bool = False
    # The layer the copy that scores belongs to (set by :class:`_Scores`; not parameters, so not fields).
    layer_idx = 0
    num_layers = 1

    @abstractmethod
    def score(self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None,
              capture: LayerCapture | None) -> torch.Tensor:
        """Scores ``[B, H or 1, N]`` for the tokens of ``keys``/``values`` ``[B, H, N, D]`` (higher = keep);
        ``queries`` are the captured ones (``None`` unless ``query_window`` asks for them)."""

    def validate(self) -> None:
        super().validate()
        require_bool(self.decode_evict, f"{self.name}.decode_evict")

    def evicts_during_decode(self) -> bool:
        return self.decode_evict

    def policy(self, layer_idx: int, num_layers: int) -> EvictionPolicy:
        return _Scores(self, layer_idx, num_layers)


# -- per-layer attention masks -----------------------------------------------------------------------------
def fit_masks_to_layers(context: RunContext | None) -> None:
    """Let layers hold different token counts (PyramidKV) during multi-token forwards.

    transformers builds one attention mask per forward, sized from layer 0's cache. When another layer
    holds a different number of tokens, this pre-hook on that layer's attention rebuilds the mask with
    the layer's own width: every held token is in the past of every new token (kvbench caches hold one
    unpadded sequence per row), so held columns are all visible and the new tokens keep their causal block.
    Installed once per model; a no-op whenever the widths already agree.
    """
    model = getattr(context, "model", None)
    if model is None:
        return
    from kvbench.capture import attention_modules

    for module in attention_modules(model):
        if not getattr(module, "_kvbench_fit_mask", False):
            module.register_forward_pre_hook(_fit_mask_hook, with_kwargs=True)
            module._kvbench_fit_mask = True


def _fit_mask_hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict] | None:
    mask = kwargs.get("attention_mask")
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    layers = getattr(cache, "layers", None)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or layers is None:
        return None
    layer = layers[module.layer_idx]
    store = getattr(layer, "store", None)
    if store is None:
        return None
    q = (args[0] if args else kwargs["hidden_states"]).shape[1]
    held = store.num_tokens() if getattr(layer, "seen_tokens", 0) else 0
    if mask.shape[-1] == held + q or mask.shape[-1] < q:
        return None
    fill = torch.ones((), dtype=torch.bool) if mask.dtype == torch.bool else torch.zeros((), dtype=mask.dtype)
    past = fill.to(mask.device).expand(*mask.shape[:-1], held)
    kwargs["attention_mask"] = torch.cat([past, mask[..., -q:]], dim=-1)
    return args, kwargs
