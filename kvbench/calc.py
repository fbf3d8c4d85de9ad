"""Projection calculator: KV-cache memory for a model architecture, and what fits on a hardware profile.

The KV cache of a decoder-only transformer holds, for every layer and every token, one key and one
value vector per *KV* head::

    kv_bytes = 2 (K and V) × layers × kv_heads × head_dim × context × batch × bytes_per_element

With grouped-query attention (GQA) ``kv_heads`` is smaller than the number of query heads, which is
why Llama-3-70B (64 query heads, 8 KV heads) needs 8× less cache than a multi-head-attention model
of the same shape. ``bytes_per_element`` is 2 for fp16/bf16, or a strategy's *measured* cost
(quantisation, eviction and their overheads folded into one number).

Fitting on a device: the profile's ``memory_bytes`` minus a reserve fraction (default 0.1) held
back for activations, allocator fragmentation and the runtime's own buffers must hold the weights
(``params × weight bytes``) plus the KV cache. The reserve is a fraction, not a measured figure:
raise it for long prefills (activations grow with the prefill chunk) and lower it for decode-only
serving with a known workspace.

``kvbench calc --model llama-3-70b --context 12000 --batch 1 --dtype fp16 --hardware server-gpu-80g``
prints a projection; ``kvbench calc claim`` checks the "Llama-3-70B needs ~48 GB of KV cache at 12,000 tokens"
claim (see ``docs/projection.md``). Both commands are :mod:`kvbench.calc_cli`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from kvbench.errors import KVBenchError
from kvbench.hardware import HardwareProfile

GB = 1e9
GIB = 2**30

#: Bytes per stored element for the dtypes a cache or weights are commonly kept in.
DTYPE_BYTES: dict[str, float] = {
    "fp32": 4.0, "float32": 4.0,
    "fp16": 2.0, "float16": 2.0,
    "bf16": 2.0, "bfloat16": 2.0,
    "fp8": 1.0, "int8": 1.0,
    "int4": 0.5,
}

DEFAULT_RESERVE_FRACTION = 0.1
#: The harness's embedded model: measured ``bytes_per_token`` figures come from it unless told otherwise.
DEFAULT_SOURCE_MODEL = "smollm2-135m"

# Presets: the config.json fields that shape the KV cache and the parameter count, copied from each
# model's public Hugging Face config.json (cited in "source"). head_dim is absent from these files
# and is derived as hidden_size // num_attention_heads, exactly as for any config.json.
# "params" is the exact parameter count of that architecture; tests/test_calc.py recomputes it by
# instantiating the config on torch's meta device, so a mistyped field cannot go unnoticed.
PRESETS: dict[str, dict[str, Any]] = {
    "llama-3-8b": {
        "display": "Llama-3-8B",
        "source": "huggingface.co/meta-llama/Meta-Llama-3-8B config.json",
        "params": 8_030_261_248,
        "config": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
                   "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                   "vocab_size": 128256, "max_position_embeddings": 8192, "tie_word_embeddings": False},
    },
    "llama-3-70b": {
        "display": "Llama-3-70B",
        "source": "huggingface.co/meta-llama/Meta-Llama-3-70B config.json",
        "params": 70_553_706_496,
        "config": {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
                   "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
                   "vocab_size": 128256, "max_position_embeddings": 8192, "tie_word_embeddings": False},
    },
    "llama-3.1-8b": {
        "display": "Llama-3.1-8B",
        "source": "huggingface.co/meta-llama/Llama-3.1-8B config.json",
        "params": 8_030_261_248,
        "config": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
                   "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                   "vocab_size": 128256, "max_position_embeddings": 131072, "tie_word_embeddings": False,
                   "rope_theta": 500000.0,
                   "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    },
    "qwen2.5-7b": {
        "display": "Qwen2.5-7B",
        "source": "huggingface.co/Qwen/Qwen2.5-7B config.json",
        "params": 7_615_616_512,
        "config": {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
                   "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                   "vocab_size": 152064, "max_position_embeddings": 131072, "tie_word_embeddings": False,
                   "use_sliding_window": False},
    },
    "mistral-7b": {
        "display": "Mistral-7B-v0.3",
        "source": "huggingface.co/mistralai/Mistral-7B-v0.3 config.json",
        "params": 7_248_023_552,
        "config": {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
                   "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                   "vocab_size": 32768, "max_position_embeddings": 32768, "tie_word_embeddings": False,
                   "sliding_window": None},
    },
    "llama-3.2-1b": {
        "display": "Llama-3.2-1B",
        "source": "huggingface.co/meta-llama/Llama-3.2-1B config.json",
        "params": 1_235_814_400,
        "config": {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
                   "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
                   "head_dim": 64, "vocab_size": 128256, "max_position_embeddings": 131072,
                   "tie_word_embeddings": True, "rope_theta": 500000.0,
                   "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    },
    "smollm2-135m": {
        "display": "SmolLM2-135M",
        "source": "huggingface.co/HuggingFaceTB/SmolLM2-135M config.json (same figures in the embedded GGUF)",
        "params": 134_515_008,
        "config": {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
                   "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                   "vocab_size": 49152, "max_position_embeddings": 8192, "tie_word_embeddings": True},
    },
}


@dataclass(frozen=True)
class ModelArch:
    """The parts of an architecture that size the KV cache, plus the parameter count for the weights."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_attention_heads: int
    params: int | None = None
    max_position_embeddings: int | None = None
    sliding_window: int | None = None
    source: str = ""

    @property
    def kv_elements_per_token(self) -> int:
        """Elements stored per token across all layers: 2 (K, V) × layers × kv_heads × head_dim."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    def without_gqa(self) -> ModelArch:
        """The same model with multi-head attention: one KV head per query head."""
        return replace(self, name=f"{self.name} (MHA, {self.num_attention_heads} KV heads)",
                       num_kv_heads=self.num_attention_heads)


@dataclass(frozen=True)
class MemoryPlan:
    """Where a device's memory goes for one (model, context, batch, bytes-per-element) point."""

    budget_bytes: int
    reserve_fraction: float
    usable_bytes: float
    weight_bytes: float
    kv_bytes: float

    @property
    def free_bytes(self) -> float:
        """Usable memory left after weights and KV cache (negative: short by that much)."""
        return self.usable_bytes - self.weight_bytes - self.kv_bytes

    @property
    def fits(self) -> bool:
        return self.free_bytes >= 0


