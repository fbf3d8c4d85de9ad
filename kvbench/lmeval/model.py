"""The lm-eval model ``kvbench``: every request answered through a strategy's compressed cache.

It loads a model the way the harness does (:func:`kvbench.models.load_model`: ``smollm2-135m``, ``tiny-llama`` or
a local checkpoint directory) and runs every request on the engine (:class:`kvbench.engine.Engine`):

1. the request's context, minus its last ``query_tokens`` tokens, is prefilled once with full attention
   (:meth:`Engine.capture`: K/V and, for attention-aware strategies, the last-window queries);
2. the strategy's cache is built from that capture (:meth:`KVBenchCache.from_capture`);
3. the held-back context tokens and the continuation are run against the compressed cache
   (:meth:`Engine.forward`, :meth:`Engine.greedy`), so every continuation token is predicted from compressed
   K/V. Holding back at least one token matters: the logits of the first continuation token come from the
   last context position, and a position processed during the prefill attends to the exact, uncompressed K/V.

``loglikelihood`` scores continuations this way; ``loglikelihood_rolling`` splits each of lm-eval's rolling
windows into chunks of ``rolling_chunk`` tokens, each scored against the compressed cache of everything before
it; ``generate_until`` decodes greedily until a stop sequence, an end-of-sequence token or ``max_gen_toks``.
With ``strategy=full`` the numbers equal lm-eval's own ``hf`` model (``tests/test_lmeval.py`` checks it request
by request).

Why ``TemplateLM`` and not a subclass of lm-eval's ``HFLM``: ``HFLM`` loads its model through the hub and
accelerate, and its request paths batch padded sequences through ``_model_call``; every one of them would be
overridden here (each request has a compressed cache of its own), leaving only ``tok_encode``, which is a few
lines mirrored below with lm-eval's own helper.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvbench import SPEC_VERSION
from kvbench.errors import KVBenchError

log = logging.getLogger(__name__)

try:  # lm-eval is the optional `eval` extra: export and import work without it, the model needs it.
    from lm_eval.api.model import TemplateLM as _LMBase

    HAVE_LM_EVAL = True
except ImportError:
    _LMBase = object  # type: ignore[assignment,misc]
    HAVE_LM_EVAL = False

MODEL_NAME = "kvbench"
LM_EVAL_INSTALL = "pip install 'lm-eval>=0.4.13,<0.5'"


def register() -> None:
    """Register ``kvbench`` in lm-eval's model registry (idempotent), as a lazy ``module:attr`` target."""
    if not HAVE_LM_EVAL:
        raise KVBenchError(f"the lm-eval integration needs lm-eval: {LM_EVAL_INSTALL}")
    from lm_eval.api.registry import model_registry

    if MODEL_NAME not in model_registry:
        model_registry.register(MODEL_NAME, target="kvbench.lmeval.model:KVBenchLM")


def strategy_params_from_arg(value: Any) -> dict[str, Any]:
    """``strategy_params`` as lm-eval hands it over: a dict (``{"group_size":32}`` on the CLI is parsed by
    lm-eval), a JSON object string (the comma-splitting string form keeps it a string), or empty."""
    if value is None or value == "":
        return {}
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as exc:
            raise KVBenchError(f"strategy_params must be a JSON object, got {value!r} ({exc.msg})") from None
        if isinstance(parsed, dict):
            return parsed
    raise KVBenchError(f"strategy_params must be a JSON object, got {value!r}")


def build_strategy(name: str, params: dict[str, Any] | None = None) -> Any:
    """The strategy ``python -m kvbench strategy=NAME`` would run: its dataclass defaults, overridden by ``params``
    (merged deeply, so ``{"evict_params": {"budget_tokens": 64}}`` keeps compose's other defaults)."""
    from kvbench import strategies
    from kvbench.config import strategy_params

    return strategies.build(name, strategy_params(name, params))


