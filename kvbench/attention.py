"""``attn_implementation="kvbench"``: attention for short queries against a long cache, and its selection.

The harness's own passes are single-token decode steps and short question/answer passes over a cache of
thousands of tokens. On CPU, PyTorch's bf16 SDPA for that shape is far slower than the memory traffic it needs
(results/perf/decode.md). This implementation is eager attention (transformers' ``eager_attention_forward``)
without ``repeat_kv``: the ``q_heads / kv_heads`` query heads of each group are stacked along the query axis,
so one matmul per KV head reads its keys once (grouped-query attention, Ainslie et al. 2023, "GQA"). Softmax
runs in float32. The matmuls run in :func:`compute_dtype`: the model's dtype on accelerators, float32 on CPU,
where on the AVX2 CPU this was built on one decode step's attention of one layer at 4K tokens (9 query heads
on 3 KV heads, bf16 cache) took ~10 ms as a bf16 matmul and 0.7-1.3 ms upcasting K/V to float32 (bf16 SDPA:
~17 ms; float32 SDPA and this path: ~0.75 ms; single thread, minimum of 40 runs). Products of bf16 inputs are
exact in float32, so this only removes rounding that SDPA's own CPU kernel (which accumulates in float32)
does not do either. Queries longer than
:data:`SHORT_QUERY` (prefill) go to SDPA unchanged.

Semantics are transformers': the mask is built by ``sdpa_mask`` (registered for this name, so the mask, its
sliding window and kvbench's per-row masks for ragged batches arrive exactly as SDPA would get them), boolean
or additive; ``scaling`` and ``softcap`` (Gemma 2's logit soft-capping) as in eager attention; attention sinks
(``s_aux``, GPT-OSS's learned per-head logits) as in GPT-OSS's eager attention: one extra softmax column per query
head, dropped after the softmax. SDPA has no such column, so with sinks every query length stays here.
"""

from __future__ import annotations

from typing import Any

import torch

from kvbench.blockattn import compute_dtype, grouped_mask

__all__ = ["CHOICES", "NAME", "PendingKV", "PendingRows", "PendingStep", "compute_dtype", "kvbench_attention_forward",
           "register", "resolve", "use"]

NAME = "kvbench"
#: Longest query handled here; longer ones (prefill) go to SDPA, whose blocked kernel suits them.
SHORT_QUERY = 64
#: ``engine.attention`` values: ``auto`` picks by device (:func:`resolve`).
CHOICES = ("auto", "sdpa", NAME)


