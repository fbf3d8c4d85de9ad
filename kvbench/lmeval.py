"""lm-evaluation-harness integration: a ``kvbench`` model, task export, and result import.

The model
    ``KVBenchLM`` is registered with lm-eval as ``kvbench``. It loads a model the way the harness does
    (:func:`kvbench.models.load_model`: ``smollm2-135m``, ``tiny-llama`` or a local checkpoint directory)
    and answers every request through a compressed cache built exactly as the engine builds it:

    1. the request's context, minus its last ``query_tokens`` tokens, is prefilled once with full
       attention (capturing K/V and, for attention-aware strategies, the last-window queries);
    2. the strategy's cache is built from that capture (:meth:`KVBenchCache.from_capture`);
    3. the held-back context tokens and the continuation are run against the compressed cache, so every
       continuation token is predicted from compressed K/V. Holding back at least one token matters:
       the logits of the first continuation token come from the last context position, and a position
       processed during the prefill attends to the exact, uncompressed K/V.

    ``loglikelihood`` scores continuations this way; ``loglikelihood_rolling`` splits each of lm-eval's
    rolling windows into chunks of ``rolling_chunk`` tokens, each scored against the compressed cache of
    everything before it; ``generate_until`` decodes greedily against the compressed cache until a stop
    sequence, an end-of-sequence token or ``max_gen_toks``. With ``strategy=full`` the numbers equal
    lm-eval's own ``hf`` model (``tests/test_lmeval.py`` checks it request by request).

    lm-eval 0.4.x has no plugin entry-point group for models, so the model must be registered in the
    process that runs the evaluation: use ``kvbench lmeval run ...`` (or ``python -m kvbench.lmeval run``,
    or the ``kvbench-lm-eval`` console script), which registers it and then hands the arguments to
    lm-eval's own CLI; from Python, ``import kvbench.lmeval`` before ``lm_eval.simple_evaluate``.

Tasks
    ``kvbench lmeval export --task legal --out DIR`` builds the harness's samples
    (:func:`kvbench.tasks.build_samples`), writes them as decoded text to ``DIR/kvbench_legal.jsonl`` and
    writes ``DIR/kvbench_legal.yaml``, so ``--tasks kvbench_legal --include_path DIR`` runs offline.

Results
    ``kvbench lmeval import RESULTS_JSON`` turns lm-eval's output JSON (and its per-sample files, when
    ``--log_samples`` wrote them) into result-store records ``results/store/lmeval-<hash>.parquet`` that
    :func:`kvbench.results.read_store` and the leaderboard read.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
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
#: Engine-record fields that lm-eval does not measure; imported records carry them as NaN.
from kvbench.record import MEASURED_FIELDS as UNMEASURED_FIELDS  # noqa: E402  (one schema: kvbench.record)


def register() -> None:
    """Register ``kvbench`` in lm-eval's model registry (idempotent).

    A lazy ``module:attr`` placeholder rather than the class itself: when this file runs as
    ``python -m kvbench.lmeval`` it is ``__main__``, and lm-eval must still resolve the one class defined
    in ``kvbench.lmeval`` (registering both would collide).
    """
    if not HAVE_LM_EVAL:
        raise KVBenchError(f"the lm-eval integration needs lm-eval: {LM_EVAL_INSTALL}")
    from lm_eval.api.registry import model_registry

    if MODEL_NAME not in model_registry:
        model_registry.register(MODEL_NAME, target="kvbench.lmeval:KVBenchLM")


# ------------------------------------------------------------------------------------------------ model


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
    import strategies
    from kvbench.config import strategy_params

    return strategies.build(name, strategy_params(name, params))


@dataclass
class _Capture:
    """A full-attention prefill of one prefix, reused by every request that shares it."""

    prefix: tuple[int, ...]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    captures: list[Any]


@dataclass
class CacheStats:
    """Running totals over every compressed cache the model built, reported in lm-eval's results JSON."""

    caches: int = 0
    kv_bytes: int = 0
    kv_bytes_fp16: int = 0
    prefix_tokens: int = 0
    held_tokens: float = 0.0
    requests: dict[str, int] = field(default_factory=dict)

    def add(self, cache: Any, prefix_len: int) -> None:
        self.caches += 1
        self.kv_bytes += int(cache.kv_bytes())
        self.kv_bytes_fp16 += int(cache.kv_bytes_fp16())
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
            # token-weighted over all caches: the fraction of a dense 16-bit cache saved
            "memory_reduction": memory_reduction(self.kv_bytes, self.kv_bytes_fp16),
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
        self.hardware = None
        if hardware:
            from kvbench.hardware import load_profile

            self.hardware = load_profile(str(hardware))
        self.query_tokens = int(query_tokens)
        self.rolling_chunk = int(rolling_chunk)
        self._max_length = int(max_length) if max_length else None
        self._max_gen_toks = int(max_gen_toks)
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id
        self.batch_size_per_gpu = batch_size
        self.stats = CacheStats()
        self._last: _Capture | None = None
        self._eos_ids = self._end_ids()

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
        kw: dict[str, Any] = {}
        if add_special_tokens is not None:
            kw["add_special_tokens"] = add_special_tokens
        elif self.add_bos_token is not None:
            kw["add_special_tokens"] = self.add_bos_token
        if add_special_tokens is None and _is_hf(self.tokenizer):
            bos_text = self.tokenizer.decode(self.prefix_token_id)
            if bos_text and string.startswith(bos_text):
                kw["add_special_tokens"] = False  # the text already carries its BOS
        ids = list(self.tokenizer.encode(string, **kw))
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=skip_special_tokens)

    # -- the compressed cache -------------------------------------------------------------------------
    def _prefill(self, prefix: list[int]) -> _Capture:
        """Full-attention prefill of ``prefix`` (kept for the next request if it shares the prefix)."""
        key = tuple(prefix)
        if self._last is not None and self._last.prefix == key:
            return self._last
        from kvbench.cache import KVBenchCache
        from kvbench.capture import QueryRecorder
        from strategies.full import Full

        self._last = None  # free the previous capture before allocating the next
        ids = torch.tensor([prefix], device=self._device)
        full = KVBenchCache(Full(), self.model.config)
        with torch.inference_mode(), QueryRecorder(self.model, self.strategy.query_window) as rec:
            self.model(input_ids=ids, cache=full, use_cache=True, logits_to_keep=1)
        self._last = _Capture(key, [layer.store.keys for layer in full.layers],
                              [layer.store.values for layer in full.layers], rec.captures)
        return self._last

    def compressed_cache(self, prefix: list[int]) -> Any:
        """The strategy's cache of ``prefix``, built from a full-attention prefill as the engine builds it.
        An empty prefix gives an empty cache (nothing to compress)."""
        from kvbench.cache import KVBenchCache
        from strategies.base import RunContext

        ids = torch.tensor([prefix], device=self._device, dtype=torch.long)
        self.strategy.bind(RunContext(model=self.model, hardware=self.hardware, prefix_ids=ids,
                                      device=str(self._device)))
        if not prefix:
            return KVBenchCache(self.strategy, self.model.config)
        cap = self._prefill(prefix)
        cache = KVBenchCache.from_capture(self.strategy, self.model.config, cap.keys, cap.values, cap.captures)
        self.stats.add(cache, len(prefix))
        return cache

    def _forward(self, cache: Any, ids: list[int], keep: int) -> torch.Tensor:
        """Run ``ids`` against ``cache``; log-probs of the last ``keep`` positions, ``[keep, vocab]`` float32."""
        with torch.inference_mode(), _attached(cache, self.model, self.strategy):
            logits = self.model(input_ids=torch.tensor([ids], device=self._device), cache=cache, use_cache=True,
                                logits_to_keep=keep).logits[0]
        return torch.log_softmax(logits.float(), dim=-1)

    def score_tokens(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """Log-probability of ``continuation`` after ``context`` through the compressed cache, and whether it
        is the greedy continuation. ``context + continuation`` is left-truncated to ``max_length + 1`` tokens
        as lm-eval's hf model does."""
        if not context or not continuation:
            raise KVBenchError("loglikelihood needs a non-empty context and continuation")
        whole = (context + continuation)[-(self.max_length + 1):]
        ctx = whole[:-len(continuation)]
        split = max(len(ctx) - self.query_tokens, 0)
        cache = self.compressed_cache(ctx[:split])
        logp = self._forward(cache, ctx[split:] + continuation[:-1], len(continuation))
        target = torch.tensor(continuation, device=logp.device)
        picked = logp.gather(1, target[:, None])[:, 0]
        return float(picked.sum()), bool((logp.argmax(-1) == target).all())

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

    def greedy(self, context: list[int], max_new_tokens: int, stop: Sequence[str] = ()) -> list[int]:
        """Greedy tokens after ``context`` through the compressed cache, ending at an end-of-sequence token
        (kept, as transformers' ``generate`` keeps it), once any ``stop`` string has been produced, or after
        ``max_new_tokens``."""
        if not context:
            raise KVBenchError("generation needs a non-empty context")
        split = max(len(context) - self.query_tokens, 0)
        cache = self.compressed_cache(context[:split])
        step = context[split:]
        tokens: list[int] = []
        with torch.inference_mode(), _attached(cache, self.model, self.strategy):
            while len(tokens) < max_new_tokens:
                logits = self.model(input_ids=torch.tensor([step], device=self._device), cache=cache,
                                    use_cache=True, logits_to_keep=1).logits
                tok = int(logits[0, -1].argmax())
                tokens.append(tok)
                if tok in self._eos_ids:
                    break
                if stop:
                    text = self.tok_decode(tokens, skip_special_tokens=False)
                    if any(s and s in text for s in stop):
                        break
                step = [tok]
        return tokens

    def _end_ids(self) -> set[int]:
        """End-of-sequence ids: the generation config's (where transformers' ``generate`` stops) and the
        tokenizer's (where lm-eval's hf model stops, through the EOS text it adds to the stop strings)."""
        ids: set[int] = set()
        for src in (getattr(getattr(self.model, "generation_config", None), "eos_token_id", None),
                    getattr(self.tokenizer, "eos_token_id", None)):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, (list, tuple)):
                ids.update(int(i) for i in src)
        return ids


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