@dataclass
class CacheStats:
    """Running totals over every compressed cache the model built, reported in lm-eval's results JSON."""

    caches: int = 0
    kv_bytes: int = 0
    kv_bytes_fp16: int = 0
    kv_bytes_dense: int = 0
    prefix_tokens: int = 0
    held_tokens: float = 0.0
    requests: dict[str, int] = field(default_factory=dict)

    def add(self, cache: Any, prefix_len: int) -> None:
        self.caches += 1
        self.kv_bytes += int(cache.kv_bytes())
        self.kv_bytes_fp16 += int(cache.kv_bytes_fp16())
        self.kv_bytes_dense += int(cache.kv_bytes_dense())
        self.prefix_tokens += prefix_len
        held = cache.held_tokens()
        self.held_tokens += sum(held) / max(len(held), 1)

    def summary(self) -> dict[str, Any]:
        from kvbench.spec import memory_reduction

        n = max(self.caches, 1)
        return {
            "caches": self.caches,
            "requests": dict(self.requests),
            "kv_bytes_mean": self.kv_bytes / n if self.caches else math.nan,
            "kv_bytes_fp16_mean": self.kv_bytes_fp16 / n if self.caches else math.nan,
            "kv_bytes_dense_mean": self.kv_bytes_dense / n if self.caches else math.nan,
            # token-weighted over all caches: the fraction of the model's own dense cache saved (spec §1), and of
            # a dense 16-bit cache beside it
            "memory_reduction": memory_reduction(self.kv_bytes, self.kv_bytes_dense),
            "memory_reduction_fp16": memory_reduction(self.kv_bytes, self.kv_bytes_fp16),
            "bytes_per_token": self.kv_bytes / self.prefix_tokens if self.prefix_tokens else math.nan,
            "kept_fraction": self.held_tokens / self.prefix_tokens if self.prefix_tokens else math.nan,
            "context_tokens_mean": self.prefix_tokens / n if self.caches else math.nan,
        }


