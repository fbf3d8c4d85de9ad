"""Stored ``full`` baselines: ``results/baselines/<key>.safetensors``, a format that cannot carry code.

A baseline is the ``full`` strategy's record plus its teacher-forced log-probs over the gold positions,
keyed by everything that determines them (:mod:`kvbench.identity`). The log-probs are a safetensors tensor and
the record is JSON in the file's metadata, so reading a baseline never unpickles anything: a crafted file can
at worst fail to parse, and is then recomputed. Files of any other format (the ``.pt`` pickles older versions
wrote) are never opened; the run says once that it ignored them.

A file is only reused when it proves it belongs where it was found (measurement spec §5.2): it carries the
identity it was computed under (its key, sample id, spec version, task/model/hardware digests, dtype, device,
seed and the log-prob tensor's shape), which must equal the reading run's; its tensor must have that shape;
and its record must agree with its own tensor and prediction (gold NLL and gold-token accuracy recomputed
from the log-probs, the score recomputed from the prediction with the task metric, the answers and metric
those of the sample). Anything else is ignored with one line and recomputed. Every record of a sample whose
baseline was reused carries the file's sha256 (``baseline_sha256``), so a reader can tell which file its
delta and fidelity rest on. These checks catch stale, misplaced and hand-edited files; a file forged
consistently throughout (prediction and score edited together) is caught by its seal: every baseline carries
an HMAC of its record, identity and log-probs under this machine's key (:func:`kvbench.results.local_seal`), so
a baseline not written by this machine's kvbench is recomputed too. A full disk while storing a baseline stops
the run (one line; finished samples are kept, a rerun resumes); any other write failure only costs the reuse.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import struct
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvbench import SPEC_VERSION
from kvbench.record import StrategyResult
from kvbench.results import atomic_write, local_seal, seal_matches, stable_hash, warn, write_bytes

if TYPE_CHECKING:
    from kvbench.tasks.base import Sample

SUFFIX = ".safetensors"
# Formats that could execute code on load; seen beside a key, they are ignored with a warning.
REFUSED_SUFFIXES = (".pt", ".pth", ".pkl", ".pickle", ".bin", ".npy", ".npz")
_LOGP = "logp"
_RECORD = "record"
_IDENTITY = "identity"
_SEAL = "seal"
#: The record's fields that make up a baseline's identity, besides its key and tensor shape.
IDENTITY_FIELDS = ("sample_id", "spec_version", "task_digest", "model_digest", "hardware_digest", "dtype",
                   "device", "seed")
#: Recomputed figures must match the stored ones this closely (the same float32 log-probs; a device may reduce
#: them in another order than the CPU).
_TOL = 1e-5


class BaselineKey:
    """``key(sample)`` is the file name of a sample's baseline; :meth:`expected` the identity the file must carry.

    ``determinants`` are the run's (:func:`kvbench.identity.determinants`); ``model`` gives the vocabulary
    size the log-probs must have (None: only the number of gold positions is checked)."""

    def __init__(self, determinants: dict[str, Any], model: Any = None) -> None:
        from kvbench.identity import record_digests

        self.determinants = determinants
        head = model.get_output_embeddings() if model is not None and hasattr(model, "get_output_embeddings") \
            else None
        weight = getattr(head, "weight", None)
        self.vocab = int(weight.shape[0]) if weight is not None else None
        self._fields = {"spec_version": determinants["spec"], **record_digests(determinants),
                        "dtype": determinants["dtype"], "device": determinants["device"],
                        "seed": determinants["seed"]}

    def __call__(self, sample: Sample) -> str:
        return stable_hash({**self.determinants, "sample": sample.sample_id})

    def expected(self, sample: Sample) -> dict[str, Any]:
        return {"sample_id": sample.sample_id, "key": self(sample), **self._fields,
                "logp_shape": [len(sample.gold_ids), self.vocab]}


def baseline_path(root: Path, key: str) -> Path:
    return root / f"{key}{SUFFIX}"


def load_baseline(root: Path, key_fn: Callable[[Sample], str], sample: Sample) -> StrategyResult | None:
    """The stored baseline for ``sample``, or None (missing, unreadable, of a refused format, or not provably
    this sample's under this run's identity). ``key_fn`` is a :class:`BaselineKey`; a plain callable (tests)
    checks the key, sample id, spec version and number of gold positions only."""
    from safetensors import SafetensorError
    from safetensors.torch import load as load_tensors

    key = key_fn(sample)
    for suffix in REFUSED_SUFFIXES:
        other = root / f"{key}{suffix}"
        if other.exists():
            warn(f"ignored {other}: baselines are only read from {SUFFIX} files (this format can run code); "
                 "recomputing the baseline")
    path = baseline_path(root, key)
    if not path.is_file():
        return None
    try:
        data = path.read_bytes()  # read once: the sha256 names exactly the bytes that were checked
        meta = _metadata(data)
        logp = load_tensors(data)[_LOGP].float()
        rec = json.loads(meta[_RECORD])
        stored = json.loads(meta.get(_IDENTITY, "null"))
        if not isinstance(rec, dict) or logp.dim() != 2:
            raise ValueError("not a kvbench baseline")
    except (SafetensorError, OSError, KeyError, TypeError, ValueError, RuntimeError, struct.error) as exc:
        # A torn or foreign file is recomputed (and overwritten), never trusted.
        warn(f"ignored unreadable baseline {path} ({type(exc).__name__}); recomputing it")
        return None
    if hasattr(key_fn, "expected"):
        expected = key_fn.expected(sample)
    else:
        expected = {"sample_id": sample.sample_id, "key": key, "spec_version": SPEC_VERSION,
                    "logp_shape": [len(sample.gold_ids), None]}
    why = _mismatch(stored, expected, list(logp.shape)) or _inconsistent(rec, logp, sample)
    if not why and not seal_matches(meta.get(_SEAL), *_sealed_parts(meta, logp)):
        why = ("it is not sealed by this machine's kvbench (written elsewhere, or its record and prediction "
               "edited together)")
    if why:
        warn(f"ignored baseline {path}: {why}; recomputing it")
        return None
    rec["baseline_reused"] = True
    rec["baseline_sha256"] = hashlib.sha256(data).hexdigest()
    return StrategyResult(rec, logp)


def sealed_here(path: Path) -> bool:
    """Whether the baseline file ``path`` carries this machine's seal over its record, identity and log-probs
    (what :func:`load_baseline` requires before reusing it): a results tree may publish it."""
    from safetensors.torch import load as load_tensors

    try:
        data = path.read_bytes()
        meta = _metadata(data)
        logp = load_tensors(data)[_LOGP].float()
    except Exception:  # torn, foreign or not safetensors at all: not this machine's
        return False
    return seal_matches(meta.get(_SEAL), *_sealed_parts(meta, logp))


def stamp(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A sample's records (its baseline first), each carrying the baseline file's sha256 (None: computed
    fresh): every strategy's delta and fidelity rest on that baseline."""
    sha = records[0].get("baseline_sha256") if records else None
    for r in records:
        r["baseline_sha256"] = sha
    return records


