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

NAME = "kvbench"
#: Longest query handled here; longer ones (prefill) go to SDPA, whose blocked kernel suits them.
SHORT_QUERY = 64
#: ``engine.attention`` values: ``auto`` picks by device (:func:`resolve`).
CHOICES = ("auto", "sdpa", NAME)


def kvbench_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                              scaling: float | None = None, is_causal: bool | None = None,
                              **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query [b, q_heads, q, d]``, ``key``/``value``
    ``[b, kv_heads, kv, d]``; returns ``[b, q, q_heads, d]`` (and no weights)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    sinks = kwargs.get("s_aux")
    b, hq, q, d = query.shape
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    softcap = kwargs.get("softcap")
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
        mask = _grouped(mask, hkv, g)
        if mask.dtype == torch.bool:
            scores.masked_fill_(~mask, float("-inf"))
        else:
            scores.add_(mask)
    if sinks is not None:  # query head h * g + j has sink logit sinks[h * g + j]: a column taken, then dropped
        sink = sinks.float().view(1, hkv, g, 1, 1).expand(b, hkv, g, q, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :kv].to(work).reshape(b, hkv, g * q, kv)
    else:
        probs = torch.softmax(scores, dim=-1).to(work).view(b, hkv, g * q, kv)
    out = torch.matmul(probs, value.to(work)).to(value.dtype)  # [b, hkv, g * q, d]
    return out.view(b, hq, q, d).transpose(1, 2).contiguous(), None


def compute_dtype(query: torch.Tensor) -> torch.dtype:
    """float32 on CPU (see the module docstring), the model's dtype elsewhere."""
    return torch.float32 if query.is_cpu else query.dtype


def _grouped(mask: torch.Tensor, hkv: int, g: int) -> torch.Tensor:
    """A mask ``[.., heads (1 or q_heads), q, kv]`` (or ``[q, kv]``) viewed as ``[.., hkv, g, q, kv]``."""
    while mask.dim() < 4:
        mask = mask[None]
    mb, mh, mq, mk = mask.shape
    return mask.view(mb, 1, 1, mq, mk) if mh == 1 else mask.view(mb, hkv, g, mq, mk)


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