class KVBenchLM(_LMBase):  # type: ignore[misc,valid-type]
    """lm-eval model ``kvbench``: a harness model whose every request runs against a strategy's compressed cache.

    Model arguments (``--model_args key=value,...``):

    * ``pretrained`` — ``smollm2-135m`` (default), ``tiny-llama`` or a local transformers checkpoint directory;
    * ``strategy`` — a kvbench strategy name (default ``full``); its parameters as ``strategy.<param>=value``
      (``strategy.group_size=32``, nested ``strategy.evict_params.budget_tokens=64``) or as
      ``strategy_params`` (a dict or JSON object string, e.g. in a JSON ``--model_args``), merged over the
      strategy's YAML defaults;
    * ``dtype`` (``float32``), ``device`` (lm-eval's ``--device``; default cuda when visible, else cpu),
      ``hardware`` (a profile name or YAML path, bound for strategies that model transfers), ``threads``;
    * ``query_tokens`` (1) — trailing context tokens processed after compression, together with the
      continuation; ``rolling_chunk`` (128) — continuation chunk length for ``loglikelihood_rolling``;
    * ``max_length`` (the model's), ``max_gen_toks`` (256), ``add_bos_token``, ``prefix_token_id`` — as
      for lm-eval's ``hf`` model.

    ``batch_size`` is accepted for command-line compatibility; requests run one at a time (each has its own
    compressed cache), sorted so that requests sharing a context share one prefill.
    """

    backend = "causal"

    def __init__(self, pretrained: str = "smollm2-135m", strategy: str = "full", strategy_params: Any = None,
                 dtype: str = "float32", device: str | None = None, hardware: str | None = None,
                 threads: int | None = None, query_tokens: int = 1, rolling_chunk: int = 128,
                 max_length: int | None = None, max_gen_toks: int = 256, add_bos_token: bool | None = None,
                 prefix_token_id: int | None = None, seed: int = 0, batch_size: Any = 1,
                 max_batch_size: int | None = None, **unused: Any) -> None:
        if not HAVE_LM_EVAL:
            raise KVBenchError(f"the lm-eval integration needs lm-eval: {LM_EVAL_INSTALL}")
        super().__init__()
        # `strategy.group_size=32` model args: Hydra's spelling, and the one lm-eval's key=value parser
        # accepts (it refuses `{` outside a whole-JSON --model_args).
        dotted = {k[len("strategy."):]: v for k, v in unused.items() if k.startswith("strategy.")}
        unused = {k: v for k, v in unused.items() if not k.startswith("strategy.")}
        if unused:
            log.warning("kvbench model: ignoring arguments it does not use: %s", ", ".join(sorted(unused)))
        if int(query_tokens) < 1:
            raise KVBenchError(f"query_tokens must be >= 1 (got {query_tokens}): the first continuation token "
                               "is predicted from the last context position, which must see the compressed cache")
        if int(rolling_chunk) < 1:
            raise KVBenchError(f"rolling_chunk must be >= 1 (got {rolling_chunk})")
        from kvbench.engine import Engine
        from kvbench.models import load_model

        if threads:
            torch.set_num_threads(int(threads))
        self._device = _resolve_device(device)
        self.pretrained = str(pretrained)
        self.model_name = self.pretrained
        self.dtype_name = str(dtype)
        is_path = self.pretrained not in ("smollm2-135m", "tiny-llama")
        self.lm = load_model(self.pretrained, dtype=self.dtype_name, device=str(self._device), seed=int(seed),
                             path=self.pretrained if is_path else None)
        self.model = self.lm.model
        self.tokenizer = self.lm.tokenizer
        params = strategy_params_from_arg(strategy_params)
        if dotted:
            from omegaconf import OmegaConf

            params = OmegaConf.to_container(OmegaConf.merge(  # type: ignore[assignment]
                OmegaConf.create(params), OmegaConf.from_dotlist([f"{k}={v}" for k, v in dotted.items()])))
        self.strategy = build_strategy(str(strategy), params)
        from kvbench.arch import describe

        describe(self.model, [self.strategy])  # the CLI's model and strategy check, with its line
        self.hardware = None
        if hardware:
            from kvbench.hardware import load_profile

            self.hardware = load_profile(str(hardware))
        self.engine = Engine(self.lm, device=str(self._device), hardware=self.hardware)
        self.query_tokens = int(query_tokens)
        self.rolling_chunk = int(rolling_chunk)
        self._max_length = int(max_length) if max_length else None
        self._max_gen_toks = int(max_gen_toks)
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id
        self.batch_size_per_gpu = batch_size
        self.stats = CacheStats()
        self._last: tuple[tuple[int, ...], Any] | None = None  # (prefix, its PrefillRow)

    # -- lm-eval's model properties -----------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix_token_id is not None:
            return int(self.custom_prefix_token_id)
        bos = getattr(self.tokenizer, "bos_token_id", None)
        return int(bos) if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        if self._max_length:
            return self._max_length
        from lm_eval.models.utils import resolve_max_length

        return resolve_max_length(self.model.config, self.tokenizer if _is_hf(self.tokenizer) else None)

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> Any:
        return self.batch_size_per_gpu

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", type(self.tokenizer).__name__)).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        if not _is_hf(self.tokenizer):
            return None
        return super().chat_template(chat_template)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not _is_hf(self.tokenizer) or not getattr(self.tokenizer, "chat_template", None):
            raise KVBenchError(f"model {self.model_name!r} has no chat template")
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def get_model_info(self) -> dict[str, Any]:
        """Merged into ``results["config"]`` by lm-eval after the run: what ``kvbench lmeval import`` reads."""
        return {
            "kvbench": {
                "model": self.model_name,
                "dtype": self.dtype_name,
                "device": str(self._device),
                "strategy": self.strategy.label(),
                "strategy_name": self.strategy.name,
                "family": self.strategy.family,
                "params": self.strategy.params(),
                "query_tokens": self.query_tokens,
                "rolling_chunk": self.rolling_chunk,
                "spec_version": SPEC_VERSION,
                "hardware": getattr(self.hardware, "name", None),
                "cache": self.stats.summary(),
            }
        }

    # -- tokenization (mirrors lm-eval's hf model, so both see the same tokens) ---------------------
    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs: Any) -> list[int]:
        from lm_eval.models.utils import has_bos_prefix

        kw: dict[str, Any] = {}
        if add_special_tokens is not None:
            kw["add_special_tokens"] = add_special_tokens
        elif self.add_bos_token is not None:
            kw["add_special_tokens"] = self.add_bos_token
        if add_special_tokens is None and _is_hf(self.tokenizer) and \
                has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id) or None):
            kw["add_special_tokens"] = False  # the text already carries its BOS
        ids = list(self.tokenizer.encode(string, **kw))
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=skip_special_tokens)

    # -- the compressed cache, on the engine ----------------------------------------------------------
    def compressed_cache(self, prefix: list[int]) -> Any:
        """The strategy's cache of ``prefix``, built from a full-attention prefill as the engine builds it
        (the prefill is kept for the next request if it shares the prefix). An empty prefix gives an empty
        cache (nothing to compress)."""
        from kvbench.cache import KVBenchCache

        self.engine.bind(self.strategy, prefix)
        # No request's cache sees more than this: a window at least as long bounds nothing (kvbench.arch).
        tokens = self.max_length + self.max_gen_toks
        if not prefix:
            return KVBenchCache(self.strategy, self.model.config, tokens=tokens)
        key = tuple(prefix)
        if self._last is None or self._last[0] != key:
            self._last = None  # free the previous capture before allocating the next
            ids = torch.tensor([prefix], device=self._device)
            self._last = (key, self.engine.capture(ids, self.strategy.query_window).rows[0])
        row = self._last[1]
        cache = KVBenchCache.from_capture(self.strategy, self.model.config, row.keys, row.values, row.captures,
                                          row.states, tokens=tokens)
        self.stats.add(cache, len(prefix))
        return cache

    def score_tokens(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """Log-probability of ``continuation`` after ``context`` through the compressed cache, and whether it
        is the greedy continuation. ``context + continuation`` is left-truncated to ``max_length + 1`` tokens
        as lm-eval's hf model does."""
        from kvbench.engine import attached

        if not context or not continuation:
            raise KVBenchError("loglikelihood needs a non-empty context and continuation")
        whole = (context + continuation)[-(self.max_length + 1):]
        ctx = whole[:-len(continuation)]
        split = max(len(ctx) - self.query_tokens, 0)
        cache = self.compressed_cache(ctx[:split])
        with torch.inference_mode(), attached(cache, self.model, self.strategy):
            logits = self.engine.forward(cache, [ctx[split:] + continuation[:-1]], len(continuation))[0]
        logp = torch.log_softmax(logits.float(), dim=-1)
        target = torch.tensor(continuation, device=logp.device)
        picked = logp.gather(1, target[:, None])[:, 0]
        return float(picked.sum()), bool((logp.argmax(-1) == target).all())

    def greedy(self, context: list[int], max_new_tokens: int, stop: Sequence[str] = ()) -> list[int]:
        """Greedy tokens after ``context`` through the compressed cache (:meth:`Engine.greedy`: ends at an
        end-of-sequence token, kept), once any ``stop`` string has been produced, or after ``max_new_tokens``."""
        from kvbench.engine import attached

        if not context:
            raise KVBenchError("generation needs a non-empty context")
        if max_new_tokens < 1:
            return []
        split = max(len(context) - self.query_tokens, 0)
        cache = self.compressed_cache(context[:split])

        def stopped(tokens: list[int]) -> bool:
            text = self.tok_decode(tokens, skip_special_tokens=False)
            return any(s and s in text for s in stop)

        with torch.inference_mode(), attached(cache, self.model, self.strategy):
            gen = self.engine.greedy(cache, torch.tensor(context[split:]), max_new_tokens,
                                     stop=stopped if stop else None)
        return gen.tokens

    # -- lm-eval's request types ----------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str] | None, list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        from tqdm import tqdm

        self.stats.requests["loglikelihood"] = self.stats.requests.get("loglikelihood", 0) + len(requests)
        # Requests sharing a context run back to back so they share one prefill (multiple choice).
        order = sorted(range(len(requests)), key=lambda i: (requests[i][1], len(requests[i][2])))
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        for i in tqdm(order, disable=disable_tqdm or self.rank != 0, desc="kvbench loglikelihood"):
            key, ctx, cont = requests[i]
            out[i] = self.score_tokens(list(ctx), list(cont))
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, out[i])
        return [r for r in out if r is not None]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
        from tqdm import tqdm

        self.stats.requests["loglikelihood_rolling"] = (self.stats.requests.get("loglikelihood_rolling", 0)
                                                        + len(requests))
        results = []
        for req in tqdm(requests, disable=disable_tqdm or self.rank != 0, desc="kvbench loglikelihood_rolling"):
            (string,) = req.args
            windows = map(make_disjoint_window, get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1))
            total = 0.0
            for ctx, cont in windows:
                # Each chunk is scored against the compressed cache of everything before it in the window.
                for start in range(0, len(cont), self.rolling_chunk):
                    ll, _ = self.score_tokens(list(ctx) + list(cont[:start]),
                                              list(cont[start:start + self.rolling_chunk]))
                    total += ll
            results.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
        return results

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
        from tqdm import tqdm

        self.stats.requests["generate_until"] = self.stats.requests.get("generate_until", 0) + len(requests)
        eos_text = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        results = []
        for req in tqdm(requests, disable=disable_tqdm or self.rank != 0, desc="kvbench generate_until"):
            context, gen_kwargs = req.args
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            if kwargs.get("do_sample"):
                log.warning("kvbench model decodes greedily; ignoring do_sample/temperature of %s",
                            getattr(req, "task_name", "a request"))
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            max_new = int(kwargs.pop("max_gen_toks"))
            ctx = self.tok_encode(context, left_truncate_len=self.max_length - max_new)
            tokens = self.greedy(ctx, max_new, until)
            text = postprocess_generated_text(self.tok_decode(tokens), until, None)
            results.append(text)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return results


def _resolve_device(device: str | None) -> torch.device:
    """lm-eval's CLI passes ``--device`` (``cuda`` by default); like its hf model, fall back to the CPU
    when no CUDA device is visible instead of failing."""
    if device and not str(device).startswith("cuda"):
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device(device or "cuda")
    if device:
        log.warning("kvbench model: device %r is not available; running on cpu", device)
    return torch.device("cpu")


def _is_hf(tokenizer: Any) -> bool:
    from transformers import PreTrainedTokenizerBase

    return isinstance(tokenizer, PreTrainedTokenizerBase)