# ------------------------------------------------------------------------------------ architectures


def _get(config: Any, key: str) -> Any:
    # transformers configs resolve aliases (GPT-2's n_layer -> num_hidden_layers) through getattr.
    return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)


def arch_from_config(config: Any, name: str = "custom", params: int | None = None,
                     source: str = "") -> ModelArch:
    """A :class:`ModelArch` from a transformers ``PretrainedConfig`` or a config.json mapping.

    ``num_key_value_heads`` missing means multi-head attention (one KV head per query head);
    ``head_dim`` missing means ``hidden_size // num_attention_heads``. Multimodal configs are read
    through their text sub-config.
    """
    if not isinstance(config, Mapping) and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    layers = _get(config, "num_hidden_layers")
    heads = _get(config, "num_attention_heads")
    for key, value in (("num_hidden_layers", layers), ("num_attention_heads", heads)):
        if not isinstance(value, int) or value < 1:
            raise KVBenchError(f"model {name}: config has no usable {key} (got {value!r}); "
                               "only decoder-only transformer configs are supported")
    kv_heads = _get(config, "num_key_value_heads") or heads
    head_dim = _get(config, "head_dim")
    if not head_dim:
        hidden = _get(config, "hidden_size")
        if not isinstance(hidden, int) or hidden < 1:
            raise KVBenchError(f"model {name}: config has neither head_dim nor hidden_size")
        head_dim = hidden // heads
    window = _get(config, "sliding_window")
    if _get(config, "use_sliding_window") is False:
        window = None  # Qwen2 configs carry a window size that is switched off
    max_pos = _get(config, "max_position_embeddings")
    return ModelArch(name=name, num_layers=int(layers), num_kv_heads=int(kv_heads), head_dim=int(head_dim),
                     num_attention_heads=int(heads), params=params,
                     max_position_embeddings=int(max_pos) if max_pos else None,
                     sliding_window=int(window) if window else None, source=source)


def count_params(config: Any) -> int | None:
    """Exact parameter count of a transformers config, by building the model on the meta device.

    No memory is allocated for weights. Returns None for architectures transformers cannot build
    as a causal LM (then pass ``params`` explicitly).
    """
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # any architecture-specific failure just means "count unknown"
        return None
    return int(sum(p.numel() for p in model.parameters()))


def arch_from_path(path: str | Path, params: int | None = None) -> ModelArch:
    """Read a config.json (file) or a local model directory with ``transformers.AutoConfig``."""
    from transformers import AutoConfig

    target = Path(path)
    if not target.exists():
        raise KVBenchError(f"{target}: no such config.json or model directory")
    try:
        config = AutoConfig.from_pretrained(str(target))
    except (OSError, ValueError, KeyError) as exc:
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise KVBenchError(f"{target}: transformers cannot read this config ({first_line})") from exc
    if params is None:
        params = count_params(config)
    return arch_from_config(config, name=str(target), params=params, source=str(target))