def save_baseline(root: Path, key: str, result: StrategyResult) -> None:
    """Write atomically (temp file + rename), with the user's umask, the identity beside the record. A
    directory that cannot be written costs only the reuse: one warning, and the run goes on."""
    from safetensors.torch import save

    record: dict[str, Any] = result.record
    logp = result.logp.detach().to("cpu").float().contiguous()
    identity = {"key": key, **{k: record.get(k) for k in IDENTITY_FIELDS}, "logp_shape": list(logp.shape)}
    meta = {_RECORD: json.dumps(record, sort_keys=True, default=_json_default),
            _IDENTITY: json.dumps(identity, sort_keys=True, default=_json_default)}
    seal = local_seal(*_sealed_parts(meta, logp))
    if seal is not None:
        meta[_SEAL] = seal
    data = save({_LOGP: logp}, metadata=meta)
    try:
        atomic_write(baseline_path(root, key), lambda tmp: write_bytes(tmp, data))
    except OSError as exc:
        if getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
            raise  # a full disk: the sample's records could not be written either (one line, resume later)
        warn(f"could not store the baseline in {root} ({exc}); it will be recomputed next time")


def _sealed_parts(meta: dict[str, str], logp: torch.Tensor) -> tuple[bytes, ...]:
    """What a baseline's seal covers: its record, its identity and its log-probs' bytes."""
    tensor = logp.detach().to("cpu").float().contiguous()
    return (meta.get(_RECORD, "").encode(), meta.get(_IDENTITY, "").encode(),
            json.dumps(list(tensor.shape)).encode(), tensor.view(-1).view(torch.uint8).numpy().tobytes())


def _metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file's header (8-byte little-endian length, then JSON)."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict):
        raise KeyError("__metadata__")
    return meta


def _mismatch(stored: Any, expected: dict[str, Any], shape: list[int]) -> str | None:
    """Why the file's identity is not the one expected (None: it is)."""
    if not isinstance(stored, dict):
        return "it carries no identity (written by an older kvbench)"
    for name, want in expected.items():
        if name == "logp_shape":
            continue
        if stored.get(name) != want:
            return f"its {name} is {stored.get(name)!r}, this run's is {want!r}"
    want_shape = expected["logp_shape"]
    if stored.get("logp_shape") != shape or shape[0] != want_shape[0] or \
            (want_shape[1] is not None and shape[1] != want_shape[1]):
        return f"its log-probs have shape {shape} (recorded {stored.get('logp_shape')}), expected " \
               f"{[want_shape[0], want_shape[1] if want_shape[1] is not None else shape[1]]}"
    return None


def _inconsistent(rec: dict[str, Any], logp: torch.Tensor, sample: Sample) -> str | None:
    """Why the record disagrees with its own tensor, prediction or sample (None: it agrees)."""
    from kvbench.errors import KVBenchError
    from kvbench.spec import fidelity
    from kvbench.tasks.metrics import score as task_score

    if rec.get("metric") != sample.metric or rec.get("answers") != list(sample.answers):
        return "its metric or answers are not the sample's"
    gold = torch.tensor(list(sample.gold_ids), dtype=torch.long)
    if bool(torch.isnan(logp).any()) or max(sample.gold_ids, default=0) >= logp.shape[1]:
        return "its log-probs hold NaN or do not cover the gold tokens"
    fid = fidelity(logp, logp, gold)
    for name, value in (("gold_nll", fid.gold_nll), ("gold_token_accuracy", fid.gold_token_accuracy)):
        if not _close(rec.get(name), value):
            return f"its {name} {rec.get(name)!r} does not follow from its log-probs ({value!r})"
    try:
        score = fid.gold_token_accuracy if sample.metric == "token_accuracy" else \
            task_score(sample.metric, str(rec.get("prediction", "")), list(sample.answers))
    except KVBenchError as exc:
        return str(exc)
    if not _close(rec.get("score"), score):
        return f"its score {rec.get('score')!r} does not follow from its prediction {rec.get('prediction')!r}"
    return None


def _close(stored: Any, value: float) -> bool:
    return isinstance(stored, (int, float)) and not isinstance(stored, bool) and \
        math.isclose(float(stored), value, rel_tol=_TOL, abs_tol=_TOL)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)