@contextmanager
def _attached(cache: Any, model: torch.nn.Module, strategy: Any) -> Iterator[None]:
    """Feed the cache the queries of each forward, for strategies that read them while decoding (as the
    engine does); a no-op for the others."""
    if strategy.query_window == 0:
        yield
        return
    with cache.attach(model):
        yield


def _is_hf(tokenizer: Any) -> bool:
    from transformers import PreTrainedTokenizerBase

    return isinstance(tokenizer, PreTrainedTokenizerBase)


# ----------------------------------------------------------------------------------------------- export

#: lm-eval metric for each kvbench task metric; ``token_accuracy`` tasks (held-out continuations) become
#: loglikelihood tasks, whose per-sample figures are the gold log-likelihood and whole-continuation match.
GENERATION_METRICS = ("substring", "exact", "f1")


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """lm-eval ``process_results`` hook of exported generation tasks: kvbench's own metric for the doc."""
    from kvbench.tasks.metrics import score

    return {doc["metric"]: float(score(doc["metric"], results[0], list(doc["answers"])))}


def task_config(task: str, overrides: Sequence[str] = (), seed: int = 0) -> Any:
    """The ``task`` node exactly as ``python -m kvbench task=<task> task.<key>=<value> seed=<seed>`` composes
    it (Hydra's compose API on kvbench's config tree, so interpolations such as ``${seed}`` resolve).
    A task without a YAML in ``conf/task`` (registered from Python) gets ``{name: task}`` plus overrides."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from kvbench.config import compose_config, group_options

    dotted = [o if o.startswith("task.") else f"task.{o}" for o in overrides]
    if task not in group_options("task"):
        try:
            return OmegaConf.merge(OmegaConf.create({"name": task, "seed": seed}),
                                   OmegaConf.from_dotlist([o[len("task."):] for o in dotted]))
        except OmegaConfBaseException as exc:
            raise KVBenchError(f"bad task override in {list(overrides)}: {str(exc).splitlines()[0]}") from None
    try:
        cfg = compose_config([f"task={task}", f"seed={seed}", *dotted])
        return OmegaConf.create(OmegaConf.to_container(cfg.task, resolve=True))
    except (KVBenchError, OmegaConfBaseException) as exc:
        raise KVBenchError(f"bad task override in {list(overrides)}: {str(exc).strip().splitlines()[0]}") from None


def export_task(task: str, out_dir: str | Path, model: str = "smollm2-135m", model_path: str | None = None,
                overrides: Sequence[str] = (), seed: int = 0) -> tuple[Path, Path]:
    """Write ``kvbench_<task>.jsonl`` (the harness's samples as text) and ``kvbench_<task>.yaml`` into ``out_dir``.

    Samples are built with the named model's tokenizer, exactly as ``python -m kvbench task=<task>`` builds
    them (``overrides`` are ``key=value`` task settings such as ``context_tokens=2048``), then decoded
    with special tokens kept so a chat template survives the round trip through text.
    """
    import yaml
    from omegaconf import OmegaConf

    from kvbench.models import load_model
    from kvbench.tasks.base import build_samples

    out = Path(out_dir).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    cfg = task_config(task, overrides, seed)
    lm = load_model(model, dtype="float32", path=model_path)
    samples = build_samples(task, cfg, lm.tokenizer, lm.max_context)
    metrics = sorted({s.metric for s in samples})
    if len(metrics) != 1:
        raise KVBenchError(f"task {task!r} mixes metrics {', '.join(metrics)}; export one metric per task")
    metric = metrics[0]

    def text(ids: list[int]) -> str:
        return lm.tokenizer.decode(ids, skip_special_tokens=False)

    name = f"kvbench_{task}"
    rows = []
    for s in samples:
        context, query = text(s.prefix_ids), text(s.query_ids)
        rows.append({
            "id": s.sample_id, "prompt": context + query, "context": context, "query": query,
            "target": text(s.gold_ids), "answers": list(s.answers), "metric": s.metric,
            "max_new_tokens": s.max_new_tokens, "context_tokens": s.context_tokens,
            "meta": json.dumps(s.metadata, sort_keys=True, default=str),
        })
    data_path = out / f"{name}.jsonl"
    from kvbench.results import atomic_write_text

    atomic_write_text(data_path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    task_cfg: dict[str, Any] = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data_path)}},
        "test_split": "test",
        "doc_to_text": "{{prompt}}",
        "doc_to_target": "{{target}}",
        "target_delimiter": "",
        "num_fewshot": 0,
        "metadata": {"version": 1.0, "kvbench_task": task, "kvbench_model": model,
                     "kvbench_spec_version": SPEC_VERSION,
                     "task_config": OmegaConf.to_container(cfg, resolve=True)},
    }
    if metric in GENERATION_METRICS:
        task_cfg.update({
            "output_type": "generate_until",
            "generation_kwargs": {"until": [], "max_gen_toks": max(s.max_new_tokens for s in samples),
                                  "do_sample": False, "temperature": 0.0},
            "metric_list": [{"metric": metric, "aggregation": "mean", "higher_is_better": True}],
        })
    else:
        task_cfg.update({
            "output_type": "loglikelihood",
            # acc first: it is the per-sample figure `kvbench lmeval import` ranks (perplexity is corpus-level)
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                            {"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False}],
        })
    body = yaml.safe_dump(task_cfg, sort_keys=False, allow_unicode=True)
    if metric in GENERATION_METRICS:
        # The `!function` tag cannot come out of safe_dump; lm-eval resolves it as an importable module path.
        body += "process_results: !function kvbench.lmeval.process_results\n"
    header = (f"# Generated by `kvbench lmeval export --task {task}` ({len(rows)} samples, model {model}).\n"
              f"# Run: kvbench lmeval run --model_args pretrained={model},strategy=int8 --tasks {name} "
              f"--include_path {out}\n")
    yaml_path = out / f"{name}.yaml"
    atomic_write_text(yaml_path, header + body)
    return data_path, yaml_path


# ----------------------------------------------------------------------------------------------- import


def _metric_keys(task_results: dict[str, Any]) -> list[tuple[str, str]]:
    """``(metric, filter)`` pairs of one task's results, in lm-eval's order, without stderr entries."""
    keys = []
    for key in task_results:
        if key == "alias" or "," not in key:
            continue
        metric, flt = key.split(",", 1)
        if not metric.endswith("_stderr"):
            keys.append((metric, flt))
    return keys


def _number(value: Any) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return math.nan
    return out


def _model_args(config: dict[str, Any]) -> dict[str, Any]:
    args = config.get("model_args") or {}
    if isinstance(args, str):
        from lm_eval.utils import simple_parse_args_string

        args = simple_parse_args_string(args) if HAVE_LM_EVAL else dict(
            a.split("=", 1) for a in args.split(",") if "=" in a)
    return dict(args)


def _sample_files(results_path: Path, task: str) -> list[Path]:
    """lm-eval's ``--log_samples`` files for ``task`` written with ``results_path`` (same timestamp)."""
    stamp = results_path.stem[len("results_"):] if results_path.stem.startswith("results_") else None
    if stamp is None:
        return []
    return sorted(results_path.parent.glob(f"samples_{task}_{stamp}.json*"))


def _aggregated_by_mean(metric: str, task_cfg: dict[str, Any]) -> bool:
    """Whether lm-eval averages ``metric`` over documents: only then is a per-document record's ``score``
    (averaged by the leaderboard) the same quantity as lm-eval's figure. Perplexities, corpus F1, BLEU
    and the like are aggregated otherwise and imported as their aggregate."""
    for entry in task_cfg.get("metric_list") or []:
        if isinstance(entry, dict) and entry.get("metric") == metric and "aggregation" in entry:
            return entry["aggregation"] == "mean"
    if not HAVE_LM_EVAL:
        return False
    from lm_eval.api.registry import get_aggregation, get_metric_aggregation

    try:
        return get_metric_aggregation(metric) is get_aggregation("mean")
    except (KeyError, ValueError):
        return False


def _per_sample_scores(files: Iterable[Path], metric: str, flt: str) -> list[tuple[str, float]]:
    """``(doc id, score)`` per document from lm-eval sample files; empty if any value is not a number
    (corpus-level metrics such as perplexity keep per-document tuples, only their aggregate is meaningful)."""
    out = []
    for path in files:
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            if row.get("filter", flt) != flt:
                continue
            value = row.get(metric)
            if isinstance(value, bool):
                value = float(value)
            if not isinstance(value, (int, float)):
                return []
            out.append((f"doc-{row.get('doc_id')}", float(value)))
    return out


def lmeval_records(results_path: str | Path, per_sample: bool = True) -> list[dict[str, Any]]:
    """Result-store records from one lm-eval results JSON.

    One record per task (its first metric, in the task's ``metric_list`` order), or one per document
    when ``--log_samples`` files sit next to the JSON and the metric is a mean over documents, so the
    leaderboard pairs strategies per sample. Every metric of the task is kept in ``lmeval_metrics`` (JSON). Fields
    that lm-eval does not measure are NaN, except the cache figures the ``kvbench`` model reports.
    """
    path = Path(results_path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise KVBenchError(f"cannot read lm-eval results {path}: {exc}") from None
    if not isinstance(data, dict) or "results" not in data or "config" not in data:
        raise KVBenchError(f"{path} is not an lm-eval results JSON (no 'results'/'config')")
    config = data["config"]
    margs = _model_args(config)
    kv = config.get("kvbench") or {}
    backend = str(config.get("model", ""))
    from kvbench.results import stable_hash

    if kv:
        strategy, strategy_name = kv["strategy"], kv["strategy_name"]
        family, params, model = kv["family"], kv["params"], kv["model"]
        dtype, spec = kv.get("dtype"), kv.get("spec_version", SPEC_VERSION)
    else:  # any other lm-eval model holds a dense, uncompressed cache: the `full` baseline
        strategy, strategy_name, family, params = "full", "full", "baseline", {}
        model = str(margs.get("pretrained", backend))
        dtype, spec = margs.get("dtype"), SPEC_VERSION
    cache = kv.get("cache", {})
    leaf_tasks = [t for t in data["results"] if t in data.get("configs", data["results"])]
    records = []
    for task in leaf_tasks:
        res = data["results"][task]
        keys = _metric_keys(res)
        if not keys:
            continue
        task_cfg = data.get("configs", {}).get(task, {})
        # The task's metric_list order decides the primary metric (results follow process_results' order).
        listed = [e.get("metric") for e in task_cfg.get("metric_list") or [] if isinstance(e, dict)]
        keys.sort(key=lambda mf: listed.index(mf[0]) if mf[0] in listed else len(listed))
        metric, flt = keys[0]
        all_metrics = {f"{m},{f}": _number(res.get(f"{m},{f}")) for m, f in keys}
        config_hash = stable_hash({
            "source": "lm-eval", "backend": backend, "model_args": margs, "strategy": strategy,
            "task": task, "task_config": task_cfg, "version": data.get("versions", {}).get(task),
            "n_shot": data.get("n-shot", {}).get(task), "limit": config.get("limit"),
            "lm_eval_version": data.get("lm_eval_version"),
        })
        base = {
            **{f: math.nan for f in UNMEASURED_FIELDS},
            "source": "lm-eval", "lmeval_backend": backend, "lmeval_task": task, "lmeval_filter": flt,
            "lmeval_version": data.get("lm_eval_version"), "lmeval_results": str(path.resolve()),
            "lmeval_metrics": json.dumps(all_metrics, sort_keys=True),
            "run_id": f"lmeval-{config_hash}", "config_hash": config_hash, "task": task, "model": model,
            "dtype": dtype, "device": kv.get("device", config.get("device")), "hardware": kv.get("hardware"),
            "seed": config.get("random_seed"), "spec_version": spec, "strategy": strategy,
            "strategy_name": strategy_name, "family": family, "params": json.dumps(params, sort_keys=True),
            "metric": metric, "query_aware": False,
            "n_samples": (data.get("n-samples", {}).get(task) or {}).get("effective"),
        }
        if cache:
            base.update({
                "kv_bytes": cache.get("kv_bytes_mean", math.nan),
                "kv_bytes_fp16": cache.get("kv_bytes_fp16_mean", math.nan),
                "memory_reduction": cache.get("memory_reduction", math.nan),
                "bytes_per_token": cache.get("bytes_per_token", math.nan),
                "kept_fraction": cache.get("kept_fraction", math.nan),
                "context_tokens": cache.get("context_tokens_mean", math.nan),
            })
        mean_metric = _aggregated_by_mean(metric, task_cfg)
        docs = _per_sample_scores(_sample_files(path, task), metric, flt) if per_sample and mean_metric else []
        if docs:
            records.extend({**base, "sample_id": sid, "score": value, "score_stderr": math.nan}
                           for sid, value in docs)
        else:
            records.append({**base, "sample_id": "aggregate", "score": _number(res.get(f"{metric},{flt}")),
                            "score_stderr": _number(res.get(f"{metric}_stderr,{flt}"))})
    if not records:
        raise KVBenchError(f"{path} holds no task results to import")
    return records


def import_results(results_path: str | Path, results_dir: str | Path = "results",
                   per_sample: bool = True) -> tuple[Path, int]:
    """Write the records of one lm-eval results JSON as ``<results_dir>/store/lmeval-<hash>.parquet``.

    The file name is a hash of the records' config hashes, so importing the same JSON twice rewrites one
    file, and :func:`kvbench.results.read_store` de-duplicates whatever else overlaps.
    """
    import pandas as pd

    from kvbench.results import atomic_write_parquet, flatten_for_store, stable_hash

    records = lmeval_records(results_path, per_sample=per_sample)
    key = stable_hash(sorted({r["config_hash"] for r in records}))
    target = Path(results_dir) / "store" / f"lmeval-{key}.parquet"
    atomic_write_parquet(flatten_for_store(pd.DataFrame(records)), target)
    return target, len(records)


def find_results_json(path: str | Path) -> list[Path]:
    """``path`` itself if it is a file, else every ``results_*.json`` below it (lm-eval's --output_path)."""
    p = Path(path)
    if p.is_file():
        return [p]
    if p.is_dir():
        found = sorted(p.rglob("results_*.json"))
        if found:
            return found
    raise KVBenchError(f"no lm-eval results JSON at {p} (expected a results_*.json file or a directory with some)")


# -------------------------------------------------------------------------------------------------- CLI


def run_lm_eval(args: Sequence[str]) -> int:
    """lm-eval's own CLI with the ``kvbench`` model registered; ``--model kvbench`` is the default."""
    register()
    argv = list(args)
    if argv and argv[0] in ("run", "ls", "validate"):
        sub, rest = argv[0], argv[1:]
    else:
        sub, rest = "run", argv
    if sub == "run" and not any(a in ("--model", "-M") or a.startswith("--model=") for a in rest):
        rest = ["--model", MODEL_NAME, *rest]
    from lm_eval.__main__ import cli_evaluate

    saved = sys.argv
    sys.argv = ["lm-eval", sub, *rest]
    try:
        cli_evaluate()
    finally:
        sys.argv = saved
    return 0


def console_main() -> None:
    """``kvbench-lm-eval``: exactly ``lm-eval``'s command line, with the ``kvbench`` model registered."""
    register()
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvbench lmeval", description="lm-evaluation-harness integration: run, export tasks, import results.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{run,export,import}")
    run = sub.add_parser("run", help="lm-eval's CLI with the kvbench model registered (--model kvbench by default)",
                         add_help=False)
    run.add_argument("args", nargs=argparse.REMAINDER)
    exp = sub.add_parser("export", help="write kvbench tasks as lm-eval task YAML + JSONL")
    exp.add_argument("--task", required=True, help="task name(s), comma-separated (e.g. legal,papers,fiction)")
    exp.add_argument("--out", required=True, help="directory for the YAML and JSONL files (the --include_path)")
    exp.add_argument("--model", default="smollm2-135m", help="model whose tokenizer builds the samples")
    exp.add_argument("--model-path", default=None, help="checkpoint directory when --model is a local model")
    exp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="task setting, as in conf/task/<task>.yaml (repeatable), e.g. --set context_tokens=2048")
    exp.add_argument("--seed", type=int, default=0, help="the harness's seed=, which seeds the task's sampling")
    imp = sub.add_parser("import", help="convert lm-eval results JSON into result-store records")
    imp.add_argument("results", nargs="+", help="results_*.json files or lm-eval --output_path directories")
    imp.add_argument("--results-dir", default="results", help="kvbench results directory (store/ goes inside)")
    imp.add_argument("--aggregate-only", action="store_true",
                     help="one record per task even when --log_samples files are present")
    return parser


def main(argv: list[str] | None = None) -> int:
    """``kvbench lmeval {run,export,import} ...``; errors are one line and exit status 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "run":  # everything after `run` belongs to lm-eval, including its --help
        return run_lm_eval(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        if args.command == "export":
            for task in [t.strip() for t in args.task.split(",") if t.strip()]:
                data, yaml_path = export_task(task, args.out, args.model, args.model_path, args.overrides,
                                              args.seed)
                print(f"{yaml_path} ({data.name})")
            print(f"run: kvbench lmeval run --model_args pretrained={args.model} --tasks "
                  f"{','.join('kvbench_' + t.strip() for t in args.task.split(',') if t.strip())} "
                  f"--include_path {Path(args.out).resolve()}")
        elif args.command == "import":
            for source in args.results:
                for path in find_results_json(source):
                    target, n = import_results(path, args.results_dir, per_sample=not args.aggregate_only)
                    print(f"{path} -> {target} ({n} records)")
    except KVBenchError as exc:
        print(f"kvbench: error: {exc}", file=sys.stderr)
        return 2
    return 0


if HAVE_LM_EVAL:
    register()

if __name__ == "__main__":
    raise SystemExit(main())