def preset(name: str) -> ModelArch:
    """A shipped architecture by name (case-insensitive); see :data:`PRESETS`."""
    entry = PRESETS.get(name.lower())
    if entry is None:
        raise KVBenchError(f"unknown model {name!r}; valid presets: {', '.join(PRESETS)} "
                           "(or a path to a transformers config.json or model directory)")
    return arch_from_config(entry["config"], name=entry["display"], params=entry["params"],
                            source=entry["source"])


def resolve_model(name_or_path: str, params: int | None = None) -> ModelArch:
    """A preset name, or a path to a config.json / model directory; ``params`` overrides the count."""
    if name_or_path.lower() in PRESETS:
        arch = preset(name_or_path)
        return arch if params is None else replace(arch, params=params)
    if Path(name_or_path).exists():
        return arch_from_path(name_or_path, params=params)
    return preset(name_or_path)  # raises the "unknown model" error naming the presets


# -------------------------------------------------------------------------------------- arithmetic


def dtype_bytes(dtype: str) -> float:
    """Bytes per element of a dtype name (``fp16``, ``bfloat16``, ``int4`` …)."""
    key = dtype.lower()
    if key not in DTYPE_BYTES:
        raise KVBenchError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[key]


def check_positive(name: str, value: float) -> None:
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not numeric or not math.isfinite(value) or value <= 0:
        raise KVBenchError(f"{name} must be a positive number, got {value!r}")


def bytes_per_element_from_token_bytes(bytes_per_token: float, source: ModelArch) -> float:
    """Turn a strategy's measured KV bytes per token on ``source`` into bytes per KV element.

    The result transfers to another model under the assumption that the strategy's cost per
    element does not depend on the model's shape (true for plain quantisation, approximately so
    for eviction at a fixed keep-ratio; group-wise scales depend on head_dim).
    """
    check_positive("bytes per token", bytes_per_token)
    return bytes_per_token / source.kv_elements_per_token


def kv_bytes_per_token(arch: ModelArch, bytes_per_element: float = 2.0) -> float:
    """KV-cache bytes one token adds across all layers."""
    check_positive("bytes per element", bytes_per_element)
    return arch.kv_elements_per_token * bytes_per_element


def kv_bytes(arch: ModelArch, context: int, batch: int = 1, bytes_per_element: float = 2.0) -> float:
    """KV-cache bytes: 2 × layers × kv_heads × head_dim × context × batch × bytes_per_element."""
    check_count("context", context, allow_zero=True)
    check_count("batch", batch, allow_zero=True)
    return kv_bytes_per_token(arch, bytes_per_element) * context * batch


def check_count(name: str, value: int, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if allow_zero else 1):
        raise KVBenchError(f"{name} must be an integer >= {0 if allow_zero else 1}, got {value!r}")


def weight_bytes(arch: ModelArch, weight_bytes_per_param: float = 2.0) -> float:
    """Bytes of the weights: params × bytes per parameter (2 for bf16/fp16 checkpoints)."""
    if arch.params is None:
        raise KVBenchError(f"model {arch.name}: parameter count unknown; pass params (CLI: --params)")
    check_positive("weight bytes per parameter", weight_bytes_per_param)
    return arch.params * weight_bytes_per_param


def _budget(hw: HardwareProfile | int) -> int:
    budget = hw.memory_bytes if isinstance(hw, HardwareProfile) else hw
    check_count("memory budget (bytes)", budget)
    return budget


def check_reserve(reserve_fraction: float) -> None:
    if not 0 <= reserve_fraction < 1:
        raise KVBenchError(f"reserve fraction must be in [0, 1), got {reserve_fraction!r}")


def memory_plan(arch: ModelArch, hw: HardwareProfile | int, context: int, batch: int = 1,
                bytes_per_element: float = 2.0, *, weight_bytes_per_param: float = 2.0,
                reserve_fraction: float = DEFAULT_RESERVE_FRACTION) -> MemoryPlan:
    """Weights + KV cache against ``(1 - reserve_fraction) × memory`` of ``hw`` (profile or byte count)."""
    check_reserve(reserve_fraction)
    budget = _budget(hw)
    return MemoryPlan(budget_bytes=budget, reserve_fraction=reserve_fraction,
                      usable_bytes=budget * (1 - reserve_fraction),
                      weight_bytes=weight_bytes(arch, weight_bytes_per_param),
                      kv_bytes=kv_bytes(arch, context, batch, bytes_per_element))


def fits(arch: ModelArch, hw: HardwareProfile | int, context: int, batch: int = 1,
         bytes_per_element: float = 2.0, *, weight_bytes_per_param: float = 2.0,
         reserve_fraction: float = DEFAULT_RESERVE_FRACTION) -> bool:
    """Whether weights and the KV cache fit in the usable memory of ``hw``."""
    return memory_plan(arch, hw, context, batch, bytes_per_element,
                       weight_bytes_per_param=weight_bytes_per_param, reserve_fraction=reserve_fraction).fits