def kvbench_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                              scaling: float | None = None, is_causal: bool | None = None,
                              **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query [b, q_heads, q, d]``, ``key [b, kv_heads, kv, d]``,
    ``value [b, kv_heads, kv, dv]``; returns ``[b, q, q_heads, dv]`` (and no weights)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    sinks = kwargs.get("s_aux")
    b, hq, q, d = query.shape
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    softcap = kwargs.get("softcap")
    # The store attends over its own storage unless sink logits join the softmax (GPT-OSS): the block reader has
    # no sink column, so those layers read dense K/V below (sinks are verified against eager there).
    if isinstance(key, PendingKV) and q <= SHORT_QUERY and not (dropout and module.training) \
            and kwargs.get("position_bias") is None and sinks is None:
        # A kvbench cache's step: the store appends the new tokens and attends over its own storage.
        if attention_mask is None and causal and q > 1:  # the new tokens are the last q of the held + new
            total = key.step.held() + q
            attention_mask = torch.ones(q, total, dtype=torch.bool, device=query.device).tril(total - q)
        out = key.step.attend(query, attention_mask, d ** -0.5 if scaling is None else scaling, softcap)
        return out.transpose(1, 2).contiguous(), None
    if isinstance(key, PendingKV):  # read densely (sinks, a long query): the held tokens and the new ones
        key, value = key.step.resolve()
    long_query = q > SHORT_QUERY or (attention_mask is None and causal and 1 < q != key.shape[-2])
    if softcap is None and sinks is None and (long_query or (dropout and module.training)
                            or kwargs.get("position_bias") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    hkv, kv = key.shape[1], key.shape[-2]
    g = hq // hkv
    if scaling is None:
        scaling = d ** -0.5
    work = compute_dtype(query)
    # Query head j reads KV head j // g (transformers' repeat_kv layout): a group's heads are contiguous.
    scores = torch.matmul(query.reshape(b, hkv, g * q, d).to(work), key.to(work).transpose(-1, -2)).float()
    scores = scores.mul_(scaling).view(b, hkv, g, q, kv)
    if softcap is not None:
        scores = torch.tanh(scores.div_(softcap)).mul_(softcap)
    mask = attention_mask
    if mask is None and causal and q > 1:  # SDPA's is_causal, aligned to the last key (q == kv but with sinks)
        mask = torch.ones(q, kv, dtype=torch.bool, device=query.device).tril(kv - q)
    if mask is not None:
        mask = grouped_mask(mask, hkv, g)
        if mask.dtype == torch.bool:
            scores.masked_fill_(~mask, float("-inf"))
        else:
            scores.add_(mask)
    if sinks is not None:  # query head h * g + j has sink logit sinks[h * g + j]: a column taken, then dropped
        sink = sinks.float().view(1, hkv, g, 1, 1).expand(b, hkv, g, q, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :kv].to(work).reshape(b, hkv, g * q, kv)
    else:
        probs = torch.softmax(scores, dim=-1).to(work).view(b, hkv, g * q, kv)
    out = torch.matmul(probs, value.to(work)).to(value.dtype)  # [b, hkv, g * q, value width]
    # The value width, not the query's: MLA's query/key heads are wider than its values (DeepSeek-V3: 192, 128).
    return out.view(b, hq, q, value.shape[-1]).transpose(1, 2).contiguous(), None


class PendingStep:
    """One layer's new K/V, handed by ``KVBenchLayer.update`` to the attention that reads them: either
    :meth:`attend` (the store appends them and attends over its own storage, ``LayerStore.attend``) or, for any
    other consumer, :meth:`resolve` (the store appends them and returns dense K/V, ``LayerStore.append``)."""

    def __init__(self, store: Any, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.store, self.keys, self.values = store, keys, values
        self.kv: tuple[torch.Tensor, torch.Tensor] | None = None
        self.done = False

    def held(self) -> int:
        """Tokens held before this step."""
        return int(self.store.num_tokens())

    def resolve(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kv is None:
            assert not self.done, "a pending step is either attended or resolved, once"
            self.kv, self.done = self.store.append(self.keys, self.values), True
        return self.kv

    def attend(self, query: torch.Tensor, mask: torch.Tensor | None, scaling: float,
               softcap: float | None) -> torch.Tensor:
        assert not self.done, "a pending step is either attended or resolved, once"
        self.done = True
        return self.store.attend(query, self.keys, self.values, mask, scaling, softcap)


class PendingRows:
    """Several samples' :class:`PendingStep` s behind one batched forward (``kvbench.cache.RowsCache``): rows
    whose K/V are left-padded to a common width. :meth:`attend` lets each row's store attend with that row's
    queries and its own columns of the per-row mask (the columns left of them are its padding) — a decode step's rows,
    which read every column of their own, together through their stores' class (``LayerStore.attend_rows``: one
    kernel call per layer where the reader has it); :meth:`resolve` gives the left-padded dense K/V, through
    ``pad``."""

    def __init__(self, steps: list[PendingStep], keys: torch.Tensor, values: torch.Tensor, pad: Any) -> None:
        self.steps, self.keys, self.values, self.pad = steps, keys, values, pad
        self.kv: tuple[torch.Tensor, torch.Tensor] | None = None

    def held(self) -> int:
        return max(s.held() + s.keys.shape[-2] for s in self.steps) - self.keys.shape[-2]

    def resolve(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kv is None:
            kv = [s.resolve() for s in self.steps]
            self.kv = self.pad([k for k, _ in kv]), self.pad([v for _, v in kv])
        return self.kv

    def attend(self, query: torch.Tensor, mask: torch.Tensor | None, scaling: float,
               softcap: float | None) -> torch.Tensor:
        outs = []
        # One query token per row (a decode step): a row's own columns, its held tokens and its new one, are all
        # visible (RowsCache.mask), so its store reads them unmasked rather than converting an all-visible mask.
        per_row = mask is not None and query.shape[-2] > 1
        kind = type(self.steps[0].store)
        if not per_row and all(type(s.store) is kind for s in self.steps):
            # every row unmasked, with stores of one class: they attend together (``LayerStore.attend_rows``)
            for s in self.steps:
                assert not s.done, "a pending step is either attended or resolved, once"
                s.done = True
            return kind.attend_rows([s.store for s in self.steps], query, [s.keys for s in self.steps],
                                    [s.values for s in self.steps], scaling, softcap)
        for i, s in enumerate(self.steps):
            m = None
            if per_row:
                row = mask[i:i + 1] if mask.shape[0] > 1 else mask
                m = row[..., row.shape[-1] - (s.held() + s.keys.shape[-2]):]
            outs.append(s.attend(query[i:i + 1], m, scaling, softcap))
        return torch.cat(outs, dim=0)


class PendingKV(torch.Tensor):
    """The new keys (or values) of a :class:`PendingStep`, as transformers' ``Cache.update`` returns them.

    ``attn_implementation="kvbench"`` recognises it and lets the store attend (:class:`PendingStep`). Any other
    use — SDPA, eager attention, a ``torch.cat`` of batch rows, even ``.shape`` — goes through
    ``__torch_function__``, which first resolves the step into the dense K/V the store's ``append`` returns, so
    every other attention reads exactly what it read before.
    """

    step: PendingStep | PendingRows
    which: int

    @staticmethod
    def wrap(step: PendingStep | PendingRows) -> tuple[PendingKV, PendingKV]:
        out = []
        for which, t in enumerate((step.keys, step.values)):
            x = torch.Tensor._make_subclass(PendingKV, t)
            x.step, x.which = step, which
            out.append(x)
        return out[0], out[1]

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        from torch.utils._pytree import tree_map

        def real(x: Any) -> Any:
            return x.step.resolve()[x.which] if isinstance(x, PendingKV) else x

        args, kwargs = tree_map(real, (args, kwargs or {}))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def register() -> None:
    """Register ``"kvbench"`` with transformers (attention function and, for its masks, ``sdpa_mask``)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, kvbench_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def resolve(choice: str, device: str) -> str:
    """The implementation ``engine.attention=choice`` means on ``device``.

    ``auto``: ``kvbench`` on CPU, where it measured faster than SDPA (bf16 decode at 512 tokens: 0.70x SDPA's
    step time with kvbench's ``full`` cache; the per-layer figures in the module docstring; re-measure with
    ``scripts/bench_decode.py``, rows ``full (sdpa)`` and ``full (kvbench)``); SDPA elsewhere (its
    flash/efficient kernels were not measured against this one on an accelerator)."""
    from kvbench.errors import KVBenchError

    if choice not in CHOICES:
        raise KVBenchError(f"unknown engine.attention {choice!r}; valid: {', '.join(CHOICES)}")
    if choice == "auto":
        return NAME if torch.device(device).type == "cpu" else "sdpa"
    return choice


def use(model: torch.nn.Module, choice: str, device: str) -> str:
    """Switch ``model`` (a transformers model) to the implementation ``choice`` resolves to; return its name."""
    from kvbench.errors import KVBenchError

    name = resolve(choice, device)
    if choice == "auto" and name == "sdpa" and not getattr(model, "_supports_sdpa", True):
        name = NAME  # no SDPA for this model (GPT-OSS: SDPA has no sink column); kvbench's attention has them
    if name == NAME:
        register()
    try:
        model.set_attn_implementation(name)
    except ValueError as exc:  # transformers refuses SDPA for models without it: one line, not a traceback
        raise KVBenchError(f"engine.attention={choice}: {str(exc).splitlines()[0].split('. ')[0]}; use "
                           f"engine.attention=auto or {NAME}") from None
    return name