def _largest(count_fits: Callable[[int], bool], estimate: float) -> int:
    """Largest n >= 0 with count_fits(n), starting from the closed-form estimate.

    The closed form can land one off through float rounding; stepping with the same predicate that
    :func:`fits` uses keeps max_context/max_batch and fits consistent at the boundary.
    """
    n = max(0, int(math.floor(estimate)))
    while n > 0 and not count_fits(n):
        n -= 1
    while count_fits(n + 1):
        n += 1
    return n


def max_context(arch: ModelArch, hw: HardwareProfile | int, batch: int = 1, bytes_per_element: float = 2.0,
                *, weight_bytes_per_param: float = 2.0,
                reserve_fraction: float = DEFAULT_RESERVE_FRACTION) -> int:
    """Largest context (tokens per sequence) that fits at ``batch``; 0 when not even the weights fit."""
    check_count("batch", batch)
    plan = memory_plan(arch, hw, 0, batch, bytes_per_element, weight_bytes_per_param=weight_bytes_per_param,
                       reserve_fraction=reserve_fraction)
    if not plan.fits:
        return 0
    per_token = kv_bytes_per_token(arch, bytes_per_element) * batch
    return _largest(lambda c: fits(arch, hw, c, batch, bytes_per_element,
                                   weight_bytes_per_param=weight_bytes_per_param,
                                   reserve_fraction=reserve_fraction),
                    plan.free_bytes / per_token)


def max_batch(arch: ModelArch, hw: HardwareProfile | int, context: int, bytes_per_element: float = 2.0,
              *, weight_bytes_per_param: float = 2.0,
              reserve_fraction: float = DEFAULT_RESERVE_FRACTION) -> int:
    """Largest batch of ``context``-token sequences that fits; 0 when not even the weights fit."""
    check_count("context", context)
    plan = memory_plan(arch, hw, context, 0, bytes_per_element, weight_bytes_per_param=weight_bytes_per_param,
                       reserve_fraction=reserve_fraction)
    if not plan.fits:
        return 0
    per_sequence = kv_bytes(arch, context, 1, bytes_per_element)
    return _largest(lambda b: fits(arch, hw, context, b, bytes_per_element,
                                   weight_bytes_per_param=weight_bytes_per_param,
                                   reserve_fraction=reserve_fraction),
                    plan.free_bytes / per_sequence)


# ---------------------------------------------------------------------------------- claim analysis


@dataclass(frozen=True)
class ClaimAnalysis:
    """What a claimed KV-cache size at some context really corresponds to."""

    model: str
    context: int
    claimed_bytes: float
    bytes_per_element: float
    per_token_bytes: float
    actual_bytes: float
    implied_batch: float
    batch_below: int
    bytes_below: float
    batch_above: int
    bytes_above: float
    context_for_claim: int
    mha_kv_heads: int
    mha_bytes: float
    mha_context_for_claim: int
    readings: list[tuple[str, float]]
    max_position_embeddings: int | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def analyse_claim(arch: ModelArch, context: int, claimed_bytes: float,
                  bytes_per_element: float = 2.0) -> ClaimAnalysis:
    """Compare ``claimed_bytes`` of KV cache at ``context`` tokens with the arithmetic.

    Reports the true single-sequence size, the batch at which the claim would hold, the context at
    which it would hold for one sequence, and the sizes under the usual misreadings (no GQA, fp32).
    """
    check_count("context", context)
    check_positive("claimed bytes", claimed_bytes)
    per_token = kv_bytes_per_token(arch, bytes_per_element)
    actual = kv_bytes(arch, context, 1, bytes_per_element)
    implied = claimed_bytes / actual
    below = max(1, math.floor(implied))
    mha = arch.without_gqa()
    readings = [
        (f"{'GQA' if a is arch else 'MHA'} ({a.num_kv_heads} KV heads), {bpe:g} B/element",
         kv_bytes(a, context, 1, bpe))
        for a in (arch, mha) for bpe in sorted({bytes_per_element, 2.0, 4.0})
    ]
    return ClaimAnalysis(
        model=arch.name, context=context, claimed_bytes=claimed_bytes, bytes_per_element=bytes_per_element,
        per_token_bytes=per_token, actual_bytes=actual, implied_batch=implied,
        batch_below=below, bytes_below=actual * below,
        batch_above=below + 1, bytes_above=actual * (below + 1),
        context_for_claim=int(claimed_bytes // per_token), mha_kv_heads=mha.num_kv_heads,
        mha_bytes=kv_bytes(mha, context, 1, bytes_per_element),
        mha_context_for_claim=int(claimed_bytes // kv_bytes_per_token(mha, bytes_per_element)),
        readings=readings, max_position_embeddings=arch.max_position_embeddings,
    )
